"""``paratrain`` command line: train, launch, bench, predict, data, devices.

Every subcommand turns bad input into one line on stderr
(``paratrain: error: ...``) and exit code 2, before anything is written.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from .errors import TrainingStopped, UsageError
from .interrupts import Terminated, sigterm_raises

_TRAIN_EPILOG = """\
tasks (--task or [task] entry): lstm-lm (default), gpt, digits-cnn, module:factory, path/to/file.py:factory
config keys (--set section.key=value; values are TOML literals):
  [data] and [model] belong to the task; lstm-lm's:
  data.corpus ptb|wikitext-2   data.mode bptt|sentence   data.bptt T   data.eval_batch_size
  data.max_sentence_len   data.drop_last (sentence mode)   data.train_fraction   data.eval_fraction
  model.embed_dim  model.hidden_dim  model.num_layers  model.dropout  model.tie_weights  model.init_range
  model.sync_batchnorm (every built-in task: BatchNorm statistics over all replicas)
  train.epochs  train.max_steps  train.seed  train.batch_size (global)  train.ref_batch_size
  train.lr_scaling none|linear|sqrt  train.warmup_steps  train.optimizer sgd|adam  train.lr
  train.momentum  train.weight_decay  train.clip  train.convention sum_over_time|mean_over_tokens
  train.schedule step|plateau|constant  train.decay  train.decay_start_epoch  train.plateau_patience
  train.accumulation  train.dtype float32|float64  train.timeout_s  train.checkpoint_every  train.keep_checkpoints
  train.log_every  train.eval_every  train.timing_warmup_steps  train.on_nonfinite skip|stop
  dist.strategy  dist.nproc  dist.backend auto|gloo|nccl  dist.device auto|cpu|cuda  dist.threads
  dist.nnodes  dist.node_rank  dist.rdzv_endpoint  dist.max_restarts  dist.bucket_mb
  dist.comm_hook none|fp16|bf16|powersgd  dist.matrix_approximation_rank  dist.start_powerSGD_iter
  dist.devices  dist.visible_devices  dist.strict_placement  dist.log_placement  dist.interop_threads
  dist.memory_fraction  dist.expandable_segments  dist.cpu_allocator retain|default
  [placement] "module.pattern" = "device"  (model parallel; e.g. "decoder" = "cuda:1")
  dist.num_ps  dist.backup_workers  dist.max_staleness  dist.staleness_lr
  dist.pipeline_stages  dist.microbatches  dist.pipeline_schedule gpipe|1f1b  dist.pipeline_split "3,1"
  dist.slow_rank  dist.slow_ms  dist.fault  dist.check_sync_every

data: --data-dir, else $PARATRAIN_DATA, else ~/.cache/paratrain (downloaded and sha256-checked).
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints usage first)
        self.exit(2, f"paratrain: error: {message}; see '{self.prog} --help'\n")


def _parser() -> argparse.ArgumentParser:
    from .dist_config import CPU_ALLOCATORS

    from .strategies import STRATEGIES

    p = _Parser(prog="paratrain", description="Train PyTorch models on many devices, processes and machines.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    t = sub.add_parser("train", help="train a task (built-in or your own) with a strategy", epilog=_TRAIN_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Train the task of a TOML recipe (the LSTM language model unless [task] entry or "
                                   "--task names another) with a strategy.")
    t.add_argument("config", nargs="?", help="TOML recipe (e.g. configs/ptb_small.toml); optional with --resume")
    t.add_argument("--task", metavar="ENTRY",
                   help="task: lstm-lm, gpt, digits-cnn, package.module:factory or path/to/file.py:factory "
                        "(default: the recipe's [task] entry)")
    t.add_argument("--strategy", choices=list(STRATEGIES),
                   help="how to split the work (default: the recipe's dist.strategy)")
    t.add_argument("--nproc", type=int,
                   help="worker processes on this node (--nproc 1 without --strategy means single)")
    t.add_argument("--run-dir", type=Path, help="new run directory (default runs/<config>-<time>); never overwritten")
    t.add_argument("--resume", type=Path, metavar="DIR", help="continue the run in DIR from its last checkpoint")
    t.add_argument("--data-dir", help="folder holding ptb/ and wikitext-2/ (default $PARATRAIN_DATA or the cache)")
    t.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value; repeatable")
    t.add_argument("--max-restarts", type=int, help="restarts of the worker group after a failure (torchrun)")
    ps = t.add_argument_group("parameter server (--strategy ps-sync | ps-async)")
    ps.add_argument("--num-ps", type=int, help="parameter-server processes per node, added to --nproc workers")
    ps.add_argument("--backup-workers", type=int, help="ps-sync: aggregate the first W-b gradients, drop the late ones")
    ps.add_argument("--max-staleness", type=int, help="ps-async: bound on update staleness in versions (-1 = none)")
    ps.add_argument("--staleness-lr", action="store_true", help="ps-async: divide the lr by the staleness")
    dv = t.add_argument_group("devices, placement, memory and threads")
    dv.add_argument("--devices", help="replicate: tower devices, e.g. cpu:0,cpu:1 or cuda:0,cuda:1")
    dv.add_argument("--visible-devices", help="CUDA devices the job may see, e.g. 0,2 (CUDA_VISIBLE_DEVICES)")
    dv.add_argument("--strict-placement", action="store_true", help="a device that does not exist is an error")
    dv.add_argument("--log-placement", action="store_true", help="print and record where each parameter lives")
    dv.add_argument("--memory-fraction", type=float, help="CUDA: cap this process at a fraction of device memory")
    dv.add_argument("--expandable-segments", action="store_true", help="CUDA: allocator expandable segments")
    dv.add_argument("--cpu-allocator", choices=CPU_ALLOCATORS,
                    help="host memory: retain = glibc reuses the blocks a step frees (default), default = glibc's own")
    dv.add_argument("--threads", type=int, help="intra-op threads per process (default cores // (processes x towers))")
    dv.add_argument("--interop-threads", type=int, help="inter-op threads per process")
    t.add_argument("--slow-rank", type=int, help="straggler injection: this rank sleeps --slow-ms before every step")
    t.add_argument("--slow-ms", type=float, help="milliseconds of delay for --slow-rank")
    t.add_argument("--fault", action="append", metavar="SPEC",
                   help="fault injection: kill:rank=R:step=S, hang:rank=R:step=S, delay:rank=R:ms=M, "
                        "nan:rank=R:step=S (repeatable)")
    t.add_argument("--check-sync-every", type=int, metavar="K",
                   help="every K steps compare the replicas' parameter checksums (stop naming the rank that differs)")
    t.add_argument("--on-nonfinite", choices=["skip", "stop"],
                   help="NaN/Inf loss or gradient: skip the step (default, counted) or stop the run")
    _add_multinode(t)

    _add_launch_parser(sub)

    from .bench.commands import add_bench_parser, add_predict_parser
    from .verify import add_parser as add_verify_parser

    from .bench.plan import add_plan_parser

    add_bench_parser(sub)
    add_predict_parser(sub)
    add_plan_parser(sub)
    add_verify_parser(sub)
    sub.add_parser("devices", help="list the devices this machine has",
                   description="List the CPU (cores) and every visible CUDA device (memory).")
    d = sub.add_parser("data", help="check (and download) a corpus",
                       description="Make sure a corpus is present: use it, or download it and verify sha256.")
    d.add_argument("corpus", choices=["ptb", "wikitext-2"])
    d.add_argument("--data-dir")
    e = sub.add_parser("export", help="write a checkpoint (a DCP folder or a .pt) as one plain .pt file",
                       description="Read CHECKPOINT (checkpoint-<step>.dcp/ of a sharded strategy, or a .pt, or a "
                                   "run dir: its newest) whole and write OUT with torch.save: 'model' (the plain "
                                   "state_dict), 'optimizer' (by parameter name from a DCP folder; as saved from "
                                   "a .pt), and the run's position. Scripts read it with "
                                   "torch.load(OUT, weights_only=True)['model'].")
    e.add_argument("checkpoint")
    e.add_argument("out")
    return p


def _add_launch_parser(sub) -> None:
    from .strategies import STRATEGIES

    ln = sub.add_parser("launch", help="run your own script with a strategy (torchrun semantics)",
                        description="Run SCRIPT in N worker processes with RANK, LOCAL_RANK, WORLD_SIZE, "
                                    "MASTER_ADDR/PORT set (loopback and a free port by default) and the strategy "
                                    "pt.init() reads ($PARATRAIN_STRATEGY, $PARATRAIN_CONFIG).")
    ln.add_argument("--nproc", type=int, default=1, help="worker processes on this node")
    ln.add_argument("--strategy", choices=list(STRATEGIES),
                    help="how pt.setup/optimizer.step split the work (default: allreduce for N > 1 processes, "
                         "else single)")
    ln.add_argument("--num-ps", type=int, help="parameter-server strategies: server processes per node (added)")
    ln.add_argument("--backup-workers", type=int, help="ps-sync: aggregate the first W-b gradients")
    ln.add_argument("--max-staleness", type=int, help="ps-async: bound on update staleness in versions")
    ln.add_argument("--staleness-lr", action="store_true", help="ps-async: divide the lr by the staleness")
    ln.add_argument("--devices", help="replicate: tower devices, e.g. cpu:0,cpu:1 or cuda:0,cuda:1")
    ln.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="a dist.* or train.timeout_s value (as in a recipe); repeatable")
    ln.add_argument("--module", "-m", action="store_true", help="SCRIPT is a module name (python -m)")
    ln.add_argument("--max-restarts", type=int, default=0)
    ln.add_argument("--threads", type=int, default=0, help="intra-op threads per worker (default cores // nproc)")
    _add_multinode(ln)
    ln.add_argument("script")
    ln.add_argument("script_args", nargs=argparse.REMAINDER)


def _add_multinode(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nnodes", type=int, help="number of nodes (default 1)")
    p.add_argument("--node-rank", type=int, help="this node's index (multi-node)")
    p.add_argument("--rdzv-endpoint", help="HOST:PORT of the rendezvous on node 0 (multi-node)")
    p.add_argument("--rdzv-id", help="job id shared by the nodes (default: $SLURM_JOB_ID, else derived from "
                                     "--rdzv-endpoint, --nnodes and --nproc)")
    p.add_argument("--rdzv-timeout", type=int, dest="rdzv_timeout_s",
                   help="seconds to wait for every node to arrive (default 120)")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import signal

    # SIGTERM ends a one-process run like Ctrl-C does (torchrun's agent has its own)
    previous = sigterm_raises(Terminated)
    try:
        return _run(args)
    finally:
        if previous is not None:  # a program that called main keeps its own handler
            signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace) -> int:
    try:
        if args.command == "train":
            return cmd_train(args)
        if args.command == "launch":
            return cmd_launch(args)
        if args.command in ("bench", "predict"):
            from .bench import commands, predict_command

            return commands.cmd_bench(args) if args.command == "bench" else predict_command.cmd_predict(args)
        if args.command == "plan":
            from .bench.plan_report import cmd_plan

            return cmd_plan(args)
        if args.command == "verify":
            from .verify import cmd_verify

            return cmd_verify(args)
        if args.command == "data":
            return cmd_data(args)
        if args.command == "devices":
            return cmd_devices()
        if args.command == "export":
            return cmd_export(args)
    except UsageError as e:
        print(f"paratrain: error: {e}", file=sys.stderr)
        return 2
    except TrainingStopped as e:
        print(f"paratrain: stopped: {e}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, Terminated) as e:
        code, name = (143, "SIGTERM") if isinstance(e, Terminated) else (130, "SIGINT")
        print(f"paratrain: {name} received: stopped (exit {code}){_checkpoint_hint()}", file=sys.stderr)
        return code
    return 2


_RUN_DIR: Path | None = None  # the run dir of this paratrain train, once it exists


def _checkpoint_hint() -> str:
    from .launch import resume_hint

    return resume_hint(_RUN_DIR)


def cmd_train(args: argparse.Namespace) -> int:
    from .runs import prepare_run, start_run

    global _RUN_DIR
    run = prepare_run(args)
    if run.complete:
        print(f"paratrain: {run.complete}")
        return 0
    _RUN_DIR = run.run_dir
    return start_run(run)


def cmd_launch(args: argparse.Namespace) -> int:
    import json

    from . import config, launch
    from .devices import apply_cpu_allocator
    from .env import default_threads
    from .strategies import STRATEGIES, default_for

    if args.nproc < 1:
        raise UsageError(f"--nproc {args.nproc} is not allowed; use --nproc 1 or more")
    if not args.module and not Path(args.script).is_file():
        raise UsageError(f"script {args.script!r} does not exist; give the path of a Python file (or -m MODULE)")
    from .cluster import slurm_dist, slurm_task_env

    given = any(getattr(args, k) is not None for k in ("nnodes", "node_rank", "rdzv_endpoint"))
    task_env = {} if given else slurm_task_env()  # srun started one task per worker: be that worker
    slurm = {} if given or task_env else slurm_dist()  # inside a Slurm step: no rendezvous flags needed
    nnodes = args.nnodes or slurm.get("nnodes", 1)
    if nnodes > 1 and not (args.rdzv_endpoint or slurm):
        raise UsageError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT of node 0")
    world = int(task_env["WORLD_SIZE"]) if task_env else args.nproc * nnodes
    dist = {"strategy": args.strategy or default_for(world), **slurm,
            "nproc": args.nproc, "nnodes": nnodes, "node_rank": args.node_rank or slurm.get("node_rank", 0),
            "rdzv_endpoint": args.rdzv_endpoint or slurm.get("rdzv_endpoint", ""), "max_restarts": args.max_restarts}
    for key in ("num_ps", "backup_workers", "max_staleness", "devices", "rdzv_id", "rdzv_timeout_s"):
        if getattr(args, key) is not None:
            dist[key] = getattr(args, key)
    if args.staleness_lr:
        dist["staleness_lr"] = True
    if args.threads:
        dist["threads"] = args.threads
    bad = [o for o in args.overrides if not o.split("=", 1)[0].strip().startswith(("dist.", "train.timeout_s"))]
    if bad:
        raise UsageError(f"--set {bad[0]!r}: paratrain launch takes dist.* and train.timeout_s; "
                         f"the rest is your script's")
    cfg = config.load(None, args.overrides, {"dist": dist})  # validated like a recipe's [dist]
    cls = STRATEGIES[cfg.dist.strategy]
    os.environ["PARATRAIN_STRATEGY"] = cfg.dist.strategy
    apply_cpu_allocator(cfg.dist.cpu_allocator)  # the script's processes read it from their environment
    os.environ["PARATRAIN_CONFIG"] = json.dumps({"dist": config.to_dict(cfg)["dist"],
                                                 "train": {"timeout_s": cfg.train.timeout_s}})
    for key, value in cls.launch_env.items():
        os.environ.setdefault(key, value)
    per_node = cls.processes_per_node(cfg.dist)
    if task_env:
        threads = args.threads or default_threads(int(task_env["LOCAL_WORLD_SIZE"]))
        os.environ.update(task_env, OMP_NUM_THREADS=str(threads))
        target = ["-m", args.script] if args.module else [args.script]
        os.execv(sys.executable, [sys.executable, "-m", "paratrain.child", *target, *args.script_args])
    d = cfg.dist
    spec = launch.LaunchSpec(nproc=per_node, target=[args.script, *args.script_args], module=args.module,
                             nnodes=d.nnodes, node_rank=d.node_rank, rdzv_endpoint=d.rdzv_endpoint,
                             rdzv_id=d.rdzv_id, rdzv_timeout_s=d.rdzv_timeout_s, max_restarts=d.max_restarts)
    return launch.run(launch.build_command(spec), args.threads or default_threads(per_node))


def cmd_devices() -> int:
    from .devices import list_devices

    for d in list_devices():
        mem = f"{d.memory_bytes / 2**30:.1f} GiB" if d.memory_bytes else "-"
        print(f"{d.name:8s} {mem:>10s}  {d.description}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """``paratrain export CHECKPOINT OUT``: one plain ``.pt`` (see the parser's description)."""
    from .strategies.sharded import read_whole
    from .train import checkpoint

    src, out = Path(args.checkpoint), Path(args.out)
    if src.is_dir() and not src.name.endswith(".dcp"):  # a run dir: its newest checkpoint
        src = checkpoint.latest(src)
    if out.exists():
        raise UsageError(f"{str(out)!r} exists; name a new file (export never overwrites)")
    state = checkpoint.load(src)
    if state.pop("dcp", False):
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

        try:
            whole = read_whole(src)
        except (CheckpointException, RuntimeError, OSError) as e:
            raise UsageError(f"checkpoint {str(src)!r} cannot be read ({str(e).splitlines()[0][:120]}): it is "
                             f"damaged") from None
        state.pop("model_shapes", None)
        state.update(model=whole["model"], optimizer=whole["optim"])
    checkpoint.atomic_torch_save(state, out)
    print(f"exported {src} (step {state.get('step')}, {len(state['model'])} tensors in 'model') to {out}")
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    from .data import ensure_corpus, load_corpus

    t0 = time.perf_counter()
    paths = ensure_corpus(args.corpus, args.data_dir)
    corpus = load_corpus(paths)
    for split in ("train", "valid", "test"):
        s = getattr(corpus, split)
        print(f"{split:5s} {paths[split]}  {s.num_lines:,} lines  {s.ids.numel():,} tokens (+eos)")
    print(f"vocab {len(corpus.vocab):,} (with <eos>)  [{time.perf_counter() - t0:.1f} s]")
    return 0


def entry() -> int:
    """The ``paratrain`` command (and ``python -m paratrain.cli``): :func:`main`, then a quick exit
    (:func:`paratrain.child.freeze_before_exit`; not in :func:`main`, which a program may call)."""
    from .child import freeze_before_exit

    try:
        return main()
    finally:
        freeze_before_exit()


if __name__ == "__main__":
    sys.exit(entry())
