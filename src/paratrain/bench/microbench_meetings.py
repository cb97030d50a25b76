"""Micro-benchmarks of compute meeting communication on this machine: what a blocking collective
costs ranks that reach it from compute (:func:`measured_meetings`), and what synchronising
BatchNorm layers costs two processes a step (:func:`measured_sync_batchnorm`). Both run in
:func:`~.microbench.measure_allreduce`'s gloo processes (``op="meeting"``: two, or more to take
turns on fewer cores; ``op="sync_batchnorm"``: two); :func:`products_for` calibrates the compute
before each meeting."""
from __future__ import annotations

import statistics
import time
from typing import Sequence

import torch

from .microbench import all_gather_single, measure_allreduce


def products_per_s(a: torch.Tensor, windows: int = 5, count: int = 100) -> float:
    """Products ``a @ a`` per second that this process computes now on its intra-op threads: the best
    of ``windows`` windows of ``count`` products each (after one to warm up), so that one preemption
    does not set the rate."""
    best = 0.0
    for w in range(windows + 1):
        t0 = time.perf_counter()
        for _ in range(count):
            torch.mm(a, a)
        if w:
            best = max(best, count / max(time.perf_counter() - t0, 1e-9))
    return best


def products_for(a: torch.Tensor, seconds: float) -> int:
    """How many ``a @ a`` take about ``seconds`` on this thread's intra-op threads (at least 1), from
    one window of 10 products: the compute a micro-benchmark puts before a layer, as inside a training
    step. (Not :func:`products_per_s`' best of several windows: a GPU's profile times sync BatchNorm's
    layers with it too, and profiles since version 19 hold what this measures.)"""
    t0 = time.perf_counter()
    for _ in range(10):
        a @ a
    return max(1, round(seconds * 10 / max(1e-7, time.perf_counter() - t0)))


def _products_everywhere(a: torch.Tensor, seconds: float) -> int:
    """:func:`products_for` as rank 0 calibrates it, the same on every rank (every rank computes as
    much). Collective: every rank calls it."""
    import torch.distributed as dist

    k = torch.tensor([products_for(a, seconds)], dtype=torch.int64)
    dist.broadcast(k, 0)
    return int(k)


def _time_sync_batchnorm(item: dict, repeats: int, warmup: int) -> float:
    """Seconds that paratrain's :class:`~paratrain.strategies.sync_batchnorm.SyncBatchNorm` over the
    ranks adds to the same layer without a reducer (plain BatchNorm) for one forward and backward on
    input of shape ``item["shape"]`` (N, C, *): three blocking all-reduces (count and sum, the variance,
    and in the backward the two sums of its gradient), each meeting a rank that may still be computing.

    As inside a training step, the layer's forward follows ``item["compute_s"][0]`` seconds of
    one-thread compute (what the step computes between two BatchNorm layers' forwards), and its backward
    ``item["compute_s"][1]`` more (what it computes between two layers' backwards: each layer's meetings
    pay the ranks' drift over the compute since the last ones). Only the layer's forward and backward
    are timed.
    The median over ``repeats`` interleaved pairs, difference of the medians. Collective: every rank
    calls it."""
    import torch.distributed as dist

    from ..strategies.sync_batchnorm import GroupReducer, SyncBatchNorm

    shape, (before, between) = [int(d) for d in item["shape"]], item["compute_s"]
    x = torch.randn(*shape, requires_grad=True)
    synced = SyncBatchNorm(shape[1], reducer=GroupReducer(dist.group.WORLD))
    plain = SyncBatchNorm(shape[1], reducer=None)
    a = torch.randn(96, 96)
    k_before = _products_everywhere(a, before)
    k_between = _products_everywhere(a, between) if between > 0 else 0

    def once(layer) -> float:
        for _ in range(k_before):
            a @ a
        t = time.perf_counter()
        y = layer(x)
        forward = time.perf_counter() - t
        for _ in range(k_between):
            a @ a
        t = time.perf_counter()
        y.sum().backward()
        return forward + time.perf_counter() - t

    alone, reduced = [], []
    for i in range(warmup + repeats):
        got = once(plain), once(synced)
        if i >= warmup:
            alone.append(got[0])
            reduced.append(got[1])
    return max(0.0, statistics.median(reduced) - statistics.median(alone))


def _time_meeting(compute_us: int, repeats: int, warmup: int) -> float:
    """Mean seconds, over the repeats and the ranks, that one blocking all-gather of 8 float32 takes
    when each rank comes to it from about ``compute_us`` microseconds of one-thread compute (rank 0's
    calibration, the same on every rank), as a collective inside a training step does: the link's
    latency, the wait for the rank that arrives last and the waking of gloo's threads. The mean, not
    the median: a step pays the rare long waits too. About 1 s of timed repeats: 30 to ``repeats``
    of them. Collective: every rank calls it."""
    import torch.distributed as dist

    a = torch.randn(96, 96)
    k = _products_everywhere(a, compute_us * 1e-6) if compute_us > 0 else 0
    part, out = torch.zeros(8), torch.zeros(8 * dist.get_world_size())
    times, repeats = [], max(30, min(repeats, round(1e6 / max(1, compute_us))))
    for i in range(warmup + repeats):
        for _ in range(k):
            a @ a
        t0 = time.perf_counter()
        all_gather_single(out, part)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    mean = torch.tensor([statistics.fmean(times)], dtype=torch.float64)
    dist.all_reduce(mean)
    return float(mean) / dist.get_world_size()


def measured_sync_batchnorm(shapes: Sequence[Sequence[int]], *, compute_s: Sequence[float] = (1e-3, 1e-3),
                            repeats: int = 40, warmup: int = 5, timeout_s: float = 120.0) -> float:
    """Seconds per training step that synchronising BatchNorm layers with these per-replica input
    shapes (N, C, *) costs two local gloo processes (one thread each) beyond plain BatchNorm: the
    sum over the layers of :func:`_time_sync_batchnorm`. ``compute_s``: (before, between), the
    one-thread compute each layer's forward follows and its backward follows, as inside the step
    (the profile gives the step's forward and backward split evenly over the layers; the default, 1 ms
    before each, is ``paratrain predict``'s). ``timeout_s``: beyond that compute, which both the
    synchronised and the plain layer run every repeat. 0 for no shapes. Raises RuntimeError as
    :func:`measure_allreduce`."""
    if not shapes:
        return 0.0
    items = [{"shape": [int(d) for d in s], "compute_s": [float(c) for c in compute_s]} for s in shapes]
    compute = 2 * (warmup + repeats) * len(shapes) * sum(items[0]["compute_s"])
    points = measure_allreduce(2, items, repeats=repeats, warmup=warmup, timeout_s=timeout_s + 2 * compute,
                               op="sync_batchnorm")
    return sum(t for _, t in points)


def measured_meetings(compute_s: Sequence[float] = (2.5e-4, 1e-3, 4e-3, 1.6e-2, 6.4e-2), *,
                      processes: int = 2, timeout_s: float = 120.0) -> list[list[float]]:
    """``[compute seconds, seconds]``: what one blocking collective costs ``processes`` local gloo
    processes (one thread each) that come to it from that much compute (:func:`_time_meeting`: about
    1 s of timed repeats per point, 30 to 400 of them). More processes than cores take turns on them:
    the compute is calibrated as it runs then (rank 0's, with the others computing), and each meeting
    waits for the processes still computing. For :func:`~.costmodel_sharded.meeting_seconds`. Raises
    RuntimeError as :func:`measure_allreduce`."""
    points = measure_allreduce(processes, [max(1, round(c * 1e6)) for c in compute_s], repeats=400, warmup=3,
                               timeout_s=timeout_s, op="meeting")
    return [[us * 1e-6, t] for us, t in points]
