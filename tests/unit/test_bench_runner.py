"""bench.runner.run_cmd: the training runs of ``paratrain plan`` and ``bench`` start in sessions of
their own (a timeout kills the whole group), so an interrupt of the caller must end them too."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

PRELUDE = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    from paratrain.bench.runner import run_cmd, runs_at_once
    from paratrain.interrupts import sigterm_raises

    sigterm_raises(KeyboardInterrupt)  # as paratrain's and the benchmark scripts': SIGTERM raised in the main thread
    out = Path(sys.argv[1])
    body = "import os, sys, time; open(sys.argv[1] + '.tmp', 'w').write(str(os.getpid())); " \\
           "os.replace(sys.argv[1] + '.tmp', sys.argv[1]); time.sleep(120)"
""")
"""The callers' start: SIGTERM raises KeyboardInterrupt; ``body``, a run that writes its pid to the
file it is given, then sleeps 120 s."""

CALLER = PRELUDE + textwrap.dedent("""
    if len(sys.argv) > 2:  # the caller is descheduled right after the run starts: the interrupt lands in Popen
        import subprocess, time

        class SlowPopen(subprocess.Popen):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                deadline = time.monotonic() + 120
                while not (out / "sent").exists() and time.monotonic() < deadline:
                    time.sleep(0.01)

        subprocess.Popen = SlowPopen
    try:
        run_cmd([sys.executable, "-c", body, str(out / "child.pid")], out / "run.log", 300, dict(os.environ))
    except KeyboardInterrupt:
        (out / "interrupted").touch()
        raise SystemExit(130)
""")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _interrupt_a_run(tmp_path, *slow: str) -> None:
    script = tmp_path / "caller.py"
    script.write_text(CALLER)
    caller = subprocess.Popen([sys.executable, str(script), str(tmp_path), *slow])
    pid_file, child = tmp_path / "child.pid", None
    try:
        deadline = time.monotonic() + 120  # start-up, apart from the behaviour: two interpreters on a busy machine
        while not pid_file.exists():
            assert caller.poll() is None and time.monotonic() < deadline, "the run never started"
            time.sleep(0.05)
        child = int(pid_file.read_text())
        assert _alive(child) and os.getsid(child) != os.getsid(caller.pid)  # its own session: no signal reaches it
        caller.send_signal(signal.SIGTERM)
        (tmp_path / "sent").touch()
        assert caller.wait(timeout=60) == 130  # the run gets SIGTERM, then up to 15 s before SIGKILL
        assert (tmp_path / "interrupted").exists()
        assert not _alive(child)
    finally:
        caller.kill()
        caller.wait()
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)


def test_an_interrupted_run_cmd_ends_its_run_which_has_a_session_of_its_own(tmp_path):
    _interrupt_a_run(tmp_path)


def test_an_interrupt_while_the_run_starts_still_ends_it(tmp_path):
    """SIGTERM while ``Popen`` has started the run but not returned (a caller descheduled there on a
    busy machine): run_cmd holds it until the run is known, then ends the run."""
    _interrupt_a_run(tmp_path, "slow")


AT_ONCE = PRELUDE + textwrap.dedent("""
    def run(i):
        return run_cmd([sys.executable, "-c", body, str(out / f"child{i}.pid")], out / f"run{i}.log", 300,
                       dict(os.environ))

    try:
        runs_at_once(run, [0, 1])
    except KeyboardInterrupt:
        (out / "interrupted").touch()
        raise SystemExit(130)
""")


def test_an_interrupt_ends_runs_at_once_on_worker_threads_without_waiting_for_them(tmp_path):
    """Two runs at once (the profile's side-by-side runs), each run_cmd on a worker thread, where no
    signal reaches it: SIGTERM to the caller ends both runs, and the caller exits well before the runs'
    120 s would have ended on their own."""
    script = tmp_path / "caller.py"
    script.write_text(AT_ONCE)
    caller = subprocess.Popen([sys.executable, str(script), str(tmp_path)])
    files, children = [tmp_path / f"child{i}.pid" for i in (0, 1)], []
    try:
        deadline = time.monotonic() + 120  # start-up, apart from the behaviour: three interpreters on a busy machine
        while not all(f.exists() for f in files):
            assert caller.poll() is None and time.monotonic() < deadline, "the runs never started"
            time.sleep(0.05)
        children = [int(f.read_text()) for f in files]
        assert all(_alive(c) for c in children)
        caller.send_signal(signal.SIGTERM)
        assert caller.wait(timeout=60) == 130  # SIGTERM to both, then up to 15 s + 2 s; not the runs' 120 s
        assert (tmp_path / "interrupted").exists()
        assert not any(_alive(c) for c in children)
    finally:
        caller.kill()
        caller.wait()
        for c in children:
            if _alive(c):
                os.kill(c, signal.SIGKILL)


def test_a_run_that_starts_while_the_runs_are_ended_is_ended_at_once(tmp_path, monkeypatch):
    """A worker thread's run_cmd that starts its run after end_running took its list: the run is ended
    at once (SIGTERM), not waited for."""
    from paratrain.bench import runner

    monkeypatch.setattr(runner, "_ENDING", True)
    t0 = time.monotonic()
    rc, _ = runner.run_cmd([sys.executable, "-c", "import time; time.sleep(120)"], tmp_path / "run.log", 300,
                           dict(os.environ))
    assert rc == -signal.SIGTERM and time.monotonic() - t0 < 60 and not runner._RUNNING


def test_a_command_that_cannot_start_raises_its_error_and_leaves_no_run(tmp_path):
    from paratrain.bench import runner

    with pytest.raises(FileNotFoundError):
        runner.run_cmd([str(tmp_path / "no-such-program")], tmp_path / "run.log", 60, dict(os.environ))
    assert not runner._RUNNING
