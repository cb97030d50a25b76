"""``replicate``: one process drives several devices (tower mode).

TensorFlow's tower model, PaddleFluid's ParallelDo, torch's DataParallel: every
step the batch is split along the batch dimension, one tower (replica) per
device runs forward and backward on its slice, the tower gradients are averaged
on the master device (devices[0]), clipped, and the master parameters updated.

* CUDA devices: ``torch.nn.parallel.replicate`` each step (parameters broadcast
  from the master, gradients reduced back through autograd) and
  ``parallel_apply`` to run the towers in threads.
* CPU virtual devices (``cpu:0,cpu:1,...``): the towers share the master's
  parameter tensors (one memory) and run in threads; autograd accumulates their
  gradients into the shared ``.grad``. Same code path for the loop and the data.

The carried LSTM state is kept per tower (each tower owns its streams). The
loop hands over ``accumulation x towers`` micro-batches per step (tower t of
micro-step j gets micro-batch ``j*towers + t``).
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..errors import UsageError
from .base import StepResult
from .single import SingleDevice


class _LossOf(nn.Module):
    """Wraps ``loss_fn(replica, micro_batch)`` as a module for ``parallel_apply``."""

    def __init__(self, loss_fn: Callable, replica: nn.Module) -> None:
        super().__init__()
        self.loss_fn, self.replica = loss_fn, replica

    def forward(self, mb: Any) -> torch.Tensor:
        return self.loss_fn(self.replica, mb)


class Replicate(SingleDevice):
    """Options: ``devices`` (list of torch.device, at least one; all CPU or all CUDA).
    One process: the collectives are those of :class:`SingleDevice` (nothing to reduce)."""

    name = "replicate"

    def __init__(self, env, **options: Any) -> None:
        super().__init__(env, **options)
        self.devices: list[torch.device] = list(options.get("devices") or [env.device])
        kinds = {d.type for d in self.devices}
        if len(kinds) != 1:
            raise UsageError(f"replicate needs devices of one kind, got {[str(d) for d in self.devices]}")
        self.tower_log: list[str] = []

    @property
    def num_replicas(self) -> int:
        return len(self.devices) * self.env.world_size

    @property
    def towers(self) -> int:
        return len(self.devices)

    @property
    def device(self) -> torch.device:
        return self.devices[0] if self.devices[0].type == "cuda" else torch.device("cpu")

    def train_step(self, micro_batches: Sequence[Any], loss_fn: Callable[[nn.Module, Any], torch.Tensor],
                   clip: float = 0.0) -> StepResult:
        """Run the towers on micro-batches ``[j*T, (j+1)*T)`` for every micro-step j, average
        the tower gradients, clip the global norm, update. Single process: no collective."""
        T = self.towers
        if len(micro_batches) % T:
            raise ValueError(f"{len(micro_batches)} micro-batches for {T} towers")
        c = self.clock
        t0 = c.mark()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for j in range(0, len(micro_batches), T):
            group = micro_batches[j:j + T]
            losses = self._run_towers(group, loss_fn) if self.device.type == "cuda" else self._run_cpu_towers(group, loss_fn)
            total += sum(float(x) for x in losses)
        with torch.no_grad():  # towers summed their gradients; the step uses their mean
            for p in self.module.parameters():
                if p.grad is not None:
                    p.grad.div_(T)
        t1 = c.mark()
        norm, ok = self._update(clip)
        # towers overlap in threads: forward and backward are one "compute" span
        return StepResult(total, norm, [("compute", t0, t1), ("optimizer", t1, c.mark())], skipped=not ok)

    def _run_cpu_towers(self, group: Sequence[Any], loss_fn: Callable) -> list[torch.Tensor]:
        out: list[Any] = [None] * len(group)

        def tower(t: int) -> None:
            try:
                loss = loss_fn(self.module, group[t])
                loss.backward()
                out[t] = loss.detach()
            except BaseException as e:  # re-raised below in the calling thread
                out[t] = e

        threads = [threading.Thread(target=tower, args=(t,), name=f"tower{t}") for t in range(1, len(group))]
        for th in threads:
            th.start()
        tower(0)  # tower 0 runs in the calling thread
        for th in threads:
            th.join()
        for x in out:
            if isinstance(x, BaseException):
                raise x
        return out

    def _run_towers(self, group: Sequence[Any], loss_fn: Callable) -> list[torch.Tensor]:
        from torch.nn.parallel import parallel_apply, replicate

        replicas = replicate(self.module, self.devices[:len(group)])
        moved = [(mb.to(d) if hasattr(mb, "to") else mb,) for mb, d in zip(group, self.devices)]
        losses = parallel_apply([_LossOf(loss_fn, r) for r in replicas], moved, devices=self.devices[:len(group)])
        torch.stack([x.to(self.devices[0]) for x in losses]).sum().backward()
        return [x.detach() for x in losses]

    def describe_towers(self) -> list[str]:
        mode = "replicate() + parallel_apply" if self.device.type == "cuda" else "shared parameters, one thread each"
        return [f"tower {t}: {d} ({mode})" for t, d in enumerate(self.devices)]
