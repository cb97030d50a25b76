"""Evaluation: a task's metrics over a whole split, sharded over the ranks that evaluate.

The strategy says which share of the split this rank evaluates
(:meth:`~paratrain.strategies.base.Strategy.evaluation_share`: every rank its
share, or rank 0 alone for a parameter server whose workers do not step
together); the task yields the batches of that share and a float64 vector of
sums per batch; the vectors are summed over the ranks (when they step together)
and turned into named metrics by the task. The result does not depend on the
world size.
"""
from __future__ import annotations

import math
from typing import Callable, Iterable

import torch
from torch import nn

from ..data import move_to

NAMES = {"ppl": "perplexity", "accuracy": "accuracy", "loss": "loss"}


@torch.no_grad()
def local_sums(task, module: nn.Module, batches, device: torch.device, padding: int = 0,
               pad_source: Callable[[], Iterable] | None = None) -> torch.Tensor | None:
    """Sum of ``task.eval_sums`` over this rank's batches (float64 vector), or None when it had none.
    ``padding``: forwards to run after them whose sums are discarded (the last of ``batches``, or the
    first of ``pad_source()`` when this rank has none), so that every rank runs as many forwards."""
    was_training = module.training
    module.eval()
    acc = None
    try:
        for batch in batches:
            sums = task.eval_sums(module, move_to(batch, device)).to(torch.float64)
            acc = sums if acc is None else acc + sums
        if padding:
            pad = batches[-1] if batches else next(iter(pad_source()))
            for _ in range(padding):
                task.eval_sums(module, move_to(pad, device))  # masked out: its sums are not added
    finally:
        module.train(was_training)
    return acc


def evaluate(task, strategy, split: str,
             reduce: Callable[[torch.Tensor, str], torch.Tensor] | None) -> dict[str, float]:
    """Metrics of ``split`` (``"valid"`` or ``"test"``). ``reduce(tensor, op)`` all-reduces over the
    ranks that evaluate together (None: this rank alone). Collective when ``reduce`` is given: then
    every rank runs as many forwards as the rank with the most batches (padded, the padding's sums
    discarded), so that a strategy whose forward is a collective (``fsdp``) never waits for a rank
    that has finished."""
    share = strategy.evaluation_share()
    strategy.before_eval()
    acc, batches, padding = None, [], 0
    if share is not None:
        batches = list(task.eval_batches(split, share))
    if reduce is not None:
        count = torch.tensor([float(len(batches))], device=strategy.device, dtype=torch.float64)
        padding = int(reduce(count, "max").item()) - len(batches)
    if share is not None:
        with strategy.eval_context():
            acc = local_sums(task, strategy.module, batches, strategy.device, padding,
                             lambda: task.eval_batches(split, (0, 1)))
    if reduce is not None:  # ranks without batches add zeros of the agreed length
        size = torch.tensor([0 if acc is None else acc.numel()], device=strategy.device, dtype=torch.float64)
        n = reduce(size, "max")
        if acc is None:
            acc = torch.zeros(int(n.item()), dtype=torch.float64, device=strategy.device)
        acc = reduce(acc.to(strategy.device), "sum")
    if acc is None or acc.numel() == 0:
        return {"loss": math.nan}
    return task.metrics(acc.cpu())


def describe(split: str, headline: str, metrics: dict[str, float]) -> str:
    """``valid perplexity 123.45``: the task's headline metric, for the progress line."""
    value = metrics.get(headline, math.nan)
    return f"{split} {NAMES.get(headline, headline)} {value:.4f}" if headline == "accuracy" else \
        f"{split} {NAMES.get(headline, headline)} {value:.2f}"
