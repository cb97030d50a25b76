"""What DDP's 16-bit compression hook costs on this machine's CPUs, for ``paratrain plan``.

``dist.comm_hook = "bf16"`` registers torch's ``default_hooks.bf16_compress_hook``
(:mod:`paratrain.strategies.comm_hooks`). For each gradient bucket of b bytes (float32) it casts the
bucket to bfloat16 and divides it by the world size, all-reduces the b/2 bytes of that payload, and
copies the sum back into the float32 bucket (``default_hooks._compress_hook``). A GPU does the casts
in microseconds and NCCL reduces bfloat16 natively, so there half the bytes is the whole story. On a
CPU neither holds: the casts are memory passes on the core that computes, and gloo reduces bfloat16
element by element through float. On the 2-vCPU Xeon (2026-11-27, 2 processes of 1 thread, gpt_wt2's
profile in ``benchmarks/results/plan-xeon/gpt_wt2-v25``) a 16 MiB bucket took 8.7 ms to cast, its 8 MiB
payload 8.8 ms to all-reduce, and the whole hook 22.4 ms, against 13.1 ms for the float32 bucket's
all-reduce on the fitted link.

:func:`time_compress_hook` times the three (cast, payload all-reduce, the whole hook) between the
processes of :func:`~.microbench.run_ranks`; :func:`measured_compress_hook` keeps the whole hook's
points, which price a bucket (:func:`~.costmodel_hooks.compress_hook_bucket_s`), and fits the payload's
link, which moves that price to other world sizes.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from .costmodel import FLOAT32_BYTES

HOOK_SIZES_BYTES = tuple(4 ** k for k in range(5, 14))
"""1 KiB ... 64 MiB of float32 gradients: the bucket sizes DDP forms (its first bucket is 1 MiB)."""


def time_compress_hook(nbytes: int, repeats: int, warmup: int) -> list[float]:
    """[cast_s, payload_s, hook_s] for a bucket of ``nbytes`` of float32 gradients (at least one element),
    each the median over ``repeats`` of the slowest rank's seconds (after ``warmup`` untimed runs):
    cast_s, the hook's own work on its rank (``bucket.to(bfloat16).div_(world_size)``, then the copy
    of the result back into the bucket), all ranks at once as in a step; payload_s, gloo's all-reduce
    of the nbytes / 2 of bfloat16 payload; hook_s, torch's ``bf16_compress_hook`` on the bucket, to its
    future's end (both, and its callback): the check that the two parts make the whole. Collective:
    every rank calls it with the same arguments."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from .microbench import _time_collective

    n = dist.get_world_size()
    bucket = torch.zeros(max(1, nbytes // FLOAT32_BYTES), dtype=torch.float32)
    payload = torch.zeros(bucket.numel(), dtype=torch.bfloat16)
    cast_s = _time_collective(lambda: bucket.copy_(bucket.to(torch.bfloat16).div_(n)), repeats, warmup)
    payload_s = _time_collective(lambda: dist.all_reduce(payload), repeats, warmup)
    hook_s = _time_collective(lambda: default_hooks.bf16_compress_hook(None, (bucket,)).wait(), repeats, warmup)
    return [cast_s, payload_s, hook_s]


def measured_compress_hook(world_size: int = 2, *, sizes_bytes: Sequence[int] = HOOK_SIZES_BYTES, repeats: int = 10,
                           warmup: int = 2, timeout_s: float = 120.0) -> dict[str, Any]:
    """The bf16 hook on this machine between ``world_size`` local gloo processes of one thread each
    (:func:`time_compress_hook` per bucket size), seconds by float32 bucket bytes:

    - ``hook``: ``[[bucket bytes, s], ...]``, the whole hook, what
      :func:`~.costmodel_hooks.compress_hook_bucket_s` prices a bucket by at ``world_size`` ranks;
    - ``payload_link``: {alpha_s, beta_s_per_byte, gamma_s_per_byte} fitted to the payload's
      all-reduces with the ring model of :func:`~.costmodel.ring_allreduce_s` on the payload's bytes
      (bucket bytes / 2), t = 2(n-1) alpha + 2(n-1)/n bytes beta, gloo's reduction in beta (gamma 0;
      :func:`~.microbench.fit_latency_bandwidth`): what moves the hook to other world sizes;
    - ``cast``, ``payload``: the two parts as measured, for the record. The whole hook also
      allocates a fresh payload each bucket and copies it back in the future's callback, on gloo's
      thread: in gpt_wt2's v25 profile it took 0.1-0.3 ms more than the sum up to 256 KiB, 1.8 ms at
      4 MiB and 4.9 ms at 16 MiB (in digits_cnn's, less than the sum at 1, 4 and 64 MiB: three
      medians of noisy timings);
    - ``world_size``.

    Raises RuntimeError (a rank failed or hung) and ValueError (bad arguments) as
    :func:`~.microbench.measure_allreduce`."""
    from .microbench import fit_latency_bandwidth, measure_allreduce

    points = measure_allreduce(world_size, sizes_bytes, repeats=repeats, warmup=warmup, timeout_s=timeout_s,
                               op="bf16_hook")
    k = 2 * (world_size - 1)
    alpha, beta = fit_latency_bandwidth([k / world_size * b / 2 for b, _ in points], [t[1] for _, t in points])
    return {"world_size": world_size,
            "payload_link": {"alpha_s": alpha / k, "beta_s_per_byte": beta, "gamma_s_per_byte": 0.0},
            **{key: [[float(b), t[i]] for b, t in points] for i, key in enumerate(("cast", "payload", "hook"))}}
