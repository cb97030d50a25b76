"""``paratrain train``: turn flags into a validated config and a run directory, then start it.

Everything that can be wrong with the input is checked here, before a run
directory is created or any process is started: config, the task (its entry, its
factory, its data: the task is built once here, as rank 0, and may download
missing data), world size against the global batch, resume directory and checkpoint. A new run never writes into an
existing non-empty directory; ``--resume DIR`` continues DIR.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path

from . import config, tasks
from .errors import UsageError


@dataclass
class PreparedRun:
    cfg: config.Config
    run_dir: Path
    data_dir: str | None
    resume: bool
    complete: str = ""  # a resumed run that has done all its steps: the line to print (nothing is written)
    lock: object = None  # the open run-dir lock file (see hold)


def _flag_overrides(args: argparse.Namespace, base_strategy: str | None) -> dict:
    from .strategies import STRATEGIES, default_for

    from .cluster import slurm_dist

    # inside a Slurm step: nodes, node rank and rendezvous from SLURM_* unless given as flags
    given = any(getattr(args, k, None) is not None for k in ("nnodes", "node_rank", "rdzv_endpoint"))
    dist: dict = {} if given else slurm_dist()
    if args.nproc is not None:
        if args.nproc < 1:
            raise UsageError(f"--nproc {args.nproc} is not allowed; use --nproc 1 or more")
        dist["nproc"] = args.nproc
    if args.strategy:
        dist["strategy"] = args.strategy
        if STRATEGIES[args.strategy].in_process:
            if args.nproc not in (None, 1):
                raise UsageError(f"--strategy {args.strategy} runs one process, not --nproc {args.nproc}; "
                                 f"drop --nproc or use --strategy allreduce")
            dist["nproc"] = 1
    elif args.nproc is not None and base_strategy in (None, default_for(1), default_for(2)):
        # --nproc alone picks the process layout: one process is the reference, several the default
        dist["strategy"] = default_for(args.nproc * (getattr(args, "nnodes", None) or dist.get("nnodes", 1)))
    for flag in ("staleness_lr", "strict_placement", "log_placement", "expandable_segments"):
        if getattr(args, flag, False):
            dist[flag] = True
    for key in ("devices", "visible_devices", "memory_fraction", "interop_threads", "threads", "cpu_allocator"):
        if getattr(args, key, None) is not None:
            dist[key] = getattr(args, key)
    if getattr(args, "fault", None):
        dist["fault"] = ",".join(args.fault)
    for key in ("nnodes", "node_rank", "rdzv_endpoint", "rdzv_id", "rdzv_timeout_s", "max_restarts", "num_ps",
                "backup_workers", "max_staleness", "slow_rank", "slow_ms", "check_sync_every"):
        if getattr(args, key, None) is not None:
            dist[key] = getattr(args, key)
    out: dict = {"dist": dist} if dist else {}
    if getattr(args, "on_nonfinite", None):
        out["train"] = {"on_nonfinite": args.on_nonfinite}
    if getattr(args, "task", None):
        out["task"] = {"entry": args.task}
    return out


def _strategy_in(path: Path | str | None) -> str | None:
    if path is None or not Path(path).is_file():
        return None
    import tomllib

    try:
        dist = tomllib.loads(Path(path).read_text(encoding="utf-8")).get("dist")
    except (tomllib.TOMLDecodeError, UnicodeDecodeError):
        return None
    strategy = dist.get("strategy") if isinstance(dist, dict) else None
    return strategy if isinstance(strategy, str) else None  # config.load reports a bad [dist] or strategy


def prepare_run(args: argparse.Namespace) -> PreparedRun:
    """Validate flags, config, task and data; create (or reopen) the run directory and write config.toml.
    Applies ``dist.cpu_allocator`` to this process (and the environment its workers inherit) before the
    task loads its data (:func:`~paratrain.devices.apply_cpu_allocator`)."""
    from .devices import apply_cpu_allocator
    from .train.checkpoint import list_checkpoints, newest_loadable

    resume_state = None
    if args.resume is not None:
        run_dir = args.resume
        if not run_dir.is_dir():
            raise UsageError(f"resume dir {str(run_dir)!r} does not exist; "
                             f"give the run dir of an earlier paratrain train")
        if args.run_dir is not None and args.run_dir != run_dir:
            raise UsageError("--run-dir and --resume name different folders; --resume continues its own run dir")
        cfg_path = run_dir / "config.toml"
        if not cfg_path.is_file():
            raise UsageError(f"resume dir {str(run_dir)!r} has no config.toml; "
                             f"give a run dir written by paratrain train")
        # passes over a damaged newest checkpoint with a warning; raises when none loads
        newest, resume_state = newest_loadable(run_dir)
        listed = list_checkpoints(run_dir)
    else:
        if args.config is None:
            raise UsageError("no config given; use paratrain train CONFIG (e.g. configs/ptb_small.toml) "
                             "or --resume DIR")
        cfg_path = Path(args.config)
    cfg = config.load(cfg_path, args.overrides, _flag_overrides(args, _strategy_in(cfg_path)))
    cfg = dataclasses.replace(cfg, task=dataclasses.replace(cfg.task, entry=tasks.normalise(cfg.task.entry)))
    cfg.check_world()
    # this process' host memory (single, towers) and, by its environment, the workers': before the task loads
    # its data, whose threads would otherwise take malloc arenas of their own (devices.apply_cpu_allocator)
    apply_cpu_allocator(cfg.dist.cpu_allocator)
    task = build_task(cfg, args.data_dir, download=True)
    if resume_state is not None:
        old = config.load(cfg_path)
        _check_checkpoint_fits(task, resume_state, newest, old, cfg)
        _check_same_data_layout(old, cfg)
    _check_rdzv_port(cfg)
    _check_strict_placement(cfg)
    data_dir = str(Path(args.data_dir).resolve()) if args.data_dir else None
    if resume_state is not None and resume_state["step"] >= total_steps(cfg, task):
        return PreparedRun(cfg, args.resume, data_dir, True, complete=_completed(args.resume, resume_state["step"]))
    run_dir = args.resume if args.resume is not None else args.run_dir
    try:
        run_dir = args.resume if args.resume is not None else _new_run_dir(args.run_dir, cfg.name)
        lock = hold(run_dir)  # one run at a time; released when this process ends
        if resume_state is not None and list_checkpoints(run_dir) != listed:  # another run saved meanwhile
            raise UsageError(f"run dir {str(run_dir)!r} changed while this run started; try again")
        # faults are for the attempt they are given to: never written into the run dir (paratrain.faults)
        saved = dataclasses.replace(cfg, dist=dataclasses.replace(cfg.dist, fault=""))
        config_path = run_dir / "config.toml"
        tmp = run_dir / ".config.toml.tmp"
        tmp.write_text(config.to_toml(saved), encoding="utf-8")
        os.replace(tmp, config_path)  # a full disk never leaves a half-written config.toml
    except OSError as e:
        raise UsageError(f"cannot write to run dir {str(e.filename or run_dir)!r} ({e.strerror}); "
                         f"free space or make it writable, or choose another --run-dir") from None
    return PreparedRun(cfg, run_dir, data_dir, args.resume is not None, lock=lock)


def total_steps(cfg: config.Config, task) -> int:
    """Optimizer steps of the whole run (``train.epochs`` of the task's steps, capped by ``train.max_steps``)."""
    full = cfg.train.epochs * task.steps_per_epoch()
    return min(full, cfg.train.max_steps) if cfg.train.max_steps else full


def hold(run_dir: Path):
    """An exclusive OS lock on ``run_dir/.lock`` for as long as the returned file stays open (this
    process's life: a killed launcher releases it, and its workers die with it). UsageError when
    another paratrain run holds it."""
    import fcntl

    f = open(run_dir / ".lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        pid = f.read().strip() or "?"
        f.close()
        raise UsageError(f"run dir {str(run_dir)!r} is in use by another paratrain run (pid {pid}); wait for it to "
                         f"end, or use another --run-dir") from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def _completed(run_dir: Path, step: int) -> str:
    """The line for a resume of a run that has already done all its steps (its summary's numbers)."""
    import json

    summary = None
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        for line in metrics.read_text(encoding="utf-8").splitlines():
            if '"summary"' in line:
                try:
                    summary = json.loads(line)
                except ValueError:
                    pass
    numbers = ""
    if summary:
        keys = [k for k in summary if k.startswith(("valid_", "test_")) and isinstance(summary[k], (int, float))]
        numbers = ": " + ", ".join(f"{k} {summary[k]:.4g}" for k in keys)
    return (f"run dir {run_dir} is complete (step {step}){numbers}; nothing to do "
            f"(raise train.max_steps or train.epochs to train on)")


_LAYOUT_FREE = {"data.eval_batch_size", "data.eval_fraction"}  # keys that do not move the training data position


def _check_same_data_layout(old: config.Config, new: config.Config) -> None:
    """A resume keeps the data position as a batch index: a change of the global batch or of the data
    layout would silently skip or repeat data, so it is refused."""
    a, b = config.to_dict(old), config.to_dict(new)
    changed = [f"data.{k}" for k in sorted(set(a["data"]) | set(b["data"])) if a["data"].get(k) != b["data"].get(k)]
    changed += ["train.batch_size"] if old.train.batch_size != new.train.batch_size else []
    changed = [k for k in changed if k not in _LAYOUT_FREE]
    if changed:
        raise UsageError(f"--resume cannot change {', '.join(changed)}: the checkpoint's data position is a batch "
                         f"index in the old layout (data would be skipped or repeated); drop the override, or "
                         f"start a new run with --run-dir")


def _check_strict_placement(cfg: config.Config) -> None:
    """Under --strict-placement every named device must exist, checked before anything is written."""
    if not cfg.dist.strict_placement:
        return
    from .devices import resolve, resolve_list

    if cfg.dist.devices:
        resolve_list(cfg.dist.devices, strict=True)
    for _, device in cfg.placement:
        resolve(device, strict=True)


def build_task(cfg: config.Config, data_dir: str | None, download: bool = False, rank: int = 0,
               world_size: int | None = None):
    """The run's task as rank ``rank`` of its data-parallel ranks would build it (CPU); ``world_size``
    replaces the recipe's ranks (1: the whole global batch on one device)."""
    import torch

    t = cfg.train
    env = tasks.TaskEnv(rank=rank, world_size=world_size or cfg.world_size, accumulation=t.accumulation,
                        global_batch=t.batch_size, seed=t.seed, dtype=getattr(torch, t.dtype), data_dir=data_dir,
                        download=download)
    return tasks.build(cfg.task.entry, cfg.task_section(), env)


def _changed_keys(old: config.Config, new: config.Config) -> list[str]:
    out = []
    for sec in config.TASK_SECTIONS:
        a, b = config.to_dict(old)[sec], config.to_dict(new)[sec]
        out += [f"{sec}.{k}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    return out + (["task.entry"] if old.task.entry != new.task.entry else [])


def _check_checkpoint_fits(task, state: dict, path: Path, old: config.Config, new: config.Config) -> None:
    """The checkpoint's parameter shapes are those of the configured model; a --resume that changes
    them names the keys it changed, otherwise the tensors that differ (e.g. another vocabulary)."""
    import torch

    with torch.device("meta"):
        want = {k: tuple(v.shape) for k, v in task.build_model().state_dict().items()}
    have = state["model_shapes"] if state.get("dcp") else \
        {k: tuple(v.shape) for k, v in state["model"].items() if hasattr(v, "shape")}
    if sorted(want.values()) == sorted(have.values()):
        return
    changed = _changed_keys(old, new)
    if changed:
        raise UsageError(f"--resume cannot change {', '.join(changed)} (the checkpoint holds the model of "
                         f"its run); drop those overrides, or start a new run with --run-dir")
    differ = [f"{k} {have.get(k)} in the checkpoint vs {want.get(k)} here" for k in sorted(set(want) | set(have))
              if want.get(k) != have.get(k)]
    raise UsageError(f"checkpoint {str(path)!r} holds a different model ({'; '.join(differ[:3])}"
                     f"{'; ...' if len(differ) > 3 else ''}); resume it with the config and corpus it was written with")


def _check_rdzv_port(cfg: config.Config) -> None:
    """Node 0 of a multi-node job hosts the rendezvous: its port must be free here."""
    d = cfg.dist
    if d.nnodes < 2 or d.node_rank != 0 or not d.rdzv_endpoint:
        return
    import socket

    host, _, port = d.rdzv_endpoint.rpartition(":")
    if host not in ("127.0.0.1", "localhost", "0.0.0.0", socket.gethostname()):
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1" if host in ("localhost", "127.0.0.1") else host, int(port)))
        except OSError as e:
            raise UsageError(f"rendezvous endpoint {d.rdzv_endpoint}: port {port} is in use here ({e.strerror}); "
                             f"choose a free port for --rdzv-endpoint") from None


def _new_run_dir(requested: Path | None, name: str) -> Path:
    if requested is None:
        requested = Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
        i = 1
        while requested.exists():
            requested = requested.with_name(f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{i}")
            i += 1
    if requested.exists() and (not requested.is_dir() or any(p.name != ".lock" for p in requested.iterdir())):
        raise UsageError(f"run dir {str(requested)!r} already exists and is not empty; "
                         f"choose a new --run-dir, or continue it with --resume {requested}")
    requested.mkdir(parents=True, exist_ok=True)
    return requested


def start_run(run: PreparedRun) -> int:
    """Train in this process (``single``) or in ``dist.nproc`` workers via torchrun."""
    from . import launch
    from .env import default_threads

    cfg = run.cfg
    print(f"[paratrain] run dir {run.run_dir}  strategy {cfg.dist.strategy}  world_size {cfg.world_size}  "
          f"global batch {cfg.train.batch_size}", flush=True)
    from .strategies import STRATEGIES

    if cfg.dist.visible_devices:
        os.environ["CUDA_VISIBLE_DEVICES"] = cfg.dist.visible_devices
    os.environ["PARATRAIN_FAULT"] = cfg.dist.fault  # this attempt's faults (config.toml never holds them)
    if STRATEGIES[cfg.dist.strategy].in_process and not cfg.dist.max_restarts:  # restarts need torchrun's agent
        from .worker import train_worker

        train_worker(run.run_dir, run.resume, run.data_dir)
        return 0
    target = ["paratrain.worker", str(run.run_dir)] + (["--resume"] if run.resume else [])
    if run.data_dir:
        target += ["--data-dir", run.data_dir]
    d = cfg.dist
    cls = STRATEGIES[d.strategy]
    per_node = cls.processes_per_node(d)  # e.g. parameter servers run in the same torchrun job
    for key, value in cls.launch_env.items():
        os.environ.setdefault(key, value)
    spec = launch.LaunchSpec(nproc=per_node, target=target, module=True, nnodes=d.nnodes, node_rank=d.node_rank,
                             rdzv_endpoint=d.rdzv_endpoint, rdzv_id=d.rdzv_id, rdzv_timeout_s=d.rdzv_timeout_s,
                             max_restarts=d.max_restarts)
    return launch.run(launch.build_command(spec), d.threads or default_threads(per_node), run.run_dir)
