"""How much ``dist.cpu_allocator = "retain"`` (glibc keeps the blocks a step frees; the default) saves
against glibc's own behaviour (``"default"``: freed blocks over its mmap threshold go back to the kernel
and are mapped and zeroed again next step), as ratios measured in one run on this machine.

Each case runs ``paratrain train`` with one setting, then the other, ``--pairs`` times, the order
alternating (retain first in pairs 1, 3, ...), so that the machine's drift falls on both. Per case it
prints the median over pairs of the step-time ratio default / retain (above 1: retain is faster), the
medians of each setting's step (``train_step_ms``, after the timing warm-up) and its peak resident set
(``peak_memory_mb``, rank 0), and the system CPU time of the runs (the kernel's page faults). Writes
``cpu_allocator.json`` and ``cpu_allocator.md`` to ``--out``.

    PARATRAIN_DATA=../shared/data python benchmarks/cpu_allocator.py --out benchmarks/results/cpu_allocator
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from _runner import REPO, run_cmd

from paratrain.devices import without_cpu_allocator

# (name, recipe, strategy, nproc, global batch, steps, threads a process, more arguments); steps include the
# summary's timing warm-up (5). The towers run one thread each, in one process: their forwards' blocks come
# from the threads' own malloc arenas unless retain's single arena holds.
_TOWERS = ("--set", 'dist.devices="cpu:0,cpu:1"')
CASES = [
    ("ptb_small single", "configs/ptb_small.toml", "single", 1, 20, 150, 1, ()),
    ("ptb_small allreduce N=2", "configs/ptb_small.toml", "allreduce", 2, 40, 150, 1, ()),
    ("ptb_small zero1 N=2", "configs/ptb_small.toml", "zero1", 2, 40, 150, 1, ()),
    ("digits_cnn single", "configs/digits_cnn.toml", "single", 1, 64, 300, 1, ()),
    ("gpt_wt2 single", "configs/gpt_wt2.toml", "single", 1, 32, 30, 1, ()),
    ("gpt_wt2 towers x2", "configs/gpt_wt2.toml", "replicate", 1, 64, 30, 2, _TOWERS),
]


def run(case: tuple, mode: str, tmp: Path, timeout_s: float) -> dict:
    name, recipe, strategy, nproc, batch, steps, threads, more = case
    run_dir = tmp / f"{name.replace(' ', '_').replace('=', '')}-{mode}-{time.monotonic_ns()}"
    cmd = ["python", "-m", "paratrain.cli", "train", recipe, "--strategy", strategy, "--run-dir", str(run_dir),
           "--cpu-allocator", mode, "--threads", str(threads), "--set", f"train.batch_size={batch}",
           "--set", f"train.max_steps={steps}", "--set", f"train.log_every={min(50, steps // 3)}", *more]
    if nproc > 1:
        cmd += ["--nproc", str(nproc)]
    env = without_cpu_allocator(os.environ)
    before = os.times()
    rc, wall = run_cmd(cmd, run_dir.with_suffix(".log"), timeout_s, env)
    after = os.times()
    if rc:
        raise SystemExit(f"{name} ({mode}) exited {rc}: see {run_dir.with_suffix('.log')}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = [r for r in records if r["kind"] == "summary"][-1]
    assert summary["cpu_allocator"] == mode, (name, mode, summary["cpu_allocator"])
    return {"step_ms": summary["train_step_ms"], "peak_memory_mb": summary["peak_memory_mb"],
            "system_s": after.children_system - before.children_system, "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "cpu_allocator")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--timeout-s", type=float, default=900.0)
    args = ap.parse_args()
    cases = [c for c in CASES if not args.cases or c[0] in args.cases.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="cpu-allocator-") as t:
        for case in cases:
            runs: dict[str, list[dict]] = {"retain": [], "default": []}
            for p in range(args.pairs):
                for mode in (("retain", "default") if p % 2 == 0 else ("default", "retain")):
                    runs[mode].append(run(case, mode, Path(t), args.timeout_s))
            ratios = [d["step_ms"] / r["step_ms"] for r, d in zip(runs["retain"], runs["default"])]
            med = {m: {k: statistics.median(x[k] for x in runs[m]) for k in runs[m][0]} for m in runs}
            row = {"case": case[0], "ratio_default_over_retain": statistics.median(ratios), "ratios": ratios,
                   "retain": med["retain"], "default": med["default"], "runs": runs}
            rows.append(row)
            print(f"{case[0]:<26} default/retain step {row['ratio_default_over_retain']:.3f} "
                  f"({', '.join(f'{x:.3f}' for x in ratios)}); step ms {med['default']['step_ms']:.1f} -> "
                  f"{med['retain']['step_ms']:.1f}; peak RSS MiB {med['default']['peak_memory_mb']:.0f} -> "
                  f"{med['retain']['peak_memory_mb']:.0f}; system s {med['default']['system_s']:.1f} -> "
                  f"{med['retain']['system_s']:.1f}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    machine = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
               "date": time.strftime("%Y-%m-%d %H:%M"), "libc": " ".join(platform.libc_ver())}
    (args.out / "cpu_allocator.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))
    lines = ["| case | step ms, default -> retain | default / retain (pairs) | peak RSS MiB | system CPU s |",
             "|---|---|---|---|---|"]
    for r in rows:
        d, k = r["default"], r["retain"]
        lines.append(f"| {r['case']} | {d['step_ms']:.1f} -> {k['step_ms']:.1f} | "
                     f"**{r['ratio_default_over_retain']:.2f}** ({', '.join(f'{x:.2f}' for x in r['ratios'])}) | "
                     f"{d['peak_memory_mb']:.0f} -> {k['peak_memory_mb']:.0f} | "
                     f"{d['system_s']:.1f} -> {k['system_s']:.1f} |")
    (args.out / "cpu_allocator.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
