"""Collective micro-benchmark on this machine: gloo all-reduce times, local reduction cost, and
the fitted :class:`~paratrain.bench.costmodel.Link` (``paratrain bench --validate-model``).

:func:`measure_allreduce` spawns ``world_size`` processes (torch.multiprocessing, spawn
context) that meet through a ``torch.distributed.FileStore`` in a temporary folder (no ports),
each with one intra-op thread and gloo pinned to loopback (``GLOO_SOCKET_IFNAME=lo`` unless
set). Per size: ``warmup`` untimed all-reduces, then ``repeats`` times: barrier, time one
all-reduce of float32 zeros (zeros: the sums never overflow), take the max over ranks (a
one-element all-reduce with MAX, outside the timed block). The result is the median of those
maxima. Rank 0 writes the results as JSON; the parent kills every rank still running after
``timeout_s`` and raises RuntimeError.

:func:`measure_gamma` times ``a.add_(b)`` on one thread in this process (gloo reduces on the
CPU, one thread per rank). :func:`measured_link` fits alpha and beta with gamma known
(:func:`~paratrain.bench.costmodel.fit_alpha_beta`).
"""
from __future__ import annotations

import datetime
import json
import os
import statistics
import tempfile
import time
import traceback
from pathlib import Path
from typing import Sequence

import torch

from .costmodel import Link, fit_alpha_beta

DEFAULT_SIZES_BYTES = tuple(4 ** k for k in range(1, 14))
"""4 B, 16 B, ..., 64 MiB: 13 sizes, a factor 4 apart."""
FLOAT32_BYTES = 4


def _rank_main(rank: int, world_size: int, workdir: str, sizes_bytes: Sequence[int], repeats: int,
               warmup: int, timeout_s: float) -> None:
    """One rank (spawned): time every size, rank 0 writes ``results.json``; errors to ``error-<rank>.txt``."""
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    try:
        store = dist.FileStore(str(Path(workdir) / "filestore"), world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        try:
            results = [(int(size), _time_allreduce(size, repeats, warmup)) for size in sizes_bytes]
        finally:
            dist.destroy_process_group()
        if rank == 0:
            (Path(workdir) / "results.json.tmp").write_text(json.dumps(results))
            os.replace(Path(workdir) / "results.json.tmp", Path(workdir) / "results.json")
    except BaseException:
        (Path(workdir) / f"error-{rank}.txt").write_text(traceback.format_exc())
        raise


def _time_allreduce(nbytes: int, repeats: int, warmup: int) -> float:
    """Median over ``repeats`` of the slowest rank's seconds for one all-reduce of ``nbytes``
    (float32 elements, at least one). Collective: every rank calls it with the same arguments."""
    import torch.distributed as dist

    x = torch.zeros(max(1, nbytes // FLOAT32_BYTES), dtype=torch.float32)
    for _ in range(warmup):
        dist.all_reduce(x)
    slowest = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        slowest.append(float(dt))
    return statistics.median(slowest)


def _failure(procs: list, workdir: Path, timeout_s: float) -> str | None:
    """The error message for ranks that hung (killed here) or failed, None if all exited 0."""
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    errors = "".join(f"\n--- rank {r}:\n{(workdir / f'error-{r}.txt').read_text()}"
                     for r in range(len(procs)) if (workdir / f"error-{r}.txt").exists())
    errors = errors or " (no traceback written: the ranks' own output is on stderr)"
    if hung:
        return (f"all-reduce benchmark: ranks {hung} still running after timeout_s = {timeout_s} s (killed); "
                f"raise timeout_s, or measure fewer or smaller sizes, or fewer repeats{errors}")
    bad = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode != 0}
    if bad:
        return f"all-reduce benchmark: ranks failed with exit codes {bad}{errors}"
    return None


def measure_allreduce(world_size: int = 2, sizes_bytes: Sequence[int] = DEFAULT_SIZES_BYTES, repeats: int = 10,
                      warmup: int = 2, timeout_s: float = 120.0) -> list[tuple[int, float]]:
    """[(bytes, median seconds)] of a gloo all-reduce (sum) of float32 tensors among
    ``world_size`` local processes, one per size in ``sizes_bytes`` (rounded down to whole
    float32 elements, at least one; the bytes returned are the ones sent).

    Raises RuntimeError when a rank fails, or when the ranks have not finished within
    ``timeout_s`` seconds of starting (they are killed); the message holds their tracebacks.
    """
    if world_size < 2 or repeats < 1 or warmup < 0 or not sizes_bytes:
        raise ValueError(f"need world_size >= 2 (got {world_size}), repeats >= 1 (got {repeats}), "
                         f"warmup >= 0 (got {warmup}) and at least one size")
    sizes = [max(1, int(s) // FLOAT32_BYTES) * FLOAT32_BYTES for s in sizes_bytes]
    ctx = torch.multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="paratrain-allreduce-") as tmp:
        workdir = Path(tmp)
        procs = [ctx.Process(target=_rank_main, args=(r, world_size, tmp, sizes, repeats, warmup, timeout_s),
                             daemon=True) for r in range(world_size)]
        for p in procs:
            p.start()
        end = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, end - time.monotonic()))
        message = _failure(procs, workdir, timeout_s)
        if message:
            raise RuntimeError(message)
        return [(int(s), float(t)) for s, t in json.loads((workdir / "results.json").read_text())]


def measure_gamma(nbytes: int = 16 * 2 ** 20, repeats: int = 20, warmup: int = 2) -> float:
    """Seconds per byte of a local float32 reduction ``a.add_(b)`` on one CPU thread (median over
    ``repeats``; the caller's thread count is restored)."""
    a = torch.zeros(max(1, nbytes // FLOAT32_BYTES), dtype=torch.float32)
    b = torch.ones_like(a)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(warmup):
            a.add_(b)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            a.add_(b)
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return statistics.median(times) / (a.numel() * FLOAT32_BYTES)


def measured_link(world_size: int = 2, *, sizes_bytes: Sequence[int] = DEFAULT_SIZES_BYTES, repeats: int = 10,
                  warmup: int = 2, timeout_s: float = 120.0, gamma_bytes: int = 16 * 2 ** 20) -> Link:
    """``Link(name="measured")`` of this machine's loopback gloo: gamma from :func:`measure_gamma`,
    alpha and beta fitted to :func:`measure_allreduce` with the ring model (relative errors)."""
    gamma = measure_gamma(gamma_bytes)
    points = measure_allreduce(world_size, sizes_bytes, repeats=repeats, warmup=warmup, timeout_s=timeout_s)
    alpha, beta = fit_alpha_beta([s for s, _ in points], [t for _, t in points], world_size, gamma)
    return Link(name="measured", alpha_s=alpha, beta_s_per_byte=beta, gamma_s_per_byte=gamma)
