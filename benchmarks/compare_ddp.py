"""Speed (and quality) of paratrain's ``allreduce`` against a hand-written DDP loop.

Runs, alternately, R repeats of

  (a) the baseline  ``torchrun --standalone --nproc-per-node P benchmarks/ddp_baseline.py ...``
  (b) paratrain     ``paratrain train configs/ptb_small.toml --nproc P --run-dir <tmp> ...``

(baseline first in every repeat), each with the same number of optimizer steps
N (``--steps``; 0 = whole epochs, ``--epochs``), each in its own subprocess with
a timeout, and prints words/s min / median / max per side and the ratio
paratrain / baseline of the medians. Also prints both sides' validation
perplexity at the stop point: the two programs compute the same mathematics
(same vocabulary order, initialisation, seed, stream split), so they should
agree to float32 rounding.

What words/s counts (the same on both sides):
  --warmup-steps 0 (default): every training step of the run, the first ones
    included. paratrain's value is ``words_per_s`` of the last ``"kind":
    "summary"`` line of ``<run_dir>/metrics.jsonl`` (all steps; it leaves out
    its logging, evaluation and checkpoint intervals); the baseline runs with
    ``--warmup-steps 0`` (all steps; evaluation left out).
  --warmup-steps W > 0: both leave out the first W steps. The baseline gets
    ``--warmup-steps W``; paratrain's value is recomputed from its ``"train"``
    records (words/s per logging interval) after step W, so W must be a
    multiple of --log-every.
Words = target tokens of the global batch (20 streams x 20 steps per step).

Usage (the real comparison; on an otherwise idle machine):
  python benchmarks/compare_ddp.py --data-dir /work/shared/data --repeats 5 --steps 400
One-epoch quality check (both sides, one repeat, valid perplexity after epoch 1):
  python benchmarks/compare_ddp.py --data-dir /work/shared/data --repeats 1 --steps 0 --epochs 1

Writes the JSON (``--json``, default ``runs/compare_ddp-<time>.json``) and every
run's output under ``runs/compare_ddp-<time>/``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BASELINE = HERE / "ddp_baseline.py"

from _runner import run_cmd  # noqa: E402  (benchmarks/ is the script folder)



def run_baseline(a: argparse.Namespace, i: int, logdir: Path, env: dict) -> dict:
    out = logdir / f"baseline-{i}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.nproc}",
           str(BASELINE), "--data-dir", a.data_dir, "--epochs", str(a.epochs), "--max-steps", str(a.steps),
           "--warmup-steps", str(a.warmup_steps), "--log-every", str(a.log_every), "--json", str(out)]
    rc, wall = run_cmd(cmd, logdir / f"baseline-{i}.log", a.timeout_s, env)
    res = json.loads(out.read_text()) if out.is_file() else {}
    return {"rc": rc, "process_wall_s": wall, "words_per_s": res.get("words_per_s", math.nan),
            "words_per_s_all_steps": res.get("words_per_s_all_steps", math.nan),
            "valid_ppl": res.get("valid_ppl", math.nan), "steps": res.get("steps"), "ok": bool(res)}


def paratrain_wps_after(records: list[dict], warmup: int) -> float:
    """words/s of the logging intervals that start at or after step ``warmup``.

    Each ``train`` record holds the words/s of the interval since the previous
    record; words per step is constant (BPTT), so it cancels.
    """
    steps = time_units = 0.0
    prev = 0
    for r in records:
        if r["kind"] == "resume":
            prev = r["step"]
        if r["kind"] != "train":
            continue
        n = r["step"] - prev
        if prev >= warmup and n > 0 and r["words_per_s"] > 0:
            steps += n
            time_units += n / r["words_per_s"]
        prev = r["step"]
    return steps / time_units if time_units else math.nan


def run_paratrain(a: argparse.Namespace, i: int, logdir: Path, env: dict) -> dict:
    with tempfile.TemporaryDirectory(prefix="compare_ddp-") as tmp:
        run_dir = Path(tmp) / "run"  # must not exist yet
        cmd = [sys.executable, "-m", "paratrain.cli", "train", a.config, "--nproc", str(a.nproc),
               "--run-dir", str(run_dir), "--data-dir", a.data_dir,
               "--set", f"train.epochs={a.epochs}", "--set", f"train.max_steps={a.steps}",
               "--set", f"train.log_every={a.log_every}"]
        rc, wall = run_cmd(cmd, logdir / f"paratrain-{i}.log", a.timeout_s, env)
        metrics = run_dir / "metrics.jsonl"
        records = []
        if metrics.is_file():
            shutil.copy(metrics, logdir / f"paratrain-{i}.metrics.jsonl")  # checkpoints are not kept
            records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    summaries = [r for r in records if r.get("kind") == "summary"]
    s = summaries[-1] if summaries else {}
    wps_all = s.get("words_per_s", math.nan)
    wps = wps_all if a.warmup_steps == 0 or not s else paratrain_wps_after(records, a.warmup_steps)
    return {"rc": rc, "process_wall_s": wall, "words_per_s": wps, "words_per_s_all_steps": wps_all,
            "valid_ppl": s.get("valid_ppl", math.nan), "steps": s.get("steps"), "ok": bool(s)}


def stats(values: list[float]) -> dict:
    v = [x for x in values if x == x]  # drop NaN
    if not v:
        return {"n": 0, "min": math.nan, "median": math.nan, "max": math.nan}
    return {"n": len(v), "min": min(v), "median": statistics.median(v), "max": max(v)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="paratrain allreduce vs hand-written DDP: words/s and perplexity.",
                                epilog="Usage" + __doc__.split("Usage", 1)[1].split("Writes", 1)[0].rstrip(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default=os.environ.get("PARATRAIN_DATA"), help="folder holding ptb/")
    p.add_argument("--repeats", "-R", type=int, default=5)
    p.add_argument("--steps", "-N", type=int, default=400, help="optimizer steps per run (0 = whole epochs)")
    p.add_argument("--epochs", type=int, default=1, help="epochs per run (an upper bound when --steps > 0)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--warmup-steps", type=int, default=0,
                   help="steps left out of words/s on both sides (0 = all steps; else a multiple of --log-every)")
    p.add_argument("--log-every", type=int, default=100, help="steps between progress records, both sides")
    p.add_argument("--config", default="configs/ptb_small.toml", help="paratrain recipe (relative to the repo)")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per run")
    p.add_argument("--json", type=Path, help="result file (default runs/compare_ddp-<time>.json)")
    a = p.parse_args(argv)
    if not a.data_dir:
        p.error("give --data-dir (the folder holding ptb/) or set PARATRAIN_DATA")
    if a.repeats < 1 or a.steps < 0 or a.epochs < 1 or a.warmup_steps < 0 or a.log_every < 1:
        p.error("--repeats, --epochs, --log-every must be >= 1; --steps, --warmup-steps >= 0")
    if a.warmup_steps % a.log_every:
        p.error(f"--warmup-steps {a.warmup_steps} must be a multiple of --log-every {a.log_every} "
                f"(paratrain's words/s after warm-up is read from its logging intervals)")
    if a.steps and a.warmup_steps >= a.steps:
        p.error(f"--warmup-steps {a.warmup_steps} leaves nothing of --steps {a.steps} to measure")
    a.data_dir = str(Path(a.data_dir).resolve())

    stamp = time.strftime("%Y%m%d-%H%M%S")
    logdir = REPO / "runs" / f"compare_ddp-{stamp}"
    logdir.mkdir(parents=True, exist_ok=True)
    json_path = a.json or REPO / "runs" / f"compare_ddp-{stamp}.json"
    cores = len(os.sched_getaffinity(0))
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, cores // a.nproc)))  # the same for both sides
    measured = "all training steps" if a.warmup_steps == 0 else f"steps after the first {a.warmup_steps}"
    what = f"{a.steps} steps" if a.steps else f"{a.epochs} epoch(s)"
    print(f"compare_ddp: {a.repeats} x (baseline, paratrain), {what}, nproc {a.nproc}, {cores} cores, "
          f"load average {os.getloadavg()[0]:.2f}; words/s over {measured}, evaluation excluded; logs in {logdir}",
          flush=True)
    if os.getloadavg()[0] > 0.5:
        print(f"compare_ddp: warning: load average {os.getloadavg()[0]:.2f} before starting; "
              f"timings are only meaningful on an otherwise idle machine", flush=True)

    runs: dict[str, list[dict]] = {"baseline": [], "paratrain": []}
    total = 2 * a.repeats
    k = 0
    for i in range(a.repeats):
        for side, fn in (("baseline", run_baseline), ("paratrain", run_paratrain)):
            k += 1
            r = fn(a, i, logdir, env)
            r["repeat"], r["loadavg_1min_after"] = i, os.getloadavg()[0]
            runs[side].append(r)
            flag = "" if r["rc"] == 0 else f"  EXIT CODE {r['rc']}" + ("" if r["ok"] else " (no result)")
            print(f"[{k}/{total}] {side:9s} repeat {i}: {r['words_per_s']:,.0f} words/s, "
                  f"valid ppl {r['valid_ppl']:.2f}, steps {r['steps']}, {r['process_wall_s']:.1f} s{flag}", flush=True)

    summary = {side: stats([r["words_per_s"] for r in rs if r["ok"]]) for side, rs in runs.items()}
    ratio = summary["paratrain"]["median"] / summary["baseline"]["median"]
    ppl = {side: [r["valid_ppl"] for r in rs if r["ok"]] for side, rs in runs.items()}
    all_ppl = [x for x in ppl["baseline"] + ppl["paratrain"] if x == x]
    ppl_spread = (max(all_ppl) - min(all_ppl)) / min(all_ppl) if all_ppl else math.nan

    w = 11
    print(f"\nwords/s ({measured}; evaluation excluded)")
    print(f"{'':10s}{'runs':>6s}{'min':>{w}s}{'median':>{w}s}{'max':>{w}s}")
    for side, s in summary.items():
        print(f"{side:10s}{s['n']:>6d}{s['min']:>{w},.0f}{s['median']:>{w},.0f}{s['max']:>{w},.0f}")
    print(f"ratio paratrain / baseline of the medians: {ratio:.3f}")
    print(f"valid perplexity at the stop point: baseline {', '.join(f'{x:.2f}' for x in ppl['baseline'])}; "
          f"paratrain {', '.join(f'{x:.2f}' for x in ppl['paratrain'])} (largest relative spread {ppl_spread:.2e})")
    failed = [f"{side} repeat {r['repeat']} (exit code {r['rc']}{'' if r['ok'] else ', no result'})"
              for side, rs in runs.items() for r in rs if r["rc"] != 0]
    if failed:
        print("non-zero exit: " + "; ".join(failed) + f" (see {logdir})")

    result = {"settings": {"repeats": a.repeats, "steps": a.steps, "epochs": a.epochs, "nproc": a.nproc,
                           "warmup_steps": a.warmup_steps, "log_every": a.log_every, "config": a.config,
                           "data_dir": a.data_dir, "cores": cores, "omp_num_threads": env["OMP_NUM_THREADS"],
                           "order": "alternating, baseline first in every repeat"},
              "measured": f"words/s over {measured}, evaluation excluded",
              "summary": summary, "ratio_paratrain_over_baseline_median": ratio,
              "valid_ppl_relative_spread": ppl_spread, "runs": runs, "logs": str(logdir)}
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {json_path}")
    return 0 if all(r["ok"] for rs in runs.values() for r in rs) else 1


if __name__ == "__main__":
    sys.exit(main())
