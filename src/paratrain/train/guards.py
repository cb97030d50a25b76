"""What the loop does around a step that is not the step itself: fault injection (``--fault``),
the straggler delay (``--slow-rank``/``--slow-ms``) and the non-finite guard.

The guard: the strategy's ``optimizer.step()`` drops a NaN/Inf merged gradient
(``skip_nonfinite``; no parameter changes); :meth:`StepGuards.nonfinite` then finds
the ranks whose loss was not finite (a collective among the ranks that step
together), counts the step, writes a ``nonfinite`` record and, with
``train.on_nonfinite = "stop"``, ends the run with one line
(:class:`~paratrain.errors.TrainingStopped`).
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from ..errors import TrainingStopped
from ..faults import inject, parse


class StepGuards:
    """One rank's faults, straggler delay and non-finite counting. ``reduce(tensor, op)``: all-reduce
    over the ranks that step together, or None."""

    def __init__(self, cfg, env, clock, reduce: Callable | None, book, say: Callable[[str], None]) -> None:
        self.env, self.clock, self.reduce, self.book, self.say = env, clock, reduce, book, say
        self.faults = parse(cfg.dist.fault)
        self.slow_s = cfg.dist.slow_ms / 1000 if env.rank == cfg.dist.slow_rank else 0.0
        self.on_nonfinite = cfg.train.on_nonfinite
        self.max_in_a_row = cfg.train.max_nonfinite_steps
        self.nonfinite_steps = 0  # all skipped steps of this attempt
        self.in_a_row = 0  # skipped steps since the last update
        self.first_loss: float | None = None
        self.warned_divergence = False

    def before_step(self, step: int) -> tuple[list, bool]:
        """Straggler delay (a ``compute`` span) and injected faults before step ``step`` (0-based).
        Returns (spans, poison): ``poison`` makes this rank's loss of the step NaN (``--fault nan``)."""
        spans = []
        if self.slow_s:  # straggler injection: slower compute
            m = self.clock.mark()
            time.sleep(self.slow_s)
            spans.append(("compute", m, self.clock.mark()))
        poison = inject(self.faults, self.env.rank, step) if self.faults else False
        return spans, poison

    def nonfinite(self, step: int, local_loss: torch.Tensor, loss_scale: float | None = None) -> None:
        """The merged gradient of step ``step`` (0-based) was NaN/Inf and no update was made: name the
        ranks whose loss was not finite, count, log; stop the run when ``on_nonfinite = "stop"``.
        ``loss_scale``: fp16's loss scale after the skip (GradScaler lowered it): with finite losses
        this is an fp16 overflow, which a lower scale cures, so ``stop`` does not apply to it (the
        limit of skipped steps in a row does)."""
        flags = torch.zeros(self.env.world_size, dtype=torch.float64, device=self.env.device)
        flags[self.env.rank] = float(not bool(torch.isfinite(local_loss)))
        if self.reduce is not None:
            flags = self.reduce(flags, "sum")
        ranks = [int(r) for r in torch.nonzero(flags).flatten().tolist()]
        self.nonfinite_steps += 1
        self.in_a_row += 1
        what = f"non-finite loss on rank(s) {ranks}" if ranks else "non-finite gradient (losses finite)"
        overflow = loss_scale is not None and not ranks
        if overflow:
            what = f"fp16 gradient overflow (loss scale now {loss_scale:g})"
        self.book.write("nonfinite", step, ranks=ranks, action=self.on_nonfinite, count=self.nonfinite_steps,
                        **({"loss_scale": loss_scale} if loss_scale is not None else {}))
        if self.on_nonfinite == "stop" and not overflow:
            raise TrainingStopped(f"{what} at step {step}; the parameters are unchanged since the last step "
                                  f"(use --on-nonfinite skip to skip such steps)", every_rank=self.reduce is not None)
        if self.in_a_row >= self.max_in_a_row:
            raise TrainingStopped(f"{self.in_a_row} steps in a row were skipped ({what}, the last at step {step}): "
                                  f"the run cannot recover; lower train.lr or train.clip and resume from the last "
                                  f"checkpoint (train.max_nonfinite_steps = {self.max_in_a_row})",
                                  every_rank=self.reduce is not None)
        self.say(f"{what} at step {step}: update skipped ({self.nonfinite_steps} so far)")

    def finite(self, step: int, local_loss: torch.Tensor) -> None:
        """Step ``step`` made an update: reset the run of skipped steps; warn once when the loss is
        finite but 100 times its first value (divergence). Reads the loss every 10th step only (a
        device sync on GPU)."""
        self.in_a_row = 0
        if self.warned_divergence or (step % 10 and self.first_loss is not None):
            return
        loss = float(local_loss)
        if self.first_loss is None:
            self.first_loss = abs(loss) or 1.0
        elif abs(loss) > 100 * self.first_loss:
            self.warned_divergence = True
            self.say(f"warning: the loss is diverging (rank {self.env.rank}: {loss:.3g} at step {step}, "
                     f"{self.first_loss:.3g} at the start); lower train.lr or set train.clip")
