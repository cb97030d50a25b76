"""``zero1``: data parallelism with the optimizer state sharded over the ranks (ZeRO stage 1,
Rajbhandari et al. 2020) through ``torch.distributed.optim.ZeroRedundancyOptimizer``.

Gradients are all-reduced (averaged) by DDP as in ``allreduce``; each rank then updates only the
parameters it owns (a partition of the parameters, balanced by size) with its part of the optimizer
state, and broadcasts them to the other ranks. Optimizer state per rank: about 1/W of
``allreduce``'s. The user's optimizer object stays the one the loop and LR schedules see: its
hyperparameters (``param_groups``) are copied to the sharded optimizer before every step, and its
own ``state`` stays empty. Checkpoints are DCP folders (:mod:`.sharded`): the model, and each rank's
optimizer state by parameter name.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..errors import UsageError
from .allreduce import AllReduce
from .sharded import ShardedCheckpoints, by_index, local_by_name, parameter_names, read_whole


class Zero1(ShardedCheckpoints, AllReduce):
    """Options: those of ``allreduce`` (``bucket_mb``, the communication hook)."""

    name = "zero1"
    cost_model = "zero1"  # paratrain.bench.costmodel_sharded
    zero = None  # torch.distributed.optim.ZeroRedundancyOptimizer, made by setup

    def _after_setup(self) -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer  # imported here: it imports torch.jit

        opt = self.optimizer
        if opt is None:
            return
        groups = [{k: v for k, v in g.items()} for g in opt.param_groups]
        self.zero = ZeroRedundancyOptimizer(groups, optimizer_class=type(opt).__mro__[2], **opt.defaults)
        self._names = parameter_names(self.module, opt)

    def _sync_hyperparameters(self) -> None:
        for mine, theirs in zip(self.zero.param_groups, self.optimizer.param_groups):
            for k, v in theirs.items():
                if k != "params":
                    mine[k] = v

    def optimizer_step(self, optimizer: torch.optim.Optimizer, base_step, closure=None):
        """The guard and scaler of :meth:`Strategy.optimizer_step`, with ZeRO's step (this rank's
        partition updated, then broadcast) in place of the optimizer's own."""
        def step():
            self._sync_hyperparameters()
            self.zero.step()

        return super().optimizer_step(optimizer, step, closure)

    def join(self):
        """Refused with several ranks: under torch's ``Join`` a ZeroRedundancyOptimizer rank that is done
        only shadows the broadcasts, so the parameters it owns stop being updated while the others
        still step (measured: they differ from allreduce's join by the whole last updates)."""
        if self.env.world_size == 1:
            return super().join()
        raise UsageError("strategy 'zero1' cannot train on uneven inputs: a rank that runs out of batches "
                         "stops updating the parameters whose optimizer state it holds; give every rank the "
                         "same number of batches (drop_last=True) or use allreduce")

    # ---- state ---------------------------------------------------------------------------------------
    def optimizer_state_dict(self) -> dict:
        """The whole optimizer state by index (ZeRO consolidates it on every rank: a collective)."""
        self._sync_hyperparameters()  # ZeRO's own param_groups follow the user's only at step()
        self.zero.consolidate_state_dict(to=0)
        whole = self.zero.state_dict() if self.env.rank == 0 else None
        whole = self.broadcast_object(whole)
        return whole

    def load_optimizer_state_dict(self, state: dict) -> None:
        """Load a whole by-index optimizer state (any strategy's): each rank keeps its partition."""
        self.zero.load_state_dict({**state, "state": dict(state["state"])})  # it rewrites the dict it gets
        for g, loaded in zip(self.optimizer.param_groups, state["param_groups"]):
            g.update({k: v for k, v in loaded.items() if k != "params"})

    def sharded_state(self) -> dict[str, Any]:
        return {"model": self.module.state_dict(),
                "optim": local_by_name(self.optimizer, self._names, self.zero.optim.state)}

    def load_sharded(self, path: Path) -> None:
        whole = read_whole(path)
        self.load_whole(whole["model"], by_index(whole["optim"], self._names))

    def load_whole(self, model: dict[str, torch.Tensor], optim: dict) -> None:
        self.module.load_state_dict(model)
        self.load_optimizer_state_dict(optim)
