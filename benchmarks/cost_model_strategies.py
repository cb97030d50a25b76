"""The cost model's error per strategy at N = 1, 2 on this machine (issue 12).

Measures, one run after the other (``--repeats R`` rounds, each round every run once, so that a slow
spell of the machine hits every point alike; the median step of each point is compared): ``single``
on gpt_wt2 at the default threads (N = 1's compute) and at 1 thread (each of 2 processes' compute on
2 cores), then ``allreduce``, ``zero1``, ``fsdp`` at N = 1 and 2 (weak scaling: each replica the
recipe's batch) and ``pipeline`` with 2 processes (1 replica of 2 stages, the recipe's batch; N
counts processes in the table); fits the link with the gloo all-reduce micro-benchmark;
predicts each step with ``paratrain.bench.strategy_model`` and prints predicted vs measured step
time (train_step_ms, rank 0) as a markdown table. Writes benchmarks/results/cost_model_strategies.json.

    PARATRAIN_DATA=../shared/data python benchmarks/cost_model_strategies.py [--steps 60] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

from paratrain.bench.commands import _load_config, _task
from paratrain.bench.costmodel import relative_error
from paratrain.bench.microbench import measured_link
from paratrain.bench.report import median_run, run_record
from paratrain.bench.strategy_model import predict_strategy, strategy_inputs
from paratrain.bench.sweep import BenchSpec, RunPlan, run_sweep
from paratrain.bench.validate import cpu_share, model_gradient_bytes, workload_from_record
from paratrain.env import available_cores

CONFIG = "configs/gpt_wt2.toml"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=3, help="rounds of every run; the median step is compared")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/cost_model_strategies.json"))
    args = ap.parse_args()
    overrides = ("data.eval_fraction=0.02", "train.checkpoint_every=0")
    cfg = _load_config(CONFIG, list(overrides))
    task = _task(cfg, None)
    b = cfg.train.batch_size
    plans = []
    for r in range(args.repeats):  # round-robin: every point once per round
        plans += [RunPlan(strategy="single", n=1, global_batch=b, repeat=r),
                  RunPlan(strategy="single", n=1, global_batch=b, threads=1, repeat=r)]
        plans += [RunPlan(strategy=s, n=n, global_batch=b * n, repeat=r)
                  for s in ("allreduce", "zero1", "fsdp") for n in (1, 2)]
        plans += [RunPlan(strategy="pipeline", n=1, global_batch=b, repeat=r)]  # 1 replica of 2 stages: 2 processes
    spec = BenchSpec(config=CONFIG, strategies=("single", "allreduce", "zero1", "fsdp", "pipeline"), nprocs=(1, 2),
                     scaling=("weak",), steps=args.steps, warmup_steps=args.steps // 3, overrides=overrides)
    runs: dict[tuple, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="paratrain-costmodel-") as tmp:
        for o in run_sweep(spec, plans, Path(tmp)):
            runs.setdefault((o.plan.strategy, o.plan.n, o.plan.threads), []).append(run_record(o))
    failed = [k for k, v in runs.items() if not all(r["ok"] for r in v)]
    if failed:
        raise SystemExit(f"runs failed: {failed}")
    recs = {k: median_run(v, "train_step_ms") for k, v in runs.items()}
    units = recs[("single", 1, None)]["units_per_step"]
    grads = model_gradient_bytes(task, cfg.train.dtype)
    workloads = {recs[("single", 1, None)]["threads_per_process"]: workload_from_record(recs[("single", 1, None)],
                                                                                      grads, units),
                 1: workload_from_record(recs[("single", 1, 1)], grads, units)}
    link = measured_link(2)
    inputs = strategy_inputs(task, cfg)
    cores = available_cores()
    rows = []
    for (strategy, n, threads), rec in sorted(recs.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        if strategy == "single":
            continue
        every = [x.get("train_step_ms", math.nan) for x in runs[(strategy, n, threads)]]
        n = 2 * n if strategy == "pipeline" else n  # processes
        per_process, scale = cpu_share(n, cores)
        w = workloads.get(per_process) or workloads[min(workloads, key=lambda t: abs(t - per_process))]
        p = predict_strategy(strategy, w, n, link, cfg, inputs, compute_scale=scale)
        measured = rec["train_step_ms"]
        rows.append({"strategy": strategy, "n": n, "predicted_step_ms": 1000 * p.step_s, "measured_step_ms": measured,
                     "measured_step_ms_all": every,
                     "predicted_exposed_comm_ms": 1000 * p.exposed_comm_s,
                     "rel_error": relative_error(1000 * p.step_s, measured) if math.isfinite(measured) else math.nan})
    result = {"config": CONFIG, "steps": args.steps, "repeats": args.repeats, "cores": cores,
              "link": {"alpha_s": link.alpha_s, "beta_s_per_byte": link.beta_s_per_byte},
              "inputs": {k: v for k, v in inputs.items()}, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"link: alpha {link.alpha_s * 1e6:.1f} us, {1 / link.beta_s_per_byte / 1e9:.2f} GB/s; cores {cores}")
    print("| strategy | N | predicted step ms | measured step ms (median) | every run ms | error |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        every = ", ".join(f"{x:.0f}" for x in r["measured_step_ms_all"])
        print(f"| {r['strategy']} | {r['n']} | {r['predicted_step_ms']:.1f} | {r['measured_step_ms']:.1f} | {every} | "
              f"{100 * r['rel_error']:+.1f}% |")


if __name__ == "__main__":
    main()
