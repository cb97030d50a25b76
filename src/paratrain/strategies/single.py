"""``single``: one process, one device, no communication (the reference every
synchronous strategy must match)."""
from __future__ import annotations

import torch
from torch import nn

from ..errors import UsageError
from .base import Strategy


class SingleDevice(Strategy):
    name = "single"
    in_process = True

    @classmethod
    def check_dist(cls, dist) -> None:
        if (dist.nproc, dist.nnodes) != (1, 1):
            raise UsageError(
                f"dist.strategy = 'single' runs one process, not dist.nproc = {dist.nproc} x dist.nnodes = "
                f"{dist.nnodes}; use dist.strategy = 'allreduce' (--strategy allreduce), or one process on one node")

    @classmethod
    def dist_for_replicas(cls, n: int) -> dict:
        return {"nproc": 1}

    @property
    def num_replicas(self) -> int:
        return 1

    def _wrap(self, module: nn.Module, batch_dim: int) -> nn.Module:
        return module

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        return tensor

    def barrier(self) -> None:
        return None
