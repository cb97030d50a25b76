"""Batching for language models, sharded per rank, with prefetch.

Two modes:

* **BPTT streams** (Zaremba et al. 2014; Mikolov's RNNLM): the token sequence
  is cut into B contiguous streams (columns); step i feeds rows
  ``[i*T, (i+1)*T)`` of every stream and the LSTM hidden state is carried from
  one step to the next.
* **Sentences**: each line (with ``<eos>`` in front as the start symbol and at
  the end as the last target) is one sample; a batch is padded to its longest
  sample and padding is masked out of the loss. Lines are reshuffled every
  epoch with a generator seeded by ``(seed, epoch)``, identical on every rank.

Sharding: with world_size W, accumulation K and global batch B, rank r owns the
``B/W`` columns (streams or sentences) ``[r*B/W, (r+1)*B/W)`` of every global
batch, cut into K micro-batches of ``B/(W*K)``. The union over ranks and
micro-batches is exactly the single-process batch; the global number of target
tokens of the step travels with it so that every rank can normalise its loss
by the *global* token count.
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from .corpus import Split
from .sharding import shard_range


@dataclass
class LMBatch:
    """One micro-batch of one rank.

    inputs, targets: (T, b) int64 token ids. mask: (T, b) bool, True where the
    target counts, or None when all count. hidden_key: index of the carried
    hidden state this micro-batch continues (BPTT), or None to start from zeros
    (sentences). num_tokens: number of counted targets.
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor | None
    hidden_key: int | None
    num_tokens: int

    def to(self, device: torch.device, non_blocking: bool = True) -> "LMBatch":
        if self.inputs.device == device:
            return self
        pin = non_blocking and device.type == "cuda"  # pinned host memory makes the copy truly asynchronous
        def mv(t):
            return None if t is None else (t.pin_memory() if pin else t).to(device, non_blocking=non_blocking)
        return LMBatch(mv(self.inputs), mv(self.targets), mv(self.mask), self.hidden_key, self.num_tokens)


@dataclass
class StepBatch:
    """Everything one rank needs for one optimizer step.

    micro: this rank's K micro-batches. global_tokens: counted targets of the
    whole global batch (all ranks, all micro-batches). index: position of the
    step in the epoch (for resume).
    """

    micro: list[LMBatch]
    global_tokens: int
    index: int


def batchify(ids: torch.Tensor, num_streams: int) -> torch.Tensor:
    """(N,) ids -> (N // B, B) with stream b in column b (trailing N % B tokens dropped)."""
    n = ids.numel() // num_streams
    return ids[: n * num_streams].view(num_streams, n).t().contiguous()


class BPTTTrainStream:
    """Training batches in BPTT-stream mode for one rank.

    Every step is a (T, B/(W*K)) window of each of this rank's K stream groups;
    ``steps_per_epoch = (N//B - 1) // T`` full windows (the ragged end is dropped,
    as in Zaremba et al.).
    """

    def __init__(self, split: Split, batch_size: int, bptt: int, rank: int, world_size: int,
                 accumulation: int = 1) -> None:
        data = batchify(split.ids, batch_size)  # (L, B)
        self.bptt = bptt
        self.steps_per_epoch = (data.size(0) - 1) // bptt
        per_rank = batch_size // world_size
        per_micro = per_rank // accumulation
        lo = rank * per_rank
        # one contiguous (L, b) tensor per micro-batch group
        self.groups = [data[:, lo + k * per_micro: lo + (k + 1) * per_micro].contiguous()
                       for k in range(accumulation)]
        self.global_tokens = batch_size * bptt

    def epoch(self, epoch: int, start: int = 0) -> Iterator[StepBatch]:
        T = self.bptt
        for i in range(start, self.steps_per_epoch):
            micro = [LMBatch(g[i * T:(i + 1) * T], g[i * T + 1:(i + 1) * T + 1], None, k, g.size(1) * T)
                     for k, g in enumerate(self.groups)]
            yield StepBatch(micro, self.global_tokens, i)


class SentenceTrainStream:
    """Training batches in sentence mode for one rank (padded, masked, reshuffled per epoch).

    ``drop_last`` (default): an epoch is ``num_lines // B`` global batches. Otherwise the last,
    shorter global batch of R < B lines is trained too: rank r takes lines
    ``shard_range(R, W, r)`` of it, cut into K micro-batches the same way, and a rank or micro-batch
    left without lines gets a padding micro-batch whose mask counts nothing (its forward and
    backward contribute zero), so that every rank runs the same steps and micro-batches and the
    step still equals the single-process one on the same R lines."""

    def __init__(self, split: Split, batch_size: int, rank: int, world_size: int,
                 accumulation: int = 1, seed: int = 0, max_len: int = 0, drop_last: bool = True) -> None:
        self.split, self.B, self.seed, self.max_len = split, batch_size, seed, max_len
        self.steps_per_epoch = split.num_lines // batch_size if drop_last else -(-split.num_lines // batch_size)
        self.rank, self.W, self.K = rank, world_size, accumulation
        self.lengths = self._lengths(torch.arange(split.num_lines))

    def _lengths(self, lines: torch.Tensor) -> torch.Tensor:
        n = self.split.starts[lines + 1] - self.split.starts[lines]  # words + <eos>
        return n.clamp(max=self.max_len) if self.max_len else n

    def order(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.split.num_lines, generator=g)

    def epoch(self, epoch: int, start: int = 0) -> Iterator[StepBatch]:
        order = self.order(epoch)
        for i in range(start, self.steps_per_epoch):
            glob = order[i * self.B:(i + 1) * self.B]
            total = int(self.lengths[glob].sum())
            lo, hi = shard_range(len(glob), self.W, self.rank)
            mine = glob[lo:hi]
            micro = []
            for k in range(self.K):
                a, b = shard_range(len(mine), self.K, k)
                micro.append(pad_sentences(self.split, mine[a:b], self.max_len) if b > a
                             else self._padding(glob[:1]))
            yield StepBatch(micro, total, i)

    def _padding(self, line: torch.Tensor) -> LMBatch:
        """A micro-batch of one line whose mask counts nothing (a rank without lines in a short batch)."""
        mb = pad_sentences(self.split, line, self.max_len)
        return LMBatch(mb.inputs, mb.targets, torch.zeros_like(mb.mask), None, 0)


def pad_sentences(split: Split, lines: torch.Tensor, max_len: int = 0) -> LMBatch:
    """Pad lines into (T, b): inputs ``<eos> w1 .. wn``, targets ``w1 .. wn <eos>``.

    ``<eos>`` (the split's last id of each line) doubles as the start symbol.
    Lines longer than ``max_len`` (> 0) are cut to their first ``max_len`` targets.
    """
    starts, ids = split.starts, split.ids
    seqs = [ids[int(starts[j]):int(starts[j + 1])] for j in lines.tolist()]
    if max_len:
        seqs = [s[:max_len] for s in seqs]
    T = max(len(s) for s in seqs)
    b = len(seqs)
    eos = int(ids[int(starts[1]) - 1])
    targets = torch.full((T, b), eos, dtype=torch.int64)
    mask = torch.zeros((T, b), dtype=torch.bool)
    for j, s in enumerate(seqs):
        targets[: len(s), j] = s
        mask[: len(s), j] = True
    inputs = torch.cat([torch.full((1, b), eos, dtype=torch.int64), targets[:-1]])
    return LMBatch(inputs, targets, mask, None, int(mask.sum()))


def bptt_eval_batches(split: Split, eval_batch_size: int, bptt: int, rank: int,
                      world_size: int) -> Iterator[LMBatch]:
    """Every prediction of the split exactly once, for this rank's share of the streams.

    The N-1 (input, target) pairs are cut into ``eval_batch_size`` contiguous
    streams of ``ceil((N-1)/B)`` pairs (the last one shorter, masked); rank r
    evaluates streams ``[r*B//W, (r+1)*B//W)`` (possibly none), carrying the
    hidden state (key 0) over windows of ``bptt``. The result does not depend on W.
    """
    n_pairs = split.ids.numel() - 1
    B = eval_batch_size
    L = -(-n_pairs // B)
    pad = L * B - n_pairs
    inp = torch.cat([split.ids[:-1], split.ids.new_zeros(pad)]).view(B, L).t()
    tgt = torch.cat([split.ids[1:], split.ids.new_zeros(pad)]).view(B, L).t()
    valid = torch.cat([torch.ones(n_pairs, dtype=torch.bool), torch.zeros(pad, dtype=torch.bool)]).view(B, L).t()
    lo, hi = shard_range(B, world_size, rank)
    if hi == lo:
        return
    inp, tgt, valid = (x[:, lo:hi].contiguous() for x in (inp, tgt, valid))
    for i in range(0, L, bptt):
        m = valid[i:i + bptt]
        n = int(m.sum())
        yield LMBatch(inp[i:i + bptt], tgt[i:i + bptt], None if n == m.numel() else m, 0, n)


def sentence_eval_batches(split: Split, eval_batch_size: int, rank: int, world_size: int,
                          max_len: int = 0) -> Iterator[LMBatch]:
    """Every line of the split once: rank r takes lines ``r, r+W, ...`` in batches."""
    mine = torch.arange(rank, split.num_lines, world_size)
    for i in range(0, len(mine), eval_batch_size):
        yield pad_sentences(split, mine[i:i + eval_batch_size], max_len)


class Prefetcher:
    """Iterate ``source`` in a background thread, ``depth`` items ahead, moving
    each item to ``device`` (pinned, non-blocking copies on CUDA), so that input
    preparation overlaps the previous step. Exceptions are re-raised in the consumer.
    """

    _END = object()

    def __init__(self, source: Iterable, device: torch.device, depth: int = 2) -> None:
        self.q: queue.Queue = queue.Queue(maxsize=depth)
        self.device = device
        self._stop = threading.Event()
        self.t = threading.Thread(target=self._run, args=(iter(source),), daemon=True)
        self.t.start()

    def _move(self, item):
        return item if self.device.type == "cpu" else move_to(item, self.device)

    def _run(self, it: Iterator) -> None:
        try:
            for item in it:
                if self._stop.is_set():
                    return
                self.q.put(self._move(item))
            self.q.put(self._END)
        except BaseException as e:  # handed to the consumer
            self.q.put(e)

    def __iter__(self):
        return self

    def __next__(self):
        item = self.q.get()
        if item is self._END:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        while self.t.is_alive():
            try:
                self.q.get_nowait()
            except queue.Empty:
                self.t.join(timeout=0.01)


def move_to(obj, device: torch.device, non_blocking: bool = True):
    """``obj`` with its tensors on ``device``: tensors (pinned first on CUDA, so the copy is
    asynchronous), objects with a ``to(device)`` method (:class:`LMBatch`), dataclasses such
    as a task's :class:`~paratrain.tasks.TrainStep` (field by field), tuples, lists, dicts."""
    import dataclasses

    if isinstance(obj, torch.Tensor):
        if obj.device == device:
            return obj
        pin = non_blocking and device.type == "cuda" and obj.device.type == "cpu"
        return (obj.pin_memory() if pin else obj).to(device, non_blocking=non_blocking)
    if isinstance(obj, LMBatch):
        return obj.to(device, non_blocking)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: move_to(getattr(obj, f.name), device, non_blocking)
                                           for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, (tuple, list)):
        moved = [move_to(x, device, non_blocking) for x in obj]
        return type(obj)(*moved) if hasattr(obj, "_fields") else type(obj)(moved)
    if isinstance(obj, dict):
        return {k: move_to(v, device, non_blocking) for k, v in obj.items()}
    return obj


class _Direct:
    """The CPU counterpart of :class:`Prefetcher`: iterate in this thread."""

    def __init__(self, batches) -> None:
        self.it = iter(batches)

    def __iter__(self):
        return self.it

    def close(self) -> None:
        pass


def batch_source(batches, device: torch.device):
    """An iterable with ``close()`` over ``batches``: a :class:`Prefetcher` on CUDA (a background
    thread prepares and copies the next batch while this one runs), the batches themselves on CPU
    (they are views of tensors in memory and every core is computing: a thread would only add GIL
    hand-offs; measured in benchmarks/RESULTS.md)."""
    return Prefetcher(batches, device) if device.type == "cuda" else _Direct(batches)
