"""What sharded data parallel's optimizer step costs beyond the plain one, for ``paratrain plan``.

``zero1`` and ``fsdp`` step the user's optimizer on ``DTensor`` shards of the parameters
(:mod:`paratrain.strategies.zero1`, :mod:`paratrain.strategies.fsdp`). A DTensor dispatches every
operation through Python (sharding propagation, then the local operation), so a step over many small
tensors costs far more than 1/N of the plain step: on digits_cnn's 11 tensors SGD took 0.61 ms on
DTensors against 0.21 ms on plain tensors. The cost model's ``optimizer / N`` sees none of that.
"""
from __future__ import annotations

import statistics
import time
from typing import Sequence

import torch


def measured_sharded_optimizer(params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer, *,
                               threads: int = 1, repeats: int = 15, warmup: int = 3) -> float:
    """Seconds per step that ``optimizer``'s class and defaults (built by
    :func:`~paratrain.train.optim.optimizer_like`) spend beyond the same step on plain tensors, when
    its parameters and gradients are ``DTensor`` shards (``Shard(0)``; ``Replicate()`` for 0-dim
    tensors), the gradients wrapped anew each step as ``zero1`` does: median over ``repeats`` steps
    of each, difference clamped at 0. Measured in this process on a one-rank gloo mesh of the
    parameters' device (a process group is made for it and destroyed after, unless one exists), at
    ``threads`` intra-op threads. The per-operation dispatch it measures does not depend on the
    number of ranks; the arithmetic it leaves out (the plain step) shrinks with the shard, which the
    cost model counts apart. Left out: gradient clipping (FSDP clips DTensor gradients: more dispatch
    and a norm all-reduce). FSDP's gradients arrive as DTensors from its reduce-scatter, so the wrap
    timed here (zero1's) is charged to FSDP too: a few hundredths of a millisecond a tensor. Raises
    RuntimeError if a default process group of another size exists."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from ..strategies.zero1 import row_dtensor
    from ..train.optim import optimizer_like

    values = [p.detach().clone() for p in params]
    device = values[0].device if values else torch.device("cpu")
    grads = [torch.randn_like(v) * 1e-3 for v in values]
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        raise RuntimeError("measured_sharded_optimizer needs a one-rank process group or none")
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(max(1, threads))
        mesh = init_device_mesh(device.type, (1,))

        def wrap(t: torch.Tensor):
            return row_dtensor(t, t, mesh)  # zero1's wrap: on one rank the rows are the whole tensor

        def median_step(shards: list[torch.Tensor], sharded: bool) -> float:
            opt = optimizer_like(type(optimizer), [{"params": shards}], optimizer.defaults)
            times = []
            for i in range(warmup + repeats):
                t0 = time.perf_counter()
                for s, g in zip(shards, grads):
                    s.grad = wrap(g) if sharded else g
                opt.step()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
            return statistics.median(times)

        # one copy of the parameters for both runs (what the steps do to them does not change the time);
        # each run's optimizer state is freed when it returns
        plain = median_step([nn.Parameter(v) for v in values], False)
        sharded = median_step([nn.Parameter(wrap(v)) for v in values], True)
        return max(0.0, sharded - plain)
    finally:
        torch.set_num_threads(old)
        if made:
            dist.destroy_process_group()


__all__ = ["measured_sharded_optimizer"]
