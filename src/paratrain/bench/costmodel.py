"""Alpha-beta cost model of data-parallel training: collectives, buckets, overlap, scaling (the links
and collectives live in :mod:`.costmodel_links` and are re-exported here).

Pure arithmetic (no torch, no I/O); :mod:`paratrain.bench.microbench` measures
the numbers that go in. Sources:

* Hockney's model: sending ``m`` bytes costs ``alpha + m * beta``; a reduction
  costs ``m * gamma`` (Thakur, Rabenseifner & Gropp 2005, "Optimization of
  collective communication operations in MPICH", IJHPCA 19(1)).
* Ring all-reduce = reduce-scatter + all-gather, ``2(n-1)`` steps of ``m/n``
  bytes (Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce algorithms for
  clusters of workstations", JPDC 69(2)).
* Bucketing and overlap of all-reduce with backward as in PyTorch DDP (Li et
  al. 2020, "PyTorch Distributed", VLDB 13(12)).

Units: seconds (``_s``), bytes (``_bytes``/``nbytes``), ``bucket_mb`` in MiB
(2**20 bytes, as DDP's ``bucket_cap_mb``). ``n`` is world_size (replicas).
Bad arguments raise :class:`~paratrain.errors.UsageError` naming the value.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Mapping, Sequence

import numpy as np

from ..errors import UsageError
from .costmodel_links import (PAT_BANDWIDTH, PAT_LEVEL_FRACTION, PAT_PER_RANK_S,  # noqa: F401 (API)
                              PRESETS, RING_PLATEAU, TREE_ALGORITHM_BANDWIDTH, TREE_CORRECTION, Link, _check_n,
                              allreduce_s, pat_latency_s, ring_allreduce_bytes, ring_allreduce_s,
                              tree_allreduce_s, tree_broadcast_s, tree_correction)

MIB = 2 ** 20
FLOAT32_BYTES = 4
ALGORITHMS = ("ring", "tree", "ps")
BUCKET_CANDIDATES_MB = (1, 2, 5, 10, 25, 50, 100)


def make_buckets(param_bytes_backward_order: Sequence[int], bucket_bytes: float) -> list[int]:
    """Greedy DDP-like buckets (bytes each) in the order gradients become ready: parameters are
    added to the open bucket, never split; a bucket closes once it holds >= ``bucket_bytes``; the
    last one may be smaller. (DDP also caps its first bucket at 1 MiB; not modelled.)"""
    if not bucket_bytes > 0:
        raise UsageError(f"bucket size {bucket_bytes} bytes must be > 0")
    buckets, open_bytes = [], 0
    for p in param_bytes_backward_order:
        open_bytes += p
        if open_bytes >= bucket_bytes:
            buckets.append(open_bytes)
            open_bytes = 0
    if open_bytes:
        buckets.append(open_bytes)
    return buckets


def overlapped_step_s(*, forward_s: float, backward_s: float, other_s: float, bucket_bytes: Sequence[int],
                      comm_s: Callable[[float], float], overlap: bool = True) -> tuple[float, float]:
    """(step_s, exposed_comm_s) with each bucket's all-reduce overlapping the rest of backward.

    Backward produces gradient bytes at a constant rate, buckets in order: bucket i is ready at
    ``backward_s * cumulative_bytes_i / total_bytes`` after backward starts; its all-reduce starts
    at max(ready_i, end of all-reduce i-1) (one collective at a time, as DDP) and lasts
    ``comm_s(bytes_i)``. step = forward + max(backward, last all-reduce end) + other;
    exposed = step - (forward + backward + other) = max(0, last end - backward).
    ``overlap=False``: no bucket overlaps compute (the cores that compute also run the collectives,
    as gloo on a CPU whose cores are all busy computing): exposed = the sum of the all-reduces.
    """
    if not overlap:
        exposed = sum(comm_s(b) for b in bucket_bytes)
        return forward_s + backward_s + other_s + exposed, exposed
    total = sum(bucket_bytes)
    end, cumulative = 0.0, 0
    for b in bucket_bytes:
        cumulative += b
        ready = backward_s * (cumulative / total) if total else backward_s
        end = max(ready, end) + comm_s(b)
    exposed = max(0.0, end - backward_s)
    return forward_s + backward_s + other_s + exposed, exposed


@dataclass(frozen=True, kw_only=True)
class Workload:
    """One replica's step, measured on one device (seconds per step) and its gradients.

    param_bytes: gradient bytes per parameter in the order gradients become ready in backward
    (reverse module order is fine); tokens_per_step: target tokens (words) per replica per step;
    payload_ratio: bytes a communication hook hands to all-reduce per gradient byte (1 plain, 0.5
    fp16/bf16, PowerSGD's measured ratio); buckets are still formed by gradient bytes, as DDP does.
    The hook's own compute (casts, PowerSGD's matrix products) is not modelled. local_sd_s: the
    standard deviation from step to step of the local time (the step less communication), in seconds
    (:func:`~.straggler.straggle_s`); 0 where not measured.
    """

    forward_s: float
    backward_s: float
    data_s: float
    optimizer_s: float
    param_bytes: tuple[int, ...]
    tokens_per_step: int
    payload_ratio: float = 1.0
    local_sd_s: float = 0.0

    def __post_init__(self) -> None:
        for key in ("forward_s", "backward_s", "data_s", "optimizer_s", "local_sd_s"):
            if not getattr(self, key) >= 0:
                raise UsageError(f"Workload.{key} = {getattr(self, key)} must be >= 0 seconds")
        if any(p < 0 for p in self.param_bytes):
            raise UsageError("Workload.param_bytes must all be >= 0")
        if not 0 < self.payload_ratio <= 1:
            raise UsageError(f"Workload.payload_ratio = {self.payload_ratio} must be in (0, 1]")
        if not self.tokens_per_step > 0:
            raise UsageError(f"Workload.tokens_per_step = {self.tokens_per_step} must be > 0")

    def local_s(self, compute_scale: float = 1.0) -> float:
        """Seconds of one step without communication: (forward + backward + data + optimizer) * scale."""
        return (self.forward_s + self.backward_s + self.data_s + self.optimizer_s) * compute_scale


@dataclass(frozen=True)
class Prediction:
    """Predicted step at world_size ``n`` (weak scaling: per-replica batch fixed).

    compute_s: step without communication; exposed_comm_s = step_s - compute_s; words_per_s:
    n * tokens_per_step / step_s; speedup S(N) against one device; efficiency S(N)/N;
    bucket_mb: MiB (0.0 for "ps", which has no buckets); optimizer_s: the seconds of the step the
    formula prices as the optimizer's (what training's optimizer span holds), filled by each formula:
    this strategy's share of the optimizer step (the whole for ring, tree and towers; 1/n for ZeRO-1
    and FSDP, with their DTensors' dispatch; a pipeline's largest stage's; :func:`predict`'s "ps" the
    workers' own step, as it prices it) and, where the formula prices a measured sharded step
    (ZeRO-1's or FSDP2's on this machine's CPU), all that step adds (its all-gather or the guard's
    norm included), so part of it may be in exposed_comm_s.
    """

    n: int
    step_s: float
    compute_s: float
    exposed_comm_s: float
    words_per_s: float
    speedup: float
    efficiency: float
    bucket_mb: float
    algorithm: str
    optimizer_s: float


def prediction(w: Workload, n: int, step_s: float, compute_s: float, algorithm: str, *, optimizer_s: float,
               replicas: int | None = None, bucket_mb: float = 0.0) -> Prediction:
    """A :class:`Prediction` of ``replicas`` (default n) replicas each stepping ``w.tokens_per_step``
    in ``step_s``: words/s, and speedup against one device's :meth:`Workload.local_s`. ``compute_s``: the
    step on an infinitely fast link (this strategy's share of the optimizer; a pipeline's bubble
    included), so that exposed communication = step - compute >= 0."""
    replicas = n if replicas is None else replicas
    words_per_s = replicas * w.tokens_per_step / step_s
    speedup = words_per_s / (w.tokens_per_step / w.local_s())
    return Prediction(n, step_s, compute_s, step_s - compute_s, words_per_s, speedup, speedup / n, float(bucket_mb),
                      algorithm, optimizer_s)


def _collective(algorithm: str) -> Callable[[float, int, Link], float]:
    if algorithm == "ring":  # on a two-level cluster's link, NCCL's pick of its rings and trees
        return allreduce_s
    if algorithm == "tree":
        return tree_allreduce_s
    raise UsageError(f"algorithm = {algorithm!r}; use one of {', '.join(ALGORITHMS)}")


def predict(w: Workload, n: int, link: Link, *, algorithm: str = "ring", bucket_mb: float | None = None,
            num_ps: int = 1, compute_scale: float = 1.0, overlap: bool = True,
            bucket_s: Callable[[float], float] | None = None) -> Prediction:
    """Predict one step of ``n`` replicas over ``link``.

    "ring"/"tree": bucketed all-reduce overlapped with backward (:func:`overlapped_step_s`; data
    and optimizer are not overlapped; "ring" on a two-level cluster's link: :func:`allreduce_s`, NCCL's
    pick of its rings and trees); ``bucket_mb`` None picks one with :func:`pick_bucket`.
    "ps": ``num_ps`` server shards, no overlap: step = local + :func:`~.costmodel_ps.ps_step_s` (its busiest
    server's shard: :func:`~.costmodel_ps.ps_largest_shard_bytes`). n == 1 is one
    device: no communication for any algorithm. ``compute_scale`` multiplies the four measured
    times (e.g. > 1 for oversubscribed CPUs); the speedup baseline is n = 1 at scale 1. ``overlap``:
    see :func:`overlapped_step_s`. ``bucket_s``: seconds of a bucket of b gradient bytes where a
    compression hook's cost was measured (:func:`~.costmodel_hooks.compress_hook_bucket_s`), in
    place of the link's all-reduce of its payload ("ring"/"tree"; "ps" has no buckets).
    """
    _check_n(n)
    _check_n(num_ps, "num_ps")
    if not compute_scale > 0:
        raise UsageError(f"compute_scale = {compute_scale} must be > 0")
    if algorithm not in ALGORITHMS:
        _collective(algorithm)  # raises with the list of algorithms
    compute_s = w.local_s(compute_scale)
    if algorithm == "ps":
        from .costmodel_ps import ps_largest_shard_bytes, ps_step_s  # (it imports this module)

        bucket_mb = 0.0
        step_s = compute_s + (ps_step_s(sum(w.param_bytes), n, num_ps, link,
                                        ps_largest_shard_bytes(w.param_bytes, num_ps)) if n > 1 else 0.0)
    else:
        if bucket_mb is None:
            bucket_mb = pick_bucket(w, n, link, algorithm, compute_scale=compute_scale, overlap=overlap,
                                    bucket_s=bucket_s)
        collective = _collective(algorithm)
        step_s, _ = overlapped_step_s(
            forward_s=w.forward_s * compute_scale, backward_s=w.backward_s * compute_scale,
            other_s=(w.data_s + w.optimizer_s) * compute_scale,
            bucket_bytes=make_buckets(w.param_bytes, bucket_mb * MIB),
            comm_s=bucket_s or (lambda b: collective(b * w.payload_ratio, n, link)), overlap=overlap)
    return prediction(w, n, step_s, compute_s, algorithm, optimizer_s=w.optimizer_s * compute_scale,
                      bucket_mb=bucket_mb)


def pick_bucket(w: Workload, n: int, link: Link, algorithm: str = "ring",
                candidates_mb: Sequence[float] = BUCKET_CANDIDATES_MB, *, compute_scale: float = 1.0,
                overlap: bool = True, bucket_s: Callable[[float], float] | None = None) -> float:
    """The candidate bucket size (MiB) with the least predicted step time (:func:`predict`, its
    ``bucket_s`` too); ties go to the larger."""
    if not candidates_mb:
        raise UsageError("candidates_mb is empty; give at least one bucket size in MiB")
    steps = {mb: predict(w, n, link, algorithm=algorithm, bucket_mb=mb, compute_scale=compute_scale,
                         overlap=overlap, bucket_s=bucket_s).step_s
             for mb in candidates_mb}
    return float(min(sorted(steps, reverse=True), key=steps.__getitem__))


def predict_curve(w: Workload, link: Link, ns: Sequence[int], **kw) -> list[Prediction]:
    """:func:`predict` for each world_size in ``ns`` (same keyword arguments)."""
    return [predict(w, n, link, **kw) for n in ns]


def fit_alpha_beta(sizes_bytes: Sequence[float], times_s: Sequence[float], n: int,
                   gamma_s_per_byte: float = 0.0) -> tuple[float, float]:
    """(alpha_s, beta_s_per_byte) from measured ring all-reduce times of ``n`` ranks.

    Model: t = 2(n-1) alpha + (2(n-1)/n beta + (n-1)/n gamma) bytes, gamma known. Least squares
    of the *relative* error (each row divided by its measured t), so 4-byte messages weigh as much
    as 64 MiB ones; constrained to alpha, beta >= 0 (if the free fit is negative, the best fit
    with that parameter at 0). Exact on noise-free data. Needs n >= 2, >= 2 distinct sizes, t > 0.
    """
    _check_n(n)
    x, t = np.asarray(sizes_bytes, dtype=float), np.asarray(times_s, dtype=float)
    if n < 2 or x.shape != t.shape or len(np.unique(x)) < 2 or not np.all(t > 0):
        raise UsageError(f"fit_alpha_beta needs n >= 2 (got {n}), >= 2 distinct sizes (got {len(np.unique(x))}) "
                         f"and as many positive times (got {t.size})")
    y = (t - (n - 1) / n * gamma_s_per_byte * x) / t
    a = np.column_stack([np.full_like(x, 2 * (n - 1)), 2 * (n - 1) / n * x]) / t[:, None]
    free = np.linalg.lstsq(a, y, rcond=None)[0]
    if np.all(free >= 0):
        return float(free[0]), float(free[1])
    fits = []
    for j in (0, 1):  # one parameter at 0, the other fitted and clamped at 0
        col = a[:, j]
        value = max(0.0, float(col @ y / (col @ col)))
        fits.append((float(np.sum((y - col * value) ** 2)), j, value))
    _, j, value = min(fits)
    return (value, 0.0) if j == 0 else (0.0, value)


def scaling(words_per_s: Mapping[int, float], baseline_words_per_s: float) -> dict[int, dict[str, float]]:
    """{n: {"speedup": S, "efficiency": S/n}} with S(N) = t(1)/t(N), t the time to train a fixed
    number of words, i.e. words_per_s(N) / baseline_words_per_s (the one-device rate)."""
    if not baseline_words_per_s > 0:
        raise UsageError(f"baseline words/s = {baseline_words_per_s} must be > 0")
    out = {}
    for n, wps in words_per_s.items():
        _check_n(n)
        s = wps / baseline_words_per_s
        out[n] = {"speedup": s, "efficiency": s / n}
    return out


def relative_error(predicted: float, measured: float) -> float:
    """(predicted - measured) / measured; raises UsageError for measured == 0."""
    if measured == 0:
        raise UsageError("relative error against a measured value of 0 is undefined")
    return (predicted - measured) / measured


def with_extra_step_s(p: Prediction, extra_s: float) -> Prediction:
    """Prediction ``p`` with ``extra_s`` more seconds of exposed communication per step: step and comm
    grow by it; words/s, speedup and efficiency shrink by step / (step + extra) (weak scaling)."""
    if not extra_s:
        return p
    shrink = p.step_s / (p.step_s + extra_s)
    return replace(p, step_s=p.step_s + extra_s, exposed_comm_s=p.exposed_comm_s + extra_s,
                   words_per_s=p.words_per_s * shrink, speedup=p.speedup * shrink, efficiency=p.efficiency * shrink)
