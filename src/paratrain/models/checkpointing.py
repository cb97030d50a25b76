"""Activation checkpointing per block (Chen et al. 2016, "Training Deep Nets with Sublinear Memory
Cost"; ``torch.utils.checkpoint`` with ``use_reentrant=False``).

A checkpointed block keeps only its inputs during the forward; its inner activations are
recomputed in the backward. The random state (dropout) is stashed and restored by
``torch.utils.checkpoint``, so the recomputation equals the forward and the gradients equal those
without checkpointing. The block's BatchNorm buffers are put back after the recomputation, which
would otherwise update the running statistics a second time each step (until 2026-11-30 it did).
State-dict keys do not change (the block's ``forward`` is wrapped on the instance, no wrapper
module is inserted).

Blocks: what the model's ``checkpoint_blocks()`` returns when it defines one; otherwise the members
of every ``nn.ModuleList`` in the model (Transformer blocks, per-layer LSTMs); otherwise the
model's direct children.
"""
from __future__ import annotations

import contextlib
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, noop_context_fn


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
        norms = [m for m in block.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        contexts = partial(_recompute_contexts, norms) if norms else noop_context_fn

        def checkpointed(*args: Any, _forward=forward, _contexts=contexts, **kwargs: Any) -> Any:
            return checkpoint(_forward, *args, use_reentrant=False, context_fn=_contexts, **kwargs)

        block.forward = checkpointed
    return [names.get(id(b), type(b).__name__) for b in chosen]


def _recompute_contexts(norms: list[nn.Module]):
    """``torch.utils.checkpoint``'s ``context_fn``: nothing around the forward; around the
    recomputation, :func:`_buffers_kept` of the block's BatchNorm layers."""
    return contextlib.nullcontext(), _buffers_kept(norms)


@contextlib.contextmanager
def _buffers_kept(norms: list[nn.Module]):
    """BatchNorm layers' buffers (running mean and variance, batches tracked) put back as they were
    before the block's recomputed forward, which would update them a second time (momentum applied
    twice, the count doubled: the running statistics, and so evaluation, would differ from the run
    without checkpointing)."""
    saved = [(b, b.detach().clone()) for m in norms for b in m.buffers(recurse=False)]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, before in saved:
                buffer.copy_(before)
