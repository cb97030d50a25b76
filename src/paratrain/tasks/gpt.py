"""``gpt``: a small decoder-only Transformer language model (:class:`paratrain.models.GPT`)
on WikiText-2 or Penn Treebank, word level (the corpus rules of the LSTM task), on the public
Task API only.

``[data]``: :class:`~paratrain.tasks.lm.LMDataConfig` with ``mode = "bptt"``: the corpus is
cut into B parallel streams and each step takes the next ``data.bptt`` tokens of every stream
(each window a training sequence; the context is the window, nothing is carried).
``[model]``: :class:`GPTConfig`. Inputs go to the model as (B, T): batch dimension 0.
Perplexity covers every prediction of the split once (windows of ``data.bptt`` tokens).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..checks import check_at_least, check_probability
from ..data.batching import LMBatch
from ..errors import UsageError
from ..models.gpt import GPT
from .base import TaskEnv
from .lm import LanguageModelTask, LMDataConfig


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """``[model]`` of ``gpt``: layers, heads, width, dropout (the context length is ``data.bptt``)."""

    n_layer: int = 2
    n_head: int = 4
    d_model: int = 128
    dropout: float = 0.0
    sync_batchnorm: bool = False  # no BatchNorm in this model; accepted so every task takes the key
    activation_checkpointing: bool = False  # recompute each block's activations in backward

    def __post_init__(self) -> None:
        for key in ("n_layer", "n_head", "d_model"):
            check_at_least("model", key, getattr(self, key), 1)
        check_probability("model", "dropout", self.dropout)
        if self.d_model % self.n_head:
            raise UsageError(f"model.d_model = {self.d_model} is not divisible by model.n_head = {self.n_head}; "
                             f"use a multiple of {self.n_head}")


def cross_entropy_sum(model: nn.Module, mb: LMBatch) -> torch.Tensor:
    """Sum over counted targets of -log p(target) for a (T, b) stream window (fed as (b, T))."""
    logits = model(mb.inputs.t())  # (b, T, V)
    V = logits.size(-1)
    targets = mb.targets.t().reshape(-1)  # (b*T,)
    if mb.mask is None:
        return F.cross_entropy(logits.reshape(-1, V), targets, reduction="sum")
    per_token = F.cross_entropy(logits.reshape(-1, V), targets, reduction="none")  # (b*T,)
    return (per_token * mb.mask.t().reshape(-1)).sum()


class GPTTask(LanguageModelTask):
    """The GPT language-model task (batch dimension 0: the model reads (b, T))."""

    batch_dim = 0

    def __init__(self, data: LMDataConfig, model: GPTConfig, env: TaskEnv) -> None:
        if data.mode != "bptt":
            raise UsageError(f"task 'gpt' reads windows of parallel streams: data.mode = {data.mode!r} is not "
                             f"supported; use data.mode = \"bptt\"")
        super().__init__(data, env)
        self.model_cfg = model

    def build_model(self) -> nn.Module:
        m = self.model_cfg
        return GPT(self.vocab_size, self.data.bptt, m.n_layer, m.n_head, m.d_model, m.dropout)

    def loss(self, model: nn.Module, mb: LMBatch) -> tuple[torch.Tensor, int]:
        """(summed cross-entropy over the window's counted targets, their number)."""
        return cross_entropy_sum(model, mb), mb.num_tokens

    def pipeline_input(self, mb: LMBatch) -> torch.Tensor:
        """What the first pipeline stage reads: the window's inputs as (b, T) (the model's layout)."""
        return mb.inputs.t()

    def pipeline_chunk(self, mb: LMBatch, lo: int, hi: int) -> LMBatch:
        """Rows ``[lo, hi)`` of ``pipeline_input(mb)`` as a micro-batch of its own (columns of (T, b))."""
        mask = None if mb.mask is None else mb.mask[:, lo:hi]
        n = int(mask.sum()) if mask is not None else mb.targets[:, lo:hi].numel()
        return LMBatch(mb.inputs[:, lo:hi], mb.targets[:, lo:hi], mask, mb.hidden_key, n)

    def eval_sums(self, model: nn.Module, mb: LMBatch) -> torch.Tensor:
        ce = cross_entropy_sum(model, mb).double()
        return torch.stack([ce, ce.new_tensor(float(mb.num_tokens))])


def make_task(section: dict[str, Any], env: TaskEnv) -> GPTTask:
    """Factory of the built-in ``gpt`` task."""
    return GPTTask(section["data"], section["model"], env)


make_task.config_sections = {"data": LMDataConfig, "model": GPTConfig}
