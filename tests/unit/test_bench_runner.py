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

CALLER = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    from paratrain.bench.runner import run_cmd

    def terminated(signum, frame):  # as paratrain's own handler: SIGTERM raised in the main thread
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminated)
    out = Path(sys.argv[1])
    if len(sys.argv) > 2:  # the caller is descheduled right after the run starts: the interrupt lands in Popen
        import subprocess, time

        class SlowPopen(subprocess.Popen):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                deadline = time.monotonic() + 120
                while not (out / "sent").exists() and time.monotonic() < deadline:
                    time.sleep(0.01)

        subprocess.Popen = SlowPopen
    body = "import os, sys, time; open(sys.argv[1] + '.tmp', 'w').write(str(os.getpid())); " \\
           "os.replace(sys.argv[1] + '.tmp', sys.argv[1]); time.sleep(120)"
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
