"""A small decoder-only Transformer language model (GPT: Radford et al. 2018, 2019), in the
style of Karpathy's nanoGPT ``model.py``.

Token and learned position embeddings, ``n_layer`` pre-LayerNorm blocks of causal
multi-head self-attention (``F.scaled_dot_product_attention``, is_causal) and a GELU
MLP (4x wide), a final LayerNorm, and the output projection tied to the token
embedding (Press & Wolf 2017). Weights ~ N(0, 0.02), the residual projections
scaled by 1/sqrt(2 n_layer) (GPT-2), biases zero.

Shapes: B batch, T time (<= block_size), C = d_model, H = n_head, V vocabulary.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    """(B, T, C) -> (B, T, C); each position attends to itself and the positions before it."""

    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"d_model {d_model} is not divisible by n_head {n_head}")
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.attn_drop = nn.Dropout(dropout)  # its p is the attention dropout (set to 0 to turn it off)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # (B, T, C) each
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, H, T, C/H)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, H, T, C/H)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, H, T, C/H)
        p = self.attn_drop.p if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # (B, H, T, C/H)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """(B, T, C) -> (B, T, 4C) -> GELU -> (B, T, C)."""

    def __init__(self, d_model: int, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm residual block: x + attn(ln1(x)), then + mlp(ln2(x)); (B, T, C) -> (B, T, C)."""

    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Args: vocab_size V; block_size, the longest context T; n_layer; n_head H; d_model C;
    dropout on embeddings, attention and residual branches. Raises ValueError when C % H != 0."""

    def __init__(self, vocab_size: int, block_size: int, n_layer: int = 2, n_head: int = 4, d_model: int = 128,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, d_model)
        self.wpe = nn.Embedding(block_size, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied (Press & Wolf 2017)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):  # residual projections (GPT-2)
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * n_layer))
            elif p.dim() == 2:
                nn.init.normal_(p, 0.0, 0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def pipeline_stages(self, num_stages: int, blocks: list[int] | None = None) -> list[nn.Module]:
        """The model cut into ``num_stages`` consecutive stages for pipeline parallelism: stage 0 the
        embeddings and its blocks, the last stage its blocks, ``ln_f`` and ``lm_head``. ``blocks``:
        the number of blocks of each stage (>= 0 each, summing to ``n_layer``); default as even as
        possible (earlier stages take the remainder). The stages share this model's modules (and so
        its parameters; the tied embedding is in the first and the last stage). ValueError for fewer
        than 2 stages, more stages than blocks + 1 without ``blocks``, or ``blocks`` that do not add up."""
        n = len(self.blocks)
        if blocks is None:
            if not 2 <= num_stages <= n + 1:
                raise ValueError(f"{num_stages} pipeline stages for a GPT of {n} blocks: use 2 to {n + 1}")
            per, extra = divmod(n, num_stages)
            blocks = [per + (1 if s < extra else 0) for s in range(num_stages)]
        if num_stages < 2 or len(blocks) != num_stages or sum(blocks) != n or min(blocks) < 0:
            raise ValueError(f"blocks per stage {list(blocks)} for {num_stages} stages of a GPT of {n} blocks: "
                             f"give {num_stages} counts >= 0 that add up to {n}")
        stages, start = [], 0
        for s, k in enumerate(blocks):
            stages.append(GPTStage(self, start, start + k, first=s == 0, last=s == num_stages - 1))
            start += k
        return stages

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx (B, T) int64 token ids, T <= block_size -> logits (B, T, V)."""
        T = idx.size(1)
        if T > self.block_size:
            raise ValueError(f"sequence of {T} tokens is longer than block_size {self.block_size}")
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        return self.lm_head(self.ln_f(x))  # (B, T, V)


class GPTStage(nn.Module):
    """Blocks ``[lo, hi)`` of ``gpt`` as one pipeline stage, with the embeddings if ``first`` and the
    final LayerNorm and output projection if ``last``. Input: idx (B, T) int64 (first) or hidden
    states (B, T, C); output: hidden states (B, T, C), or logits (B, T, V) (last)."""

    def __init__(self, gpt: GPT, lo: int, hi: int, *, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.wte, self.wpe, self.drop = gpt.wte, gpt.wpe, gpt.drop
        self.blocks = nn.ModuleList(gpt.blocks[lo:hi])
        if last:
            self.ln_f, self.lm_head = gpt.ln_f, gpt.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            pos = torch.arange(x.size(1), device=x.device)  # (T,)
            x = self.drop(self.wte(x) + self.wpe(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.last else x
