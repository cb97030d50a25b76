"""A small convolutional network with BatchNorm (Ioffe & Szegedy 2015) for 8x8 digit images.

(B, 1, 8, 8) -> conv 3x3 (c1) -> BN -> ReLU -> conv 3x3 (c2) -> BN -> ReLU -> max-pool 2
-> (B, c2, 4, 4) -> conv 3x3 (c3) -> BN -> ReLU -> global average pool -> (B, c3)
-> dropout -> linear -> logits (B, classes). Convolutions before BatchNorm have no bias
(BatchNorm's shift replaces it).
"""
from __future__ import annotations

import torch
from torch import nn


def conv_bn(c_in: int, c_out: int) -> nn.Sequential:
    """(B, c_in, H, W) -> (B, c_out, H, W): 3x3 convolution (padding 1), BatchNorm, ReLU."""
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU())


class DigitsCNN(nn.Module):
    """Args: channels (c1, c2, c3), classes, dropout before the classifier."""

    def __init__(self, channels: tuple[int, int, int] = (16, 32, 64), classes: int = 10, dropout: float = 0.0) -> None:
        super().__init__()
        c1, c2, c3 = channels
        self.features = nn.Sequential(conv_bn(1, c1), conv_bn(c1, c2), nn.MaxPool2d(2), conv_bn(c2, c3))
        self.drop = nn.Dropout(dropout)
        self.classifier = nn.Linear(c3, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, 1, 8, 8) float -> logits (B, classes)."""
        h = self.features(x)  # (B, c3, 4, 4)
        return self.classifier(self.drop(h.mean(dim=(2, 3))))  # (B, classes)
