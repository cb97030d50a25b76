"""The alpha-beta cost model of :mod:`.costmodel` for the sharded strategies (the pipeline's:
:mod:`.costmodel_pipeline`; towers: :mod:`.costmodel_towers`).

Pure arithmetic on a :class:`~.costmodel.Workload` (one replica's step measured on one device) and
a :class:`~.costmodel.Link`. Collectives are ring algorithms (Patarasuk & Yuan 2009; Thakur et al.
2005): an all-gather or a reduce-scatter of a message of ``nbytes`` (its whole, unsharded size) is
n-1 steps of nbytes/n, so ``(n-1) alpha + (n-1)/n nbytes beta`` (+ ``(n-1)/n nbytes gamma`` for the
reduction of a reduce-scatter); an all-reduce is the two in a row. Where every machine holds one
rank of the collective group (a flat network preset; one device a machine; a pipeline's stage group
spread one rank a machine), NCCL runs an all-gather on the faster of the ring and its PAT algorithm
(:func:`allgather_s`); an all-reduce on the faster of its ring and trees
(:func:`~.costmodel.allreduce_s`). FSDP2's reduce-scatter stays on the ring: it averages its float32
(or bf16) gradients with ``ReduceOp.AVG``, a pre-multiplied sum in NCCL, which NCCL keeps off PAT
(src/enqueue.cc: "Tree reduceScatter doesn't support scaling yet").

* ``zero1`` (Rajbhandari et al. 2020, stage 1): DDP's bucketed all-reduce overlapped with backward
  (:func:`~.costmodel.predict`), the optimizer on 1/n of the parameters, then the updated
  parameters all-gathered (each rank's rows of every parameter), not overlapped.
* ``fsdp`` (FSDP2, ZeRO-3 with ``reshard_after_forward``): per unit (block) an all-gather before its
  forward, prefetched while the previous unit computes (one communication stream, one unit ahead);
  in backward, in reverse, an all-gather again (when resharded) and a reduce-scatter of the unit's
  gradients after its compute; the optimizer on 1/n of every parameter. Compute of a unit is
  proportional to its parameter bytes. Each collective has FSDP2's copy-in and copy-out around it
  (the shard into the all-gather's buffer, the gathered parameters out of it; the gradients into the
  reduce-scatter's buffer, the reduced shard out), priced as measured memory copies where known.
  The root unit (first in forward order) stays gathered from its forward to its backward. A bf16
  or fp16 recipe's ``MixedPrecisionPolicy`` gathers the parameters cast to the low dtype (half the
  bytes of float32) and reduce-scatters the gradients in float32. After the
  backward, the trainer's guard all-reduces the sharded gradient's norm. On this machine's CPU,
  where FSDP2's collectives block (no streams), each unit is priced as what FSDP2 was measured to
  add to it between two processes, hooks, copies, collectives and the waits inside them
  (:func:`fsdp_paths_s`, the ranks coming to each collective from a barrier and almost no compute
  after it; since profile version 39 each rank runs the model's forward and backward before that
  barrier, so the paths hold what a step's cold caches cost them), and each
  stretch of compute ends in the wait that the meeting of n processes after it costs beyond two
  processes' after none (:func:`meeting_seconds`; at n = 2 too); its optimizer step (the guard's
  norm with its all-reduce, the sharded step) is what it was measured to add to allreduce's
  between two processes (:func:`fsdp_step_path_s`).
Units: seconds (``_s``), bytes. Bad arguments raise :class:`~paratrain.errors.UsageError`.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

from ..errors import UsageError
from .costmodel import (FLOAT32_BYTES, MIB, PAT_BANDWIDTH, Link, Prediction, Workload, _check_n, allreduce_s,
                        predict, prediction)
from .costmodel_links import base_s


def ring_allgather_s(nbytes: float, n: int, link: Link) -> float:
    """Seconds of a ring all-gather whose result is ``nbytes``: base + (n-1) alpha + (n-1)/n nbytes beta
    (base: ``link.base_latency_s``, NCCL's once a collective); 0 for n == 1."""
    _check_n(n)
    return 0.0 if n == 1 else (base_s(n, link) + (n - 1) * link.alpha_s
                               + (n - 1) / n * nbytes * link.beta_s_per_byte)


def ring_reduce_scatter_s(nbytes: float, n: int, link: Link) -> float:
    """Seconds of a ring reduce-scatter of ``nbytes``: base + (n-1) alpha + (n-1)/n nbytes (beta + gamma)
    (base as :func:`ring_allgather_s`'s); 0 for n == 1."""
    _check_n(n)
    return 0.0 if n == 1 else (base_s(n, link) + (n - 1) * link.alpha_s
                               + (n - 1) / n * nbytes * (link.beta_s_per_byte + link.gamma_s_per_byte))


def allgather_s(nbytes: float, n: int, link: Link) -> float:
    """Seconds of the all-gather NCCL runs on ``link`` among ``n`` ranks, whose result is ``nbytes``: the
    ring (:func:`ring_allgather_s`); where every machine holds one rank (``link.pat_latency_s`` set), the
    faster of it and NCCL's PAT, pat_latency_s (its base latency included) + nbytes beta / 0.75 (NCCL
    src/graph/tuning.cc)."""
    ring = ring_allgather_s(nbytes, n, link)
    if link.pat_latency_s is None or n == 1:
        return ring
    return min(ring, link.pat_latency_s + nbytes * link.beta_s_per_byte / PAT_BANDWIDTH)


def predict_zero1(w: Workload, n: int, link: Link, *, bucket_mb: float = 25.0, compute_scale: float = 1.0,
                  overlap: bool = True, gather_link: Link | None = None,
                  meeting_s: Callable[[float], float] | None = None,
                  copy_s: Callable[[float], float] | None = None,
                  step_path_s: float | None = None,
                  path_meeting_s: Callable[[float], float] | None = None, dispatch_s: float = 0.0,
                  bucket_s: Callable[[float], float] | None = None) -> Prediction:
    """One ``zero1`` step of n replicas: allreduce's overlapped step with the optimizer on 1/n of the
    parameters, plus the all-gather of the updated parameters (over ``gather_link`` where all-gathers
    were measured apart, else ``link``). ``meeting_s``: :func:`meeting_seconds`; the ranks reach the
    all-gather from the optimizer's share of the step apart: the step gains ``meeting_s(O / n)`` less
    the all-gather's alpha, once. ``copy_s``: seconds of a memory copy of so many bytes (measured on a
    CPU, where copies take the cores that compute); ``Zero1._gather_rows`` copies the rank's rows into
    the send buffer (P / n bytes of the P parameter bytes) and the other ranks' rows out
    (P (n - 1) / n), in the step's critical path: ``copy_s(P / n) + copy_s(P (n - 1) / n)`` (0 for
    n = 1 or without ``copy_s``). ``dispatch_s``: what stepping the optimizer on DTensor shards costs
    beyond the plain step's 1/n, per step (the wrap and per-operation dispatch, measured in one
    process: :func:`~.microbench_sharded.measured_sharded_optimizer`), times ``compute_scale``, at
    n > 1, in the step's compute and its optimizer part (0: not known, or already in a measured
    one-rank overhead). ``bucket_s``: a compression hook's measured seconds per bucket, as
    :func:`~.costmodel.predict`'s (the gradients' all-reduce is allreduce's, hook and all).

    ``step_path_s`` (this machine's CPU, ``overlap=False``): what ZeRO-1's optimizer step was measured
    to add to allreduce's between 2 processes of one thread each
    (:func:`~.microbench_sharded.time_sharded_step`: the DTensor wrap and dispatch, the arithmetic on
    half the rows instead of all, the copies, the all-gather and the waits inside it). Then the step
    is allreduce's (the whole optimizer) plus ``step_path_s``, moved from 2 to n ranks by the terms
    that depend on n: the optimizer's arithmetic, ``O s (1/n - 1)`` in place of the path's
    ``O (1/2 - 1)`` (its 2 processes had a core each: scale 1), the all-gather's ring time at
    n less at 2, the copies at n less at 2, and the wait that n processes' meeting (``meeting_s``)
    costs beyond the 2 processes' (``path_meeting_s``; 0 at or below the cores, where they are one
    table). The one-process DTensor dispatch (``dispatch_s``) is inside the measured path and is not
    added again. Measured on 2026-11-27 (2 vCPU, 1 thread a process),
    timing zero1's step inside training: digits_cnn at N = 2, the wrap 1.9 ms, the sharded step
    3.3 ms, the copies 0.8 ms and the all-gather 1.2 ms (8.0 ms in all, 7.4 ms above allreduce's),
    against 3.6 ms above allreduce's by the terms above without ``step_path_s``: the wrap and dispatch
    ran at two processes' speed, and the copies' per-tensor calls cost 40 times their bytes' time.
    The path is not scaled by ``compute_scale``, as FSDP's unit paths are not: at N = 4 on the 2
    cores the wrap and the sharded step took as long as at N = 2 (digits_cnn 2.0 and 3.7 ms, ptb_small
    2.2 and 1.8 ms, medians of each of the 4 ranks), while the all-gather waited for the processes
    taking turns (digits_cnn 8-10 ms against 1.2 ms at N = 2): the meeting's term."""
    glink = gather_link or link
    nbytes = sum(w.param_bytes)
    if step_path_s is not None and n > 1 and not overlap:
        s = compute_scale
        whole = predict(w, n, link, algorithm="ring", bucket_mb=bucket_mb, compute_scale=s, overlap=overlap,
                        bucket_s=bucket_s)
        # the path holds the arithmetic of 2 ranks at their measured speed, O (1/2 - 1); here O s (1/n - 1)
        step = (whole.step_s + step_path_s + w.optimizer_s * (s * (1 / n - 1) - (1 / 2 - 1))
                + allgather_s(nbytes, n, glink) - allgather_s(nbytes, 2, glink))
        if copy_s is not None:
            step += (copy_s(nbytes / n) + copy_s(nbytes * (n - 1) / n)) - 2 * copy_s(nbytes / 2)
        if meeting_s is not None and path_meeting_s is not None:
            c = w.optimizer_s * s / n
            step += max(0.0, meeting_s(c) - path_meeting_s(c))
        compute = whole.compute_s - w.optimizer_s * s * (1 - 1 / n)
        # training's optimizer span: all this step adds to allreduce's without its optimizer (at least O s / n)
        optimizer = max(w.optimizer_s * s / n, step - (whole.step_s - w.optimizer_s * s))
        return prediction(w, n, step, compute, "sharded_optimizer", optimizer_s=optimizer, bucket_mb=bucket_mb)
    ddp = predict(replace(w, optimizer_s=w.optimizer_s / n), n, link, algorithm="ring", bucket_mb=bucket_mb,
                  compute_scale=compute_scale, overlap=overlap, bucket_s=bucket_s)
    dispatch = dispatch_s * compute_scale if n > 1 else 0.0
    step = ddp.step_s + dispatch + allgather_s(nbytes, n, glink)
    if meeting_s is not None and n > 1:
        step += max(0.0, meeting_s(w.optimizer_s * compute_scale / n) - glink.alpha_s)
    if copy_s is not None and n > 1:
        step += copy_s(nbytes / n) + copy_s(nbytes * (n - 1) / n)
    return prediction(w, n, step, ddp.compute_s + dispatch, "sharded_optimizer", optimizer_s=ddp.optimizer_s + dispatch,
                      bucket_mb=bucket_mb)


def fsdp_phases_s(compute_s: float, unit_bytes: Sequence[int], gather: Sequence[float],
                  after: Sequence[float] = ()) -> float:
    """Seconds of one pass over the units in order, one communication stream beside compute: unit
    i's all-gather ``gather[i]`` (none when ``gather`` is empty) must end before its compute
    (``compute_s`` split by ``unit_bytes``) starts, and unit i+1's is issued when unit i's compute
    starts (prefetch one unit ahead); ``after[i]`` (the backward's reduce-scatter) is issued when
    unit i's compute ends. Returns when the last compute and communication end."""
    total = sum(unit_bytes) or 1
    k = len(unit_bytes)
    ready = [0.0] * k  # when unit i's parameters are gathered
    comm_free = gather[0] if gather else 0.0
    ready[0] = comm_free
    compute_end = 0.0
    for i in range(k):
        start = max(compute_end, ready[i])
        if gather and i + 1 < k:
            ready[i + 1] = comm_free = max(comm_free, start) + gather[i + 1]
        compute_end = start + compute_s * unit_bytes[i] / total
        if i < len(after):
            comm_free = max(comm_free, compute_end) + after[i]
    return max(compute_end, comm_free)


def piecewise(points: Sequence[Sequence[float]], what: str, x: str, proportional_above: bool
               ) -> Callable[[float], float]:
    """y(x) linear between the measured ``(x > 0, y >= 0)`` points (``what``, ``x``: their names, for
    errors), the smallest x's y below them, and above them the largest x's y (or, ``proportional_above``,
    its y per x times x)."""
    pts = sorted((float(b), float(t)) for b, t in points)
    if not pts or any(b <= 0 or t < 0 for b, t in pts):
        raise UsageError(f"{what} needs ({x} > 0, seconds >= 0) points, got {points}")

    def y(x: float) -> float:
        if x <= pts[0][0]:
            return pts[0][1]
        for (b0, t0), (b1, t1) in zip(pts, pts[1:]):
            if x <= b1:
                return t0 + (t1 - t0) * (x - b0) / (b1 - b0)
        return pts[-1][1] * x / pts[-1][0] if proportional_above else pts[-1][1]
    return y


def copy_seconds(points: Sequence[Sequence[float]]) -> Callable[[float], float]:
    """Seconds of a memory copy of x bytes from measured ``(bytes, seconds)`` points
    (:func:`~.microbench.measure_copies`): linear between the two measured sizes around x, the
    smallest size's time below it, the largest size's seconds per byte above it (0 for x <= 0). A
    copy's cost per byte is not one number on a CPU: small ones stay in cache or reuse freed memory,
    large ones fault in fresh pages."""
    y = piecewise(points, "copy_seconds", "bytes", proportional_above=True)
    return lambda nbytes: y(nbytes) if nbytes > 0 else 0.0


def meeting_seconds(points: Sequence[Sequence[float]]) -> Callable[[float], float]:
    """Seconds that one blocking collective of a small message costs ranks coming to it from c seconds
    of compute, from measured ``(compute seconds, seconds)`` points (:func:`~.microbench_meetings.measured_meetings`):
    linear between the two measured points around c, the nearest end's value outside them. Inside a
    training step on this machine a collective costs that much where the link's alpha (fitted back to
    back after a barrier) leaves out the wait for the rank that arrives last and the waking of the
    threads that run it (here 0.5 ms after 0.25 ms of compute, 2.0-2.5 ms after 4-64 ms, against an
    all-gather's alpha of 0.35 ms)."""
    return piecewise(points, "meeting_seconds", "compute seconds", proportional_above=False)


def fsdp_copies_s(nbytes: float, n: int, copy_s: Callable[[float], float] | None) -> float:
    """Seconds of the two copies around one FSDP2 collective of a unit of ``nbytes`` (whole): an
    all-gather copies the rank's shard in (nbytes / n) and the gathered parameters out (nbytes); a
    reduce-scatter copies the gradients in (nbytes) and the reduced shard out (nbytes / n). So
    ``copy_s(nbytes / n) + copy_s(nbytes)`` (0 without ``copy_s``, or for n = 1: no collective)."""
    _check_n(n)
    if copy_s is None or n == 1:
        return 0.0
    return copy_s(nbytes / n) + copy_s(nbytes)


def predict_fsdp(w: Workload, n: int, link: Link, *, unit_bytes: Sequence[int], reshard: bool = True,
                 compute_scale: float = 1.0, overlap: bool = True, gather_link: Link | None = None,
                 scatter_link: Link | None = None, copy_s: Callable[[float], float] | None = None,
                 meeting_s: Callable[[float], float] | None = None,
                 unit_path_s: Callable[[float], Sequence[float]] | None = None,
                 path_meeting_s: Callable[[float], float] | None = None,
                 step_path_s: float | None = None, dispatch_s: float = 0.0,
                 gather_scale: float = 1.0) -> Prediction:
    """One ``fsdp`` step of n ranks. ``unit_bytes``: each shard unit's parameter bytes (whole, not
    sharded, as stored), in forward order: the root first (its own parameters, which FSDP2 keeps
    gathered from the forward to the backward: no second all-gather), then the units. A unit of 0
    bytes has no collective. ``gather_scale``: the all-gathers' bytes per stored byte (a bf16 or fp16
    recipe's ``MixedPrecisionPolicy`` casts the parameters before gathering them: 0.5 of float32; its
    gradients are reduce-scattered in float32, as stored: 1). ``gather_link`` / ``scatter_link``:
    the all-gather's and reduce-scatter's own measured links (default ``link``: at the all-reduce's
    alpha, beta, gamma, the all-gather on :func:`allgather_s`, NCCL's ring or PAT, the reduce-scatter,
    an average, on the ring).
    ``copy_s``: seconds of a memory copy of so many bytes, for the copies FSDP2 makes around each
    collective (:func:`fsdp_copies_s`; measured on a CPU, where they take the cores that compute).
    After the backward, the trainer's non-finite guard (and clipping) all-reduces the norm of the
    sharded gradient: one more collective of 4 bytes on ``link`` (a blocking one: at least
    ``meeting_s(0)``, the ranks reaching it a moment after the last reduce-scatter). ``meeting_s``
    (:func:`meeting_seconds`; on a CPU, where FSDP2's collectives block, having no stream of their
    own): the ranks reach the collective after each stretch of compute apart, each unit's forward and
    its backward (the backward's next all-gather follows a reduce-scatter at once), so the step gains
    ``2 k (meeting_s(c) - alpha)`` for k units with parameters and c = (forward + backward) / 2k, the
    all-gather's alpha being already in the collectives' price. ``overlap=False``: no collective
    overlaps compute (all exposed); with ``unit_path_s`` too (this machine's CPU), the collectives
    are :func:`fsdp_paths_s` of the measured paths instead of the ring model and ``copy_s``.
    ``path_meeting_s``: :func:`meeting_seconds` of the 2 processes those paths were measured between,
    whose means hold the 2 processes' waits after a barrier and almost no compute (the model's forward
    and backward, which each rank runs before that barrier since profile version 39, are not between
    the barrier and the collectives; the benchmark's unit multiplies
    its input by the sum of each parameter's first element; a rank waits inside each collective it
    reaches first): with the paths, each wait is ``meeting_s(c) - path_meeting_s(0)`` (the table's
    smallest point, 0.25 ms of compute: slightly above none, so the wait is slightly low), what n
    processes coming from a stretch of c
    seconds of compute wait beyond that (at n = 2 the drift of the ranks over the stretch and the
    waking of gloo's threads after it; above the cores, the taking of turns too). Measured on
    2026-11-29 (2-vCPU EPYC VM, one thread a process) with :func:`~.microbench_sharded.time_fsdp_unit`'s
    unit given c of compute before each collective: FSDP2's forward of a 93.6 KB unit went from
    1.5 ms at c = 0 to 1.8, 2.4 and 2.6 ms at 1, 4 and 16 ms, where the meeting table rose 0.3, 1.2
    and 0.9 ms; digits_cnn's whole model under FSDP2 in two processes paid 3.5-3.9 ms forward and
    6.5-7.7 ms backward beyond the plain model, against the unit paths' 2.1 and 4.7 ms. From
    2026-11-26 until then each wait was ``meeting_s(c) - path_meeting_s(c)`` (0 at n = 2), after
    ptb_small's collectives timed in training matched the benchmark's means (75.8 against 74.4 ms a
    step): re-scored, the waits of ``- path_meeting_s(0)`` move the three recipes' validated fsdp
    rows from -18.5, -3.2 and -7.5% to -16.4, +2.5 and -6.1% (digits_cnn, ptb_small, gpt_wt2). The
    paths are not scaled by ``compute_scale``. Without ``path_meeting_s`` each wait is the meeting
    less the all-gather's alpha, as before 2026-11-26.

    ``dispatch_s``: what the optimizer's step on DTensor shards and the guard's norm of the DTensor
    gradients cost beyond the plain step's 1/n, per step (their per-operation dispatch, measured in
    one process: :func:`~.microbench_sharded.measured_sharded_optimizer` and
    :func:`~.microbench_sharded.measured_sharded_norm`), times ``compute_scale``, at n > 1, in the
    step's compute and its optimizer part; not with ``step_path_s`` on this machine's CPU, which
    holds it (0: not known, or already in a measured one-rank overhead).

    ``step_path_s`` (this machine's CPU, ``overlap=False``): what FSDP2's optimizer step was measured
    to add to allreduce's between 2 processes (:func:`~.microbench_sharded.time_sharded_step`: the
    guard's norm of the DTensor shards with its all-reduce, and the optimizer's dispatch and
    arithmetic on half of each parameter). Then the step's optimizer part is ``O s / n`` plus
    :func:`fsdp_step_path_s` (the path less its 2 processes' arithmetic, ``O (1/2 - 1)``; the norm's
    ring all-reduce at n less at 2 and the wait that n processes' meeting costs beyond 2), in
    place of the DTensor dispatch terms and the norm's collective above, which the path holds.
    Measured on 2026-11-27 (2 vCPU, 1 thread a process): digits_cnn's step on DTensor shards took
    3.2-3.3 ms in training at N = 2 where the one-process dispatch terms and the norm's meeting gave 1.6
    ms; the path measured 2.2-2.3 ms above allreduce's 0.5 ms.
    """
    _check_n(n)
    if not unit_bytes or any(b < 0 for b in unit_bytes):
        raise UsageError("predict_fsdp needs the units' parameter bytes (>= 0), in forward order, the root first")
    s = compute_scale
    path = step_path_s is not None and not overlap  # the measured step: it holds the dispatch and the norm
    dispatch = dispatch_s * s if n > 1 and not path else 0.0
    optimizer = w.optimizer_s * s / n + dispatch  # training's optimizer span (the guard's norm too, where measured)
    other = w.data_s * s + optimizer
    compute = (w.forward_s + w.backward_s) * s + other
    if n == 1:
        return prediction(w, n, compute, compute, "sharded_parameters", optimizer_s=optimizer)
    units = sum(1 for b in unit_bytes if b)
    if path:  # the measured step holds the norm's all-reduce at 2 ranks
        after_backward = fsdp_step_path_s(w, n, link, step_path_s, meeting_s, path_meeting_s)
        optimizer += after_backward
    else:  # the guard's all-reduce of the norm: a blocking collective a moment after the last reduce-scatter
        after_backward = allreduce_s(FLOAT32_BYTES, n, link)
        if meeting_s is not None:
            after_backward = max(after_backward, meeting_s(0.0))
    glink, slink = gather_link or link, scatter_link or link
    measured = unit_path_s is not None and not overlap  # this machine's CPU: the units' measured paths
    waits = 0.0
    if meeting_s is not None and units:  # a wait per stretch of compute: each unit's forward and its backward
        segment = (w.forward_s + w.backward_s) * s / (2 * units)
        # the paths' ranks came to each collective from almost no compute (the table's first point)
        held = path_meeting_s(0.0) if measured and path_meeting_s is not None else glink.alpha_s
        waits = 2 * units * max(0.0, meeting_s(segment) - held)
    if measured:
        paths = fsdp_paths_s(unit_bytes, n, reshard, unit_path_s, glink, slink, gather_scale)
        return prediction(w, n, compute + paths + waits + after_backward, compute, "sharded_parameters",
                          optimizer_s=optimizer)
    g = gather_scale
    ag = [allgather_s(b * g, n, glink) + fsdp_copies_s(b * g, n, copy_s) if b else 0.0 for b in unit_bytes]
    rs = [ring_reduce_scatter_s(b, n, slink) + fsdp_copies_s(b, n, copy_s) if b else 0.0 for b in unit_bytes]
    again = [0.0] + ag[1:] if reshard else []  # the backward's gathers (the root's stayed)
    if not overlap:
        step = compute + sum(ag) + sum(again) + sum(rs) + waits + after_backward
        return prediction(w, n, step, compute, "sharded_parameters", optimizer_s=optimizer)
    fwd = fsdp_phases_s(w.forward_s * s, unit_bytes, ag)
    bwd = fsdp_phases_s(w.backward_s * s, list(reversed(unit_bytes)), list(reversed(again)), list(reversed(rs)))
    return prediction(w, n, fwd + bwd + waits + after_backward + other, compute, "sharded_parameters",
                      optimizer_s=optimizer)


def fsdp_step_path_s(w: Workload, n: int, link: Link, step_path_s: float,
                     meeting_s: Callable[[float], float] | None = None,
                     path_meeting_s: Callable[[float], float] | None = None) -> float:
    """Seconds FSDP2's optimizer step costs n ranks beyond its arithmetic's 1/n (``O s / n``, in the
    step's compute), from ``step_path_s``, what it was measured to add to allreduce's plain step
    between 2 processes (:func:`~.microbench_sharded.time_sharded_step`): the path less its own 2
    processes' arithmetic ``O (1/2 - 1)``, i.e. ``step_path_s + O / 2`` (at least 0: on large models
    the sharded step can measure below allreduce's by more than O / 2 at the profile's threads), plus
    what n ranks add to the guard's all-reduce of the norm inside it: the ring all-reduce of 4 bytes
    at n less at 2, and the wait that n processes' meeting (``meeting_s``) costs beyond the 2 processes'
    (``path_meeting_s``) a moment after the last reduce-scatter (both 0 at n = 2). For
    :func:`predict_fsdp`'s step and :func:`~.plan_model.step_parts`' optimizer part."""
    _check_n(n)
    extra = max(0.0, step_path_s + w.optimizer_s / 2)
    extra += max(0.0, allreduce_s(FLOAT32_BYTES, n, link) - allreduce_s(FLOAT32_BYTES, 2, link))
    if meeting_s is not None and path_meeting_s is not None:
        extra += max(0.0, meeting_s(0.0) - path_meeting_s(0.0))
    return extra


def fsdp_paths_s(unit_bytes: Sequence[int], n: int, reshard: bool, unit_path_s: Callable[[float], Sequence[float]],
                 gather_link: Link, scatter_link: Link, gather_scale: float = 1.0) -> float:
    """Seconds FSDP2 adds to one step of n ranks around the units' compute, none of it overlapped,
    from what it was measured to add to a unit of so many bytes between 2 ranks beyond the same module
    without FSDP2 (``unit_path_s(bytes) -> (forward, backward resharded, backward kept)``,
    :func:`~.microbench_sharded.time_fsdp_unit`): its hooks, the copies into and out of the
    collectives' buffers, the collectives and the waits inside them, all of which the alpha-beta
    model leaves out. Until 2026-11-26 the measurement took one rank's FSDP2 off as well, and the
    model added a wait per stretch of compute instead: with every collective of ptb_small's step
    timed in training, FSDP2's work outside the collectives was 36 ms a step (one rank alone: 19 to
    36 ms), which the model lacked, and the waits, which the measured collectives already held, were
    counted twice. Per unit of ``unit_bytes`` (forward order, the root first and never gathered
    again; 0 bytes: no collective), its forward and its backward, plus for n != 2 the ring model's
    difference between n and 2 ranks on the links (the all-gathers' of ``gather_scale`` of the bytes:
    :func:`predict_fsdp`'s; the paths themselves were measured under the same policy). 0 for n = 1."""
    _check_n(n)
    if n == 1:
        return 0.0
    total = 0.0
    for i, b in enumerate(unit_bytes):
        if not b:
            continue
        fwd, bwd_again, bwd_kept = unit_path_s(b)
        again = reshard and i > 0
        d_ag = allgather_s(b * gather_scale, n, gather_link) - allgather_s(b * gather_scale, 2, gather_link)
        d_rs = ring_reduce_scatter_s(b, n, scatter_link) - ring_reduce_scatter_s(b, 2, scatter_link)
        total += fwd + d_ag + (bwd_again + d_ag if again else bwd_kept) + d_rs
    return total


def unit_paths(points: Sequence[Sequence[float]]) -> Callable[[float], tuple[float, float, float]]:
    """``unit_path_s`` for :func:`fsdp_paths_s` from measured ``[bytes, forward, backward resharded,
    backward kept]`` rows (:func:`~.microbench_sharded.measured_fsdp_units`): each column linear in
    the bytes between the measured sizes, the smallest's below them, proportional above them."""
    cols = [piecewise([(r[0], r[k]) for r in points], "unit_paths", "bytes", proportional_above=True)
            for k in (1, 2, 3)]
    return lambda nbytes: (cols[0](nbytes), cols[1](nbytes), cols[2](nbytes))


__all__ = ["ring_allgather_s", "ring_reduce_scatter_s", "allgather_s",
           "predict_zero1", "predict_fsdp", "fsdp_phases_s",
           "copy_seconds", "meeting_seconds", "piecewise", "fsdp_copies_s", "fsdp_paths_s", "fsdp_step_path_s",
           "unit_paths", "MIB"]
