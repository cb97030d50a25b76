"""Activation checkpointing per block (Chen et al. 2016, "Training Deep Nets with Sublinear Memory
Cost"; ``torch.utils.checkpoint`` with ``use_reentrant=False``).

A checkpointed block keeps only its inputs during the forward; its inner activations are
recomputed in the backward. The random state (dropout) is stashed and restored by
``torch.utils.checkpoint``, so the recomputation equals the forward and the gradients equal those
without checkpointing. State-dict keys do not change (the block's ``forward`` is wrapped on the
instance, no wrapper module is inserted).

Blocks: what the model's ``checkpoint_blocks()`` returns when it defines one; otherwise the members
of every ``nn.ModuleList`` in the model (Transformer blocks, per-layer LSTMs); otherwise the
model's direct children.
"""
from __future__ import annotations

from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint


def blocks(model: nn.Module) -> list[nn.Module]:
    """The modules :func:`enable` checkpoints (see the module docstring)."""
    own = getattr(model, "checkpoint_blocks", None)
    if callable(own):
        return list(own())
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if lists:
        return [b for lst in lists for b in lst]
    return list(model.children())


def enable(model: nn.Module, which: list[nn.Module] | None = None) -> list[str]:
    """Checkpoint each block of ``model`` (``which``, default :func:`blocks`); returns their names.
    Raises ValueError when the model has no block to checkpoint."""
    chosen = which if which is not None else blocks(model)
    if not chosen:
        raise ValueError("the model has no block to checkpoint (no checkpoint_blocks(), ModuleList or children)")
    names = {id(m): n for n, m in model.named_modules()}
    for block in chosen:
        forward = block.forward

        def checkpointed(*args: Any, _forward=forward, **kwargs: Any) -> Any:
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        block.forward = checkpointed
    return [names.get(id(b), type(b).__name__) for b in chosen]
