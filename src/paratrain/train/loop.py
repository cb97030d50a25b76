"""The trainer: one loop for every strategy and every task (``fit``).

Per optimizer step, the data-parallel step of DESIGN.md: this rank's shard of
the global batch comes from the task (``train_steps``); the learning rate is set;
:meth:`~paratrain.strategies.base.Strategy.train_step` runs forward and backward
on each micro-batch (the task's loss, normalised by the global count), merges the
gradients, clips the global norm and updates. The loop knows no strategy and no
model: what differs is a strategy method, what is model-specific is the task's.

Around the step, each part in its own module: :mod:`.guards` (faults, stragglers,
non-finite gradients), :mod:`.bookkeeping` (losses, throughput, step timing,
metric records, summary), :mod:`.evaluation`, :mod:`.checkpointing`; and the
watchdog (:mod:`paratrain.watchdog`) that names the rank a collective waited for.
Validation after every epoch (and every ``eval_every`` steps), checkpoints every
``checkpoint_every`` steps and at epoch end, test metrics at the end.
"""
from __future__ import annotations

import os

import time
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch

from .. import tasks
from ..bench.memory import ddp_bucket_bytes, track_memory
from ..bench.mfu import count_flops
from ..config import Config
from ..consistency import check_ranks, check_sync, config_text
from ..data import batch_source
from ..devices import Placement, apply_memory_controls, apply_placement, format_placement_log
from ..env import DistEnv
from ..errors import UsageError
from ..faults import poisoned
from ..seeding import hash_seed
from ..strategies import STRATEGIES
from ..watchdog import Watchdog
from . import evaluation
from .bookkeeping import Bookkeeper
from .checkpointing import Checkpointer, Position
from .guards import StepGuards
from .optim import LRSchedule, build_optimizer, effective_lr_clip, effective_weight_decay, scaling_factor


def _restart() -> int:
    """How many times torchrun has restarted this worker group (0 on the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def stream_seed(seed: int, rank: int, step: int, tower: int = 0) -> int:
    """A 63-bit seed for the random numbers of (``seed``, ``rank``, ``tower``, ``step``)
    (:func:`paratrain.seeding.hash_seed`: no two share or shift into each other's stream)."""
    return hash_seed(seed, rank, tower, step)


def seed_step(seed: int, device: torch.device) -> None:
    """Seed the generators a step draws from (dropout masks): the CPU one, and the device's on CUDA.
    Not ``torch.manual_seed``: without a started CUDA it records a stack trace for lazy CUDA seeding
    on every call (0.1-0.5 ms per step on this CPU)."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)


class Trainer:
    """Builds task, model, optimizer, schedule and strategy for one rank and runs :meth:`fit`.

    Every rank constructs one and calls :meth:`fit` (collective). Rank 0 alone prints
    and writes into ``run_dir``. ``strategy_options``: extra constructor options of the
    strategy (what its ``init_process`` returned, e.g. a parameter server's layout).
    """

    def __init__(self, cfg: Config, env: DistEnv, run_dir: Path, data_dir: str | None = None,
                 verbose: bool = True, strategy_options: dict | None = None) -> None:
        self.cfg, self.env, self.run_dir, self.verbose = cfg, env, Path(run_dir), verbose
        t = cfg.train
        cls = STRATEGIES[cfg.dist.strategy]
        options = {**cls.options(cfg), **(strategy_options or {}), "timing": True, "skip_nonfinite": True,
                   "placed": bool(cfg.placement), "precision": t.precision}
        self.strategy = cls(env, **options)
        share, shares = self.strategy.data_share()
        self.task_env = tasks.TaskEnv(rank=share, world_size=shares, accumulation=t.accumulation,
                                      global_batch=t.batch_size, seed=t.seed, device=self.strategy.device,
                                      dtype=getattr(torch, t.dtype), data_dir=data_dir)
        self.task = tasks.build(cfg.task.entry, cfg.task_section(), self.task_env)
        self.strategy.task = self.task  # (pipeline: how a micro-batch is fed to stage 0 and cut)
        torch.manual_seed(t.seed)  # same initial parameters on every rank and in single
        model = self.task.build_model().to(self.task_env.dtype)
        self.placement: list[Placement] = []
        if cfg.placement:  # model parallel: modules on the plan's devices, activations follow
            self.placement = apply_placement(model, dict(cfg.placement), str(env.device), cfg.dist.strict_placement)
        if cfg.model_value("activation_checkpointing", False):
            self._checkpoint_activations(model)
        T = tasks.optional(self.task, "sequence_length")
        lr, self.clip = effective_lr_clip(t, T)
        optimizer = build_optimizer(model.parameters(), t, lr, effective_weight_decay(t, T) if T else None)
        self.schedule = LRSchedule(t, lr, scaling_factor(t.lr_scaling, t.batch_size, t.ref_batch_size or t.batch_size))
        for note in apply_memory_controls(env.device, cfg.dist.memory_fraction, cfg.dist.expandable_segments):
            self.say(note)
        self.strategy.setup(model, optimizer, batch_dim=tasks.optional(self.task, "batch_dim"),
                            sync_batchnorm=bool(cfg.model_value("sync_batchnorm", False)))
        self.reduce, self.gather = self._collectives()
        if env.world_size > 1:  # every rank: same model, config and versions (collective)
            check_ranks(self.strategy.module, config_text(cfg), self.strategy.all_gather_object)
        self.strategy.arm_timeouts(t.timeout_s)  # set-up is over: collectives time out after train.timeout_s
        if cfg.dist.log_placement:
            self._log_placement()
        self.pos = Position()
        self._steps_here = 0  # steps this process has run (a resumed run starts at 0 again)
        self.results: dict[str, float] = {}
        self.book = Bookkeeper(self.run_dir, env, self.strategy, tasks.optional(self.task, "unit"), t, self.reduce,
                               verbose)
        self.guards = StepGuards(cfg, env, self.strategy.clock, self.reduce, self.book, self.say)
        self.checkpointer = Checkpointer(self.run_dir, self.strategy, self.task, self.schedule, t.keep_checkpoints,
                                         env.is_main)
        self.steps_per_epoch = self.task.steps_per_epoch()
        # ranks that wait for each other: name the missing rank when a collective times out
        self.watchdog = Watchdog(env.rank, env.world_size if self.strategy.lockstep else 1, t.timeout_s)

    def _collectives(self) -> tuple[Callable | None, Callable | None]:
        """(reduce(tensor, op) over the ranks that step together, or None; the sum used to gather the
        task's carried state for checkpoints, or None when the ranks cannot be gathered)."""
        s = self.strategy
        if not s.lockstep:
            return None, None
        if self.env.world_size == 1:
            return None, lambda t: t
        return s.all_reduce, lambda t: s.all_reduce(t, "sum")

    # ---- small things ---------------------------------------------------------------------------
    @property
    def step(self) -> int:
        return self.pos.step

    @property
    def total_steps(self) -> int:
        t = self.cfg.train
        full = t.epochs * self.steps_per_epoch
        return min(full, t.max_steps) if t.max_steps else full

    def _checkpoint_activations(self, model: torch.nn.Module) -> None:
        """``model.activation_checkpointing``: checkpoint each block (:mod:`paratrain.models.checkpointing`)."""
        from ..models import checkpointing

        try:
            names = checkpointing.enable(model)
        except ValueError as e:
            raise UsageError(f"model.activation_checkpointing: {e}") from None
        self.say(f"activation checkpointing: {len(names)} block(s) ({', '.join(names[:4])}"
                 f"{', ...' if len(names) > 4 else ''})")

    def dropout_seed(self, step: int) -> int:
        """Seed of step ``step``'s random numbers (dropout masks): a function of (seed, rank, step)
        only, so ranks draw different masks and a resumed run draws the same ones (no RNG state to save)."""
        return stream_seed(self.cfg.train.seed, self.env.rank, step)

    def say(self, msg: str) -> None:
        if self.env.is_main and self.verbose:
            from tqdm import tqdm

            tqdm.write(f"[rank {self.env.rank}] {msg}")

    def _log_placement(self) -> None:
        """Print and write (placement.txt) which device holds each parameter, and the towers or servers."""
        rows = self.placement or [Placement(n, str(p.device), p.numel(), p.numel() * p.element_size())
                                  for n, p in self.strategy.module.named_parameters()]
        text = "\n".join([format_placement_log(rows), *self.strategy.describe()])
        if self.env.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)  # a Trainer used directly may name a new run dir
            (self.run_dir / "placement.txt").write_text(text + "\n")
            self.say("placement:\n" + text)

    # ---- checkpoints and evaluation ----------------------------------------------------------------
    def save(self) -> None:
        """Checkpoint the run (every rank calls it; rank 0 writes)."""
        self.book.timer.reset_arrival()  # time spent here is not waiting in the next step's collective
        self.watchdog.at(self.pos.step, "checkpoint")
        self.checkpointer.save(self.pos, self.gather)

    def restore(self, path: Path, state: dict | None = None) -> None:
        """Load model, optimizer, schedule, position and task state (every rank) from ``path``, or from
        ``state``, its contents as rank 0 loaded them."""
        self.pos = self.checkpointer.restore(path, state)
        self.book.start_interval(self.pos)
        p = self.pos
        restart = _restart()
        self.say((f"restart {restart} of {self.cfg.dist.max_restarts}: resuming from step {p.step} ({path.name})"
                  if restart else f"resumed from {path.name}: step {p.step}, epoch {p.epoch}, batch {p.batch_index}"))
        self.book.write("resume", p.step, epoch=p.epoch, batch_index=p.batch_index, checkpoint=path.name)

    def resume_from_rank0(self, wanted: bool) -> None:
        """Resume every rank from rank 0's newest checkpoint, sent over the process group: nodes
        without a shared filesystem hold no checkpoint of their own (only rank 0 writes them), and
        rank 0 alone decides whether there is one to resume (``wanted``: ``should_resume`` there).
        Every rank must call it."""
        from .checkpoint import newest_loadable

        mine = None
        if self.env.is_main and wanted:
            path, state = newest_loadable(self.run_dir, warn=lambda m: None, mmap=False)  # the launcher warned
            mine = (path.name, state)
        name, state = self.strategy.broadcast_object(mine) or (None, None)
        if state is not None:
            self.restore(self.run_dir / name, state)
        else:
            self.say_fresh_restart()

    def say_fresh_restart(self) -> None:
        """The line of a restarted group that found no checkpoint (nothing on a first attempt)."""
        if _restart():
            self.say(f"restart {_restart()} of {self.cfg.dist.max_restarts}: no checkpoint yet: starting from step 0")

    def evaluate(self, split: str) -> float:
        """The task's metrics of a whole split (recorded as ``<split>_<name>``); returns the mean
        loss. Every rank must call it (a collective where ranks step together)."""
        self.book.timer.reset_arrival()
        self.watchdog.at(self.pos.step, "evaluation")
        metrics = evaluation.evaluate(self.task, self.strategy, split, self.reduce)
        named = {f"{split}_{k}": v for k, v in metrics.items()}
        self.results.update(named)
        self.book.write(split, self.pos.step, epoch=self.pos.epoch, **named)
        where = f"epoch {self.pos.epoch}" if self.pos.batch_index else f"end of epoch {self.pos.epoch - 1}"
        self.say(f"step {self.pos.step} ({where}): "
                 f"{evaluation.describe(split, tasks.optional(self.task, 'headline'), metrics)}")
        return metrics["loss"]

    # ---- training ------------------------------------------------------------------------------------
    def _loss_fn(self, global_count: float, poison: bool) -> Callable:
        """The step's loss: the task's summed loss over a micro-batch divided by ``global_count /
        num_replicas``, so that the merged gradient is that of the per-unit mean over the global batch."""
        norm = global_count / self.strategy.num_replicas
        task, book = self.task, self.book

        def loss_fn(model: torch.nn.Module, micro_batch: Any) -> torch.Tensor:
            loss_sum, count = task.loss(model, micro_batch)
            book.add_loss(loss_sum, count)
            return loss_sum / norm

        return poisoned(loss_fn) if poison else loss_fn

    def run_epoch(self, bar) -> bool:
        """Train from the current position to the end of the epoch or of training. True if the epoch ended."""
        pos, s = self.pos, self.strategy
        if pos.batch_index == 0:
            tasks.optional(self.task, "start_epoch")(pos.epoch)
        source = batch_source(self.task.train_steps(pos.epoch, pos.batch_index), s.device)  # GPU: prefetched
        clock, it = s.clock, iter(source)
        lr = self.schedule.lr(pos.step, pos.epoch)
        self.book.resume_clock()
        try:
            while True:
                self.watchdog.at(pos.step, "before the step")
                m0 = clock.mark()
                step = next(it, None)  # 1-2. this rank's shard of the global batch
                if step is None:
                    break
                spans = [("data", m0, clock.mark())]
                lr = self.schedule.apply(s.optimizer, pos.step, pos.epoch)
                seed_step(self.dropout_seed(pos.step), s.device)
                extra, poison = self.guards.before_step(pos.step)
                self.watchdog.at(pos.step, "gradient all-reduce")
                # 3-6. forward/backward per micro-batch, merge, clip, update (the strategy's one implementation)
                run = partial(s.train_step, step.micro_batches, self._loss_fn(step.global_count, poison), self.clip)
                if pos.step + 1 == self.cfg.train.track_memory_step:
                    res, self.book.tracked_memory = track_memory(run, s.module, s.state_optimizers(),
                                                                  ddp_bucket_bytes(s.engine))
                elif self.book.flops_per_step is None and self._steps_here >= 1:
                    # from this process' second step (the first may set up: a pipeline infers its shapes): model FLOPs
                    res, self.book.flops_per_step = count_flops(run)
                else:
                    res = run()
                self._steps_here += 1
                if res.skipped:
                    self.guards.nonfinite(pos.step, res.loss, s.scaler.get_scale() if s.scaler is not None else None)
                else:
                    self.guards.finite(pos.step, res.loss)
                pos.step, pos.batch_index, pos.units = pos.step + 1, pos.batch_index + 1, pos.units + step.global_count
                if bar is not None:
                    bar.update(1)
                self.book.step_done(pos.step - 1, m0, clock.mark(), spans + extra + res.spans, res.collective)
                stop = s.finished(pos.step, self.total_steps)
                self._after_step(lr, bar, stop)
                if stop:
                    break
        finally:
            source.close()
        return pos.batch_index >= self.steps_per_epoch

    def _after_step(self, lr: float, bar, stop: bool) -> None:
        """Replica check, the interval's metrics record, and a due evaluation or checkpoint."""
        pos, t, d = self.pos, self.cfg.train, self.cfg.dist
        if d.check_sync_every and self.reduce is not None and self.strategy.synchronous \
                and pos.step % d.check_sync_every == 0:
            self.watchdog.at(pos.step - 1, "logging all-reduce")
            check_sync(self.strategy.module, self.strategy.all_reduce, self.env.rank, self.env.world_size, pos.step)
        if pos.step % t.log_every == 0 or stop or pos.batch_index == self.steps_per_epoch:
            self.book.pause_clock(pos)
            self.watchdog.at(pos.step - 1, "logging all-reduce")
            self.book.log_interval(pos, lr, bar)
            self.book.resume_clock()
        eval_due = bool(t.eval_every) and pos.step % t.eval_every == 0
        save_due = bool(t.checkpoint_every) and pos.step % t.checkpoint_every == 0
        if (eval_due or save_due) and not stop:
            self.book.pause_clock(pos)
            if eval_due:
                self.evaluate("valid")
            if save_due:
                self.save()
            self.book.resume_clock()

    def fit(self) -> dict[str, Any]:
        """Train to the end (epochs or max_steps), validate every epoch, test at the end.

        Every rank must call it. Returns the summary numbers (metrics, throughput, ...).
        """
        t0 = time.perf_counter()
        bar = None
        if self.verbose and self.env.is_main:
            from tqdm import tqdm

            bar = tqdm(total=self.total_steps, initial=self.pos.step, desc=f"[rank 0] {self.cfg.dist.strategy}",
                       unit="step", dynamic_ncols=True, mininterval=1.0)
        try:
            while not self.strategy.finished(self.pos.step, self.total_steps):
                if self.run_epoch(bar):
                    self.schedule.observe(self.evaluate("valid"))
                    self.pos.epoch, self.pos.batch_index = self.pos.epoch + 1, 0
                    self.save()
                elif self.strategy.finished(self.pos.step, self.total_steps):  # stopped inside an epoch
                    self.evaluate("valid")
                    self.save()
            if "valid_loss" not in self.results:
                self.evaluate("valid")
            self.evaluate("test")
        except RuntimeError as e:  # a collective timed out or lost a peer: say who is gone or late
            said = self.watchdog.diagnose(e) if self.env.world_size > 1 else None
            if said is None:
                raise
            from ..errors import TrainingStopped

            raise TrainingStopped(said) from None
        finally:
            if bar is not None:
                bar.close()
        results = {"epochs": round(self.pos.step / self.steps_per_epoch, 3), **self.results,
                   "nonfinite_steps": self.guards.nonfinite_steps}
        return self.book.summary(self.pos, results, time.perf_counter() - t0,
                                 {"task": self.cfg.task.entry, "strategy": self.cfg.dist.strategy})

    def close(self, clean: bool = True) -> None:
        """Close metric files and release the strategy (every rank). ``clean=False`` after a
        failure: skip the strategy's teardown (its final barrier would wait for ranks that are gone)."""
        self.watchdog.close()
        self.book.close()
        if clean:
            self.strategy.teardown()
