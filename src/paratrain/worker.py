"""Worker process entry point: ``python -m paratrain.worker RUN_DIR [--resume] [--data-dir DIR]``.

Started by ``paratrain train`` through torchrun (one per rank) or called
in-process for ``single``. Reads ``RUN_DIR/config.toml``, joins the process
group, trains, leaves the group. A :class:`~paratrain.errors.UsageError`
prints one line prefixed with the rank and exits with code 2.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

from . import config
from .errors import TrainingStopped, UsageError


def train_worker(run_dir: Path, resume: bool = False, data_dir: str | None = None) -> dict:
    """Train the run in ``run_dir`` as this process' rank; returns the summary. Every rank must call it."""
    from .env import init, shutdown
    from .train import Trainer
    from .train.checkpoint import latest, should_resume

    cfg = config.load(run_dir / "config.toml")
    env = init(cfg.dist.device, cfg.dist.backend, cfg.dist.threads, cfg.train.timeout_s,
               towers=cfg.dist.towers, interop_threads=cfg.dist.interop_threads)
    trainer, clean = None, False
    try:
        trainer = Trainer(cfg, env, run_dir, data_dir)
        if should_resume(run_dir, resume):
            trainer.restore(latest(run_dir))
        summary = trainer.fit()
        clean = True
        return summary
    finally:
        if trainer is not None:
            trainer.close(clean)
        if clean:
            shutdown()


def ps_worker(run_dir: Path, resume: bool = False, data_dir: str | None = None) -> int:
    """A process of a parameter-server job (role from RANK). Where the strategy
    tolerates losing a worker (ps-async, ps-sync with backup workers), a worker
    other than rank 0 runs in a child process: if it dies, this process reports
    it and exits 0 so that torchrun keeps the rest of the job running."""
    from .ps.runtime import layout_of, run_process

    cfg = config.load(run_dir / "config.toml")
    rank = int(os.environ.get("RANK", 0))
    role, index = layout_of(cfg).role(rank)
    tolerant = role == "worker" and index != 0 and (cfg.dist.strategy == "ps-async" or cfg.dist.backup_workers > 0)
    if not tolerant:
        try:
            run_process(cfg, run_dir, rank, resume=resume, data_dir=data_dir)
        finally:
            from .env import shutdown

            shutdown()
        return 0
    import multiprocessing as mp

    child = mp.get_context("spawn").Process(target=_ps_child, args=(run_dir, rank, resume, data_dir))
    child.start()
    child.join()
    if child.exitcode != 0:
        how = f"signal {-child.exitcode}" if child.exitcode < 0 else f"exit code {child.exitcode}"
        print(f"[rank {index}] paratrain: worker {index} died ({how}); {cfg.dist.strategy} continues with "
              f"the other workers", file=sys.stderr, flush=True)
    return 0


def _ps_child(run_dir: Path, rank: int, resume: bool, data_dir: str | None) -> None:
    from .env import shutdown
    from .ps.runtime import run_process

    try:
        run_process(config.load(run_dir / "config.toml"), run_dir, rank, resume=resume, data_dir=data_dir)
    finally:
        shutdown()


@record
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="paratrain.worker")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--data-dir", default=None)
    args = p.parse_args(argv)
    try:
        if config.load(args.run_dir / "config.toml").uses_ps:
            return ps_worker(args.run_dir, args.resume, args.data_dir)
        train_worker(args.run_dir, args.resume, args.data_dir)
    except UsageError as e:
        print(f"[rank {os.environ.get('RANK', 0)}] paratrain: error: {e}", file=sys.stderr, flush=True)
        return 2
    except TrainingStopped as e:
        print(f"[rank {os.environ.get('RANK', 0)}] paratrain: stopped: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
