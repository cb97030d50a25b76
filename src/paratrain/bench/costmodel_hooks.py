"""A DDP compression hook's price per gradient bucket where its cost was measured (a CPU's profile
on this machine: :mod:`.microbench_hooks`), for :func:`~.costmodel.predict`'s ``bucket_s``.

Elsewhere the plan prices a 16-bit hook as its payload alone, half the bucket's bytes on the link
(``Workload.payload_ratio``): a GPU casts in microseconds and NCCL reduces 16-bit floats natively.
"""
from __future__ import annotations

from typing import Callable

from .costmodel import Link, ring_allreduce_s
from .costmodel_sharded import piecewise


def compress_hook_bucket_s(n: int, measured: dict) -> Callable[[float], float]:
    """Seconds of one bucket of b float32 gradient bytes under torch's ``bf16_compress_hook`` among
    ``n`` ranks: ``own(b) + ring_allreduce_s(b / 2, n, payload_link)``, from ``measured``
    (:func:`~.microbench_hooks.measured_compress_hook`): the hook's work on its rank (the casts to
    bfloat16 and back, a fresh payload, the future's callback; ``own``, measured between 2 ranks,
    linear between the measured bucket sizes, proportional above them), which does not change with
    n, and the ring all-reduce (Patarasuk & Yuan 2009) of its b / 2 bytes of bfloat16 payload on the
    link fitted to gloo's bfloat16 all-reduces (its element-wise reduction in beta). At n = 1 no
    hook runs: 0. Raises UsageError for points that are not (bytes > 0, seconds >= 0)."""
    own = piecewise(measured["own"], "the hook's own seconds", "bucket bytes", proportional_above=True)
    link = Link(name="bf16-payload", **measured["payload_link"])
    return lambda b: (own(b) + ring_allreduce_s(b / 2, n, link)) if n > 1 and b > 0 else 0.0
