"""Where workers and parameter servers sit in a torchrun job.

Every node runs ``nproc`` workers (local ranks 0..nproc-1) and ``num_ps``
servers (local ranks nproc..nproc+num_ps-1), so global rank 0 is worker 0.
Workers are numbered 0..W-1 (W = nnodes x nproc), servers 0..K-1
(K = nnodes x num_ps); RPC names are ``worker<i>`` and ``ps<k>``.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PSLayout:
    nproc: int
    num_ps: int
    nnodes: int = 1

    @property
    def per_node(self) -> int:
        return self.nproc + self.num_ps

    @property
    def num_workers(self) -> int:
        return self.nnodes * self.nproc

    @property
    def num_servers(self) -> int:
        return self.nnodes * self.num_ps

    @property
    def world_size(self) -> int:
        return self.nnodes * self.per_node

    def role(self, global_rank: int) -> tuple[str, int]:
        """("worker", i) or ("server", k) of a global rank."""
        node, local = divmod(global_rank, self.per_node)
        if local < self.nproc:
            return "worker", node * self.nproc + local
        return "server", node * self.num_ps + local - self.nproc

    def global_rank(self, role: str, index: int) -> int:
        if role == "worker":
            node, local = divmod(index, self.nproc)
            return node * self.per_node + local
        node, local = divmod(index, self.num_ps)
        return node * self.per_node + self.nproc + local

    def name(self, role: str, index: int) -> str:
        return f"{'worker' if role == 'worker' else 'ps'}{index}"

    def worker_ranks(self) -> list[int]:
        return [self.global_rank("worker", i) for i in range(self.num_workers)]

    def server_ranks(self) -> list[int]:
        return [self.global_rank("server", k) for k in range(self.num_servers)]
