"""``paratrain bench`` and ``paratrain predict``'s flags; ``paratrain bench``: flags -> sweep -> files and tables
(``paratrain predict`` itself: :mod:`.predict_command`)."""
from __future__ import annotations

import argparse
import datetime
import shlex
import sys
from pathlib import Path

from ..errors import UsageError
from ..strategies import REFERENCE
from ..strategies.comm_hooks import HOOKS
from .sweep import MODELLED, BenchSpec, finite, plan_runs, run_sweep

DEFAULT_CONFIG = "configs/ptb_small.toml"


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",")) if text.strip() else ()  # "1,,2": an empty item is refused
    except ValueError:
        raise UsageError(f"{flag} {text!r}: give comma-separated integers, e.g. {flag} 1,2,4") from None


def add_bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="measure speedup and scaling efficiency (a sweep of training runs)",
                       description="Run a sweep (strategies x N x batch) of short training runs on real data; "
                                   "write results.json, report.md and PNG plots.")
    b.add_argument("config", nargs="?", default=DEFAULT_CONFIG, help=f"TOML recipe (default {DEFAULT_CONFIG})")
    b.add_argument("--task", help="task entry (default: the recipe's [task] entry)")
    b.add_argument("--strategies", default=f"{REFERENCE},{MODELLED}",
                   help=f"comma-separated registered strategies (default {REFERENCE},{MODELLED})")
    b.add_argument("--nproc", default="1,2", help="replica counts N, comma-separated (default 1,2)")
    b.add_argument("--batch", default="", help="per-replica batches (weak) / global batches (strong); "
                                               "default the recipe's train.batch_size")
    b.add_argument("--scaling", default="weak,strong", help="weak, strong or weak,strong (default both)")
    b.add_argument("--steps", type=int, default=100, help="optimizer steps per run (default 100)")
    b.add_argument("--warmup", type=int, default=20, help="steps left out of every measurement (default 20)")
    b.add_argument("--repeats", type=int, default=1, help="runs per point; words/s is the median (default 1)")
    b.add_argument("--num-ps", type=int, default=1, help="parameter servers for ps-* strategies (default 1)")
    b.add_argument("--out", type=Path, help="output folder (default runs/bench-<time>); must not exist")
    b.add_argument("--validate-model", action="store_true",
                   help=f"also run {MODELLED} at N = 1, 2, 4 and compare with the cost model's predictions")
    b.add_argument("--timeout-s", type=float, default=900.0, help="per run (default 900)")
    b.add_argument("--data-dir", help="folder holding ptb/ and wikitext-2/ (default $PARATRAIN_DATA)")
    b.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="config override passed to every run; repeatable")


def add_predict_parser(sub) -> None:
    from .costmodel import ALGORITHMS, PRESETS
    from ..strategies import DEFAULT
    from .strategy_model import predicted

    p = sub.add_parser("predict", help="predict scaling with the alpha-beta cost model",
                       description="Predict step time, words/s and scaling efficiency for N = 1, 2, 4, ... up to "
                                   "--nproc from a measured single-device step and an interconnect.")
    p.add_argument("config", nargs="?", default=DEFAULT_CONFIG, help=f"TOML recipe (default {DEFAULT_CONFIG})")
    p.add_argument("--task", help="task entry (default: the recipe's [task] entry)")
    p.add_argument("--nproc", type=int, default=1024, help="largest N (default 1024)")
    p.add_argument("--interconnect", default="measured", metavar="{" + ",".join([*PRESETS, "measured"]) + "}",
                   help="link preset (every device on it), or 'measured' (fit a gloo all-reduce micro-benchmark "
                        "here); for machines of several devices on a network, INTRA+INTER, use paratrain plan")
    p.add_argument("--algorithm", default="ring", choices=ALGORITHMS, help="ring / tree all-reduce, or ps")
    p.add_argument("--strategy", default=DEFAULT, choices=predicted(),
                   help=f"a strategy the cost model covers (default {DEFAULT}, with --algorithm); the recipe's "
                        f"[dist] keys apply (reshard_after_forward, pipeline_stages, microbatches)")
    p.add_argument("--num-ps", type=int, default=1, help="parameter-server shards for --algorithm ps")
    p.add_argument("--bucket-mb", type=float, help="all-reduce bucket size (default: the one predicted best)")
    p.add_argument("--comm-hook", choices=HOOKS, help="gradient compression (default: the recipe's dist.comm_hook); "
                   "its all-reduce payload is measured in a short 2-process run (bf16 with --interconnect "
                   "measured, the ring and float32 on a CPU: the whole hook is timed here and prices each "
                   "bucket), and the table adds the uncompressed prediction")
    p.add_argument("--from-bench", type=Path, metavar="DIR",
                   help="take the single-device step from a bench folder instead of measuring it now")
    p.add_argument("--steps", type=int, default=60, help="steps of the single-device measurement (default 60)")
    p.add_argument("--plot", type=Path, help="write the words/s and efficiency curves to this PNG")
    p.add_argument("--data-dir", help="folder holding ptb/ and wikitext-2/ (default $PARATRAIN_DATA)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")


def _load_config(path: str, overrides: list[str], task: str | None = None):
    from .. import config

    from ..devices import apply_cpu_allocator

    if not Path(path).is_file():
        raise UsageError(f"config {path!r} does not exist; give a TOML recipe such as {DEFAULT_CONFIG}")
    cfg = config.load(path, overrides, {"task": {"entry": task}} if task else None)
    apply_cpu_allocator(cfg.dist.cpu_allocator)  # what bench, predict and plan time keeps memory as training does
    return cfg


def _machine() -> dict:
    import torch

    from ..env import available_cores

    dev = (f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}" if torch.cuda.is_available()
           else "no GPU")
    return {"cpu_cores": available_cores(), "device": dev, "torch": torch.__version__, "python": sys.version.split()[0]}


def _task(cfg, data_dir: str | None):
    """The recipe's task (its data and model; fails early, exit 2, when either is wrong)."""
    from ..runs import build_task

    return build_task(cfg, data_dir)


def cmd_bench(args: argparse.Namespace) -> int:
    from . import report

    cfg = _load_config(args.config, args.overrides, args.task)
    spec = BenchSpec(config=args.config, task=args.task, strategies=tuple(s for s in args.strategies.split(",") if s),
                     nprocs=_ints(args.nproc, "--nproc"), batches=_ints(args.batch, "--batch"),
                     scaling=tuple(s for s in args.scaling.split(",") if s), steps=args.steps,
                     warmup_steps=args.warmup, repeats=args.repeats, num_ps=args.num_ps,
                     overrides=tuple(args.overrides), timeout_s=args.timeout_s, data_dir=args.data_dir,
                     validate_model=args.validate_model)
    out = args.out or Path("runs") / f"bench-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    if out.exists() and any(out.iterdir()):
        raise UsageError(f"--out {out} already exists and is not empty; choose a new folder")
    task = _task(cfg, args.data_dir)  # fails early (exit 2) when the task or its data is wrong
    plans = plan_runs(spec, cfg.train.batch_size)
    print(f"[bench] {len(plans)} runs of {spec.steps} steps ({spec.warmup_steps} warm-up) -> {out}", flush=True)
    outcomes = run_sweep(spec, plans, out)
    records = [report.run_record(o) for o in outcomes]
    results = {"date": f"{datetime.datetime.now():%Y-%m-%d %H:%M}", "machine": _machine(),
               "task": cfg.task.entry, "unit": getattr(task, "unit", "samples"),
               "command": "paratrain " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
               "spec": {k: getattr(spec, k) for k in spec.__dataclass_fields__},
               "runs": records, "scaling": report.scaling_rows(records, spec, cfg.train.batch_size)}
    if spec.validate_model:
        results["model_validation"] = _validate(records, spec, cfg, task)
    for path in report.write(results, out):
        print(f"[bench] wrote {path}")
    print(report.markdown(results))
    failed = [r["name"] for r in records if not r["ok"]]
    if failed:
        print(f"paratrain: bench: {len(failed)} run(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _units_per_step(rec: dict) -> float:
    """Units (words, samples) per step per replica, measured by a single-device run."""
    units = rec.get("units_per_step")
    if not finite(units) or units <= 0:
        raise UsageError("the single-device run reported no units per step; rerun it with this paratrain")
    return units


def _validate(records: list[dict], spec: BenchSpec, cfg, task) -> dict:
    from ..env import available_cores
    from .microbench import measured_link
    from .report import median_run
    from .validate import model_gradient_bytes, validate, workload_from_record

    b = (spec.batches or (cfg.train.batch_size,))[0]
    cores = available_cores()
    grads = model_gradient_bytes(task, cfg.train.dtype)

    def median_rec(strategy, n, g, threads):
        key = (strategy, n, g, threads)
        point = [r for r in records if (r["strategy"], r["n"], r["global_batch"], r["threads"]) == key]
        return median_run(point, "train_step_ms")

    base, one = median_rec(REFERENCE, 1, b, None), median_rec(REFERENCE, 1, b, 1)
    if base is None or one is None:
        return {"note": "the single-device runs failed; no validation", "points": {}}
    units = _units_per_step(base)
    workloads = {base["threads_per_process"]: workload_from_record(base, grads, units),
                 1: workload_from_record(one, grads, units)}
    print("[bench] fitting the link: gloo all-reduce micro-benchmark (2 processes)", flush=True)
    link = measured_link(2)
    points = {n: r for n in (1, 2, 4) if (r := median_rec(MODELLED, n, b * n, None)) is not None}
    return validate(points, workloads, link, cores, cfg.dist.bucket_mb)
