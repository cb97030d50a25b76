"""Is ``paratrain plan``'s ps-async ``loop_ps_stolen_s`` the exchanges' cost, or the machine's drift?

The profile (:func:`paratrain.bench.profile_runs_ps.loop_ps`) takes, each round, a parameter
server's job of 2 workers and one server, then 2 one-thread one-device runs side by side, and keeps
the median of (the job's timed compute - the side-by-side runs'). Here each job is bracketed: the
side-by-side runs go before and after it (ABA), so a drift of the machine shows as a difference
between the two side-by-side runs around one job, and the job's own spread apart from it.

    PARATRAIN_DATA=../shared/data python benchmarks/ps_stolen_bracketed.py configs/ptb_small.toml --rounds 4
    PARATRAIN_DATA=../shared/data python benchmarks/ps_stolen_bracketed.py configs/gpt_wt2.toml --rounds 3 \
        --step-s 0.55

Prints each round (ms of timed compute a step: data + forward + backward + compute, the mean of the
runs' workers) and the differences against the run before, the run after and their mean. Run alone on
the machine; about 100 s (ptb_small, 4 rounds) to 250 s (gpt_wt2, 3 rounds) on 2 cores.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time

import _runner  # noqa: F401  (SIGTERM ends the runs, as Ctrl-C does; benchmarks/ is the script folder)
from paratrain.bench.plan_profile import run_steps
from paratrain.bench.profile_runs import loop_runs, loop_spec
from paratrain.bench.profile_runs_ps import timed_compute
from paratrain.bench.sweep import RunPlan
from paratrain.config import load
from paratrain.strategies import REFERENCE


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--strategy", default="ps-async")
    ap.add_argument("--step-s", type=float, default=0.06, help="a one-device step's seconds, for the run's steps")
    ap.add_argument("--min-steps", type=int, default=30, help="as plan's --profile-steps")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = ap.parse_args()
    batch = load(args.config, args.overrides).train.batch_size
    steps = run_steps(args.min_steps, args.step_s)
    spec = loop_spec(args.config, None, tuple(args.overrides), None, (args.strategy, REFERENCE), (2,), "strong", steps)
    copies = iter(range(1000, 10**6))
    with tempfile.TemporaryDirectory(prefix="ps-stolen-") as tmp:

        def compute_ms(plans: list) -> float:  # the runs at once; the mean timed compute of their workers, ms
            got, why = timed_compute(loop_runs(spec, plans, tmp))
            if got is None:
                raise SystemExit(f"a run {why}")
            return got[0] * 1e3

        def side_by_side() -> float:
            return compute_ms([RunPlan(strategy=REFERENCE, n=1, global_batch=batch, threads=1, repeat=next(copies))
                               for _ in range(2)])

        t0, out, before = time.time(), [], side_by_side()
        for r in range(args.rounds):
            job = compute_ms([RunPlan(strategy=args.strategy, n=2, global_batch=2 * batch, repeat=r)])
            after = side_by_side()
            out.append({"before_ms": before, "job_ms": job, "after_ms": after})
            print(f"round {r}: side by side before {before:.1f} ms, {args.strategy}'s job {job:.1f}, side by side "
                  f"after {after:.1f}; job - before {job - before:+.1f}, job - after {job - after:+.1f}, "
                  f"job - their mean {job - (before + after) / 2:+.1f}", flush=True)
            before = after
    print(f"{steps} steps a run, {time.time() - t0:.0f} s")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
