"""Numbers of a run: training loss per logging interval, throughput, the step-time breakdown,
metric records (rank 0) and the summary.

Throughput counts the task's unit (``words`` for the language models, ``samples``
for a classifier): ``<unit>_per_s`` over the whole run and
``<unit>_per_s_after_warmup`` over the logging intervals that start after
``train.timing_warmup_steps``; evaluation and checkpoints are outside the
training clock. Step timing is :mod:`paratrain.bench.timing`'s (spans marked by
the strategy, idle split off communication once per interval by a small
collective among the ranks that step together).
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ..bench.timing import RankTimer, breakdown, write_rank_timing
from ..devices import cpu_allocator_in_effect, host_memory_split, peak_memory_bytes, synchronize
from .metrics import MetricsLog, format_summary


class Bookkeeper:
    """One rank's bookkeeping. ``reduce(tensor, op)``: all-reduce over the ranks that step together,
    or None (this rank alone). Rank 0 writes ``metrics.jsonl`` and TensorBoard scalars."""

    def __init__(self, run_dir: Path, env, strategy, unit: str, train, reduce: Callable | None,
                 verbose: bool = True) -> None:
        self.run_dir, self.env, self.strategy, self.unit, self.train = Path(run_dir), env, strategy, unit, train
        self.reduce, self.verbose = reduce, verbose
        self.log = MetricsLog(self.run_dir) if env.is_main else None
        self.timer = RankTimer(strategy.clock)
        self.loss_sum = torch.zeros((), dtype=torch.float64)
        self.loss_count = 0.0
        self._tick = time.perf_counter()
        self._interval_start = 0  # first step of the current logging interval
        self._interval_time, self._interval_units = 0.0, 0  # train_time_s and units at its start
        self._measured_units, self._measured_time_s = 0, 0.0  # intervals after timing warm-up
        self.flops_per_step: float | None = None  # this rank's model FLOPs in one step (counted in its first)
        self.tracked_memory: dict[str, float] = {}  # train.track_memory_step: this rank's peak bytes, by kind

    # ---- inside a step ----------------------------------------------------------------------------
    def add_loss(self, loss_sum: torch.Tensor, count: Any) -> None:
        """Accumulate a micro-batch's summed loss and unit count (for the interval's mean loss)."""
        self.loss_sum = self.loss_sum.to(loss_sum.device) + loss_sum.detach().double()
        self.loss_count += float(count)

    def step_done(self, step: int, start: Any, end: Any, spans: list, collective: tuple | None) -> None:
        self.timer.add(step, start, end, spans, collective)

    # ---- the training clock -------------------------------------------------------------------------
    def resume_clock(self) -> None:
        self._tick = time.perf_counter()

    def pause_clock(self, pos) -> None:
        """Stop the training clock (before evaluation, a checkpoint, logging): adds to ``pos.train_time_s``."""
        synchronize(self.env.device)
        pos.train_time_s += time.perf_counter() - self._tick

    def start_interval(self, pos) -> None:
        """A new logging interval starts at ``pos`` (after a resume or an evaluation pause)."""
        self._interval_start, self._interval_time, self._interval_units = pos.step, pos.train_time_s, pos.units
        self.timer.reset_arrival()

    # ---- logging ---------------------------------------------------------------------------------------
    def _step_times(self, pos) -> tuple[dict[str, float], bool]:
        arrivals = self.timer.flush()
        t = torch.tensor(arrivals, dtype=torch.float64, device=self.env.device)
        peak = (self.reduce(t, "max") if self.reduce is not None else t).cpu()
        counted = self._interval_start >= self.train.timing_warmup_steps
        self._interval_start = pos.step
        return self.timer.finish_interval(arrivals, peak.tolist(), counted), counted

    def log_interval(self, pos, lr: float, bar) -> None:
        """Mean training loss since the last record (collective where ranks step together), units/s,
        step-time breakdown. Every rank calls it (the clock is paused)."""
        times, counted = self._step_times(pos)
        dev = self.env.device
        acc = torch.stack([self.loss_sum.to(dev), torch.tensor(self.loss_count, dtype=torch.float64, device=dev)])
        if self.reduce is not None:
            acc = self.reduce(acc, "sum")
        self.loss_sum, self.loss_count = torch.zeros((), dtype=torch.float64), 0.0
        loss = float(acc[0] / acc[1]) if acc[1] > 0 else math.nan
        if not self.log:
            self._interval_time = pos.train_time_s
            return
        units = self.strategy.units_trained(pos.units, pos.step)
        dt = max(pos.train_time_s - self._interval_time, 1e-9)
        rate = (units - self._interval_units) / dt
        if counted:
            self._measured_units += units - self._interval_units
            self._measured_time_s += dt
        self._interval_time, self._interval_units = pos.train_time_s, units
        extra = {"ppl": math.exp(min(loss, 700))} if self.unit == "words" else {}
        self.log.write("train", pos.step, epoch=pos.epoch, loss=loss, **extra, lr=lr, **{f"{self.unit}_per_s": rate},
                       **{k: round(v, 4) for k, v in times.items()}, **self.strategy.metrics())
        if bar is not None:
            parts = [f"loss {loss:.3f}", *([f"ppl {extra['ppl']:.1f}"] if extra else []), f"lr {lr:.3g}",
                     f"{rate:,.0f} {self.unit}/s"]
            bar.set_postfix_str(" | ".join(parts))

    def write(self, kind: str, step: int, **values: Any) -> None:
        if self.log:
            self.log.write(kind, step, **values)

    # ---- the end ---------------------------------------------------------------------------------------
    def summary(self, pos, results: dict[str, float], wall_s: float, extra: dict[str, Any]) -> dict[str, Any]:
        """The run's summary record (rank 0 writes and prints it); every rank writes its timing file."""
        env, t, unit = self.env, self.train, self.unit
        units = self.strategy.units_trained(pos.units, pos.step) if self.log else 0
        summary: dict[str, Any] = {
            **extra, "world_size": env.world_size, "global_batch": t.batch_size,
            "per_replica_batch": t.batch_size // self.strategy.replicas, "steps": pos.step, **results,
            f"{unit}_per_s": units / max(pos.train_time_s, 1e-9),
            f"{unit}_per_s_after_warmup": (self._measured_units / self._measured_time_s
                                           if self._measured_time_s > 0 else math.nan),
            "unit": unit, "units_per_step": pos.units / pos.step if pos.step else math.nan, "wall_time_s": wall_s,
            "device": str(env.device),
            "backend": env.backend if env.world_size > 1 else "-", "threads_per_process": torch.get_num_threads(),
            "peak_memory_mb": round(peak_memory_bytes(env.device) / 2**20, 1),
            "cpu_allocator": cpu_allocator_in_effect(),  # host memory between steps (devices.apply_cpu_allocator)
        }
        split = host_memory_split() if env.device.type == "cpu" and self.log else None
        if split:  # rank 0's host memory at the end (the plan's host bound: plan_feasible.host_demand)
            summary["host_private_mb"], summary["host_shared_mb"] = (round(b / 2**20, 1) for b in split)
        timing = self.timer.summary()
        write_rank_timing(self.run_dir, env.rank, {"rank": env.rank, "world_size": env.world_size,
                                                   "strategy": extra.get("strategy"),
                                                   "warmup_steps": t.timing_warmup_steps, **timing})
        parts = breakdown(timing)
        if not timing["measured_steps"]:  # no interval wholly after the warm-up: no breakdown (not zeros)
            parts = dict.fromkeys(parts, math.nan)
        summary.update({k: round(v, 3) for k, v in parts.items()})
        summary["timed_steps"] = timing["measured_steps"]
        # wall time per measured step by the throughput clock (logging included): what the breakdown must add up to
        summary["train_step_ms"] = (1000.0 * self._measured_time_s / timing["measured_steps"]
                                    if timing["measured_steps"] and self.log else math.nan)
        step_ms = summary["train_step_ms"]  # too short a run for a timed interval: its whole clock per step
        step_ms = step_ms if math.isfinite(step_ms) else 1000.0 * pos.train_time_s / max(pos.step, 1)
        summary.update(self._utilisation(step_ms, summary["units_per_step"]))
        if self.log:
            summary.update(self.strategy.metrics())
            self.log.write("summary", pos.step, **summary)
            if self.verbose:
                print(format_summary([("run dir", str(self.run_dir)), *summary.items()]), flush=True)
        return summary

    def _utilisation(self, step_ms: float, units_per_step: float) -> dict[str, Any]:
        """MFU (:mod:`paratrain.bench.mfu`): the model FLOPs of one step summed over the ranks that
        step together (each counted its first step), over the step time and their peak FLOP/s. Every
        rank of the group calls it (a sum all-reduce)."""
        from ..bench.mfu import mfu, peak_flops

        local = self.flops_per_step if self.flops_per_step is not None else math.nan
        acc = torch.tensor([local, 1.0], dtype=torch.float64, device=self.env.device)
        mem = torch.tensor([self.tracked_memory.get("peak", math.nan)], dtype=torch.float64, device=self.env.device)
        if self.reduce is not None:
            acc, mem = self.reduce(acc, "sum"), self.reduce(mem, "max")
        flops, ranks = float(acc[0]), int(round(float(acc[1])))
        devices = ranks * len(getattr(self.strategy, "devices", None) or [None])  # towers: devices per process
        if not self.log:
            return {}
        tracked = ({"tracked_peak_memory_mb": round(float(mem[0]) / 2**20, 2),  # the largest rank's
                    "rank0_tracked_memory_mb": {k: round(v / 2**20, 2) for k, v in self.tracked_memory.items()}}
                   if self.train.track_memory_step else {})
        dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(self.train.precision, self.train.dtype)
        achieved = flops / (step_ms / 1000) / devices if flops > 0 and step_ms > 0 else None
        peak, source = peak_flops(self.env.device, dtype, achieved)
        return {"model_flops_per_step": flops, f"flops_per_{self.unit.rstrip('s')}": flops / units_per_step,
                "mfu": mfu(flops, step_ms / 1000, devices, peak), "peak_flops_per_device": peak,
                "peak_flops_source": source, **tracked}

    def close(self) -> None:
        if self.log:
            self.log.close()
            self.log = None
