"""Data-parallel strategies side by side: allreduce, ps-sync, ps-async, ps-sync with a backup worker,
without and with a straggler.

What runs. Four strategies, each with W workers (``--nproc``, default 2) and,
for the parameter-server ones, K = ``--num-ps`` servers (default 1) added as
extra processes of the same torchrun job:

  allreduce     ``--strategy allreduce``                                 (DDP over gloo)
  ps-sync       ``--strategy ps-sync  --num-ps K``                       (wait for all W gradients)
  ps-async      ``--strategy ps-async --num-ps K``                       (apply every gradient on arrival)
  ps-sync+b1    ``--strategy ps-sync  --num-ps K --backup-workers 1``    (aggregate the first W-1 gradients,
                                                                          drop the late one; with W = 2 that is
                                                                          ONE gradient of B/W streams per update)

under two conditions:

  none          no straggler;
  straggler     worker ``--slow-rank`` (default 1) sleeps ``--slow-ms`` M before every step. M defaults to
                the measured median step time of allreduce without a straggler, so the straggler is about
                2x slower than the others. It is measured on the very first run of the benchmark (allreduce,
                no straggler, repeat 0: the median over its logging intervals, the first interval left out
                when there are several), so that both conditions can alternate in every repeat.

Every run is ``paratrain train CONFIG --strategy S --nproc W [--num-ps K] [--backup-workers 1]
[--slow-rank 1 --slow-ms M] --run-dir <tmp> --data-dir D --set train.max_steps=N --set train.log_every=L
--set train.checkpoint_every=0`` in its own subprocess (own process group; on ``--timeout-s`` the group
and every process below it are killed, exit code 124), with this checkout's ``src/`` first on PYTHONPATH.
Order: R repeats; in each, condition ``none`` then ``straggler``, and within a condition the four
strategies in the fixed round-robin order above.

What is read. The last ``"kind": "summary"`` record of each run's ``metrics.jsonl`` (written by worker
0): ``words_per_s`` (training steps only; evaluation, checkpoint and logging intervals left out),
``valid_ppl`` at the stop point (evaluated by worker 0 on its own copy of the parameters: for
ps-async and backup workers that copy can be an update or two behind the servers' final version), and for the PS strategies the servers' counters as seen by worker 0
at its end: ``updates`` (server 0's version), ``grads_dropped`` (late gradients discarded by ps-sync),
``staleness_mean/p50/p99/max`` (versions, over every shard update), ``wait_s`` (seconds worker 0
spent waiting for servers: push round trips, pulls, admission). From the ``train`` records:
updates/s between the first and the last record (start-up left out). The table gives medians over
repeats (words/s also min-max) and the ratio of each words/s median to allreduce's without a straggler.

What words/s counts. allreduce: tokens of the global batches stepped through (B x bptt per step).
PS strategies: tokens of the gradients the servers *applied* (server 0's count x tokens per push),
so dropped gradients do not count. Stopping: allreduce and ps-sync after N steps (updates = N);
ps-async after W x N applied gradients (updates = W x N, each of B/W streams); ps-sync+b1 after N
versions (each of W-1 gradients). The processes stop on the servers' count, not all at the same
local step.

Oversubscription. W workers + K servers (+ torchrun's agent, and for ps-async / backup workers an
idle supervisor parent per worker other than 0) share the machine's cores; paratrain gives each
process cores // (W + K) intra-op threads (at least 1). On a 2-core machine with W = 2, allreduce just
fits (2 processes) while the PS strategies are oversubscribed (W + K = 3 busy processes): the servers'
CPU time is taken from the workers. A straggler made by sleeping gives its core away while it sleeps,
which helps the others on an oversubscribed machine. The script prints W, K and os.cpu_count() so the
numbers are read in that light.

Expected shape (the hypothesis this benchmark tests; from the issue):
  * no straggler: allreduce >= ps-sync in words/s (one collective vs a round trip through a server
    that does the update on one process);
  * with a straggler: ps-async and ps-sync with a backup worker beat ps-sync in words/s (ps-sync and
    allreduce wait for the straggler every step; the other two do not).

Usage (the real comparison; on an otherwise idle machine):
  python benchmarks/compare_strategies.py --data-dir /work/shared/data --repeats 3 --steps 300 --nproc 2
Three workers (the recipe's global batch 20 is raised to 21, a multiple of 3, and reported):
  python benchmarks/compare_strategies.py --data-dir /work/shared/data --repeats 3 --steps 300 --nproc 3
Smoke test (minutes; not a measurement):
  python benchmarks/compare_strategies.py --data-dir /work/shared/data -R 1 -N 20 --log-every 5 \\
      --slow-ms 50 --set data.eval_fraction=0.05

Writes the JSON (``--json``, default ``runs/compare_strategies-<time>.json``) and every run's output
and metrics.jsonl under ``runs/compare_strategies-<time>/``.
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
import tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

from _runner import run_cmd  # noqa: E402  (benchmarks/ is the script folder)

STRATEGIES: dict[str, list[str]] = {  # label -> flags; the PS ones get --num-ps K added
    "allreduce": ["--strategy", "allreduce"],
    "ps-sync": ["--strategy", "ps-sync"],
    "ps-async": ["--strategy", "ps-async"],
    "ps-sync+b1": ["--strategy", "ps-sync", "--backup-workers", "1"],
    # one process (issue 4's comparison; use with --conditions none)
    "single": ["--strategy", "single"],
    "replicate": ["--strategy", "replicate", "--devices", "cpu:0,cpu:1"],
}
IN_PROCESS = ("single", "replicate")
CONDITIONS = ("none", "straggler")
PS_KEYS = ("updates", "grads_received", "grads_dropped", "staleness_mean", "staleness_p50", "staleness_p99",
           "staleness_max", "dead_workers", "wait_s")


def recipe(path: Path) -> dict:
    return tomllib.loads(path.read_text(encoding="utf-8"))


def words_per_step(run_cfg: dict) -> float:
    """Tokens of one global batch in BPTT mode (B streams x bptt steps); NaN for sentence mode."""
    data, train = run_cfg.get("data", {}), run_cfg.get("train", {})
    if data.get("mode", "bptt") != "bptt":
        return math.nan
    return float(train["batch_size"] * data["bptt"])


def step_ms_median(records: list[dict], tokens_per_step: float) -> float:
    """Median milliseconds per global step over the ``train`` records (allreduce: words = steps x B x bptt).

    The first logging interval (start-up, warm-up) is left out when there are several.
    """
    wps = [r["words_per_s"] for r in records if r.get("kind") == "train" and r.get("words_per_s", 0) > 0]
    if len(wps) > 1:
        wps = wps[1:]
    if not wps or not tokens_per_step == tokens_per_step:
        return math.nan
    return statistics.median(1000.0 * tokens_per_step / w for w in wps)


def updates_per_s(records: list[dict]) -> float:
    """Optimizer updates applied per second between the first and the last ``train`` record.

    allreduce: steps; PS strategies: server 0's version (``updates``) as worker 0 saw it. Uses the
    records' wall-clock stamps, so the first logging interval (start-up) is left out; no evaluation
    happens in between (it runs at the end).
    """
    tr = [r for r in records if r.get("kind") == "train"]
    if len(tr) < 2 or tr[-1]["wall_time"] <= tr[0]["wall_time"]:
        return math.nan
    key = "updates" if "updates" in tr[0] else "step"
    return (tr[-1][key] - tr[0][key]) / (tr[-1]["wall_time"] - tr[0]["wall_time"])


def last_error(log: Path) -> str:
    """The most telling line of a failed run's output (paratrain's per-rank failure lines first)."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    for key in ("failed:", "error:", "Error", "died"):
        hits = [ln for ln in lines if key in ln]
        if hits:
            return hits[-1][:300]
    return lines[-1][:300] if lines else ""


def build_cmd(a: argparse.Namespace, strategy: str, slow_ms: float | None, run_dir: Path) -> list[str]:
    cmd = [sys.executable, "-m", "paratrain.cli", "train", a.config, *STRATEGIES[strategy]]
    if strategy not in IN_PROCESS:
        cmd += ["--nproc", str(a.nproc)]
    if strategy.startswith("ps-"):
        cmd += ["--num-ps", str(a.num_ps)]
    if slow_ms is not None:
        cmd += ["--slow-rank", str(a.slow_rank), "--slow-ms", f"{slow_ms:g}"]
    cmd += ["--run-dir", str(run_dir), "--data-dir", a.data_dir,
            "--set", f"train.max_steps={a.steps}", "--set", f"train.log_every={a.log_every}",
            "--set", "train.checkpoint_every=0"]
    if a.batch_size:
        cmd += ["--set", f"train.batch_size={a.batch_size}"]
    for s in a.overrides:
        cmd += ["--set", s]
    return cmd


def run_one(a: argparse.Namespace, strategy: str, condition: str, slow_ms: float | None, i: int,
            logdir: Path, env: dict) -> dict:
    """One paratrain run; returns its summary numbers (NaN / None where it wrote none)."""
    name = f"{condition}-{strategy}-{i}"
    with tempfile.TemporaryDirectory(prefix="compare_strategies-") as tmp:
        run_dir = Path(tmp) / "run"  # must not exist yet
        cmd = build_cmd(a, strategy, slow_ms, run_dir)
        rc, wall = run_cmd(cmd, logdir / f"{name}.log", a.timeout_s, env)
        records, run_cfg = [], {}
        if (run_dir / "metrics.jsonl").is_file():
            shutil.copy(run_dir / "metrics.jsonl", logdir / f"{name}.metrics.jsonl")  # the rest is dropped
            records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
        if (run_dir / "config.toml").is_file():
            run_cfg = recipe(run_dir / "config.toml")
    summaries = [r for r in records if r.get("kind") == "summary"]
    s = summaries[-1] if summaries else {}
    res = {"strategy": strategy, "condition": condition, "repeat": i, "rc": rc, "ok": bool(s) and rc == 0,
           "has_summary": bool(s), "process_wall_s": wall, "slow_ms": slow_ms, "command": cmd,
           "words_per_s": s.get("words_per_s", math.nan), "valid_ppl": s.get("valid_ppl", math.nan),
           "test_ppl": s.get("test_ppl", math.nan), "steps": s.get("steps"),
           "wall_time_s": s.get("wall_time_s", math.nan), "threads_per_process": s.get("threads_per_process"),
           "updates_per_s": updates_per_s(records),
           "step_ms_median": step_ms_median(records, words_per_step(run_cfg)) if strategy == "allreduce" else math.nan}
    for k in PS_KEYS:
        res[k] = s.get(k, math.nan) if strategy.startswith("ps-") else math.nan
    if strategy == "allreduce" and s:
        res["updates"] = s.get("steps", math.nan)  # one update per step
    if rc != 0 or not s:
        res["error"] = last_error(logdir / f"{name}.log")
    return res


def stats(values: list[float]) -> dict:
    v = [x for x in values if x is not None and x == x]  # drop NaN / missing
    if not v:
        return {"n": 0, "min": math.nan, "median": math.nan, "max": math.nan}
    return {"n": len(v), "min": min(v), "median": statistics.median(v), "max": max(v)}


def summarize(runs: list[dict], strategies: list[str], conditions: list[str]) -> list[dict]:
    rows = []
    for c in conditions:
        for st in strategies:
            rs = [r for r in runs if r["condition"] == c and r["strategy"] == st and r["has_summary"]]
            n_all = sum(1 for r in runs if r["condition"] == c and r["strategy"] == st)
            row = {"condition": c, "strategy": st, "runs": len(rs), "runs_started": n_all,
                   "words_per_s": stats([r["words_per_s"] for r in rs])}
            for k in ("valid_ppl", "test_ppl", "step_ms_median", "updates_per_s", *PS_KEYS):
                row[k] = stats([r[k] for r in rs])["median"]
            rows.append(row)
    base = next((r["words_per_s"]["median"] for r in rows if r["condition"] == "none" and r["strategy"] == "allreduce"),
                math.nan)
    for r in rows:
        r["ratio_to_allreduce_none"] = r["words_per_s"]["median"] / base if base == base and base > 0 else math.nan
    return rows


def _f(x: float, fmt: str) -> str:
    return "-" if x is None or x != x else format(x, fmt)


def markdown_table(rows: list[dict]) -> str:
    head = ("| condition | strategy | runs | words/s median | words/s min-max | x allreduce (none) | valid ppl "
            "| updates | updates/s | dropped grads | staleness mean / max | worker 0 wait_s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        w = r["words_per_s"]
        stale = "-" if r["staleness_mean"] != r["staleness_mean"] else \
            f"{r['staleness_mean']:.2f} / {r['staleness_max']:.0f}"
        lines.append(f"| {r['condition']} | {r['strategy']} | {r['runs']}/{r['runs_started']} | {_f(w['median'], ',.0f')} "
                     f"| {_f(w['min'], ',.0f')}-{_f(w['max'], ',.0f')} | {_f(r['ratio_to_allreduce_none'], '.3f')} "
                     f"| {_f(r['valid_ppl'], '.2f')} | {_f(r['updates'], '.0f')} | {_f(r['updates_per_s'], '.2f')} "
                     f"| {_f(r['grads_dropped'], '.0f')} "
                     f"| {stale} | {_f(r['wait_s'], '.1f')} |")
    return "\n".join(lines)


def hypothesis_check(rows: list[dict]) -> list[str]:
    """The issue's expected shape, checked on the medians (a reading of this run, not a test)."""
    med = {(r["condition"], r["strategy"]): r["words_per_s"]["median"] for r in rows}

    def cmp(c: str, x: str, y: str) -> str | None:
        a, b = med.get((c, x), math.nan), med.get((c, y), math.nan)
        if a != a or b != b:
            return None
        return f"{c}: {x} {a:,.0f} {'>=' if a >= b else '<'} {y} {b:,.0f} words/s ({'as expected' if a >= b else 'NOT as expected'})"

    out = [cmp("none", "allreduce", "ps-sync"), cmp("straggler", "ps-async", "ps-sync"),
           cmp("straggler", "ps-sync+b1", "ps-sync")]
    return [x for x in out if x]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="allreduce vs ps-sync vs ps-async vs ps-sync+backup, with and without "
                                            "a straggler: words/s, perplexity, PS counters.",
                                epilog="Usage" + __doc__.split("Usage", 1)[1].split("Writes", 1)[0].rstrip(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default=os.environ.get("PARATRAIN_DATA"), help="folder holding ptb/")
    p.add_argument("--repeats", "-R", type=int, default=3)
    p.add_argument("--steps", "-N", type=int, default=300, help="optimizer steps per run (train.max_steps)")
    p.add_argument("--nproc", "-W", type=int, default=2, help="workers per run (>= 2)")
    p.add_argument("--num-ps", type=int, default=1, help="parameter servers for the PS strategies")
    p.add_argument("--slow-rank", type=int, default=1, help="the straggler's worker rank")
    p.add_argument("--slow-ms", type=float, default=None,
                   help="straggler delay per step (default: measured median allreduce step time, no straggler)")
    p.add_argument("--log-every", type=int, default=25, help="steps between train records (step-time samples)")
    p.add_argument("--batch-size", type=int, default=0,
                   help="global batch (default: the recipe's, rounded up to a multiple of --nproc if needed)")
    p.add_argument("--strategies", default="allreduce,ps-sync,ps-async,ps-sync+b1",
                   help=f"subset of {','.join(STRATEGIES)}")
    p.add_argument("--conditions", default=",".join(CONDITIONS), help=f"subset of {','.join(CONDITIONS)}")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="extra config override for every run (repeatable), e.g. data.eval_fraction=0.05")
    p.add_argument("--config", default="configs/ptb_small.toml", help="paratrain recipe (relative to the repo)")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per run")
    p.add_argument("--json", type=Path, help="result file (default runs/compare_strategies-<time>.json)")
    a = p.parse_args(argv)
    if not a.data_dir:
        p.error("give --data-dir (the folder holding ptb/) or set PARATRAIN_DATA")
    if a.repeats < 1 or a.steps < 1 or a.log_every < 1 or a.num_ps < 1:
        p.error("--repeats, --steps, --log-every and --num-ps must be >= 1")
    if a.nproc < 2:
        p.error(f"--nproc {a.nproc}: a straggler and --backup-workers 1 need at least 2 workers; use --nproc 2 or 3")
    if not 0 <= a.slow_rank < a.nproc:
        p.error(f"--slow-rank {a.slow_rank} is not a worker rank of --nproc {a.nproc}; use 0..{a.nproc - 1}")
    if a.slow_ms is not None and a.slow_ms < 0:
        p.error(f"--slow-ms {a.slow_ms} must be >= 0")
    a.strategies = [s for s in a.strategies.split(",") if s]
    a.conditions = [c for c in a.conditions.split(",") if c]
    if bad := [s for s in a.strategies if s not in STRATEGIES] + [c for c in a.conditions if c not in CONDITIONS]:
        p.error(f"unknown strategy/condition {', '.join(bad)}; choose from {', '.join([*STRATEGIES, *CONDITIONS])}")
    if "straggler" in a.conditions and a.slow_ms is None and not ("allreduce" in a.strategies and "none" in a.conditions):
        p.error("the straggler's delay is measured on allreduce without a straggler; keep both, or give --slow-ms")
    a.data_dir = str(Path(a.data_dir).resolve())
    base_batch = recipe(REPO / a.config).get("train", {}).get("batch_size", 20)
    if not a.batch_size and base_batch % a.nproc:
        a.batch_size = -(-base_batch // a.nproc) * a.nproc
        a.batch_note = (f"global batch {base_batch} of {a.config} is not divisible by --nproc {a.nproc}; "
                        f"using train.batch_size={a.batch_size}")
    else:
        a.batch_note = ""
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    logdir = REPO / "runs" / f"compare_strategies-{stamp}"
    logdir.mkdir(parents=True, exist_ok=True)
    json_path = a.json or REPO / "runs" / f"compare_strategies-{stamp}.json"
    # this checkout's paratrain, whatever the editable install points at; paratrain sets
    # OMP_NUM_THREADS = cores // (processes per node) itself
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")])))
    cpu_count, cores = os.cpu_count(), len(os.sched_getaffinity(0))
    W, K = a.nproc, a.num_ps
    print(f"compare_strategies: {a.repeats} repeat(s) x {len(a.conditions)} condition(s) x {len(a.strategies)} "
          f"strategies ({', '.join(a.strategies)}), {a.steps} steps each; logs in {logdir}", flush=True)
    print(f"compare_strategies: nproc (workers) W={W}, parameter servers K={K}; os.cpu_count()={cpu_count}, "
          f"usable cores {cores}; processes per run: allreduce {W}, PS {W + K} -> "
          f"{'OVERSUBSCRIBED' if W + K > cores else 'fits'} (allreduce {'oversubscribed' if W > cores else 'fits'}); "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    print(f"compare_strategies: paratrain from {REPO / 'src'} (PYTHONPATH), {sys.executable}", flush=True)
    if a.batch_note:
        print(f"compare_strategies: {a.batch_note}", flush=True)
    if os.getloadavg()[0] > 0.5:
        print(f"compare_strategies: warning: load average {os.getloadavg()[0]:.2f} before starting; "
              f"timings are only meaningful on an otherwise idle machine", flush=True)

    slow_ms, slow_src = a.slow_ms, ("--slow-ms" if a.slow_ms is not None else None)
    runs: list[dict] = []
    total = a.repeats * len(a.conditions) * len(a.strategies)
    k = 0
    for i in range(a.repeats):
        for c in a.conditions:
            for st in a.strategies:
                k += 1
                if c == "straggler" and slow_ms is None:
                    slow_ms, slow_src = measured_slow_ms(runs)
                    if slow_ms is None:
                        print("compare_strategies: no allreduce step time measured (the first run failed); "
                              "give --slow-ms", flush=True)
                        return 1
                    print(f"compare_strategies: straggler delay --slow-ms {slow_ms:.1f} ({slow_src})", flush=True)
                r = run_one(a, st, c, slow_ms if c == "straggler" else None, i, logdir, env)
                r["loadavg_1min_after"] = os.getloadavg()[0]
                runs.append(r)
                print(progress_line(k, total, r), flush=True)

    rows = summarize(runs, a.strategies, a.conditions)
    table = markdown_table(rows)
    notes = run_notes(a, slow_ms, slow_src, runs, cpu_count, cores)
    checks = hypothesis_check(rows)
    print("\n" + table + "\n")
    for n in notes + ["expected shape (issue): " + c for c in checks]:
        print(f"- {n}")
    failed = [f"{r['condition']}/{r['strategy']} repeat {r['repeat']} (exit code {r['rc']}"
              f"{'' if r['has_summary'] else ', no summary'}): {r.get('error', '')}" for r in runs if not r["ok"]]
    if failed:
        print("failed runs:\n  " + "\n  ".join(failed) + f"\n  (see {logdir})")

    result = {"settings": {"repeats": a.repeats, "steps": a.steps, "nproc": W, "num_ps": K, "slow_rank": a.slow_rank,
                           "slow_ms": slow_ms, "slow_ms_source": slow_src, "log_every": a.log_every,
                           "batch_size": a.batch_size or None, "overrides": a.overrides, "config": a.config,
                           "data_dir": a.data_dir, "strategies": a.strategies, "conditions": a.conditions,
                           "order": "per repeat: conditions in order, strategies round-robin in order"},
              "machine": {"os_cpu_count": cpu_count, "usable_cores": cores, "processes_allreduce": W,
                          "processes_ps": W + K, "loadavg_1min_start": runs[0]["loadavg_1min_after"] if runs else None},
              "measured": "words/s of training steps (summary record of worker 0); medians over repeats",
              "summary": rows, "markdown": table, "notes": notes, "expected_shape": checks,
              "runs": runs, "logs": str(logdir)}
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {json_path}")
    return 0 if all(r["ok"] for r in runs) else 1


def measured_slow_ms(runs: list[dict]) -> tuple[float | None, str]:
    ms = [r["step_ms_median"] for r in runs if r["strategy"] == "allreduce" and r["condition"] == "none"
          and r["has_summary"] and r["step_ms_median"] == r["step_ms_median"]]
    if not ms:
        return None, ""
    return statistics.median(ms), (f"measured: median allreduce step time without a straggler, "
                                   f"{len(ms)} run(s) before the first straggler run")


def progress_line(k: int, total: int, r: dict) -> str:
    extra = ""
    if r["strategy"] == "allreduce":
        extra = f", {_f(r['step_ms_median'], '.1f')} ms/step"
    elif r["has_summary"]:
        extra = (f", updates {_f(r['updates'], '.0f')}, dropped {_f(r['grads_dropped'], '.0f')}, staleness "
                 f"{_f(r['staleness_mean'], '.2f')}/{_f(r['staleness_max'], '.0f')}, wait {_f(r['wait_s'], '.1f')} s")
    flag = "" if r["ok"] else f"  EXIT CODE {r['rc']}{'' if r['has_summary'] else ' (no summary)'}: {r.get('error', '')}"
    return (f"[{k}/{total}] {r['condition']:9s} {r['strategy']:10s} repeat {r['repeat']}: "
            f"{_f(r['words_per_s'], ',.0f')} words/s, valid ppl {_f(r['valid_ppl'], '.2f')}, steps {r['steps']}"
            f"{extra}, {r['process_wall_s']:.1f} s{flag}")


def run_notes(a: argparse.Namespace, slow_ms: float | None, slow_src: str | None, runs: list[dict],
              cpu_count: int | None, cores: int) -> list[str]:
    W, K = a.nproc, a.num_ps
    notes = [f"nproc W={W} workers, K={K} parameter server(s); os.cpu_count()={cpu_count} (usable {cores}): "
             f"allreduce runs {W} processes, the PS strategies {W + K} (+ torchrun's agent)"
             + ("; the machine is oversubscribed, the servers take CPU from the workers" if W + K > cores else "")]
    threads = sorted({r["threads_per_process"] for r in runs if r.get("threads_per_process")})
    if threads:
        notes.append(f"intra-op threads per process (worker 0's summary): {', '.join(map(str, threads))}")
    if a.batch_note:
        notes.append(a.batch_note)
    if "straggler" in a.conditions and slow_ms is not None:
        ar = stats([r["step_ms_median"] for r in runs if r["strategy"] == "allreduce" and r["condition"] == "none"])
        notes.append(f"straggler: worker {a.slow_rank} sleeps {slow_ms:.1f} ms before every step ({slow_src}); "
                     f"allreduce step time without a straggler over all repeats: median {_f(ar['median'], '.1f')} ms "
                     f"(min {_f(ar['min'], '.1f')}, max {_f(ar['max'], '.1f')})")
    if "ps-sync+b1" in a.strategies:
        notes.append(f"ps-sync+b1 aggregates W-1 = {W - 1} gradient(s) per update"
                     + (" (with W=2: one gradient of B/2 streams per update, the other one dropped when late)"
                        if W == 2 else ""))
    if "ps-async" in a.strategies:
        notes.append(f"ps-async stops after W x N = {W * a.steps} applied gradients (updates), each of B/W streams")
    notes.append("words/s: allreduce counts global-batch tokens stepped through; PS strategies count tokens of "
                 "gradients the servers applied (dropped ones excluded); evaluation and logging left out")
    notes.append("updates, dropped grads, staleness, wait_s: medians over repeats of worker 0's end-of-run view; "
                 "wait_s is worker 0's time waiting for servers (push round trips, pulls); '-' = not applicable")
    notes.append("updates/s: optimizer updates per second between worker 0's first and last train record "
                 "(allreduce, ps-sync: one global batch each; ps-async: one worker's B/W share each; "
                 f"ps-sync+b1: {W - 1} of W shares each)")
    return notes


if __name__ == "__main__":
    sys.exit(main())
