"""Run one benchmark command in its own process group, with a log file and a timeout that
ends the whole process tree (torchrun starts each worker in a session of its own); run several at
once (:func:`runs_at_once`), ended together when the caller is interrupted.

Used by ``paratrain bench``, ``paratrain plan``'s profile and the scripts in ``benchmarks/``."""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, TypeVar

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
    kill_trees([proc])


def kill_trees(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every run of ``procs``: its process group and every process below it (started here);
    wait up to 15 s for the runs, 2 s more for torchrun's agents to end their workers themselves,
    then SIGKILL what is left."""
    below = {proc.pid: descendants(proc.pid) for proc in procs}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for proc in procs:
            _signal_tree(proc, below[proc.pid], sig)
        try:
            deadline = time.monotonic() + 15
            for proc in procs:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            if sig == signal.SIGTERM:
                time.sleep(2)  # give torchrun's agent time to end its workers itself
            below = {pid: [p for p in got if Path(f"/proc/{p}").exists()] for pid, got in below.items()}
            if not any(below.values()):
                return
        except subprocess.TimeoutExpired:
            continue


_RUNNING: set[subprocess.Popen] = set()  # run_cmd's runs going now, on any thread
_ENDING = False  # set by end_running: a run that starts now is ended at once
_LOCK = threading.Lock()


def end_running() -> None:
    """End every run :func:`run_cmd` has going, on any thread (:func:`kill_trees`), and each that
    starts until :func:`runs_at_once` returns: for a caller interrupted while its worker threads
    wait on runs. Call from the main thread."""
    global _ENDING
    with _LOCK:
        _ENDING = True
        procs = list(_RUNNING)
    kill_trees(procs)


T = TypeVar("T")
R = TypeVar("R")


def runs_at_once(run: Callable[[T], R], items: list[T]) -> list[R]:
    """``[run(item) for item in items]``, each on a thread of its own at once (runs side by side, each
    through :func:`run_cmd`), in the order of ``items``. Signals reach the main thread only, so
    :func:`run_cmd` on a worker thread cannot end its run when the caller is interrupted, and the
    caller would wait for every run to finish: an exception here (KeyboardInterrupt, paratrain's
    SIGTERM) ends them (:func:`end_running`) before it goes on. Call from the main thread."""
    global _ENDING
    try:
        with ThreadPoolExecutor(len(items)) as pool:
            try:
                return list(pool.map(run, items))
            except BaseException:
                end_running()
                raise
    finally:
        with _LOCK:
            _ENDING = False


def _signal_tree(proc: subprocess.Popen, below: list[int], sig: int) -> None:
    """Send ``sig`` to the run's process group (started here: start_new_session) and to each of
    ``below``; one already gone, or not ours, is passed over."""
    for target in [proc.pid, *below]:
        try:
            os.killpg(target, sig) if target == proc.pid else os.kill(target, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _kill_now(proc: subprocess.Popen, below: list[int]) -> None:
    """SIGKILL the run's process group, ``below`` and what is below the run now, without waiting."""
    _signal_tree(proc, list(dict.fromkeys([*below, *descendants(proc.pid)])), signal.SIGKILL)


def run_cmd(cmd: list[str], log: Path, timeout_s: float, env: dict, cwd: Path | str | None = None) -> tuple[int, float]:
    """Run ``cmd`` in its own process group with output to ``log``; kill it and everything below it
    on timeout, and when this process is interrupted while it runs (Ctrl-C, or SIGTERM raised as an
    exception: ``paratrain``'s handler), before the interrupt goes on: the run's own session does not
    get the terminal's or the caller's signal, so it would outlive ``paratrain plan`` or ``bench``.

    An interrupt while the run starts is held until ``proc`` is known (``signals_held``), then raised
    where it ends the run (where its handler raises, as paratrain's do). Signals reach the main thread
    only: on a worker thread, call this through :func:`runs_at_once`, which ends the runs for it.

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
                with _LOCK:
                    _RUNNING.add(proc)
                    ending = _ENDING
            if ending:  # started on a worker thread as end_running ended the others
                kill_tree(proc)
                rc = -signal.SIGKILL if proc.returncode is None else proc.returncode
            else:
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
        finally:
            with _LOCK:
                _RUNNING.discard(proc)
    return rc, time.perf_counter() - t0
