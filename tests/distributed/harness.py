"""Run a function on W spawned ranks (gloo, FileStore in a temp dir, process-group
timeout, one thread each) under hard deadlines; a hang fails the test instead of CI.

Three deadlines: start-up (spawn, imports, joining the process group: slow on a busy
machine, and not what a test is about) has its own, generous one; ``deadline_s``
bounds the behaviour under test, from the moment every rank is ready; once a rank has
failed, the others have ``failed_grace_s`` to end (as torchrun ends a job).

Ranks are forked from a server that has imported torch and paratrain once (:mod:`tests.preload`):
a fresh interpreter per rank would spend 4-5 s of CPU on those imports alone, most of a small
test's time on 2 cores. The ranks share no state with pytest's process. The server has pytest's
environment of when it started: a test that changes ``os.environ`` for its ranks sets it in ``fn``."""
from __future__ import annotations

import datetime
import os
import signal
import time
import traceback
from pathlib import Path

import torch

from ..preload import context


def _entry(fn, rank: int, world_size: int, workdir: str, args: tuple, pg_timeout_s: float,
           deadline_s: float) -> None:
    import faulthandler

    import torch.distributed as dist

    from paratrain.env import leave_group

    # a rank still running just before the deadline, or told by SIGUSR1 (the harness, before it kills
    # it), writes every thread's stack (for the failure message)
    stacks = open(Path(workdir) / f"stacks-{rank}.txt", "w")
    faulthandler.register(signal.SIGUSR1, file=stacks)
    torch.set_num_threads(1)
    out = Path(workdir) / f"result-{rank}.pt"
    try:
        if world_size > 1:
            store = dist.FileStore(str(Path(workdir) / "filestore"), world_size)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=pg_timeout_s))
        (Path(workdir) / f"ready-{rank}").touch()  # start-up is over: the behaviour's deadline starts
        faulthandler.dump_traceback_later(max(1.0, deadline_s - 10), exit=False, file=stacks)
        try:
            result = fn(rank, world_size, *args)
        finally:
            if dist.is_initialized():
                leave_group()
        torch.save(result, out)
    except BaseException:
        (Path(workdir) / f"error-{rank}.txt").write_text(traceback.format_exc())
        raise


def _wait_ready(procs, workdir: Path, startup_s: float) -> None:
    """Until every rank is ready (or ended: its error is reported below), at most ``startup_s``."""
    end = time.monotonic() + startup_s
    while time.monotonic() < end:
        if all((workdir / f"ready-{r}").exists() or not p.is_alive() for r, p in enumerate(procs)):
            return
        time.sleep(0.1)


def run_ranks(fn, world_size: int, workdir: Path, *args, deadline_s: float = 180.0, startup_s: float = 180.0,
              pg_timeout_s: float = 60.0, failed_grace_s: float = 10.0) -> list:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` processes; return their results.

    ``fn`` must be a module-level function (spawn pickles it by name). Fails with every rank's
    traceback on error, and kills all ranks when start-up takes longer than ``startup_s`` or, once
    every rank is ready, ``fn`` takes longer than ``deadline_s``, or the others are still running
    ``failed_grace_s`` after one rank failed (as torchrun ends a job when one worker fails).
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    # an earlier call's files in the same workdir: its store (its ranks' addresses, which the new ranks
    # would try to reach) and its ranks' markers and results
    for pattern in ("filestore", "ready-*", "error-*.txt", "stacks-*.txt", "result-*.pt"):
        for left in workdir.glob(pattern):
            left.unlink()
    ctx = context()
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, str(workdir), args, pg_timeout_s, deadline_s))
             for r in range(world_size)]
    for p in procs:
        p.start()
    _wait_ready(procs, workdir, startup_s)
    end = time.monotonic() + deadline_s
    failed: list[int] = []
    while time.monotonic() < end and any(p.is_alive() for p in procs):
        if not failed and any(p.exitcode not in (None, 0) for p in procs):  # the rest get failed_grace_s to end
            failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            end = min(end, time.monotonic() + failed_grace_s)
        time.sleep(0.05)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    if hung and failed:  # killed before their own stack dump: ask for it
        for r in hung:
            os.kill(procs[r].pid, signal.SIGUSR1)
        time.sleep(0.5)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    errors = "\n".join(f"--- rank {r}:\n{(workdir / f'error-{r}.txt').read_text()}"
                       for r in range(world_size) if (workdir / f"error-{r}.txt").exists())
    if hung:
        stacks = "\n".join(f"--- rank {r} stacks:\n{(workdir / f'stacks-{r}.txt').read_text()[-4000:]}" for r in hung
                           if (workdir / f"stacks-{r}.txt").exists())
        not_ready = [r for r in range(world_size) if not (workdir / f"ready-{r}").exists()]
        when = (f"still starting after {startup_s} s" if not_ready
                else f"still running {failed_grace_s} s after rank(s) {failed} failed" if failed
                else f"still running {deadline_s} s after start-up")
        raise AssertionError(f"ranks {hung} {when} (killed)\n{errors}\n{stacks}")
    bad = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode != 0}
    if bad:
        raise AssertionError(f"ranks failed with exit codes {bad}\n{errors}")
    return [torch.load(workdir / f"result-{r}.pt", weights_only=True) for r in range(world_size)]


def max_rel_diff(a: dict, b: dict) -> float:
    """max over tensors of max|a-b| / max|b| (b the reference)."""
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max() / b[k].double().abs().max().clamp_min(1e-300))
               for k in b)


def fit_rank(rank: int, world_size: int, cfg_dict: dict, data_dir: str, run_dir, resume: bool = False) -> dict:
    """Train ``cfg_dict`` as ``rank`` of ``world_size`` (gloo, CPU; inside :func:`run_ranks`), resuming
    from the newest checkpoint of ``run_dir`` when ``resume``. Every rank calls it. Returns the
    summary and the whole final model (``state``; a collective for sharded strategies)."""
    import torch

    from paratrain.config import from_dict
    from paratrain.env import DistEnv
    from paratrain.train import Trainer
    from paratrain.train.checkpoint import latest

    env = DistEnv(rank, rank, world_size, world_size, "gloo", torch.device("cpu"))
    tr = Trainer(from_dict(cfg_dict), env, run_dir, data_dir, verbose=False)
    if resume:
        tr.restore(latest(Path(run_dir)))
    summary = tr.fit()
    state = {k: v.detach().clone() for k, v in tr.strategy.state_dict().items()}
    tr.close()
    return {"summary": summary, "steps": summary["steps"], "state": state}


def train_in_process(cfg_dict: dict, data, run_dir: Path, resume: bool = False) -> None:
    """Train ``cfg_dict`` in this process (one-process strategies), resuming from the newest
    checkpoint of ``run_dir`` when ``resume``."""
    from paratrain.config import from_dict
    from paratrain.env import DistEnv
    from paratrain.train import Trainer
    from paratrain.train.checkpoint import latest

    tr = Trainer(from_dict(cfg_dict), DistEnv(), run_dir, str(data), verbose=False)
    if resume:
        tr.restore(latest(run_dir))
    tr.fit()
    tr.close()
