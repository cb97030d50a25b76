"""In-process micro-benchmarks of CPU towers (threads of one process): what synchronised BatchNorm's
meetings between the tower threads cost a training step (:func:`measured_tower_sync_batchnorm`), and
the towers' forward as ``replicate`` runs it: split, side by side in their threads, joined, with the
loss on the joined outputs, and their one backward, plain and with synchronised BatchNorm in turn
(:func:`measured_towers_forward`; the profile's entry, :func:`towers_forward`).
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
                            warmup: int = 2, least_s: float = 0.0, most: int = 300,
                            synced: tuple[torch.nn.Module, Any] | None = None) -> dict[str, float]:
    """Seconds of the training loop's forward and backward of ``towers`` CPU towers, each right after
    a training step at this process' threads: ``loss_of(engine)``, the loss of the towers' whole batch
    (``towers`` replicas' batches) through :class:`~paratrain.strategies.towers.CPUTowers` around
    ``model``, split along ``batch_dim``, then its one backward. That is what ``replicate`` times as
    its forward (the buffers copied to the replicas, the split, each tower's forward side by side in
    a thread with its share of the intra-op threads under its own random generator, the join of their
    outputs and the loss on the joined outputs with every thread) and its backward (one backward in
    the calling thread through every tower's graph, the gradients summed into the shared
    parameters). ``step()``: one training step of ``model``. ``synced``: (the model with synchronised
    BatchNorm, its :class:`~paratrain.strategies.towers.TowerGroup`), timed the same way in turn
    with the plain one, each right after a training step of ``model`` (the copy itself is not
    trained): what the towers' meetings add, with the
    machine's drift alike in both. Median of at least ``repeats`` after ``warmup``, and more until the
    timed forwards and backwards last ``least_s`` (at most ``most``). Returns ``{"seconds": forward,
    "backward_seconds": backward, "repeats"}`` and, with ``synced``, ``"sync_batchnorm_s"``: its
    forward + backward less the plain one's (at least 0). Every thread the towers start ends before
    it returns; the models' gradients are left as None.

    The towers' forwards alone, each with its own loss in its thread (this measurement until
    profile version 26), were 25-40% under the loop's forward on a 2-vCPU Xeon (gpt_wt2: 420 against
    585 ms; 2026-11-28): the join, the loss on the joined logits and the towers' per-operation
    random-generator mode were left out. Processes of one thread each were up to 30% under the
    threads (ptb_small: 38 against 46-53 ms). Until version 36 the forward alone was timed, 5 times:
    on the 2-vCPU EPYC VM digits_cnn's median of 5 was 6.6 ms where 300 gave 4.8 (2026-11-29)."""
    from ..strategies.towers import CPUTowers

    engines = [(CPUTowers(model, towers, batch_dim, torch.get_num_threads()), model)]
    if synced is not None:
        engines.append((CPUTowers(synced[0], towers, batch_dim, torch.get_num_threads(), synced[1]), synced[0]))
    times: list[list[tuple[float, float]]] = [[] for _ in engines]
    i = timed = 0
    while i < warmup + repeats or (timed < least_s and i < warmup + most):
        for (engine, module), got in zip(engines, times):
            step()
            start = time.perf_counter()
            loss = loss_of(engine)
            middle = time.perf_counter()
            loss.backward()
            end = time.perf_counter()
            for p in module.parameters():  # as the loop's zero_grad(set_to_none=True) leaves them
                p.grad = None
            if i >= warmup:
                got.append((middle - start, end - middle))
                timed += end - start
        i += 1
    out = {"seconds": statistics.median(f for f, _ in times[0]),
           "backward_seconds": statistics.median(b for _, b in times[0]), "repeats": len(times[0])}
    if synced is not None:
        both = [statistics.median(f + b for f, b in got) for got in times]
        out["sync_batchnorm_s"] = max(0.0, both[1] - both[0])
    return out


def towers_forward(task, model: torch.nn.Module, device: torch.device, one_step: Callable[[], None],
                   towers_task: Callable[[int], Any], towers: int, batch: int, *, sync_batchnorm: bool = False,
                   least_s: float = 2.0, precision: str = "fp32") -> dict[str, Any] | None:
    """The profile's ``towers_forward_threads``: ``{"towers", "joined": True, "seconds",
    "backward_seconds", "repeats"}`` (since version 36 the backward too, and ``"sync_batchnorm_s"``
    where ``sync_batchnorm``: the recipe's ``model.sync_batchnorm``), the forward and backward
    of ``towers`` CPU towers of ``model`` as ``replicate`` runs them, for about ``least_s`` seconds
    (:func:`~.microbench_towers.measured_towers_forward`) on the first training step of
    ``towers_task(towers x batch)`` (the task built for one process holding every tower's batch of
    ``batch``), split along the task's ``batch_dim`` (0 where it has none), right after
    ``one_step()``, their forward under ``precision``'s autocast as training runs a bf16 or fp16
    recipe's (:class:`~paratrain.strategies.wrapping.AutocastModule` around the towers). None, with a
    line, where that task cannot be built or gives no step (e.g. fewer
    training examples than the towers' batch): the plan then prices the towers' forwards one after
    the other."""
    from ..data.batching import move_to
    from ..errors import UsageError
    from ..strategies.precision import LOW_DTYPES
    from ..tasks import optional
    from ..strategies.wrapping import AutocastModule

    whole_batch = towers * batch
    try:
        whole = towers_task(whole_batch)
        first = next(iter(whole.train_steps(0, 0)))
    except (UsageError, StopIteration) as e:
        print(f"[plan] CPU towers' forward not measured: the task gives no training step of {whole_batch} "
              f"({e or 'no batches'}); the towers' forwards are priced one after the other", flush=True)
        return None
    batches = [move_to(mb, device, non_blocking=False) for mb in first.micro_batches]  # as the loop moves them
    low = LOW_DTYPES.get(precision)
    wrapped: dict[int, torch.nn.Module] = {}  # per engine (plain, synchronised), made once: not in the timed forward

    def loss_of(engine: torch.nn.Module) -> torch.Tensor:  # a bf16 or fp16 recipe's forward as training runs it
        if low is not None and id(engine) not in wrapped:
            wrapped[id(engine)] = AutocastModule(engine, device.type, low)
        run = wrapped.get(id(engine), engine)
        return sum(whole.loss(run, mb)[0] for mb in batches) / float(first.global_count)

    pair = None
    if sync_batchnorm:  # replicate's own conversion (Replicate._sync_batchnorm), on a copy of the model
        import copy

        from ..strategies.sync_batchnorm import TowerReducer, convert
        from ..strategies.towers import TowerGroup

        group = TowerGroup(towers)
        try:
            pair = (convert(copy.deepcopy(model), TowerReducer(group)), group)
        except (TypeError, RuntimeError, copy.Error) as e:  # a model that cannot be copied: the loop's pair prices it
            print(f"[plan] CPU towers' sync BatchNorm not timed in this process: the model cannot be copied ({e}); "
                  f"the training loop's runs with it on and off price it", flush=True)
    got = measured_towers_forward(model, loss_of, one_step, towers, optional(task, "batch_dim"), least_s=least_s,
                                  synced=pair)
    return {"towers": towers, "joined": True, **got}
