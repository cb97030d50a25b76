"""Fault injection for tests and demos, off unless ``--fault`` is given.

Spec: ``KIND:rank=R[:step=S][:ms=M]``, several joined by commas.

* ``kill:rank=1:step=50``: rank 1 kills itself (SIGKILL) after 50 completed steps;
* ``hang:rank=1:step=20``: rank 1 stops (sleeps) after 20 steps, never to return;
* ``delay:rank=0:ms=200``: rank 0 sleeps 200 ms before every step (a straggler);
* ``nan:rank=0:step=30``: rank 0's loss of step 30 (0-based) is NaN (so is its gradient).

kill, hang and nan fire in the first attempt only: after torchrun restarts the group
(``TORCHELASTIC_RESTART_COUNT`` > 0) the resumed run goes past the step.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from .errors import UsageError

KINDS = ("kill", "hang", "delay", "nan")


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int = 0
    ms: float = 0.0


def parse(spec: str) -> list[Fault]:
    """Parse a comma-separated fault list; UsageError names the bad part."""
    out = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        kind, *fields = part.split(":")
        if kind not in KINDS:
            raise UsageError(f"--fault {part!r}: unknown kind {kind!r}; use one of {', '.join(KINDS)}")
        values: dict[str, float] = {}
        for f in fields:
            key, _, val = f.partition("=")
            if key not in ("rank", "step", "ms"):
                raise UsageError(f"--fault {part!r}: unknown field {key!r}; use rank=R, step=S, ms=M")
            try:
                values[key] = float(val)
            except ValueError:
                raise UsageError(f"--fault {part!r}: {key} must be a number") from None
        if "rank" not in values:
            raise UsageError(f"--fault {part!r} needs rank=R")
        out.append(Fault(kind, int(values["rank"]), int(values.get("step", 0)), values.get("ms", 0.0)))
    return out


def first_attempt() -> bool:
    """False in a worker group torchrun restarted."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def inject(faults: list[Fault], rank: int, steps_done: int) -> bool:
    """Called by the loop before every step on every rank. Returns True when this rank's
    loss of this step must be made NaN (``nan`` fault)."""
    poison = False
    for f in faults:
        if f.rank != rank:
            continue
        if f.kind == "delay":
            time.sleep(f.ms / 1000)
        elif f.step != steps_done or not first_attempt():
            continue
        elif f.kind == "kill":
            print(f"[rank {rank}] fault injection: SIGKILL after {steps_done} steps", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        elif f.kind == "hang":
            print(f"[rank {rank}] fault injection: hanging after {steps_done} steps", flush=True)
            while True:
                time.sleep(3600)
        elif f.kind == "nan":
            print(f"[rank {rank}] fault injection: NaN loss at step {steps_done}", flush=True)
            poison = True
    return poison


def poisoned(loss_fn):
    """``loss_fn`` whose loss is NaN (the ``nan`` fault)."""
    return lambda model, mb: loss_fn(model, mb) * float("nan")
