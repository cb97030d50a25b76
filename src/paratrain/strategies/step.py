"""What one optimizer step reports (:class:`StepResult`), what a strategy notes while the
user's own loop runs it (:class:`StepRecord`), and the ``no_sync`` ability (:class:`NoSyncMixin`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ContextManager

import torch


@dataclass
class StepResult:
    """What :meth:`Strategy.train_step` returns for one optimizer step of this rank.

    loss: sum of the values ``loss_fn`` returned for this rank's micro-batches
        (detached, 0-dim, the loss's dtype and device).
    grad_norm: L2 norm of the merged gradient before clipping (0-dim), or None when
        the step computed none (no clipping and no non-finite guard). Parameter
        server: the norm of this worker's own gradient (the merge happens on the servers).
    spans: labelled ``(label, start, end)`` marks of :attr:`Strategy.clock`
        (labels in :data:`paratrain.bench.timing.CATEGORIES`).
    collective: ``(start, end)`` marks of the gradient merge that waits for the
        other replicas, or None; the loop uses it to split idle time off.
    skipped: the merged gradient was not finite (NaN/Inf): no parameter changed.
    """

    loss: torch.Tensor
    grad_norm: torch.Tensor | None
    spans: list = field(default_factory=list)
    collective: tuple | None = None
    skipped: bool = False


@dataclass
class StepRecord:
    """What the strategy saw during one optimizer step (reset by every ``optimizer.step()``)."""

    norm: torch.Tensor | None = None  # from clip_grad_norm_ or the non-finite guard
    spans: list = field(default_factory=list)
    collective: tuple | None = None
    skipped: bool = False
    unscaled: bool = False  # fp16: GradScaler.unscale_ has run on this step's gradient


class NoSyncMixin:
    """Ability: a context in which backward does not communicate (gradient accumulation)."""

    def no_sync(self) -> ContextManager:  # pragma: no cover - interface
        raise NotImplementedError
