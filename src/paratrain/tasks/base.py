"""The Task protocol: what ``paratrain train`` needs to train any model with every feature.

A task is made by a *factory*, ``factory(section, env) -> Task``, named by the
recipe (``[task] entry = "..."``) or ``--task``: a built-in name (``lstm-lm``,
``gpt``, ``digits-cnn``), ``package.module:factory`` or ``path/to/file.py:factory``.

* ``section`` (dict): the recipe's ``[task]`` table without ``entry``, plus the
  ``[data]`` and ``[model]`` tables under the keys ``"data"`` and ``"model"``
  (validated dataclasses when the factory declares them in a
  ``config_sections = {"data": DataCls, "model": ModelCls}`` attribute, plain dicts otherwise).
* ``env`` (:class:`TaskEnv`): this rank's place in the job and the batch arithmetic.

The trainer calls only the methods below. Per optimizer step (the data-parallel
step of DESIGN.md): ``train_steps`` yields this rank's :class:`TrainStep`;
``loss(model, micro_batch)`` runs once per micro-batch with the strategy's
wrapped model; the strategy merges, clips and updates.

**Normalisation contract.** ``loss`` returns ``(loss_sum, count)``: the *sum* of
the per-unit losses of the micro-batch (per token for a language model, per sample
for a classifier) and the number of units in it. The trainer divides ``loss_sum`` by
``TrainStep.global_count / num_replicas``, so that after the strategy averages over
replicas the gradient is that of the **per-unit mean over the global batch**,
exactly what one device computes on the whole batch (also when ranks hold different
numbers of units, e.g. padded sentences). ``count`` feeds the training-loss log.

**Carried state** (BPTT hidden state) lives in the task: ``start_epoch`` resets it,
``state_dict(all_reduce)`` returns it for checkpoints (``all_reduce``, when not None,
sums a tensor over the data-parallel ranks, collective: every rank calls
``state_dict``), ``load_state_dict`` takes it back (any world_size may have written it).
The data position (epoch, step index) is the trainer's: ``train_steps(epoch, start)``
must yield the same steps for the same arguments.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Protocol, runtime_checkable

import torch
from torch import nn

from ..errors import UsageError


@dataclass(frozen=True)
class TaskEnv:
    """What a task factory is told about the run.

    rank, world_size: this rank among the data-parallel ranks (parameter server:
    the worker index among the workers). accumulation: micro-batches per optimizer
    step on this rank. global_batch: samples (sequences, streams, images) per
    optimizer step over all ranks (``train.batch_size``). Towers are invisible to
    tasks: the strategy's wrapped model splits each micro-batch over them.
    """

    rank: int = 0
    world_size: int = 1
    accumulation: int = 1
    global_batch: int = 1
    seed: int = 0
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32
    data_dir: str | None = None
    download: bool = False  # the launching process checking the run: a task may fetch missing data

    @property
    def per_rank(self) -> int:
        """Samples of the global batch on this rank."""
        return self.global_batch // self.world_size

    @property
    def micro_batch(self) -> int:
        """Samples per micro-batch."""
        return self.per_rank // self.accumulation

    def micro_ranges(self) -> list[tuple[int, int]]:
        """[start, stop) of each of this rank's micro-batches within the global batch: rank r owns
        ``[r*B/W, (r+1)*B/W)``, cut into ``accumulation`` contiguous pieces. The union over ranks and
        micro-batches is exactly ``[0, B)``."""
        lo, b = self.rank * self.per_rank, self.micro_batch
        return [(lo + k * b, lo + (k + 1) * b) for k in range(self.accumulation)]


@dataclass
class TrainStep:
    """This rank's part of one optimizer step.

    micro_batches: ``env.accumulation`` objects, each passed to ``Task.loss``.
    global_count: units (tokens, samples) the loss is averaged over in the *global*
    batch (all ranks, all micro-batches; the same number on every rank).
    """

    micro_batches: list
    global_count: float


@runtime_checkable
class Task(Protocol):
    """A trainable model with its data (see the module docstring).

    Attributes: ``unit``, what throughput counts (``"words"``, ``"samples"``);
    ``batch_dim``, the batch dimension of the model's tensor inputs (towers split along
    it); ``headline``, the metric printed after an evaluation (a key of :meth:`metrics`);
    ``sequence_length``, T of ``train.convention = "sum_over_time"`` (1 for non-sequences).

    Methods (every rank calls them; none is collective except ``state_dict`` with an
    ``all_reduce``): ``build_model()``, the model (the trainer sets its dtype and device);
    ``steps_per_epoch()``; ``train_steps(epoch, start)``, this rank's steps of epoch
    ``epoch`` (1-based) from index ``start``; ``loss(model, micro_batch)`` ->
    ``(loss_sum, count)`` (see the normalisation contract); ``eval_batches(split, share)``,
    this rank's evaluation batches of ``"valid"`` or ``"test"`` for ``share`` = (index,
    count) (a new pass: reset any evaluation state); ``eval_sums(model, batch)`` -> a
    float64 vector of sums the trainer all-reduces; ``metrics(sums)`` -> named numbers,
    ``"loss"`` included; ``start_epoch``, ``state_dict``, ``load_state_dict``: carried state.
    """

    unit: str
    batch_dim: int
    headline: str
    sequence_length: int

    def build_model(self) -> nn.Module: ...

    def steps_per_epoch(self) -> int: ...

    def train_steps(self, epoch: int, start: int) -> Iterator[TrainStep]: ...

    def loss(self, model: nn.Module, micro_batch: Any) -> tuple[torch.Tensor, Any]: ...

    def eval_batches(self, split: str, share: tuple[int, int]) -> Iterable[Any]: ...

    def eval_sums(self, model: nn.Module, batch: Any) -> torch.Tensor: ...

    def metrics(self, sums: torch.Tensor) -> dict[str, float]: ...

    def start_epoch(self, epoch: int) -> None: ...

    def state_dict(self, all_reduce: Callable[[torch.Tensor], torch.Tensor] | None) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


REQUIRED = ("build_model", "steps_per_epoch", "train_steps", "loss", "eval_batches", "eval_sums", "metrics")


class TaskBase:
    """Defaults for the optional parts of :class:`Task` (no carried state, batch dimension 0,
    ``samples`` as the unit). Subclass it and write the required methods."""

    unit = "samples"
    batch_dim = 0
    headline = "loss"
    sequence_length = 1

    def start_epoch(self, epoch: int) -> None:
        """Called before the first step of every epoch (also a resumed one)."""

    def state_dict(self, all_reduce: Callable[[torch.Tensor], torch.Tensor] | None) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def pipeline_input(self, micro_batch: Any) -> torch.Tensor:
        """What a pipeline's first stage reads: the first tensor of a tuple/list micro-batch
        ((inputs, targets, ...)), or the micro-batch itself if it is a tensor; rows along dim 0.
        UsageError for other micro-batches (write your own ``pipeline_input``/``pipeline_chunk``)."""
        first = micro_batch[0] if isinstance(micro_batch, (tuple, list)) and micro_batch else micro_batch
        if not isinstance(first, torch.Tensor):
            raise UsageError(f"a pipeline's first stage cannot be fed a micro-batch of type "
                             f"{type(micro_batch).__name__}: give your task pipeline_input(mb) and "
                             f"pipeline_chunk(mb, lo, hi)")
        return first

    def pipeline_chunk(self, micro_batch: Any, lo: int, hi: int) -> Any:
        """Rows [lo, hi) (dim 0) of every tensor of a tuple/list micro-batch, or of a tensor one, as a
        micro-batch of the same kind (what the task's ``loss`` gets for one pipeline micro-batch)."""
        if isinstance(micro_batch, torch.Tensor):
            return micro_batch[lo:hi]
        return type(micro_batch)(t[lo:hi] if isinstance(t, torch.Tensor) else t for t in micro_batch)


def check_task(task: Any, entry: str) -> None:
    """Raise UsageError naming ``entry`` and every required method ``task`` lacks."""
    missing = [m for m in REQUIRED if not callable(getattr(task, m, None))]
    if missing:
        raise UsageError(f"task {entry!r} returned {type(task).__name__}, which lacks "
                         f"{', '.join(missing)}; a Task needs {', '.join(REQUIRED)} (see paratrain.tasks.Task)")


def optional(task: Any, name: str) -> Any:
    """``task``'s attribute ``name``, or :class:`TaskBase`'s default for it (bound to ``task``)."""
    value = getattr(task, name, None)
    if value is not None:
        return value
    default = getattr(TaskBase, name)
    return default.__get__(task) if callable(default) else default

