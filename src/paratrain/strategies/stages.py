"""How strategy ``pipeline`` cuts a model into stages and feeds a task's micro-batches to them.

The stages: the model's own ``pipeline_stages(S)`` (with ``blocks=[n_0, ...]`` for the stage plan
``dist.pipeline_split``), else, for an ``nn.Sequential``, its children in S consecutive groups. The
micro-batches: the task's own ``pipeline_input(mb)`` (what stage 0 reads, rows along dim 0) and
``pipeline_chunk(mb, lo, hi)`` (rows [lo, hi) as a micro-batch of its own), else
:class:`~paratrain.tasks.TaskBase`'s, which take batches of tensors ((inputs, targets, ...) tuples).
Refused in one line: a model that says why it cannot be cut (``no_pipeline_reason``), a model with
BatchNorm, a task whose batch dimension is not 0.
"""
from __future__ import annotations

from typing import Any, Callable

from torch import nn

from ..errors import UsageError


def split_blocks(text: str, stages: int) -> list[int] | None:
    """``dist.pipeline_split`` ("3,1": blocks per stage) as a list of S counts, or None for "".
    UsageError for a count that is not a whole number >= 0 or a list of another length than S."""
    if not text.strip():
        return None
    try:
        blocks = [int(x) for x in text.split(",")]
    except ValueError:
        blocks = [-1]
    if len(blocks) != stages or min(blocks) < 0:
        raise UsageError(f"dist.pipeline_split = {text!r}: give {stages} whole numbers >= 0 separated by commas, "
                         f"the blocks of each of the dist.pipeline_stages = {stages} stages (e.g. \"3,1\")")
    return blocks


def even_blocks(n: int, stages: int) -> list[int]:
    """n blocks over ``stages`` stages as evenly as possible, earlier stages taking the remainder."""
    per, extra = divmod(n, stages)
    return [per + (1 if s < extra else 0) for s in range(stages)]


def sequential_stages(seq: nn.Sequential, stages: int, blocks: list[int] | None = None) -> list[nn.Module]:
    """``seq``'s children in ``stages`` consecutive ``nn.Sequential`` groups (sharing ``seq``'s
    modules), ``blocks[s]`` children in group s (default :func:`even_blocks`). ValueError when the
    counts do not add up to ``len(seq)`` or a stage would be empty."""
    n = len(seq)
    blocks = even_blocks(n, stages) if blocks is None else blocks
    if stages < 2 or len(blocks) != stages or sum(blocks) != n or min(blocks) < 1:
        raise ValueError(f"layers per stage {blocks} for {stages} stages of an nn.Sequential of {n} layers: give "
                         f"{stages} counts >= 1 that add up to {n}")
    out, start = [], 0
    for k in blocks:
        out.append(seq[start:start + k])
        start += k
    return out


def cut_stages(module: nn.Module, stages: int, split: str = "") -> list[nn.Module]:
    """The S = ``stages`` stage modules of ``module`` (sharing its parameters) under the stage plan
    ``split`` (``dist.pipeline_split``). UsageError, one line, when the model cannot be cut so."""
    reason = getattr(module, "no_pipeline_reason", None)
    if reason:
        raise UsageError(f"strategy 'pipeline' does not run {type(module).__name__}: {reason}; use allreduce, fsdp "
                         f"or zero1")
    bn = next((n for n, m in module.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)), None)
    if bn is not None:
        raise UsageError(f"strategy 'pipeline' does not run a model with BatchNorm ({bn or type(module).__name__}): "
                         f"each micro-batch would be normalised with its own statistics, not the batch's; use "
                         f"allreduce, fsdp or zero1")
    blocks = split_blocks(split, stages)
    where = f"dist.pipeline_stages = {stages}" + (f", dist.pipeline_split = {split!r}" if blocks else "")
    try:
        if hasattr(module, "pipeline_stages"):
            return list(module.pipeline_stages(stages, **({"blocks": blocks} if blocks else {})))
        if isinstance(module, nn.Sequential):
            return sequential_stages(module, stages, blocks)
    except ValueError as e:
        raise UsageError(f"{where}: {e}") from None
    except TypeError:
        raise UsageError(f"dist.pipeline_split needs {type(module).__name__}.pipeline_stages to take "
                         f"blocks=[blocks per stage]; remove dist.pipeline_split") from None
    raise UsageError(f"strategy 'pipeline' needs the model to cut itself into stages: {type(module).__name__} is "
                     f"not an nn.Sequential and has no pipeline_stages(num_stages) method")


def task_hooks(task: Any) -> tuple[Callable[[Any], Any], Callable[[Any, int, int], Any]]:
    """``(pipeline_input, pipeline_chunk)`` of ``task``: its own, else TaskBase's defaults, which
    UsageError refuses for a task whose batch dimension is not 0 (the schedule splits along dim 0)."""
    from ..tasks.base import TaskBase, optional

    names = ("pipeline_input", "pipeline_chunk")
    own = [getattr(type(task), k, None) not in (None, getattr(TaskBase, k)) for k in names]
    if not all(own) and getattr(task, "batch_dim", 0) != 0:
        raise UsageError(f"strategy 'pipeline' splits micro-batches along dimension 0; task "
                         f"{type(task).__name__} has batch_dim {task.batch_dim}: give it pipeline_input / "
                         f"pipeline_chunk that lay rows along dimension 0")
    return optional(task, names[0]), optional(task, names[1])


def pipeline_refusal(task: Any, stages: int, split: str = "") -> str | None:
    """Why ``task``'s model does not run as a pipeline of ``stages`` stages (one line, from
    :func:`cut_stages` or :func:`task_hooks`, e.g. a model with BatchNorm, or one whose blocks are not a
    sequence), or None where it does. Builds the model on the meta device (its structure alone) and
    runs nothing."""
    import torch

    try:
        with torch.device("meta"):
            model = task.build_model()
        cut_stages(model, stages, split)
        task_hooks(task)
    except UsageError as e:
        return str(e)
    return None
