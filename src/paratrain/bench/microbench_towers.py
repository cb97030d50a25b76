"""In-process micro-benchmarks of CPU towers (threads of one process): what synchronised BatchNorm's
meetings between the tower threads cost a training step (:func:`measured_tower_sync_batchnorm`), and
the towers' forward as ``replicate`` runs it: split, side by side in their threads, joined, with the
loss on the joined outputs (:func:`measured_towers_forward`; the profile's entry, :func:`towers_forward`).
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

    from ..env import intra_op_threads
    from ..strategies.sync_batchnorm import SyncBatchNorm, TowerReducer
    from ..strategies.towers import CPUTowers, TowerGroup

    if not shapes or towers < 2:
        return 0.0
    threads = torch.get_num_threads()
    a = torch.randn(96, 96)
    with intra_op_threads(threads // towers):  # a tower thread's share: calibrate the compute there
        k = products_for(a, compute_s)

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


def measured_towers_forward(model: torch.nn.Module, loss_of: Callable[[torch.nn.Module], Any],
                            step: Callable[[], None], towers: int, batch_dim: int, *, repeats: int = 5,
                            warmup: int = 2) -> float:
    """Seconds of the training loop's forward of ``towers`` CPU towers, right after a training step
    at this process' threads: ``loss_of(engine)``, the loss of the towers' whole batch (``towers``
    replicas' batches) through :class:`~paratrain.strategies.towers.CPUTowers` around ``model``,
    split along ``batch_dim``. That is what ``replicate`` times as its forward: the buffers copied
    to the replicas, the split, each tower's forward side by side in a thread with its share of
    the intra-op threads under its own random generator, the join of their outputs and the loss on
    the joined outputs with every thread. ``step()``: one training step of ``model``. Median of
    ``repeats`` after ``warmup``; every thread the towers start ends before it returns.

    The towers' forwards alone, each with its own loss in its thread (this measurement until
    profile version 26), were 25-40% under the loop's forward on a 2-vCPU Xeon (gpt_wt2: 420 against
    585 ms; 2026-11-28): the join, the loss on the joined logits and the towers' per-operation
    random-generator mode were left out. Processes of one thread each were up to 30% under the
    threads (ptb_small: 38 against 46-53 ms)."""
    from ..strategies.towers import CPUTowers

    engine = CPUTowers(model, towers, batch_dim, torch.get_num_threads())
    times = []
    for i in range(warmup + repeats):
        step()
        start = time.perf_counter()
        loss = loss_of(engine)
        if i >= warmup:
            times.append(time.perf_counter() - start)
        del loss  # its graph is freed outside the timed forward, as training frees it in the backward
    return statistics.median(times)


def towers_forward(task, model: torch.nn.Module, device: torch.device, one_step: Callable[[], None],
                   towers_task: Callable[[int], Any], towers: int, batch: int) -> dict[str, Any] | None:
    """The profile's ``towers_forward_threads``: ``{"towers", "joined": True, "seconds"}``, the forward
    of ``towers`` CPU towers of ``model`` as ``replicate`` runs it
    (:func:`~.microbench_towers.measured_towers_forward`) on the first training step of
    ``towers_task(towers x batch)`` (the task built for one process holding every tower's batch of
    ``batch``), split along the task's ``batch_dim`` (0 where it has none), right after
    ``one_step()``. None, with a line, where that task cannot be built or gives no step (e.g. fewer
    training examples than the towers' batch): the plan then prices the towers' forwards one after
    the other."""
    from ..data.batching import move_to
    from ..errors import UsageError
    from ..tasks import optional

    whole_batch = towers * batch
    try:
        whole = towers_task(whole_batch)
        first = next(iter(whole.train_steps(0, 0)))
    except (UsageError, StopIteration) as e:
        print(f"[plan] CPU towers' forward not measured: the task gives no training step of {whole_batch} "
              f"({e or 'no batches'}); the towers' forwards are priced one after the other", flush=True)
        return None
    batches = [move_to(mb, device, non_blocking=False) for mb in first.micro_batches]  # as the loop moves them

    def loss_of(engine: torch.nn.Module) -> torch.Tensor:
        return sum(whole.loss(engine, mb)[0] for mb in batches) / float(first.global_count)

    return {"towers": towers, "joined": True,
            "seconds": measured_towers_forward(model, loss_of, one_step, towers, optional(task, "batch_dim"))}
