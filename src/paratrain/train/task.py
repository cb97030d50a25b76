"""The language-modelling task: loss of a micro-batch, carried hidden state, evaluation."""
from __future__ import annotations

import threading
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..data.batching import LMBatch


class LMTask:
    """Computes the loss of LM micro-batches and carries the BPTT hidden state.

    ``norm`` is set by the loop each step to ``global_tokens / num_replicas``
    so that the replicas' averaged gradients equal the gradient of the mean
    cross-entropy over the *global* batch (exact in sentence mode, where ranks
    hold different numbers of tokens). ``ce_sum`` and ``tokens`` accumulate this
    rank's summed cross-entropy (nats) and target count for logging.
    """

    def __init__(self) -> None:
        self.hidden: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.norm = 1.0
        self.ce_sum = torch.zeros((), dtype=torch.float64)
        self.tokens = 0
        self._lock = threading.Lock()  # towers (replicate) call loss_fn from several threads

    def reset_hidden(self) -> None:
        self.hidden = {}

    def gather_hidden(self, batch: int, rank: int, world_size: int, micro: int, all_reduce) -> dict:
        """The carried BPTT state of the whole global batch, ``{0: [h, c]}`` each (L, batch, H), or {}
        before the first step. Rank r's micro-batch k holds streams ``r*batch/world_size +
        k*per_micro ...``; ``all_reduce`` (sum, in place) assembles them. Collective: every rank."""
        if not self.hidden:
            return {}
        per_micro = batch // world_size // micro
        h_like = next(iter(self.hidden.values()))[0]
        full = torch.zeros((2, h_like.size(0), batch, h_like.size(2)), dtype=h_like.dtype, device=h_like.device)
        for k, (h, c) in self.hidden.items():
            lo = rank * (batch // world_size) + k * per_micro
            full[0, :, lo:lo + per_micro], full[1, :, lo:lo + per_micro] = h, c
        all_reduce(full)
        return {0: [full[0], full[1]]}

    def scatter_hidden(self, hidden: dict, batch: int, rank: int, world_size: int, micro: int,
                       device: torch.device, dtype: torch.dtype) -> None:
        """Take this rank's streams of a :meth:`gather_hidden` state (any world_size wrote it);
        zeros when there is none or the global batch differs."""
        self.reset_hidden()
        if not hidden:
            return
        h, c = hidden[0]
        if h.size(1) != batch:
            return  # different global batch: the carried state does not apply; start from zeros
        per_micro = batch // world_size // micro
        for k in range(micro):
            lo = rank * (batch // world_size) + k * per_micro
            self.hidden[k] = (h[:, lo:lo + per_micro].to(device, dtype).contiguous(),
                              c[:, lo:lo + per_micro].to(device, dtype).contiguous())

    def loss_fn(self, model: nn.Module, mb: LMBatch) -> torch.Tensor:
        """Summed masked cross-entropy of ``mb`` divided by ``norm`` (0-dim)."""
        ce = cross_entropy_sum(model, mb, self.hidden)
        with self._lock:
            self.ce_sum = self.ce_sum.to(ce.device) + ce.detach().double()
            self.tokens += mb.num_tokens
        return ce / self.norm

    def take_log_counts(self) -> tuple[torch.Tensor, int]:
        out = (self.ce_sum, self.tokens)
        self.ce_sum, self.tokens = torch.zeros((), dtype=torch.float64, device=self.ce_sum.device), 0
        return out


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


@torch.no_grad()
def evaluate(module: nn.Module, batches: Iterable[LMBatch], device: torch.device) -> torch.Tensor:
    """(summed cross-entropy, counted targets) of this rank's batches, float64 tensor (2,).

    The caller all-reduces it; perplexity = exp(sum / count), independent of world_size.
    """
    was_training = module.training
    module.eval()
    hidden: dict = {}
    acc = torch.zeros(2, dtype=torch.float64, device=device)
    for mb in batches:
        mb = mb.to(device)
        acc[0] += cross_entropy_sum(module, mb, hidden).double()
        acc[1] += mb.num_tokens
    module.train(was_training)
    return acc
