"""Hang diagnostics: name the rank that did not arrive when a collective times out.

Every collective of the process group has a timeout (``train.timeout_s``); when it
expires gloo/NCCL raise an error that says *that* something timed out, not *who*
is missing. Each rank therefore posts its position -- (step, phase, operation) --
into the job's c10d store (the torchrun TCPStore) from a daemon thread once per
``interval_s``; the training thread only assigns two attributes per step. When a
collective fails, :meth:`Watchdog.diagnose` reads every rank's last post and names
the ranks that are gone (a process that exited: its pid is gone on this host; or a
peer whose heartbeats stopped: connection lost), e.g. ``rank 1 exited at step 50
(gradient all-reduce; process 4242 is gone)``, else the ranks that are late (alive,
behind this one), e.g. ``rank 1 did not arrive at the gradient all-reduce of step 20
within timeout_s=30 (rank 1 is at step 20, before the step, alive)``.

:meth:`Watchdog.at` also stores the position in a 16-byte memory-mapped file,
``$PARATRAIN_POSITIONS/rank{r}.pos``, when the launcher set that variable (every strategy, also
without a store): the page outlives a killed process, so the launcher can say at which step a
worker of its node died (:func:`last_position`) at the cost of one ``struct.pack_into`` per call.
"""
from __future__ import annotations

import datetime
import json
import mmap
import os
import socket
import struct
import threading
import time

_HOST = socket.gethostname()  # posted with every heartbeat: a gone pid is checked on the same host only
PHASES = {"before the step": 0, "gradient all-reduce": 1, "logging all-reduce": 2, "evaluation": 3,
          "checkpoint": 3, "start": -1}


def is_backend_error(e: BaseException) -> bool:
    """torch's own distributed error types (c10d ``DistError`` and its subclasses: backend, network,
    store, queue-empty). gloo raises a plain RuntimeError for a lost peer or a timed-out collective,
    so for those the watchdog decides from facts (heartbeats, processes), not from the message."""
    import torch.distributed as dist

    return isinstance(e, dist.DistError)


_OPS = list(PHASES)
_OP_INDEX = {op: i for i, op in enumerate(_OPS)}


def _position_map(rank: int) -> mmap.mmap | None:
    """The shared page :meth:`Watchdog.at` writes (step, op index) into; None without a launcher."""
    folder = os.environ.get("PARATRAIN_POSITIONS")
    if not folder or not os.path.isdir(folder):
        return None
    try:
        fd = os.open(os.path.join(folder, f"rank{rank}.pos"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, 16)
            m = mmap.mmap(fd, 16)
        finally:
            os.close(fd)
        struct.pack_into("<qq", m, 0, 0, _OP_INDEX["start"])
        return m
    except OSError:
        return None


def last_position(folder: str, rank: int) -> str:
    """' at step 50 (gradient all-reduce)': where rank ``rank`` of this node last was by its watchdog's
    page under ``folder``; '' when it wrote none (a parameter server, a user's own loop)."""
    try:
        with open(os.path.join(folder, f"rank{rank}.pos"), "rb") as f:
            step, op = struct.unpack("<qq", f.read(16))
        return f" at step {step} ({_OPS[op]})"
    except (OSError, struct.error, IndexError):
        return ""


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
        self.position = _position_map(rank)
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
        if self.position is not None:
            struct.pack_into("<qq", self.position, 0, step, _OP_INDEX[op])

    def _post(self) -> None:
        self.store.set(str(self.rank), json.dumps({"step": self.step, "op": self.op, "t": time.time(),
                                                   "pid": os.getpid(), "host": _HOST}))

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

    def diagnose(self, error: BaseException) -> str | None:
        """One sentence for a failed collective: the ranks that are gone (their process exited, or
        their heartbeats stopped: connection lost), else the ranks that are late (alive, behind this
        one), else a backend failure although every rank arrived. None when no peer is gone or late
        and ``error`` is not one of torch's distributed error types (then it is not a communication
        failure: the caller re-raises it). Waits up to ~3 heartbeat intervals to tell gone from late."""
        import psutil

        where = f"the {self.op} of step {self.step}"
        first = str(error).strip().splitlines()[-1][:160] if str(error).strip() else type(error).__name__
        if self.store is None:
            return f"{where} failed ({first})" if is_backend_error(error) else None
        me, host = (self.step, PHASES.get(self.op, 0)), _HOST
        before = self.positions()
        time.sleep(3 * self.interval_s)  # a live peer posts again meanwhile; a dead one cannot
        now, after = time.time(), self.positions()
        gone, late = [], []
        for r in range(self.world_size):
            if r == self.rank:
                continue
            pos, old = after.get(r), before.get(r)
            if pos is None:
                gone.append(f"rank {r} never reported (it did not start or could not reach the store)")
                continue
            same_host = pos.get("host") == host and pos.get("pid")
            if same_host and not psutil.pid_exists(pos["pid"]):
                gone.append(f"rank {r} exited (process {pos['pid']} is gone; last seen at step {pos['step']}, "
                            f"{pos['op']})")
            elif old is not None and pos["t"] == old["t"] and now - pos["t"] > 2 * self.interval_s:
                gone.append(f"connection to rank {r} lost (no heartbeat for {now - pos['t']:.1f} s from "
                            f"{pos.get('host', '?')}; last seen at step {pos['step']}, {pos['op']})")
            elif (pos["step"], PHASES.get(pos["op"], 0)) < me:
                late.append((r, f"rank {r} is at step {pos['step']}, {pos['op']}, alive"))
        if gone:
            return f"{'; '.join(gone)}: {where} cannot complete"
        if late:
            names = ", ".join(str(r) for r, _ in late)
            return (f"rank{'s' if len(late) > 1 else ''} {names} did not arrive at {where} within "
                    f"timeout_s={self.timeout_s:g} ({'; '.join(n for _, n in late)})")
        if is_backend_error(error):
            return (f"{where} did not complete although every rank reached it (network or backend failure: "
                    f"{first})")
        return None

    def close(self) -> None:
        self._stop.set()
