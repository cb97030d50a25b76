"""The benchmark scripts' subprocess runner: ``paratrain.bench.runner`` (``paratrain bench`` uses it
too), started in the repository root. Importing it makes SIGTERM raise KeyboardInterrupt in the
script, as ``paratrain``'s own handler does, so that the runner ends its runs on SIGTERM as on Ctrl-C
(the runs are in sessions of their own: the default action would end the script alone)."""
import signal
import threading
from pathlib import Path

from paratrain.bench import runner
from paratrain.bench.runner import descendants, kill_tree  # noqa: F401
from paratrain.interrupts import sigterm_raises

REPO = Path(__file__).resolve().parent.parent

if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
    sigterm_raises(KeyboardInterrupt)


def run_cmd(cmd: list[str], log: Path, timeout_s: float, env: dict) -> tuple[int, float]:
    """``paratrain.bench.runner.run_cmd`` in the repository root."""
    return runner.run_cmd(cmd, log, timeout_s, env, cwd=REPO)
