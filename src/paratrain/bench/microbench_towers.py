"""In-process micro-benchmarks of CPU towers (threads of one process): what synchronised BatchNorm's
meetings between the tower threads cost a training step (:func:`measured_tower_sync_batchnorm`), and
the towers' forwards side by side in their threads (:func:`measured_towers_forward`).
The collectives between processes are in :mod:`.microbench`."""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import torch

from .microbench_meetings import products_for


def measured_tower_sync_batchnorm(shapes: Sequence[Sequence[int]], towers: int = 2, *, repeats: int = 40,
                                  warmup: int = 5, compute_s: float = 1e-3) -> float:
    """Seconds per training step that synchronising BatchNorm layers with these per-tower input shapes
    (N, C, *) costs ``towers`` CPU towers of this process beyond plain BatchNorm: per layer, the
    towers' forward (:class:`~paratrain.strategies.towers.CPUTowers`, each tower thread with its share
    of this process' intra-op threads, about ``compute_s`` of compute before the layer, as inside a
    training step) meets twice at :meth:`~paratrain.strategies.towers.TowerGroup.exchange` (count and
    sum, then the variance) and the one backward runs through the sums. Median of ``repeats``
    interleaved forward + backward passes, synchronised minus plain, summed over the layers. 0 for no
    shapes. Runs in this process; every thread it starts ends before it returns."""
    from torch import nn

    from ..strategies.sync_batchnorm import SyncBatchNorm, TowerReducer
    from ..strategies.towers import CPUTowers, TowerGroup

    if not shapes or towers < 2:
        return 0.0
    threads = torch.get_num_threads()
    a = torch.randn(96, 96)
    torch.set_num_threads(max(1, threads // towers))  # a tower thread's share: calibrate the compute there
    try:
        k = products_for(a, compute_s)
    finally:
        torch.set_num_threads(threads)

    class Busy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(k):
                a @ a
            return x

    total = 0.0
    for shape in shapes:
        shape = [int(d) for d in shape]
        x = torch.randn(towers * shape[0], *shape[1:], requires_grad=True)
        group = TowerGroup(towers)
        synced = CPUTowers(nn.Sequential(Busy(), SyncBatchNorm(shape[1], reducer=TowerReducer(group))),
                           towers, 0, threads, group)
        plain = CPUTowers(nn.Sequential(Busy(), SyncBatchNorm(shape[1], reducer=None)), towers, 0, threads)

        def once(layer) -> float:
            t = time.perf_counter()
            layer(x).sum().backward()
            return time.perf_counter() - t

        alone, reduced = [], []
        for i in range(warmup + repeats):
            got = once(plain), once(synced)
            if i >= warmup:
                alone.append(got[0])
                reduced.append(got[1])
        total += max(0.0, statistics.median(reduced) - statistics.median(alone))
    return total


def measured_towers_forward(model: torch.nn.Module, forward: Callable[[torch.nn.Module], Any],
                            step: Callable[[], None], towers: int, *, repeats: int = 5, warmup: int = 2) -> float:
    """Seconds of ``towers`` forwards of one replica's batch side by side in threads of this process,
    each thread with one intra-op thread, right after a training step at this process' threads: what
    CPU towers (:class:`~paratrain.strategies.towers.CPUTowers`) run on this machine's cores, in the
    same threads (:func:`~paratrain.strategies.towers.run_threads`, tower 0 in this thread) and after
    the same full-thread backward and optimizer step. ``forward(module)``: one replica's loss through
    ``module`` (kept until the thread ends, as a tower's graph is); ``step()``: one training step of
    ``model``. Median of ``repeats`` after ``warmup``. Processes of one thread each, the profile's
    other measurement of a side-by-side forward, were up to 30% faster than these threads here (ptb_small:
    38 against 46-53 ms), which the towers' prediction must not assume."""
    from ..strategies.towers import run_threads, shallow_replica

    replicas = [model] + [shallow_replica(model) for _ in range(towers - 1)]
    threads = torch.get_num_threads()

    def tower(module: torch.nn.Module) -> Callable[[], None]:
        def call() -> None:
            torch.set_num_threads(1)
            forward(module)
        return call

    times = []
    for i in range(warmup + repeats):
        step()
        start = time.perf_counter()
        try:
            run_threads([tower(m) for m in replicas])
        finally:  # tower 0 ran in this thread: the next step gets every thread back
            torch.set_num_threads(threads)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)
