"""``zero1``: data parallelism with the optimizer state sharded over the ranks (ZeRO stage 1,
Rajbhandari et al. 2020), each tensor's state split by rows as FSDP2 splits parameters.

Gradients are all-reduced (averaged) by DDP as in ``allreduce``. Every parameter of shape
(d0, ...) is split along dim 0 into W chunks (``torch.chunk``'s sizes: ceil(d0 / W) rows, the
last ranks fewer or none); rank r's optimizer holds a ``DTensor`` parameter (``Shard(0)`` on a 1-D
``DeviceMesh``) whose local part is a view of rows r of the real parameter, with the matching rows
of the all-reduced gradient. Its step updates those rows in place, with state for those rows only;
one ``all_gather`` then gives every rank the rows the others updated. A 0-dim parameter is
``Replicate``: every rank updates it. Optimizer state per rank: 1/W of ``allreduce``'s for every
model, also when one tensor (a tied embedding) holds most of the parameters, which a partition of
whole parameters (``torch.distributed.optim.ZeroRedundancyOptimizer``) cannot balance. An
element-wise optimizer (SGD, Adam, AdamW, ...) computes exactly what it computes on whole tensors;
one with per-tensor reductions gets them from DTensor's sharded operators, as under ``fsdp``.

The user's optimizer object stays the one the loop and LR schedules see: its hyperparameters
(``param_groups``) are copied to the sharded optimizer before every step, and its own ``state``
stays empty. Checkpoints are DCP folders (:mod:`.sharded`): the model, and each rank's rows of the
optimizer state by parameter name (reshardable to any world size and strategy).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import UsageError
from .allreduce import AllReduce
from .sharded import ShardedCheckpoints, by_index, local_by_name, parameter_names, read_whole
from .wrapping import user_optimizer_class


def row_range(rows: int, rank: int, world: int) -> tuple[int, int]:
    """Rank ``rank``'s rows [lo, hi) of a dim-0 size ``rows`` split over ``world`` ranks as
    ``torch.chunk`` (and DTensor's ``Shard(0)``) splits it: ceil(rows / world) rows each."""
    per = -(-rows // world)
    return min(rank * per, rows), min((rank + 1) * per, rows)


def row_dtensor(rows: torch.Tensor, p: torch.Tensor, mesh):
    """``rows``, this rank's rows of a tensor of ``p``'s shape (all of it for a 0-dim ``p``), as a
    DTensor on the 1-D ``mesh`` (no copy: the DTensor's local part is ``rows``)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not p.dim():
        return DTensor.from_local(rows, mesh, [Replicate()], run_check=False)
    return DTensor.from_local(rows, mesh, [Shard(0)], shape=p.shape, stride=p.stride(), run_check=False)


class Zero1(ShardedCheckpoints, AllReduce):
    """Options: those of ``allreduce`` (``bucket_mb``, the communication hook)."""

    name = "zero1"
    cost_model = "sharded_optimizer"  # paratrain.bench.costmodel_sharded.predict_zero1
    shard_optimizer = None  # the user's optimizer class over this rank's row shards (DTensors), made by setup

    def _after_setup(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        from ..train.optim import optimizer_like  # paratrain.train imports the strategies

        opt = self.optimizer
        if opt is None:
            return
        world, rank = self.env.world_size, self.env.rank
        self.mesh = init_device_mesh(self.device.type, (world,))
        self._pairs: list[tuple[nn.Parameter, nn.Parameter, int, int]] = []  # (param, shard, lo, hi)
        groups = []
        for g in opt.param_groups:
            shards = []
            for p in g["params"]:
                lo, hi = row_range(p.shape[0], rank, world) if p.dim() else (0, 0)
                shard = nn.Parameter(self._dtensor(p.detach()[lo:hi] if p.dim() else p.detach(), p))
                self._pairs.append((p, shard, lo, hi))
                shards.append(shard)
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": shards})
        self.shard_optimizer = optimizer_like(user_optimizer_class(opt), groups, opt.defaults)
        self._names = parameter_names(self.module, opt)
        self._layout = self._row_layout()

    def state_optimizers(self) -> list[torch.optim.Optimizer]:
        """The sharded optimizer (this rank's rows of the state); the user's keeps no state."""
        return [self.shard_optimizer] if self.shard_optimizer is not None else super().state_optimizers()

    def _dtensor(self, rows: torch.Tensor, p: torch.Tensor):
        return row_dtensor(rows, p, self.mesh)

    def _sync_hyperparameters(self) -> None:
        for mine, theirs in zip(self.shard_optimizer.param_groups, self.optimizer.param_groups):
            for k, v in theirs.items():
                if k != "params":
                    mine[k] = v

    def optimizer_step(self, optimizer: torch.optim.Optimizer, base_step, closure=None):
        """The guard and scaler of :meth:`Strategy.optimizer_step`, with the sharded step (this rank's
        rows updated, then all-gathered) in place of the optimizer's own."""
        def step():
            for p, shard, lo, hi in self._pairs:
                shard.grad = None if p.grad is None else self._dtensor(p.grad[lo:hi] if p.dim() else p.grad, p)
            self._sync_hyperparameters()
            self.shard_optimizer.step()
            self._gather_rows()

        return super().optimizer_step(optimizer, step, closure)

    def _row_layout(self) -> list[tuple[torch.dtype, list[nn.Parameter], list[int]]]:
        """Per parameter dtype: the parameters with rows (0-dim ones are replicated) and their
        offsets in an all-gather buffer of ceil(d0 / W) padded rows each (the last offset: its size).
        Fixed by the model and W: computed once."""
        world = self.env.world_size
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for p, _, _, _ in self._pairs:
            if p.dim():
                by_dtype.setdefault(p.dtype, []).append(p)
        layout = []
        for dtype, params in by_dtype.items():
            offsets = [0]
            for p in params:
                offsets.append(offsets[-1] + -(-p.shape[0] // world) * (p.numel() // p.shape[0] if p.shape[0] else 0))
            layout.append((dtype, params, offsets))
        return layout

    def _gather_rows(self) -> None:
        """Every rank's updated rows to every rank: one ``all_gather`` per parameter dtype of the
        padded rows each rank updated (:meth:`_row_layout`)."""
        world, rank = self.env.world_size, self.env.rank
        if world == 1:
            return
        for dtype, params, offsets in self._layout:
            send = torch.empty(offsets[-1], dtype=dtype, device=self.device)  # padding is never read
            for p, off in zip(params, offsets):
                lo, hi = row_range(p.shape[0], rank, world)
                send[off:off + p[lo:hi].numel()].copy_(p.detach()[lo:hi].reshape(-1))
            recv = [torch.empty_like(send) for _ in range(world)]
            dist.all_gather(recv, send)
            with torch.no_grad():
                for r in range(world):
                    for p, off in zip(params, offsets):
                        lo, hi = row_range(p.shape[0], r, world)
                        if r != rank and hi > lo:
                            p[lo:hi].copy_(recv[r][off:off + p[lo:hi].numel()].view_as(p[lo:hi]))

    def join(self):
        """Refused with several ranks: a rank that runs out of batches would stop updating its rows
        while the others still step."""
        if self.env.world_size == 1:
            return super().join()
        raise UsageError("strategy 'zero1' cannot train on uneven inputs: a rank that runs out of batches "
                         "stops updating the rows whose optimizer state it holds; give every rank the "
                         "same number of batches (drop_last=True) or use allreduce")

    # ---- state ---------------------------------------------------------------------------------------
    def _local_state(self) -> dict[nn.Parameter, dict]:
        """{parameter: its state}, DTensor rows of this rank's shards ("step" a plain tensor)."""
        state = self.shard_optimizer.state
        return {p: state[shard] for p, shard, _, _ in self._pairs if shard in state}

    def optimizer_state_dict(self) -> dict:
        """The whole optimizer state by index (each sharded tensor all-gathered: a collective)."""
        self._sync_hyperparameters()
        sd = self.shard_optimizer.state_dict()  # by index; the shards are in the user's parameters' order
        whole = {}
        for i in sorted(sd["state"]):
            whole[i] = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in sd["state"][i].items()}
        return {"state": whole, "param_groups": sd["param_groups"]}

    def load_optimizer_state_dict(self, state: dict) -> None:
        """Load a whole by-index optimizer state (any strategy's): each rank keeps its rows."""
        mine = {}
        for i, st in state["state"].items():
            p, _, lo, hi = self._pairs[int(i)]
            mine[int(i)] = {k: self._dtensor((v[lo:hi] if p.dim() else v).detach().clone(), p)
                            if k != "step" and isinstance(v, torch.Tensor) and v.shape == p.shape else v
                            for k, v in st.items()}
        self.shard_optimizer.load_state_dict({**state, "state": mine})
        for g, loaded in zip(self.optimizer.param_groups, state["param_groups"]):
            g.update({k: v for k, v in loaded.items() if k != "params"})

    def sharded_state(self) -> dict[str, Any]:
        return {"model": self.module.state_dict(),
                "optim": local_by_name(self.optimizer, self._names, self._local_state())}

    def load_sharded(self, path: Path) -> None:
        whole = read_whole(path)
        self.load_whole(whole["model"], by_index(whole["optim"], self._names))

    def load_whole(self, model: dict[str, torch.Tensor], optim: dict) -> None:
        self.module.load_state_dict(model)
        self.load_optimizer_state_dict(optim)
