"""What a training checkpoint holds and how a trainer writes and reads it.

The file format and its safety (atomic writes, sha256 sidecar, ``weights_only``
loading) are :mod:`.checkpoint`'s. Here: the state of a run. ``model`` (plain
state_dict), ``optimizer`` (whole model, assembled by the strategy), ``schedule``,
``epoch`` / ``batch_index`` (the data position: the next step), ``units`` and
``train_time_s`` (throughput bookkeeping), ``task`` (the task's carried state, e.g.
the BPTT hidden state of the whole global batch). Rank 0 writes, or every rank for a sharded
strategy (a DCP folder); every rank calls :meth:`Checkpointer.save` (gathering the task state may
be a collective).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


from ..errors import TrainingStopped, UsageError
from . import checkpoint


@dataclass
class Position:
    """Where training is: optimizer steps done, the 1-based epoch of the next step, its index in
    that epoch, units (words, samples) of the global batches stepped through, training seconds."""

    step: int = 0
    epoch: int = 1
    batch_index: int = 0
    units: int = 0
    train_time_s: float = 0.0


class Checkpointer:
    """Saves and restores a run (model, optimizer, schedule, position, task state) in ``run_dir``."""

    def __init__(self, run_dir: Path, strategy, task, schedule, keep: int, is_main: bool) -> None:
        self.run_dir, self.strategy, self.task, self.schedule = Path(run_dir), strategy, task, schedule
        self.keep, self.is_main = keep, is_main
        self.last_saved = -1

    def save(self, pos: Position, gather) -> Path | None:
        """Write ``checkpoint-<step>.pt`` (rank 0), or ``checkpoint-<step>.dcp/`` (every rank, for a
        sharded strategy). ``gather``: the task state's all-reduce over the ranks, or None when they
        cannot be gathered. Every rank must call it. Raises TrainingStopped (no file written) when a
        parameter is not finite."""
        task_state = self.task.state_dict(gather)
        s = self.strategy
        bad = s.nonfinite_parameters()
        if bad:  # every rank agrees: all stop; never write a checkpoint one cannot resume from
            raise TrainingStopped(f"parameters {bad[:3]} are not finite at step {pos.step}; no checkpoint "
                                  f"written, the previous one is kept")
        if pos.step == self.last_saved:  # an epoch end on a checkpoint_every step: once
            return None
        self.last_saved = pos.step
        meta = {"schedule": self.schedule.state_dict(), "epoch": pos.epoch, "batch_index": pos.batch_index,
                "task": task_state, "units": pos.units, "train_time_s": pos.train_time_s,
                "precision": s.precision_state_dict(), "comm": s.comm_state_dict()}
        if s.sharded:
            return checkpoint.save_sharded(self.run_dir, s.sharded_state(), meta, pos.step, is_main=self.is_main,
                                           barrier=s.barrier, keep=self.keep)
        if not self.is_main:
            return None
        state = {"model": s.state_dict(), "optimizer": s.optimizer_state_dict(), **meta}
        return checkpoint.save(self.run_dir, state, pos.step, keep=self.keep)

    def restore(self, path: Path, state: dict | None = None) -> Position:
        """Load model, optimizer, schedule and task state (every rank) from ``path``, or from
        ``state`` (the loaded contents of ``path``, received from rank 0); return the position."""
        state = checkpoint.load(path) if state is None else state
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

        try:
            self._load_model_and_optimizer(Path(path), state)
        except (RuntimeError, KeyError, ValueError, CheckpointException) as e:
            raise UsageError(f"checkpoint {path} does not fit this model ({str(e).splitlines()[0][:120]}); "
                             f"resume with the config it was written with") from None
        self.schedule.load_state_dict(state["schedule"])
        self.strategy.load_precision_state_dict(state.get("precision", {}))
        self.strategy.load_comm_state_dict(state.get("comm", {}))
        legacy = {"hidden": state["hidden"]} if state.get("hidden") else {}  # format of paratrain <= 0.1 runs
        self.task.load_state_dict(state.get("task", legacy))
        return Position(state["step"], state["epoch"], state["batch_index"],
                        state.get("units", state.get("words", 0)), state.get("train_time_s", 0.0))

    def _load_model_and_optimizer(self, path: Path, state: dict) -> None:
        """Any checkpoint into any strategy: a DCP folder into a sharded strategy's shards (every rank
        reads its part), otherwise the whole state (a ``.pt`` file's, or a DCP folder read whole)."""
        from ..strategies.sharded import by_index, parameter_names, read_whole

        s = self.strategy
        sharded = s.sharded
        if state.get("dcp") and sharded:
            s.load_sharded(path)
            return
        if state.get("dcp"):
            whole = read_whole(path)
            model, optim = whole["model"], by_index(whole["optim"], parameter_names(s.module, s.optimizer))
        else:
            model, optim = state["model"], state["optimizer"]
        if sharded:
            s.load_whole(model, optim)
        else:
            s.load_state_dict(model)
            s.load_optimizer_state_dict(optim)
