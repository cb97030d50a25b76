"""``single``: one process, one device, no communication (the reference every
synchronous strategy must match)."""
from __future__ import annotations

import torch
from torch import nn

from .base import Strategy


class SingleDevice(Strategy):
    name = "single"
    in_process = True

    @property
    def num_replicas(self) -> int:
        return 1

    def _wrap(self, module: nn.Module) -> nn.Module:
        return module

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        return tensor

    def barrier(self) -> None:
        return None
