"""What a strategy's checkpoints hold and load: a mixin of :class:`~paratrain.strategies.base.Strategy`.

Whole-model state dicts (the model without wrapper prefixes, the optimizer by index, as a
``checkpoint-<step>.pt`` stores them), the state of the gradient communication (PowerSGD's memory),
and the collective that makes every rank's module whole before one is read. Sharded strategies
override these with collectives (:mod:`.fsdp`, :mod:`.zero1`, :mod:`.pipeline`). Needs ``self.module``
and ``self.optimizer`` from the strategy.
"""
from __future__ import annotations

import torch

from .wrapping import base_load_state_dict, base_state_dict


class StrategyState:
    """The state part of a strategy (overridden per strategy)."""

    def optimizer_state_dict(self) -> dict:
        """The optimizer's state_dict for the whole model (what a checkpoint stores)."""
        return base_state_dict(self.optimizer)

    def load_optimizer_state_dict(self, state: dict) -> None:
        """Load a whole-model optimizer state_dict (from any strategy)."""
        base_load_state_dict(self.optimizer, state)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The plain model's state_dict (no wrapper prefixes); same on every rank."""
        return self.module.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True):
        """Load a plain model state_dict (from any strategy or world_size) on every rank."""
        return self.module.load_state_dict(state, strict=strict)

    def comm_state_dict(self) -> dict:
        """State of the gradient communication that a checkpoint keeps (PowerSGD's memory: every rank's).
        Every rank must call it (it may gather). Default: none."""
        return {}

    def load_comm_state_dict(self, state: dict) -> None:
        """Load :meth:`comm_state_dict` (every rank, its own part)."""

    def gather_whole(self) -> None:
        """Make :attr:`module` hold the whole current model on every rank (pipeline: each stage's
        parameters broadcast to the other stages). Every rank calls it. Default: it already does."""
