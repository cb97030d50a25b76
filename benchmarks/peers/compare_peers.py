"""Speed (and quality) of paratrain's ``allreduce`` against its peers: the same training
written as a plain hand-written DDP loop, with Hugging Face Accelerate, with Lightning Fabric.

Runs R repeats of, in this order within every repeat (alternating),

  plain       ``python -m torch.distributed.run --standalone --nproc-per-node P benchmarks/peers/ddp_plain.py ...``
  accelerate  the same launch of ``benchmarks/peers/accelerate_lm.py``
  fabric      the same launch of ``benchmarks/peers/fabric_lm.py``
  paratrain   ``paratrain train configs/ptb_small.toml --nproc P --run-dir <tmp> ...``

(``--rotate``: repeat i starts at the (i mod 4)-th program), each with the same
number of optimizer steps N (``--steps``; 0 = whole epochs, ``--epochs``), each
in its own subprocess with a timeout, and every one with OMP_NUM_THREADS = cores // P and cores // P intra-op threads per process
(and gloo on the loopback interface, as paratrain sets it on one node). Prints
words/s min / median / max per program, the ratio paratrain / peer of the
medians (and the smallest and largest ratio of one repeat's two runs), and every
program's validation perplexity at the stop point: the four compute the same
mathematics (same vocabulary order, initialisation, seed, stream split), so they
should agree to float32 rounding.

What words/s counts (the same for every program):
  --warmup-steps 0 (default): every training step of the run, the first ones
    included. paratrain's value is ``words_per_s`` of the last ``"kind":
    "summary"`` line of ``<run_dir>/metrics.jsonl`` (all steps; it leaves out
    its logging, evaluation and checkpoint intervals); the peers run with
    ``--warmup-steps 0`` (all steps; evaluation left out).
  --warmup-steps W > 0: all leave out the first W steps. The peers get
    ``--warmup-steps W``; paratrain's value is recomputed from its ``"train"``
    records (words/s per logging interval) after step W, so W must be a
    multiple of --log-every.
Words = target tokens of the global batch (20 streams x 20 steps per step).

Usage (the real comparison; on an otherwise idle machine; benchmarks/run_peers.sh runs this):
  python benchmarks/peers/compare_peers.py --data-dir /work/shared/data --repeats 5 --steps 400
paratrain against the hand-written loop only:
  python benchmarks/peers/compare_peers.py --data-dir /work/shared/data --only plain,paratrain
One-epoch quality check (one repeat, valid perplexity after epoch 1):
  python benchmarks/peers/compare_peers.py --data-dir /work/shared/data --repeats 1 --steps 0 --epochs 1

Writes the JSON (``--json``, default ``runs/compare_peers-<time>.json``) and every
run's output under ``runs/compare_peers-<time>/``.
"""
from __future__ import annotations

import argparse
import importlib.util
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
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/, for _runner

from _runner import run_cmd  # noqa: E402

PEERS = {"plain": ("ddp_plain.py", None), "accelerate": ("accelerate_lm.py", "accelerate"),
         "fabric": ("fabric_lm.py", "lightning_fabric")}  # name: (script, module it needs)
PROGRAMS = [*PEERS, "paratrain"]
# paratrain with glibc's own allocator (--cpu-allocator default), as the peers run: not in the default list
OPTIONAL = ["paratrain-default"]


def run_peer(name: str, a: argparse.Namespace, i: int, logdir: Path, env: dict) -> dict:
    out = logdir / f"{name}-{i}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.nproc}",
           str(HERE / PEERS[name][0]), "--data-dir", a.data_dir, "--epochs", str(a.epochs),
           "--max-steps", str(a.steps), "--warmup-steps", str(a.warmup_steps), "--log-every", str(a.log_every),
           "--json", str(out)]
    rc, wall = run_cmd(cmd, logdir / f"{name}-{i}.log", a.timeout_s, env)
    res = json.loads(out.read_text()) if out.is_file() else {}
    return {"rc": rc, "process_wall_s": wall, "words_per_s": res.get("words_per_s", math.nan),
            "words_per_s_all_steps": res.get("words_per_s_all_steps", math.nan),
            "valid_ppl": res.get("valid_ppl", math.nan), "steps": res.get("steps"),
            "threads_per_process": res.get("threads_per_process"), "ok": bool(res)}


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


def run_paratrain(a: argparse.Namespace, i: int, logdir: Path, env: dict, name: str = "paratrain") -> dict:
    with tempfile.TemporaryDirectory(prefix="compare_peers-") as tmp:
        run_dir = Path(tmp) / "run"  # must not exist yet
        allocator = ["--cpu-allocator", "default"] if name == "paratrain-default" else []
        cmd = [sys.executable, "-m", "paratrain.cli", "train", a.config, "--nproc", str(a.nproc), *allocator,
               "--run-dir", str(run_dir), "--data-dir", a.data_dir,
               "--set", f"train.epochs={a.epochs}", "--set", f"train.max_steps={a.steps}",
               "--set", f"train.log_every={a.log_every}"]
        rc, wall = run_cmd(cmd, logdir / f"{name}-{i}.log", a.timeout_s, env)
        metrics = run_dir / "metrics.jsonl"
        records = []
        if metrics.is_file():
            shutil.copy(metrics, logdir / f"{name}-{i}.metrics.jsonl")  # checkpoints are not kept
            records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    summaries = [r for r in records if r.get("kind") == "summary"]
    s = summaries[-1] if summaries else {}
    wps_all = s.get("words_per_s", math.nan)
    wps = wps_all if a.warmup_steps == 0 or not s else paratrain_wps_after(records, a.warmup_steps)
    return {"rc": rc, "process_wall_s": wall, "words_per_s": wps, "words_per_s_all_steps": wps_all,
            "valid_ppl": s.get("valid_ppl", math.nan), "steps": s.get("steps"),
            "threads_per_process": s.get("threads_per_process"), "ok": bool(s)}


def run_program(name: str, a: argparse.Namespace, i: int, logdir: Path, env: dict) -> dict:
    return run_paratrain(a, i, logdir, env, name) if name.startswith("paratrain") else run_peer(name, a, i, logdir, env)


def stats(values: list[float]) -> dict:
    v = [x for x in values if x == x]  # drop NaN
    if not v:
        return {"n": 0, "min": math.nan, "median": math.nan, "max": math.nan}
    return {"n": len(v), "min": min(v), "median": statistics.median(v), "max": max(v)}


def ratios(runs: dict[str, list[dict]], summary: dict[str, dict]) -> dict[str, dict]:
    """paratrain / peer: of the medians, and min / max over repeats of one repeat's two runs."""
    out = {}
    for peer in (p for p in runs if p != "paratrain" and "paratrain" in runs):
        per_repeat = [pr["words_per_s"] / r["words_per_s"] for pr, r in zip(runs["paratrain"], runs[peer])
                      if pr["ok"] and r["ok"] and r["words_per_s"] > 0]
        s = stats(per_repeat)
        out[peer] = {"of_medians": summary["paratrain"]["median"] / summary[peer]["median"],
                     "per_repeat_min": s["min"], "per_repeat_max": s["max"], "per_repeat": per_repeat}
    return out


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="paratrain allreduce vs hand-written DDP, Accelerate, Fabric: "
                                            "words/s and perplexity.",
                                epilog="Usage" + __doc__.split("Usage", 1)[1].split("Writes", 1)[0].rstrip(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default=os.environ.get("PARATRAIN_DATA"), help="folder holding ptb/")
    p.add_argument("--repeats", "-R", type=int, default=5)
    p.add_argument("--steps", "-N", type=int, default=400, help="optimizer steps per run (0 = whole epochs)")
    p.add_argument("--epochs", type=int, default=1, help="epochs per run (an upper bound when --steps > 0)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--warmup-steps", type=int, default=0,
                   help="steps left out of words/s by every program (0 = all steps; else a multiple of --log-every)")
    p.add_argument("--log-every", type=int, default=100, help="steps between progress records, every program")
    p.add_argument("--config", default="configs/ptb_small.toml", help="paratrain recipe (relative to the repo)")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per run")
    p.add_argument("--only", default=",".join(PROGRAMS),
                   help=f"comma-separated programs to run, in this order per repeat (default {','.join(PROGRAMS)})")
    p.add_argument("--rotate", action="store_true",
                   help="start repeat i with the (i mod programs)-th program, so no program always runs first")
    p.add_argument("--json", type=Path, help="result file (default runs/compare_peers-<time>.json)")
    a = p.parse_args(argv)
    if not a.data_dir:
        p.error("give --data-dir (the folder holding ptb/) or set PARATRAIN_DATA")
    if a.repeats < 1 or a.steps < 0 or a.epochs < 1 or a.warmup_steps < 0 or a.log_every < 1 or a.nproc < 1:
        p.error("--repeats, --epochs, --log-every, --nproc must be >= 1; --steps, --warmup-steps >= 0")
    if a.warmup_steps % a.log_every:
        p.error(f"--warmup-steps {a.warmup_steps} must be a multiple of --log-every {a.log_every} "
                f"(paratrain's words/s after warm-up is read from its logging intervals)")
    if a.steps and a.warmup_steps >= a.steps:
        p.error(f"--warmup-steps {a.warmup_steps} leaves nothing of --steps {a.steps} to measure")
    a.programs = [x.strip() for x in a.only.split(",") if x.strip()]
    unknown = sorted(set(a.programs) - set(PROGRAMS + OPTIONAL))
    if unknown or not a.programs or len(set(a.programs)) != len(a.programs):
        p.error(f"--only takes distinct names from {', '.join(PROGRAMS + OPTIONAL)}; got {a.only!r}")
    missing = [m for name in a.programs if name in PEERS and (m := PEERS[name][1])
               and importlib.util.find_spec(m) is None]
    if missing:
        p.error(f"{', '.join(missing)} not installed: pip install -e \".[peers]\" (or leave them out with --only)")
    a.data_dir = str(Path(a.data_dir).resolve())
    stamp = time.strftime("%Y%m%d-%H%M%S")
    a.logdir, a.json = REPO / "runs" / f"compare_peers-{stamp}", a.json or REPO / "runs" / f"compare_peers-{stamp}.json"
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    logdir = a.logdir
    logdir.mkdir(parents=True, exist_ok=True)
    cores = len(os.sched_getaffinity(0))
    # the same threads for every program; this checkout's paratrain, whatever the editable install points at
    from paratrain.devices import without_cpu_allocator

    # glibc's malloc as a peer's user gets it (paratrain sets its own)
    env = dict(without_cpu_allocator(os.environ), OMP_NUM_THREADS=str(max(1, cores // a.nproc)),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")])))
    if sys.platform.startswith("linux"):  # paratrain pins gloo to loopback on one node; so do the peers here
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    measured = "all training steps" if a.warmup_steps == 0 else f"steps after the first {a.warmup_steps}"
    what = f"{a.steps} steps" if a.steps else f"{a.epochs} epoch(s)"
    print(f"compare_peers: {a.repeats} x ({', '.join(a.programs)}), {what}, nproc {a.nproc}, {cores} cores, "
          f"OMP_NUM_THREADS {env['OMP_NUM_THREADS']}, load average {os.getloadavg()[0]:.2f}; "
          f"words/s over {measured}, evaluation excluded; logs in {logdir}", flush=True)
    if os.getloadavg()[0] > 0.5:
        print(f"compare_peers: warning: load average {os.getloadavg()[0]:.2f} before starting; "
              f"timings are only meaningful on an otherwise idle machine", flush=True)

    runs: dict[str, list[dict]] = {name: [] for name in a.programs}
    total, k = len(a.programs) * a.repeats, 0
    for i in range(a.repeats):
        shift = i % len(a.programs) if a.rotate else 0
        for name in a.programs[shift:] + a.programs[:shift]:
            k += 1
            r = run_program(name, a, i, logdir, env)
            r["repeat"], r["loadavg_1min_after"] = i, os.getloadavg()[0]
            runs[name].append(r)
            flag = "" if r["rc"] == 0 else f"  EXIT CODE {r['rc']}" + ("" if r["ok"] else " (no result)")
            print(f"[{k}/{total}] {name:10s} repeat {i}: {r['words_per_s']:,.0f} words/s, "
                  f"valid ppl {r['valid_ppl']:.2f}, steps {r['steps']}, threads {r['threads_per_process']}, "
                  f"{r['process_wall_s']:.1f} s{flag}", flush=True)

    summary = {name: stats([r["words_per_s"] for r in rs if r["ok"]]) for name, rs in runs.items()}
    ratio = ratios(runs, summary)
    ppl = {name: [r["valid_ppl"] for r in rs if r["ok"]] for name, rs in runs.items()}
    all_ppl = [x for v in ppl.values() for x in v if x == x]
    ppl_spread = (max(all_ppl) - min(all_ppl)) / min(all_ppl) if all_ppl else math.nan

    w = 11
    print(f"\nwords/s ({measured}; evaluation excluded)")
    print(f"{'':11s}{'runs':>5s}{'min':>{w}s}{'median':>{w}s}{'max':>{w}s}   valid ppl")
    for name, s in summary.items():
        print(f"{name:11s}{s['n']:>5d}{s['min']:>{w},.0f}{s['median']:>{w},.0f}{s['max']:>{w},.0f}   "
              + ", ".join(f"{x:.2f}" for x in ppl[name]))
    if ratio:
        print(f"\nparatrain / peer{'':4s}{'of medians':>11s}{'repeat min':>11s}{'repeat max':>11s}")
        for peer, r in ratio.items():
            print(f"{peer:20s}{r['of_medians']:>11.3f}{r['per_repeat_min']:>11.3f}{r['per_repeat_max']:>11.3f}")
    print(f"valid perplexity: largest relative spread over all runs {ppl_spread:.2e}")
    failed = [f"{name} repeat {r['repeat']} (exit code {r['rc']}{'' if r['ok'] else ', no result'})"
              for name, rs in runs.items() for r in rs if r["rc"] != 0]
    if failed:
        print("non-zero exit: " + "; ".join(failed) + f" (see {logdir})")

    result = {"settings": {"repeats": a.repeats, "steps": a.steps, "epochs": a.epochs, "nproc": a.nproc,
                           "warmup_steps": a.warmup_steps, "log_every": a.log_every, "config": a.config,
                           "data_dir": a.data_dir, "cores": cores, "omp_num_threads": env["OMP_NUM_THREADS"],
                           "programs": a.programs, "order": f"alternating, {', '.join(a.programs)} in every repeat"
                           + (", rotated by one program per repeat" if a.rotate else "")},
              "measured": f"words/s over {measured}, evaluation excluded",
              "summary": summary, "ratio_paratrain_over_peer": ratio,
              "valid_ppl_relative_spread": ppl_spread, "runs": runs, "logs": str(logdir)}
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {a.json}")
    return 0 if all(r["ok"] for rs in runs.values() for r in rs) else 1


if __name__ == "__main__":
    sys.exit(main())
