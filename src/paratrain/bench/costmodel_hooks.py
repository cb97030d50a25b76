"""A DDP compression hook's price per gradient bucket where its cost was measured (a CPU's profile
on this machine: :mod:`.microbench_hooks`), for :func:`~.costmodel.predict`'s ``bucket_s``
(``allreduce``'s and ``zero1``'s buckets).

Elsewhere the plan prices a 16-bit hook as its payload alone, half the bucket's bytes on the link
(``Workload.payload_ratio``, :func:`hook_payload_ratio`: a quarter of float64's): a GPU casts in
microseconds and NCCL reduces 16-bit floats natively.
"""
from __future__ import annotations

from typing import Callable

from .costmodel import Link, ring_allreduce_s
from .costmodel_sharded import piecewise


def measured_hook(prof: dict, on_this_machine: bool) -> dict | None:
    """The profile's measurement of DDP's bf16 hook where it prices the hook (``prof["bf16_hook"]``,
    :func:`~.microbench_hooks.measured_compress_hook`): a CPU's profile planned on this machine, whose
    cores the measurement ran on, of float32 gradients (the measurement's buckets); else None (a preset,
    a GPU's profile, a float64 recipe, a profile before version 25)."""
    ok = on_this_machine and prof.get("device") == "cpu" and prof.get("dtype", "float32") == "float32"
    return prof.get("bf16_hook") if ok else None


def hook_payload_ratio(dtype: str) -> float:
    """Bytes a 16-bit compression hook (fp16, bf16) hands to all-reduce per gradient byte of
    ``train.dtype``: 2 bytes an element, 0.5 of float32's and 0.25 of float64's
    (``Workload.payload_ratio``)."""
    return 2 / {"float32": 4, "float64": 8}[dtype]


def compress_hook_bucket_s(n: int, measured: dict, compute_scale: float = 1.0) -> Callable[[float], float]:
    """Seconds of one bucket of b float32 gradient bytes under torch's ``bf16_compress_hook`` among
    ``n`` ranks, from ``measured`` (:func:`~.microbench_hooks.measured_compress_hook`, between
    ``measured["world_size"]`` = m ranks): the whole hook as measured at m ranks (``hook``, linear
    between the measured bucket sizes, proportional above them), moved from m to n ranks by its
    payload's ring all-reduce (Patarasuk & Yuan 2009) of b / 2 bytes on the link fitted to gloo's
    bfloat16 all-reduces (its element-wise reduction in beta):
    ``hook(b) + ring_allreduce_s(b / 2, n, payload_link) - ring_allreduce_s(b / 2, m, payload_link)``.
    The rest of the hook, its work on its rank (the casts to bfloat16 and back, a fresh payload, the
    future's callback: ``hook(b) - ring_allreduce_s(b / 2, m)``, at least 0), does not change with n;
    it is compute on the rank's cores, so ``compute_scale`` (> 1 where processes take turns on the
    cores) stretches it as it does the step's compute. At n = 1 no hook runs: 0. n is at least m
    otherwise (m = 2: :func:`~.microbench_hooks.measured_compress_hook`). Raises UsageError for
    points that are not (bytes > 0, seconds >= 0)."""
    hook = piecewise(measured["hook"], "the bf16 hook's seconds", "bucket bytes", proportional_above=True)
    link, m = Link(name="bf16-payload", **measured["payload_link"]), measured["world_size"]

    def bucket_s(b: float) -> float:
        if n == 1 or b <= 0:
            return 0.0
        at_m = ring_allreduce_s(b / 2, m, link)
        own = max(0.0, hook(b) - at_m)
        return hook(b) + (compute_scale - 1) * own + ring_allreduce_s(b / 2, n, link) - at_m
    return bucket_s
