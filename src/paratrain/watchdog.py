"""Hang diagnostics: name the rank that did not arrive when a collective times out.

Every collective of the process group has a timeout (``train.timeout_s``); when it
expires gloo/NCCL raise an error that says *that* something timed out, not *who*
is missing. Each rank therefore posts its position -- (step, phase, operation) --
into the job's c10d store (the torchrun TCPStore) from a daemon thread once per
``interval_s``; the training thread only assigns two attributes per step. When a
collective fails, :meth:`Watchdog.diagnose` reads every rank's last post and names
the ranks behind this one (or silent: a dead process posts nothing), the step and
the operation, e.g. ``rank 1 did not arrive at the gradient all-reduce of step 20
within timeout_s=30 (rank 1 is at step 20, before the step, last post 0.4 s ago)``.
"""
from __future__ import annotations

import datetime
import json
import os
import threading
import time

PHASES = {"before the step": 0, "gradient all-reduce": 1, "logging all-reduce": 2, "evaluation": 3,
          "checkpoint": 3, "start": -1}


def is_comm_failure(e: BaseException) -> bool:
    """True for the errors a collective raises when a peer is missing (timeout) or gone."""
    text = str(e).lower()
    return any(k in text for k in ("timed out", "timeout", "connection closed", "connection reset",
                                   "pair closure", "broken pipe", "no route"))


class Watchdog:
    """Heartbeats of this rank in the job's store and the diagnosis of a failed collective.

    Construct on every rank after the process group exists (needs MASTER_ADDR/PORT from
    torchrun; a no-op for world_size 1). :meth:`at` marks the position (cheap);
    :meth:`close` stops the thread.
    """

    def __init__(self, rank: int, world_size: int, timeout_s: float, interval_s: float = 1.0) -> None:
        self.rank, self.world_size, self.timeout_s, self.interval_s = rank, world_size, timeout_s, interval_s
        self.step, self.op = 0, "start"
        self.store = None
        self._stop = threading.Event()
        if world_size < 2 or "MASTER_ADDR" not in os.environ:
            return
        import torch.distributed as dist

        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        try:
            base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                                 is_master=False, timeout=datetime.timedelta(seconds=30))
        except Exception:  # no reachable store: run without diagnostics rather than fail the job
            return
        self.store = dist.PrefixStore(f"paratrain/heartbeat/{attempt}", base)
        self._post()
        self._thread = threading.Thread(target=self._loop, name="paratrain-watchdog", daemon=True)
        self._thread.start()

    def at(self, step: int, op: str) -> None:
        """This rank is at ``op`` of step ``step`` (0-based); ``op`` is a key of :data:`PHASES`."""
        self.step, self.op = step, op

    def _post(self) -> None:
        self.store.set(str(self.rank), json.dumps({"step": self.step, "op": self.op, "t": time.time()}))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._post()
            except Exception:
                return  # the store went away: the job is ending

    def positions(self) -> dict[int, dict | None]:
        """Every rank's last post (None: never posted)."""
        out: dict[int, dict | None] = {}
        for r in range(self.world_size):
            key = str(r)
            try:
                out[r] = json.loads(self.store.get(key)) if self.store.check([key]) else None
            except Exception:
                out[r] = None
        return out

    def diagnose(self, error: BaseException) -> str:
        """One sentence: which ranks did not arrive at this rank's operation, and where they are."""
        where = f"the {self.op} of step {self.step}"
        if self.store is None:
            return f"{where} failed ({str(error).strip().splitlines()[-1][:160]})"
        me = (self.step, PHASES.get(self.op, 0))
        now, late, notes = time.time(), [], []
        for r, pos in self.positions().items():
            if r == self.rank:
                continue
            if pos is None:
                late.append(r)
                notes.append(f"rank {r} never reported")
                continue
            age = now - pos["t"]
            behind = (pos["step"], PHASES.get(pos["op"], 0)) < me
            silent = age > max(5 * self.interval_s, 5.0)
            if behind or silent:
                late.append(r)
                state = "silent (process gone?)" if silent else "alive"
                notes.append(f"rank {r} is at step {pos['step']}, {pos['op']}, last post {age:.1f} s ago, {state}")
        if not late:
            return (f"{where} did not complete within timeout_s={self.timeout_s:g} although every rank reached it "
                    f"(network or backend failure: {str(error).strip().splitlines()[-1][:120]})")
        names = ", ".join(map(str, late))
        return (f"rank{'s' if len(late) > 1 else ''} {names} did not arrive at {where} within "
                f"timeout_s={self.timeout_s:g} ({'; '.join(notes)})")

    def close(self) -> None:
        self._stop.set()
