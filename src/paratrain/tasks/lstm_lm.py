"""``lstm-lm``: the LSTM language model on Penn Treebank / WikiText-2 (Zaremba et al. 2014),
written on the public Task API (:mod:`paratrain.tasks.base`) only.

``[data]``: :class:`~paratrain.tasks.lm.LMDataConfig`. ``[model]``: :class:`LSTMConfig`.
The BPTT hidden state is carried from one step to the next per micro-batch (key
``k`` = this rank's k-th micro-batch of streams), reset at every epoch start, and
saved in checkpoints for the *whole* global batch (``{"hidden": {0: [h, c]}}``,
each (L, B, H)), so that any world size and accumulation can resume it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..checks import check_at_least, check_probability
from ..data.batching import LMBatch
from ..errors import UsageError
from ..models.lstm_lm import LSTMLM
from .base import TaskEnv
from .lm import LanguageModelTask, LMDataConfig


@dataclass(frozen=True, kw_only=True)
class LSTMConfig:
    """``[model]`` of ``lstm-lm`` (see :class:`paratrain.models.lstm_lm.LSTMLM`)."""

    embed_dim: int = 200
    hidden_dim: int = 200
    num_layers: int = 2
    dropout: float = 0.0
    tie_weights: bool = False
    init_range: float = 0.1
    layerwise: bool = False  # one module per LSTM layer (rnn.layers.N), for placement plans
    sync_batchnorm: bool = False  # no BatchNorm in this model; accepted so every task takes the key
    activation_checkpointing: bool = False  # recompute each block's activations in backward

    def __post_init__(self) -> None:
        for key in ("embed_dim", "hidden_dim", "num_layers"):
            check_at_least("model", key, getattr(self, key), 1)
        check_probability("model", "dropout", self.dropout)
        check_at_least("model", "init_range", self.init_range, 0, strict=True)
        if self.tie_weights and self.embed_dim != self.hidden_dim:
            raise UsageError(
                f"model.tie_weights = true needs model.embed_dim == model.hidden_dim "
                f"(got {self.embed_dim} and {self.hidden_dim}); make them equal or set tie_weights = false"
            )


def cross_entropy_sum(model: nn.Module, mb: LMBatch, hidden: dict) -> torch.Tensor:
    """Sum over counted targets of -log p(target); updates ``hidden[mb.hidden_key]`` (detached)."""
    h0 = hidden.get(mb.hidden_key) if mb.hidden_key is not None else None
    logits, h1 = model(mb.inputs, h0)  # (T, b, V)
    if mb.hidden_key is not None:
        hidden[mb.hidden_key] = (h1[0].detach(), h1[1].detach())
    V = logits.size(-1)
    if mb.mask is None:
        return F.cross_entropy(logits.view(-1, V), mb.targets.reshape(-1), reduction="sum")
    per_token = F.cross_entropy(logits.view(-1, V), mb.targets.reshape(-1), reduction="none")  # (T*b,)
    return (per_token * mb.mask.reshape(-1)).sum()


class LSTMLMTask(LanguageModelTask):
    """The LSTM LM task: inputs (T, b) token ids, batch dimension 1 (streams are columns)."""

    batch_dim = 1

    def __init__(self, data: LMDataConfig, model: LSTMConfig, env: TaskEnv) -> None:
        super().__init__(data, env)
        self.model_cfg = model
        self.hidden: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # training: per micro-batch
        self._eval_hidden: dict = {}

    def build_model(self) -> nn.Module:
        m = self.model_cfg
        return LSTMLM(self.vocab_size, m.embed_dim, m.hidden_dim, m.num_layers, m.dropout, m.tie_weights,
                      m.init_range, m.layerwise)

    def loss(self, model: nn.Module, mb: LMBatch) -> tuple[torch.Tensor, int]:
        """(summed cross-entropy over the micro-batch's counted targets, their number)."""
        return cross_entropy_sum(model, mb, self.hidden), mb.num_tokens

    def eval_batches(self, split: str, share: tuple[int, int]):
        self._eval_hidden = {}
        return super().eval_batches(split, share)

    def eval_sums(self, model: nn.Module, mb: LMBatch) -> torch.Tensor:
        ce = cross_entropy_sum(model, mb, self._eval_hidden).double()
        return torch.stack([ce, ce.new_tensor(float(mb.num_tokens))])

    # ---- carried state ------------------------------------------------------------------------------
    def start_epoch(self, epoch: int) -> None:
        self.hidden = {}  # Zaremba et al.: the state starts at zero every epoch

    def state_dict(self, all_reduce: Callable[[torch.Tensor], torch.Tensor] | None) -> dict:
        """``{"hidden": {0: [h, c]}}`` of the whole global batch, each (L, B, H); ``{}`` before the
        first step or when the ranks cannot be gathered (``all_reduce`` None). Rank r's micro-batch k
        holds streams ``r*B/W + k*B/(W*K) ...``; the all-reduce (sum) assembles them."""
        if not self.hidden or all_reduce is None:
            return {}
        env, per_micro = self.env, self.env.micro_batch
        h_like = next(iter(self.hidden.values()))[0]
        full = h_like.new_zeros((2, h_like.size(0), env.global_batch, h_like.size(2)))
        for k, (h, c) in self.hidden.items():
            lo = env.rank * env.per_rank + k * per_micro
            full[0, :, lo:lo + per_micro], full[1, :, lo:lo + per_micro] = h, c
        all_reduce(full)
        return {"hidden": {0: [full[0], full[1]]}}

    def load_state_dict(self, state: dict) -> None:
        """Take this rank's streams of a :meth:`state_dict` (any world_size wrote it); zeros when
        there is none or the global batch differs."""
        self.hidden = {}
        hidden = state.get("hidden") or {}
        if not hidden:
            return
        h, c = hidden[0]
        env = self.env
        if h.size(1) != env.global_batch:
            return  # different global batch: the carried state does not apply; start from zeros
        for k in range(env.accumulation):
            lo = env.rank * env.per_rank + k * env.micro_batch
            self.hidden[k] = (h[:, lo:lo + env.micro_batch].to(env.device, env.dtype).contiguous(),
                              c[:, lo:lo + env.micro_batch].to(env.device, env.dtype).contiguous())


def make_task(section: dict[str, Any], env: TaskEnv) -> LSTMLMTask:
    """Factory of the built-in ``lstm-lm`` task."""
    return LSTMLMTask(section["data"], section["model"], env)


make_task.config_sections = {"data": LMDataConfig, "model": LSTMConfig}
