"""Per-step timing: where each optimizer step's wall time goes, per rank.

A step is cut into labelled spans on one clock (:class:`StepClock`: the host's
``perf_counter`` on CPU, CUDA events read after a device synchronisation on
GPU, so a span is device time, not kernel-launch time):

=============  ============================================================
``data``       waiting for the next batch (iterator + host-to-device copy)
``forward``    forward passes of this rank's micro-batches
``backward``   backward passes, up to the moment the last gradient is ready
``compute``    forward+backward that cannot be split (towers run in threads;
               injected straggler delay, ``--slow-ms``)
``comm``       gradient communication *not hidden* behind backward: for DDP,
               from the last bucket becoming ready (its comm hook fires) to
               the end of ``backward()``; for the parameter server, push and
               pull (the servers' optimizer included)
``idle``       waiting for other ranks: split off ``comm`` afterwards (below)
``optimizer``  global-norm clipping, ``optimizer.step``, ``zero_grad``
=============  ============================================================

Idle time (Li et al. 2020 call it "skew"): a collective cannot finish before the
last rank arrives, and every rank leaves it at about the same moment. Rank r's
*arrival offset* ``a_r`` is the time from the end of its previous collective to
the start of this one; the rank with the largest offset is the one everyone
waits for, so rank r's idle time is ``min(comm_r, max_j a_j - a_r)`` and the
rest of ``comm_r`` is communication proper (:func:`split_idle`). The offsets
are compared across ranks once per logging interval (one small collective).

Pure aggregation lives here too (:func:`summarise_ranks`) so the report and the
tests share it.
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Any, Iterable, Sequence

import torch

CATEGORIES = ("data", "forward", "backward", "compute", "comm", "idle", "optimizer")
"""Span labels, in the order a report stacks them."""

Span = tuple[str, Any, Any]  # (label, start mark, end mark)


class StepClock:
    """Marks on one timeline. CPU: ``time.perf_counter()`` floats. CUDA: recorded
    ``torch.cuda.Event`` objects on the current stream; :meth:`seconds` needs the
    device synchronised (the training loop does it at every logging step).
    ``enabled=False``: every mark is 0.0 and costs nothing (a user's own loop)."""

    def __init__(self, device: torch.device, enabled: bool = True) -> None:
        self.enabled = enabled
        self.cuda = enabled and device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter() if self.enabled else 0.0

    def seconds(self, a: Any, b: Any) -> float:
        """Seconds from mark ``a`` to mark ``b``."""
        return a.elapsed_time(b) / 1000.0 if self.cuda else b - a


def span_seconds(clock: StepClock, spans: Iterable[Span]) -> dict[str, float]:
    """Sum the spans' seconds per label (labels from :data:`CATEGORIES`)."""
    out = dict.fromkeys(CATEGORIES, 0.0)
    for label, a, b in spans:
        out[label] += clock.seconds(a, b)
    return out


def split_idle(comm_s: Sequence[float], arrival_s: Sequence[float], max_arrival_s: Sequence[float]) -> list[float]:
    """Idle seconds per step: ``min(comm, max_arrival - arrival)``, clamped at 0.

    ``arrival_s[i]``: this rank's time from the end of its previous collective to
    the start of step i's; ``max_arrival_s[i]``: the largest over ranks. NaN
    arrivals (no collective that step) give 0.
    """
    out = []
    for c, a, m in zip(comm_s, arrival_s, max_arrival_s):
        out.append(0.0 if math.isnan(a) or math.isnan(m) else min(c, max(0.0, m - a)))
    return out


JITTER_PER_DIFFERENCE = math.sqrt(math.pi) / 2
"""Standard deviation per mean absolute successive difference of normal noise (:func:`successive_difference_sd`)."""


def successive_difference_sd(xs: Sequence[float]) -> float:
    """The standard deviation of the step-to-step noise of the series ``xs`` (any unit), estimated from
    its successive differences: ``sqrt(pi) / 2 * mean(|x[i+1] - x[i]|)``, 0 for fewer than two values.

    Two independent draws X1, X2 of the same noise differ as two successive steps do, so
    ``mean |x[i+1] - x[i]|`` estimates ``E|X1 - X2|`` (Gini's mean difference), which is
    ``2 sd / sqrt(pi)`` for normal noise. Unlike the plain standard deviation, a slow drift of the
    machine over the run (which all of a job's ranks share, and which makes none of them wait) adds
    almost nothing (von Neumann et al. 1941 use the mean square successive difference for the same
    reason). For n = 2 ranks the straggle it prices, ``sd / sqrt(pi)``, is ``E|X1 - X2| / 2``,
    exactly the expected wait of the faster rank, whatever the noise's distribution."""
    if len(xs) < 2:
        return 0.0
    return JITTER_PER_DIFFERENCE * statistics.fmean(abs(b - a) for a, b in zip(xs, xs[1:]))


class RankTimer:
    """This rank's per-step records: collects spans, resolves them at sync points.

    ``add(step, start, end, spans, collective)`` once per step; ``flush``
    (after a device sync) turns pending marks into rows; ``finish_interval``
    splits idle off comm with the interval's max arrival offsets (collective in
    the caller) and returns the interval's means in milliseconds.
    """

    def __init__(self, clock: StepClock) -> None:
        self.clock = clock
        self.pending: list[tuple[int, Any, Any, list[Span], Any, Any, bool]] = []
        self.rows: list[dict[str, float]] = []  # resolved, idle not yet split
        self.prev_comm_end: Any = None
        self.totals = dict.fromkeys(("step",) + CATEGORIES, 0.0)
        self.measured_steps = 0
        self.local_squares = 0.0  # sum over measured steps of their local time (step - comm - idle)^2, s^2
        self.local_diffs = 0.0  # sum of |local time - the previous measured step's|, seconds
        self.local_pairs = 0  # successive measured steps with no pause between them
        self.last_local: float | None = None  # the previous measured step's local time (None after a pause)
        self.paused = False  # reset_arrival since the last add: the next step follows a pause

    def add(self, step: int, start: Any, end: Any, spans: list[Span], comm: tuple[Any, Any] | None) -> None:
        """Record step ``step`` (0-based) from ``start`` to ``end`` with its spans; ``comm``:
        (start, end) marks of the step's gradient collective, or None."""
        arrival_from = self.prev_comm_end if self.prev_comm_end is not None else start
        self.pending.append((step, start, end, spans, arrival_from, comm, self.paused))
        self.paused = False
        if comm is not None:
            self.prev_comm_end = comm[1]

    def reset_arrival(self) -> None:
        """Forget the previous collective and step (after evaluation or a checkpoint between steps:
        the step after the pause is not a successive difference of the one before it)."""
        self.prev_comm_end = None
        self.paused = True

    def flush(self) -> list[float]:
        """Resolve pending steps (device must be synchronised); returns their arrival offsets (NaN: none)."""
        arrivals = []
        for step, start, end, spans, arrival_from, comm, paused in self.pending:
            row = span_seconds(self.clock, spans)
            row["step"] = self.clock.seconds(start, end)
            row["index"] = step
            row["after_pause"] = paused
            arrivals.append(self.clock.seconds(arrival_from, comm[0]) if comm is not None else math.nan)
            self.rows.append(row)
        self.pending.clear()
        return arrivals

    def finish_interval(self, arrivals: Sequence[float], max_arrivals: Sequence[float],
                        count: bool = True) -> dict[str, float]:
        """Split idle for the rows of the last :meth:`flush`, add them to the totals when
        ``count`` (the caller leaves warm-up intervals out) and return their mean milliseconds per step."""
        rows = self.rows[-len(arrivals):] if arrivals else []
        for row, idle in zip(rows, split_idle([r["comm"] for r in rows], arrivals, max_arrivals)):
            row["idle"] += idle
            row["comm"] -= idle
            if count:
                self.measured_steps += 1
                for k in self.totals:
                    self.totals[k] += row[k]
                local = row["step"] - row["comm"] - row["idle"]
                self.local_squares += local * local
                if self.last_local is not None and not row["after_pause"]:
                    self.local_diffs += abs(local - self.last_local)
                    self.local_pairs += 1
                self.last_local = local
        self.rows.clear()
        if not rows:
            return {}
        return {f"{k}_ms": 1000.0 * sum(r[k] for r in rows) / len(rows) for k in ("step",) + CATEGORIES}

    def summary(self) -> dict[str, float]:
        """Mean milliseconds per measured step (after warm-up) of each category and of the step, and
        ``local_sd_ms``: the standard deviation over the measured steps of the step's local time (the
        step less its ``comm`` and ``idle``: what a rank takes between two meetings with the others),
        and ``local_jitter_ms``: the same spread from step to step only, without the run's drift
        (:func:`successive_difference_sd`; :func:`~.straggler.straggle_s` prices the waiting it causes)."""
        n = max(self.measured_steps, 1)
        out = {f"{k}_ms": 1000.0 * v / n for k, v in self.totals.items()}
        out["measured_steps"] = self.measured_steps
        mean = (self.totals["step"] - self.totals["comm"] - self.totals["idle"]) / n
        out["local_sd_ms"] = 1000.0 * math.sqrt(max(0.0, self.local_squares / n - mean * mean))
        out["local_jitter_ms"] = 1000.0 * JITTER_PER_DIFFERENCE * self.local_diffs / max(self.local_pairs, 1)
        return out


def breakdown(ms: dict[str, float]) -> dict[str, float]:
    """Report columns from per-category milliseconds: compute = forward + backward + compute,
    other = step - (data + compute + comm + idle + optimizer) (logging, loop overhead)."""
    compute = ms.get("forward_ms", 0.0) + ms.get("backward_ms", 0.0) + ms.get("compute_ms", 0.0)
    parts = {"data_ms": ms.get("data_ms", 0.0), "compute_ms": compute, "comm_ms": ms.get("comm_ms", 0.0),
             "idle_ms": ms.get("idle_ms", 0.0), "optimizer_ms": ms.get("optimizer_ms", 0.0)}
    step = ms.get("step_ms", 0.0)
    parts["other_ms"] = step - sum(parts.values())
    parts["step_ms"] = step
    return parts


def summarise_ranks(per_rank: Sequence[dict[str, float]]) -> dict[str, Any]:
    """Across ranks' :meth:`RankTimer.summary` dicts: the mean breakdown, the slowest
    rank by compute, and skew = (max - min) / mean of per-rank compute time."""
    rows = [breakdown(r) for r in per_rank]
    if not rows:
        return {}
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}
    compute = [r["compute_ms"] for r in rows]
    avg = sum(compute) / len(compute)
    return {"mean": mean, "per_rank": rows, "slowest_rank": max(range(len(rows)), key=lambda i: compute[i]),
            "compute_skew": (max(compute) - min(compute)) / avg if avg > 0 else 0.0}


def write_rank_timing(run_dir, rank: int, record: dict) -> None:
    """Write this rank's step-time summary to ``run_dir/timing/rank<R>.json`` (atomically). Every rank
    writes its own: parameter-server workers share no collective to gather them, and the bench
    report reads all ranks."""
    import json
    from pathlib import Path

    folder = Path(run_dir) / "timing"
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(folder / f"rank{rank}.json")
