"""Optimizer, learning-rate rules and schedules.

* Recipe conventions: Zaremba et al. (2014) minimise the loss *summed* over the
  T unrolled steps and averaged over the batch; paratrain minimises the mean
  over tokens, which is that loss / T. Gradients shrink by T, so for SGD the
  same updates need lr x T and a clip threshold of clip / T
  (:func:`effective_lr_clip`). Adam's update does not depend on the loss scale,
  so only the clip threshold changes.
* LR scaling rule (Goyal et al. 2017, "Accurate, Large Minibatch SGD"): for a
  global batch B against the recipe's reference batch B0, lr x B/B0
  (``linear``) or x sqrt(B/B0) (``sqrt``), reached by a linear warmup over
  ``warmup_steps`` from the unscaled lr.
* Schedules: ``step`` (Zaremba: lr x decay^max(epoch - decay_start_epoch, 0),
  epochs counted from 1), ``plateau`` (lr x decay when validation loss did not
  improve for more than ``plateau_patience`` evaluations, as in PyTorch's
  word_language_model), ``constant``.
"""
from __future__ import annotations

import math

import torch

from ..config import TrainConfig


def effective_lr_clip(train: TrainConfig, tokens_per_sequence: int) -> tuple[float, float]:
    """(lr, clip) for the mean-over-tokens loss, from the recipe's convention.

    ``tokens_per_sequence`` is T (the BPTT length). Returns the recipe's values
    unchanged for ``convention = "mean_over_tokens"``.
    """
    lr, clip = train.lr, train.clip
    if train.convention == "sum_over_time":
        clip = clip / tokens_per_sequence
        if train.optimizer == "sgd":
            lr = lr * tokens_per_sequence
    return lr, clip


def scaling_factor(rule: str, batch_size: int, ref_batch_size: int) -> float:
    """LR multiplier for global batch ``batch_size`` vs the recipe's ``ref_batch_size``."""
    k = batch_size / ref_batch_size if ref_batch_size else 1.0
    return {"none": 1.0, "linear": k, "sqrt": math.sqrt(k)}[rule]


def effective_weight_decay(train: TrainConfig, tokens_per_sequence: int) -> float:
    """The recipe's L2 weight decay for the mean-over-tokens loss: wd / T under ``sum_over_time``.

    Gradients of the mean loss are 1/T of the summed loss's, and torch adds ``wd * p`` to them: the
    recipe's update ``lr * (T g + wd p)`` is ``(lr T) * (g + (wd / T) p)`` for SGD, and Adam, which
    ignores a common scale of its input, needs the same ratio ``g : (wd / T) p``."""
    if train.convention == "sum_over_time":
        return train.weight_decay / tokens_per_sequence
    return train.weight_decay


def build_optimizer(params, train: TrainConfig, lr: float, weight_decay: float | None = None) -> torch.optim.Optimizer:
    """The recipe's optimizer (``sgd`` with momentum, or ``adam``); ``weight_decay`` defaults to the recipe's."""
    wd = train.weight_decay if weight_decay is None else weight_decay
    if train.optimizer == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=wd)
    return torch.optim.SGD(params, lr=lr, momentum=train.momentum, weight_decay=wd)


class LRSchedule:
    """Learning rate as a function of (step, epoch) plus plateau state.

    ``base_lr`` is the recipe's lr after the convention conversion; ``factor``
    the batch-scaling multiplier. ``lr(step, epoch)`` is pure given the plateau
    state; ``state_dict``/``load_state_dict`` carry that state through checkpoints.
    """

    def __init__(self, train: TrainConfig, base_lr: float, factor: float = 1.0) -> None:
        self.kind, self.decay = train.schedule, train.decay
        self.decay_start, self.patience = train.decay_start_epoch, train.plateau_patience
        self.warmup = train.warmup_steps
        self.base_lr, self.factor = base_lr, factor
        self.plateau_scale = 1.0
        self.best = math.inf
        self.bad_evals = 0

    def lr(self, step: int, epoch: int) -> float:
        """lr for optimizer step ``step`` (0-based) in ``epoch`` (1-based)."""
        target = self.base_lr * self.factor
        if self.warmup and step < self.warmup:
            start = self.base_lr if self.factor > 1 else target / self.warmup
            target = start + (target - start) * (step + 1) / self.warmup
        if self.kind == "step":
            target *= self.decay ** max(epoch - self.decay_start, 0)
        elif self.kind == "plateau":
            target *= self.plateau_scale
        return target

    def observe(self, valid_loss: float) -> None:
        """Report a validation loss (plateau schedule)."""
        if valid_loss < self.best:
            self.best, self.bad_evals = valid_loss, 0
        else:
            self.bad_evals += 1
            if self.kind == "plateau" and self.bad_evals > self.patience:
                self.plateau_scale *= self.decay
                self.bad_evals = 0

    def apply(self, optimizer: torch.optim.Optimizer, step: int, epoch: int) -> float:
        lr = self.lr(step, epoch)
        for g in optimizer.param_groups:
            g["lr"] = lr
        return lr

    def state_dict(self) -> dict:
        return {"plateau_scale": self.plateau_scale, "best": self.best, "bad_evals": self.bad_evals}

    def load_state_dict(self, state: dict) -> None:
        self.plateau_scale, self.best, self.bad_evals = state["plateau_scale"], state["best"], state["bad_evals"]


def optimizer_like(cls: type, params, defaults: dict) -> torch.optim.Optimizer:
    """``cls(params, **defaults)`` with only the keywords ``cls.__init__`` accepts: an optimizer's
    ``defaults`` may hold more than its constructor takes (``AdamW`` passes
    ``decoupled_weight_decay=True`` to ``Adam`` and does not accept it back). For the same update
    rule over other parameters (the parameter server's shards, ZeRO-1's row shards)."""
    import inspect

    accepted = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        return cls(params, **defaults)
    return cls(params, **{k: v for k, v in defaults.items() if k in accepted})
