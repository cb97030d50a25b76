"""LSTM language model (Zaremba, Sutskever & Vinyals 2014, "Recurrent Neural
Network Regularization"; the PyTorch word_language_model example).

Shapes: T = time steps (BPTT length or padded sentence length), B = batch
(streams or sentences), V = vocabulary, E = embedding size, H = hidden size,
L = layers.
"""
from __future__ import annotations

import torch
from torch import nn

Hidden = tuple[torch.Tensor, torch.Tensor]


class LSTMLM(nn.Module):
    """Embedding -> dropout -> L-layer LSTM (dropout between layers) -> dropout -> linear decoder.

    Args:
        vocab_size: V. embed_dim: E. hidden_dim: H. num_layers: L.
        dropout: probability on the embedding output, between LSTM layers and on
            the last LSTM output (Zaremba's non-recurrent dropout).
        tie_weights: share the decoder weight with the embedding (Press & Wolf
            2017, Inan et al. 2017); needs E == H.
        init_range: every parameter is drawn from U(-init_range, init_range)
            (Zaremba et al.), decoder bias zero.
    """

    def __init__(self, vocab_size: int, embed_dim: int = 200, hidden_dim: int = 200,
                 num_layers: int = 2, dropout: float = 0.0, tie_weights: bool = False,
                 init_range: float = 0.1) -> None:
        super().__init__()
        if tie_weights and embed_dim != hidden_dim:
            raise ValueError(f"tie_weights needs embed_dim == hidden_dim, got {embed_dim} and {hidden_dim}")
        self.num_layers, self.hidden_dim = num_layers, hidden_dim
        self.embedding = nn.Embedding(vocab_size, embed_dim)
        self.drop = nn.Dropout(dropout)
        self.rnn = nn.LSTM(embed_dim, hidden_dim, num_layers, dropout=dropout if num_layers > 1 else 0.0)
        self.decoder = nn.Linear(hidden_dim, vocab_size)
        if tie_weights:
            self.decoder.weight = self.embedding.weight
        for p in self.parameters():
            nn.init.uniform_(p, -init_range, init_range)
        nn.init.zeros_(self.decoder.bias)

    def init_hidden(self, batch_size: int, like: torch.Tensor | None = None) -> Hidden:
        """Zero state: h and c, each (L, B, H), on the parameters' device and dtype."""
        w = self.decoder.weight if like is None else like
        z = w.new_zeros(self.num_layers, batch_size, self.hidden_dim)
        return z, z.clone()

    def forward(self, inputs: torch.Tensor, hidden: Hidden | None = None) -> tuple[torch.Tensor, Hidden]:
        """inputs (T, B) int64 -> logits (T, B, V) and the new hidden state ((L, B, H), (L, B, H))."""
        emb = self.drop(self.embedding(inputs))  # (T, B, E)
        out, hidden = self.rnn(emb, hidden)  # (T, B, H)
        logits = self.decoder(self.drop(out))  # (T, B, V)
        return logits, hidden
