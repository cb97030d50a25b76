"""What the language-model tasks share: the ``[data]`` section, the corpus, batching and perplexity.

Batching (:mod:`paratrain.data.batching`): ``data.mode = "bptt"`` cuts the corpus
into B parallel streams and steps through them ``data.bptt`` tokens at a time
(Zaremba et al. 2014); ``"sentence"`` makes each line a padded, masked sample.
Rank r owns columns ``[r*B/W, (r+1)*B/W)`` of every global batch, cut into the
micro-batches of gradient accumulation. The loss unit is the target token; the
metric is perplexity = exp(mean cross-entropy per token), over every prediction
of the split exactly once whatever the world size.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch

from ..checks import check_at_least, check_choice
from ..data import (BPTTTrainStream, SentenceTrainStream, bptt_eval_batches, ensure_corpus, load_corpus,
                    sentence_eval_batches)
from ..errors import UsageError
from .base import TaskBase, TaskEnv, TrainStep


@dataclass(frozen=True, kw_only=True)
class LMDataConfig:
    """``[data]`` of the language-model tasks. ``mode`` is ``bptt`` (B parallel streams unrolled
    ``bptt`` steps; Zaremba et al. 2014) or ``sentence`` (one line per sample, padded, loss masked)."""

    corpus: str = "ptb"
    mode: str = "bptt"
    bptt: int = 20
    eval_batch_size: int = 10
    max_sentence_len: int = 0  # 0 = no limit (sentence mode: longer lines are cut)
    train_fraction: float = 1.0  # use the first fraction of the training split (quick runs)
    eval_fraction: float = 1.0  # use the first fraction of valid/test (quick runs)
    drop_last: bool = True  # sentence mode: false trains the epoch's last, shorter global batch too

    def __post_init__(self) -> None:
        check_choice("data", "corpus", self.corpus, ("ptb", "wikitext-2"))
        check_choice("data", "mode", self.mode, ("bptt", "sentence"))
        check_at_least("data", "bptt", self.bptt, 1)
        check_at_least("data", "eval_batch_size", self.eval_batch_size, 1)
        check_at_least("data", "max_sentence_len", self.max_sentence_len, 0)
        if not self.drop_last and self.mode != "sentence":
            raise UsageError("data.drop_last = false applies to data.mode = \"sentence\" (BPTT streams have no "
                             "last batch to keep); remove it or use sentence mode")
        for key in ("train_fraction", "eval_fraction"):
            v = getattr(self, key)
            if not 0 < v <= 1:
                raise UsageError(f"data.{key} = {v!r} is out of range; use a value in (0, 1]")


def perplexity(loss: float) -> float:
    """exp(mean cross-entropy in nats); inf on overflow."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


class LanguageModelTask(TaskBase):
    """Base of ``lstm-lm`` and ``gpt``: data, training steps, evaluation batches, perplexity.
    Subclasses write ``build_model``, ``loss`` and ``eval_sums``."""

    unit = "words"
    headline = "ppl"

    def __init__(self, data: LMDataConfig, env: TaskEnv) -> None:
        self.data, self.env = data, env
        corpus = load_corpus(ensure_corpus(data.corpus, env.data_dir, allow_download=env.download))
        self.vocab_size = len(corpus.vocab)
        self.splits = {"train": corpus.train.head(data.train_fraction),
                       "valid": corpus.valid.head(data.eval_fraction), "test": corpus.test.head(data.eval_fraction)}
        self.sequence_length = data.bptt if data.mode == "bptt" else 1
        if data.mode == "bptt":
            self.stream: Any = BPTTTrainStream(self.splits["train"], env.global_batch, data.bptt, env.rank,
                                               env.world_size, env.accumulation)
        else:
            self.stream = SentenceTrainStream(self.splits["train"], env.global_batch, env.rank, env.world_size,
                                              env.accumulation, env.seed, data.max_sentence_len, data.drop_last)
        if self.stream.steps_per_epoch < 1:
            what = f" x bptt {data.bptt}" if data.mode == "bptt" else ""
            raise UsageError(f"the training split is too small for one step of global batch {env.global_batch}"
                             f"{what}; use a smaller train.batch_size or a larger data.train_fraction")

    def steps_per_epoch(self) -> int:
        return self.stream.steps_per_epoch

    def train_steps(self, epoch: int, start: int) -> Iterator[TrainStep]:
        for sb in self.stream.epoch(epoch, start):
            yield TrainStep(sb.micro, sb.global_tokens)

    def eval_batches(self, split: str, share: tuple[int, int]) -> Iterable[Any]:
        d, (rank, world) = self.data, share
        if d.mode == "bptt":
            return bptt_eval_batches(self.splits[split], d.eval_batch_size, d.bptt, rank, world)
        return sentence_eval_batches(self.splits[split], d.eval_batch_size, rank, world, d.max_sentence_len)

    def metrics(self, sums: torch.Tensor) -> dict[str, float]:
        """``sums`` = (summed cross-entropy in nats, target tokens) -> loss (nats per token), ppl."""
        loss = float(sums[0] / sums[1]) if sums[1] > 0 else math.nan
        return {"loss": loss, "ppl": perplexity(loss)}
