"""``allreduce``: multi-process data parallelism with DistributedDataParallel.

Each rank holds a replica (DDP broadcasts rank 0's parameters at setup);
gradients are averaged by bucketed ring all-reduce overlapped with backward
(Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data
Parallel Training"). gloo on CPU, NCCL on GPU (chosen by :mod:`paratrain.env`).
"""
from __future__ import annotations

import inspect
import warnings
from typing import Any, ContextManager

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..env import leave_group
from ..errors import UsageError
from .base import Strategy
from .comm_hooks import HOOK_KEYS, CommHook
from .step import NoSyncMixin

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
_DDP_ARGS = inspect.signature(DDP.__init__).parameters


class AllReduce(NoSyncMixin, Strategy):
    """Options: ``bucket_mb`` (DDP bucket cap in MiB, default 25), ``broadcast_buffers`` (DDP sends rank
    0's buffers every forward, default true; off with ``model.sync_batchnorm``), ``comm_hook``,
    ``matrix_approximation_rank``, ``start_powerSGD_iter`` (gradient compression: :mod:`.comm_hooks`)."""

    name = "allreduce"
    dist_keys = ("bucket_mb", "broadcast_buffers") + HOOK_KEYS
    cost_model = "ring"  # bucketed ring all-reduce overlapped with backward
    hook: CommHook | None = None  # the communication hook registered on DDP (None: DDP's built-in all-reduce)

    @classmethod
    def options(cls, cfg) -> dict[str, Any]:
        return {"bucket_mb": cfg.dist.bucket_mb, "broadcast_buffers": cfg.dist.broadcast_buffers,
                **{k: getattr(cfg.dist, k) for k in HOOK_KEYS}}

    def _ensure_group(self) -> None:
        """The default process group: the launcher's, or for one process a gloo group of its own."""
        if not dist.is_initialized():
            if self.env.world_size > 1:
                raise UsageError(f"strategy {self.name!r} needs a process group; "
                                 f"start it with paratrain launch/train --nproc N")
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            self._own_group = True

    def _wrap(self, module: nn.Module, batch_dim: int) -> nn.Module:
        self._ensure_group()
        ids = [self.device] if self.device.type == "cuda" else None
        # replicas of sync BatchNorm layers already agree on their buffers: no broadcast every forward
        # (torch 2.13 renamed broadcast_buffers to forward_sync_buffers; init still syncs them)
        key = "forward_sync_buffers" if "forward_sync_buffers" in _DDP_ARGS else "broadcast_buffers"
        sync = self.options.get("broadcast_buffers", True) and not self._bn_group_made
        ddp = DDP(module, device_ids=ids, bucket_cap_mb=self.options.get("bucket_mb", 25.0),
                  gradient_as_bucket_view=True, **{key: sync})
        name = self.options.get("comm_hook", "none")
        if self.timing or name != "none":
            self.hook = CommHook(name, matrix_approximation_rank=self.options.get("matrix_approximation_rank", 1),
                                 start_powerSGD_iter=self.options.get("start_powerSGD_iter", 1000),
                                 on_bucket=self._bucket_ready if self.timing else None)
            self.hook.register(ddp, module)
        return ddp

    _bn_group_made = False

    def stats_group(self):
        """A group of its own for BatchNorm statistics, so that they never interleave with DDP's
        bucket all-reduces on the default group (every rank calls setup, so creating it is safe)."""
        if self.env.world_size < 2:
            return None
        self._bn_group_made = True
        self._bn_group = dist.new_group(list(range(self.env.world_size)))
        return self._bn_group

    def _groups(self) -> list:
        return [self._bn_group] if self._bn_group_made else []

    def _bucket_ready(self) -> None:
        """Mark when a gradient bucket is ready (the hook calls it). The last bucket's mark ends
        backward compute; the rest of ``backward()`` is exposed communication."""
        self._grads_ready = self.clock.mark()

    def metrics(self) -> dict[str, float]:
        """The hook's payload count (:meth:`.comm_hooks.CommHook.metrics`) when a hook is registered."""
        return self.hook.metrics() if self.hook is not None else {}

    def comm_state_dict(self) -> dict:
        """Every rank's PowerSGD state, in rank order (a collective when there is one)."""
        if self.hook is None or self.hook.state is None:
            return {}
        return {"powersgd": self.all_gather_object(self.hook.state_dict())}

    def load_comm_state_dict(self, state: dict) -> None:
        """This rank's part of :meth:`comm_state_dict`; at another world size PowerSGD keeps only its
        step counter (the error feedback is per rank)."""
        ranks = state.get("powersgd") if self.hook is not None and self.hook.state is not None else None
        if not ranks:
            return
        if len(ranks) == self.env.world_size:
            self.hook.load_state_dict(ranks[self.env.rank])
            return
        warnings.warn(f"the checkpoint's PowerSGD state is of {len(ranks)} ranks, this job has "
                      f"{self.env.world_size}: error feedback and P/Q memory start afresh")
        self.hook.state.iter = ranks[0]["iter"]

    def no_sync(self) -> ContextManager:
        """DDP's ``no_sync()``: backward accumulates locally, the next backward outside it communicates."""
        return self.engine.no_sync()

    def join(self) -> ContextManager:
        """torch's ``Join`` over DDP (``torch.distributed.algorithms.Join``): a rank out of batches
        answers the others' gradient all-reduces with zeros (the merge still divides by world_size)
        and, when the last rank is done, every rank gets the last one's parameters. Collectives of
        your own inside the context are not shadowed: keep them outside it."""
        from torch.distributed.algorithms import Join

        if not isinstance(self.engine, DDP):  # fsdp, pipeline: nothing here answers a departed rank
            return super().join()
        return Join([self.engine] if self.env.world_size > 1 else [])

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.env.world_size > 1:
            dist.all_reduce(tensor, op=_OPS[op])
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.env.world_size > 1:
            dist.broadcast(tensor, src)
        return tensor

    def barrier(self) -> None:
        if self.env.world_size > 1:
            dist.barrier()

    def all_gather_object(self, obj: Any) -> list[Any]:
        if self.env.world_size < 2:
            return [obj]
        out: list = [None] * self.env.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if self.env.world_size < 2:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)  # rank src's object reaches each rank once
        return box[0]

    def teardown(self) -> None:
        """Wait for every rank, then drop the DDP reducer before the group goes away
        (a reducer outliving its gloo group can abort the process at exit)."""
        if self.env.world_size > 1 and dist.is_initialized():
            dist.barrier()
        self.release()
        if getattr(self, "_own_group", False):
            leave_group()
            self._own_group = False

    def release(self) -> None:
        """Drop the DDP reducer (no other rank is waited for): what must go before the process group."""
        self.engine = None
        if self.model is not None:
            object.__setattr__(self.model, "_engine", self.module)
        import gc

        gc.collect()
