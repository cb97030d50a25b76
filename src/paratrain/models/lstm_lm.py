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


class LayerwiseLSTM(nn.Module):
    """An L-layer LSTM as L one-layer ``nn.LSTM`` modules (``layers.0`` ... ``layers.L-1``),
    so that a placement plan can put layers on different devices (model parallelism).
    Same mathematics as ``nn.LSTM(num_layers=L, dropout=p)``; hidden state ((L, B, H), (L, B, H))."""

    def __init__(self, input_size: int, hidden_size: int, num_layers: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.LSTM(input_size if i == 0 else hidden_size, hidden_size)
                                    for i in range(num_layers))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, hidden: Hidden | None = None) -> tuple[torch.Tensor, Hidden]:
        """x (T, B, E) -> out (T, B, H), ((L, B, H), (L, B, H)) on the last layer's device."""
        hs, cs = [], []
        for i, layer in enumerate(self.layers):
            h0 = None if hidden is None else (hidden[0][i:i + 1], hidden[1][i:i + 1])  # (1, B, H) each
            x, (h, c) = layer(x, h0)
            hs.append(h)
            cs.append(c)
            if i < len(self.layers) - 1:
                x = self.drop(x)
        return x, (torch.cat([h.to(x.device) for h in hs]), torch.cat([c.to(x.device) for c in cs]))


def convert_state_dict(state: dict[str, torch.Tensor], layerwise: bool) -> dict[str, torch.Tensor]:
    """Rename LSTM weights between ``rnn.weight_ih_l{k}`` (nn.LSTM) and
    ``rnn.layers.{k}.weight_ih_l0`` (LayerwiseLSTM); other keys unchanged."""
    import re

    out = {}
    for k, v in state.items():
        m = re.fullmatch(r"rnn\.(weight|bias)_(ih|hh)_l(\d+)", k)
        n = re.fullmatch(r"rnn\.layers\.(\d+)\.(weight|bias)_(ih|hh)_l0", k)
        if layerwise and m:
            k = f"rnn.layers.{m.group(3)}.{m.group(1)}_{m.group(2)}_l0"
        elif not layerwise and n:
            k = f"rnn.{n.group(2)}_{n.group(3)}_l{n.group(1)}"
        out[k] = v
    return out


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
        layerwise: one module per LSTM layer (``rnn.layers.N``) for placement
            plans; state dicts of either layout load into both.
    """

    # why it cannot be cut into pipeline stages (the strategy that refuses it names itself)
    no_pipeline_reason = ("each LSTM layer carries its hidden state from one BPTT window to the next (across "
                          "steps), which a stage's schedule of micro-batches cannot thread through")

    def __init__(self, vocab_size: int, embed_dim: int = 200, hidden_dim: int = 200,
                 num_layers: int = 2, dropout: float = 0.0, tie_weights: bool = False,
                 init_range: float = 0.1, layerwise: bool = False) -> None:
        super().__init__()
        self.layerwise = layerwise
        if tie_weights and embed_dim != hidden_dim:
            raise ValueError(f"tie_weights needs embed_dim == hidden_dim, got {embed_dim} and {hidden_dim}")
        self.num_layers, self.hidden_dim = num_layers, hidden_dim
        self.embedding = nn.Embedding(vocab_size, embed_dim)
        self.drop = nn.Dropout(dropout)
        if layerwise:
            self.rnn: nn.Module = LayerwiseLSTM(embed_dim, hidden_dim, num_layers, dropout)
        else:
            self.rnn = nn.LSTM(embed_dim, hidden_dim, num_layers, dropout=dropout if num_layers > 1 else 0.0)
        self.decoder = nn.Linear(hidden_dim, vocab_size)
        if tie_weights:
            self.decoder.weight = self.embedding.weight
        for p in self.parameters():
            nn.init.uniform_(p, -init_range, init_range)
        nn.init.zeros_(self.decoder.bias)

    def checkpoint_blocks(self) -> list[nn.Module]:
        """Blocks for activation checkpointing: the LSTM (each layer when ``layerwise``)."""
        return list(self.rnn.layers) if self.layerwise else [self.rnn]

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Loads a state dict of either LSTM layout (see :func:`convert_state_dict`)."""
        return super().load_state_dict(convert_state_dict(state_dict, self.layerwise), strict, assign)

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
