"""Run one benchmark command in its own process group, with a log file and a timeout that
ends the whole process tree (torchrun starts each worker in a session of its own).

Used by ``paratrain bench`` and by the scripts in ``benchmarks/``."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from ..interrupts import signals_held


def descendants(pid: int) -> list[int]:
    """Process ids below ``pid`` (Linux /proc). torchrun starts each worker in a session of its own,
    so killing the launcher's process group alone can leave workers and servers behind."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL, the run's process group and every process below it (started here)."""
    below = descendants(proc.pid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for target in [proc.pid, *below]:
            try:
                if target == proc.pid:
                    os.killpg(proc.pid, sig)  # the group started here (start_new_session)
                else:
                    os.kill(target, sig)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            proc.wait(timeout=15)
            if sig == signal.SIGTERM:
                time.sleep(2)  # give torchrun's agent time to end its workers itself
            below = [p for p in below if Path(f"/proc/{p}").exists()]
            if not below:
                return
        except subprocess.TimeoutExpired:
            continue


def _kill_now(proc: subprocess.Popen, below: list[int]) -> None:
    """SIGKILL the run's process group, ``below`` and what is below the run now, without waiting."""
    for target in [proc.pid, *dict.fromkeys([*below, *descendants(proc.pid)])]:
        try:
            os.killpg(target, signal.SIGKILL) if target == proc.pid else os.kill(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def run_cmd(cmd: list[str], log: Path, timeout_s: float, env: dict, cwd: Path | str | None = None) -> tuple[int, float]:
    """Run ``cmd`` in its own process group with output to ``log``; kill it and everything below it
    on timeout, and when this process is interrupted while it runs (Ctrl-C, or SIGTERM raised as an
    exception: ``paratrain``'s handler), before the interrupt goes on: the run's own session does not
    get the terminal's or the caller's signal, so it would outlive ``paratrain plan`` or ``bench``.

    An interrupt while the run starts is held until ``proc`` is known (``signals_held``), then raised
    where it ends the run.

    Returns (exit code, wall seconds); exit code 124 means timed out.
    """
    t0 = time.perf_counter()
    with open(log, "w") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        proc = None
        try:
            with signals_held():
                proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, env=env,
                                        start_new_session=True)
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            rc = 124
        except BaseException:  # interrupted here: end the run and everything below it too
            if proc is None:  # Popen failed: no run started
                raise
            below = descendants(proc.pid)
            try:
                kill_tree(proc)
            except BaseException:  # interrupted again while it waited: no more waiting
                _kill_now(proc, below)
                raise
            raise
    return rc, time.perf_counter() - t0
