"""``digits-cnn``: a BatchNorm CNN (:class:`paratrain.models.DigitsCNN`) on the handwritten
digits that ship inside scikit-learn (``sklearn.datasets.load_digits``: 1,797 images, 8x8,
16 grey levels, 10 classes), on the public Task API only. Needs the ``digits`` extra
(``pip install "paratrain[digits]"``, scikit-learn).

Split: a fixed permutation seeded by ``data.split_seed`` gives ``data.test_size`` test,
``data.valid_size`` validation and the rest training images. Pixels are scaled to [-1, 1].
Each epoch the training images are shuffled with a generator seeded by (train.seed, epoch),
the same on every rank; step i's global batch is the next B of them, rank r takes its
contiguous B/W (then its micro-batches): the union is exactly the one-device batch. The
incomplete last batch is dropped. Loss: cross-entropy per sample; metric: accuracy.
BatchNorm: ``model.sync_batchnorm = true`` makes N replicas compute what one device does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ..checks import check_at_least, check_probability
from ..data.sharding import shard_range
from ..errors import UsageError
from ..models.cnn import DigitsCNN
from .base import TaskBase, TaskEnv, TrainStep


@dataclass(frozen=True, kw_only=True)
class DigitsDataConfig:
    """``[data]`` of ``digits-cnn``: the fixed split and the evaluation batch."""

    split_seed: int = 0
    valid_size: int = 300
    test_size: int = 300
    eval_batch_size: int = 100

    def __post_init__(self) -> None:
        for key in ("valid_size", "test_size", "eval_batch_size"):
            check_at_least("data", key, getattr(self, key), 1)
        if self.valid_size + self.test_size >= 1797:
            raise UsageError(f"data.valid_size + data.test_size = {self.valid_size + self.test_size} leaves no "
                             f"training image of the 1,797; use smaller sizes")


@dataclass(frozen=True, kw_only=True)
class DigitsModelConfig:
    """``[model]`` of ``digits-cnn``."""

    channels1: int = 16
    channels2: int = 32
    channels3: int = 64
    dropout: float = 0.0
    sync_batchnorm: bool = False  # batch statistics over every replica (see the module docstring)
    activation_checkpointing: bool = False  # recompute each block's activations in backward

    def __post_init__(self) -> None:
        for key in ("channels1", "channels2", "channels3"):
            check_at_least("model", key, getattr(self, key), 1)
        check_probability("model", "dropout", self.dropout)


def load_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """(images (1797, 1, 8, 8) float32 in [-1, 1], labels (1797,) int64). UsageError without scikit-learn."""
    try:
        from sklearn.datasets import load_digits as sk_load
    except ImportError:
        raise UsageError("task 'digits-cnn' needs scikit-learn: pip install \"paratrain[digits]\"") from None
    d = sk_load()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 8.0 - 1.0  # 16 grey levels -> [-1, 1]
    return x, torch.tensor(d.target, dtype=torch.int64)


class DigitsTask(TaskBase):
    """Image classification task: micro-batches are ``(images (b, 1, 8, 8), labels (b,))``."""

    unit = "samples"
    batch_dim = 0
    headline = "accuracy"

    def __init__(self, data: DigitsDataConfig, model: DigitsModelConfig, env: TaskEnv) -> None:
        self.data, self.model_cfg, self.env = data, model, env
        x, y = load_digits()
        x = x.to(env.dtype)
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(data.split_seed))
        test, valid, train = (order[:data.test_size], order[data.test_size:data.test_size + data.valid_size],
                              order[data.test_size + data.valid_size:])
        self.splits = {"train": (x[train], y[train]), "valid": (x[valid], y[valid]), "test": (x[test], y[test])}
        if len(train) < env.global_batch:
            raise UsageError(f"the training split has {len(train)} images, fewer than one global batch of "
                             f"{env.global_batch}; use a smaller train.batch_size")

    def build_model(self) -> nn.Module:
        m = self.model_cfg
        return DigitsCNN((m.channels1, m.channels2, m.channels3), 10, m.dropout)

    def steps_per_epoch(self) -> int:
        return len(self.splits["train"][1]) // self.env.global_batch

    def train_steps(self, epoch: int, start: int) -> Iterator[TrainStep]:
        x, y = self.splits["train"]
        B = self.env.global_batch
        perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(self.env.seed * 1_000_003 + epoch))
        for i in range(start, self.steps_per_epoch()):
            batch = perm[i * B:(i + 1) * B]
            micro = [(x[batch[lo:hi]], y[batch[lo:hi]]) for lo, hi in self.env.micro_ranges()]
            yield TrainStep(micro, float(B))

    def loss(self, model: nn.Module, micro_batch: Any) -> tuple[torch.Tensor, int]:
        """(summed cross-entropy over the micro-batch's images, their number)."""
        x, y = micro_batch
        return F.cross_entropy(model(x), y, reduction="sum"), len(y)

    def eval_batches(self, split: str, share: tuple[int, int]) -> Iterable[Any]:
        x, y = self.splits[split]
        lo, hi = shard_range(len(y), share[1], share[0])
        b = self.data.eval_batch_size
        return [(x[i:min(i + b, hi)], y[i:min(i + b, hi)]) for i in range(lo, hi, b)]

    def eval_sums(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        logits = model(x)
        ce = F.cross_entropy(logits, y, reduction="sum").double()
        correct = (logits.argmax(dim=1) == y).sum().double()
        return torch.stack([ce, ce.new_tensor(float(len(y))), correct])

    def metrics(self, sums: torch.Tensor) -> dict[str, float]:
        """``sums`` = (summed cross-entropy, images, correct) -> loss per image, accuracy."""
        n = float(sums[1])
        return {"loss": float(sums[0]) / n if n else math.nan, "accuracy": float(sums[2]) / n if n else math.nan}


def make_task(section: dict[str, Any], env: TaskEnv) -> DigitsTask:
    """Factory of the built-in ``digits-cnn`` task."""
    return DigitsTask(section["data"], section["model"], env)


make_task.config_sections = {"data": DigitsDataConfig, "model": DigitsModelConfig}
