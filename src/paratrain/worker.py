"""Worker process entry point: ``python -m paratrain.worker RUN_DIR [--resume] [--data-dir DIR]``.

Started by ``paratrain train`` through torchrun (one per process of the job) or
called in-process for one-process strategies. Reads ``RUN_DIR/config.toml``, joins
the job the strategy's way (:meth:`~paratrain.strategies.base.Strategy.init_process`:
a training rank, or a parameter server that serves and returns), trains, leaves.
Where the strategy tolerates losing a rank (``Strategy.supervised``), the rank
trains in a child process: if it dies, this process reports it and exits 0 so that
torchrun keeps the rest of the job running. A
:class:`~paratrain.errors.UsageError` prints one line prefixed with the rank and
exits with code 2.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

from . import config
from .child import exit_after, freeze_before_exit
from .errors import TrainingStopped, UsageError


def process_settings(cfg: config.Config, **overrides):
    """How a process of this run joins its job (a :class:`~paratrain.env.ProcessSettings`)."""
    from .env import ProcessSettings
    from .strategies import STRATEGIES

    d = cfg.dist
    return ProcessSettings(device=d.device, backend=d.backend, threads=d.threads, interop_threads=d.interop_threads,
                           cpu_allocator=d.cpu_allocator,
                           timeout_s=cfg.train.timeout_s, options=STRATEGIES[d.strategy].options(cfg), **overrides)


def with_faults(cfg: config.Config) -> config.Config:
    """``cfg`` with this attempt's ``--fault`` list, which the launcher passes in ``$PARATRAIN_FAULT``
    (faults are never written into a run dir, so a ``--resume`` does not fire them again)."""
    import dataclasses

    fault = os.environ.get("PARATRAIN_FAULT", "")
    return dataclasses.replace(cfg, dist=dataclasses.replace(cfg.dist, fault=fault)) if fault else cfg


def train_worker(run_dir: Path, resume: bool = False, data_dir: str | None = None, run=None, verbose: bool = True,
                 **settings) -> dict | None:
    """Join the job of the run in ``run_dir`` and train as this process' rank; returns the summary
    (a server's stats for a parameter server). Every process of the job must call it. ``run(trainer)
    -> dict`` replaces ``trainer.fit()`` (``paratrain verify`` drives the steps itself)."""
    from .env import shutdown
    from .strategies import STRATEGIES
    from .train import Trainer
    from .train.checkpoint import newest_loadable, should_resume

    cfg = with_faults(config.load(run_dir / "config.toml"))
    env, options = STRATEGIES[cfg.dist.strategy].init_process(process_settings(cfg, **settings))
    if env is None:  # a server of a parameter-server job: it served until every worker was done
        shutdown()
        return options.get("server_stats")
    trainer, clean = None, False
    try:
        trainer = Trainer(cfg, env, run_dir, data_dir, verbose=verbose, strategy_options=options)
        if cfg.dist.nnodes > 1 and env.world_size > 1:  # no shared filesystem: rank 0's checkpoint for all
            trainer.resume_from_rank0(env.is_main and should_resume(run_dir, resume))
        elif should_resume(run_dir, resume):
            trainer.restore(*newest_loadable(run_dir, warn=lambda m: None, mmap=False))  # the launcher warned
        else:
            trainer.say_fresh_restart()
        summary = run(trainer) if run is not None else trainer.fit()
        clean = True
        return summary
    finally:
        if trainer is not None:
            trainer.close(clean)
        if clean:
            shutdown()
        else:  # no group teardown after a failure (it could wait for a dead rank); RPC stops locally
            from .ps.runtime import shutdown_rpc

            shutdown_rpc()


def supervised_worker(run_dir: Path, rank: int, resume: bool, data_dir: str | None, strategy: str) -> int:
    """Train this rank in a child process; report its death instead of failing the job."""
    import multiprocessing as mp

    child = mp.get_context("spawn").Process(target=_child, args=(run_dir, resume, data_dir))
    child.start()
    child.join()
    if child.exitcode != 0:
        how = f"signal {-child.exitcode}" if child.exitcode < 0 else f"exit code {child.exitcode}"
        print(f"[rank {rank}] paratrain: worker {_worker_index(run_dir, rank)} died ({how}); {strategy} "
              f"continues with the other workers", file=sys.stderr, flush=True)
    return 0


def _worker_index(run_dir: Path, rank: int) -> int:
    from .ps.layout import PSLayout

    d = config.load(run_dir / "config.toml").dist
    return PSLayout(d.nproc, d.num_ps, d.nnodes).role(rank)[1]


def _child(run_dir: Path, resume: bool, data_dir: str | None) -> None:
    from .env import shutdown

    try:
        train_worker(run_dir, resume, data_dir)
    finally:
        shutdown()
    freeze_before_exit()


def _quiet_write_errors_in_threads() -> None:
    """A background writer (TensorBoard's event thread) that hits a full disk must not print a
    traceback: the training thread meets the same error and says it in one line."""
    import threading

    default = threading.excepthook

    def hook(args) -> None:
        if not issubclass(args.exc_type, OSError):
            default(args)

    threading.excepthook = hook


@record
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="paratrain.worker")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--data-dir", default=None)
    args = p.parse_args(argv)
    rank = int(os.environ.get("RANK", 0))
    _quiet_write_errors_in_threads()
    try:
        from .strategies import STRATEGIES

        cfg = config.load(args.run_dir / "config.toml")
        if STRATEGIES[cfg.dist.strategy].supervised(cfg.dist, rank):
            return supervised_worker(args.run_dir, rank, args.resume, args.data_dir, cfg.dist.strategy)
        train_worker(args.run_dir, args.resume, args.data_dir)
    except UsageError as e:
        print(f"[rank {rank}] paratrain: error: {e}", file=sys.stderr, flush=True)
        return 2
    except OSError as e:  # a full disk, a read-only run dir: the path and the cause, the last checkpoint intact
        where = e.filename or f"to run dir {args.run_dir}"
        print(f"[rank {rank}] paratrain: stopped: cannot write {where} ({e.strerror}); the "
              f"last complete checkpoint in {args.run_dir} is intact: free space and resume with --resume",
              file=sys.stderr, flush=True)
        return 1
    except TrainingStopped as e:
        if rank == 0 or not e.every_rank:
            print(f"[rank {rank}] paratrain: stopped: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    exit_after(main)
