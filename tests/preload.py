"""New processes for the tests without a new interpreter's imports: a preloaded fork server.

On the 2-core machine a new Python process spends 4-5 s of CPU importing torch and torch._dynamo
(which torch's optimizers import on first use) before it does anything; the suite starts hundreds.
``multiprocessing``'s forkserver imports them once per pytest process (:data:`PRELOAD`), and each
new process is a fork of that server: a single-threaded process that has run nothing, holds no
pytest state, and shares nothing with the test's process afterwards.

- :func:`context`: the start method of the distributed harness's ranks
  (:func:`tests.distributed.harness.run_ranks`).
- :func:`run_cli`: the ``paratrain`` command line as :func:`subprocess.run` would run
  ``python -m paratrain.cli ARGS`` (its own process, working directory, environment, stdout and
  stderr, exit code), forked from the server. The workers it launches are new interpreters, as
  a user's are (``torch.distributed.run``). What only a new interpreter shows (import-time
  failures, the console script, the exit's own cost, signals to a process group) is tested with
  real processes (``fresh=True`` in :func:`tests.e2e.test_cli.paratrain`, test_processes,
  test_bad_input's process cases).

The server has pytest's environment and ``sys.path`` of when it started; :func:`run_cli` gives
each command the environment it is passed.
"""
from __future__ import annotations

import io
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from paratrain.bench.microbench import RANK_PRELOAD

# one fork server per process serves both: whichever of this and bench.microbench.rank_context
# starts it first, the micro-benchmarks' modules are preloaded too
PRELOAD = [*RANK_PRELOAD, "torch.distributed.elastic.multiprocessing", "torch.distributed.run", "paratrain.cli",
           "paratrain.train", "paratrain.strategies", "tests.preload"]


def context():
    """The forkserver context, its server preloading :data:`PRELOAD` (read when the server starts: the
    first process this pytest process starts from it)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _cli(args: list[str], cwd: str, env: dict[str, str], out: str, err: str) -> None:
    """In the forked process: become ``python -m paratrain.cli ARGS`` run in ``cwd`` with ``env``,
    its stdout and stderr the files ``out`` and ``err``; exit as :func:`paratrain.cli.entry` returns
    (after the interpreter's exit handlers, which a forked process does not run by itself)."""
    import atexit

    from paratrain import cli

    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    line = env.get("PYTHONUNBUFFERED") == "1"
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=line, write_through=line)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), errors="backslashreplace",
                                  line_buffering=True)
    sys.argv = [cli.__file__, *args]
    code = 1
    try:
        code = cli.entry()
    finally:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code)


def run_cli(args: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, "-m", "paratrain.cli", *args], cwd=cwd, env=env,
    capture_output=True, text=True, timeout=timeout)``, forked from the preloaded server. Raises
    :class:`subprocess.TimeoutExpired` (the process killed) as that would."""
    with tempfile.TemporaryDirectory(prefix="paratrain-cli-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        proc = context().Process(target=_cli, args=(list(args), str(cwd), dict(env), str(out), str(err)))
        proc.start()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired(["paratrain", *args], timeout, out.read_text(errors="replace"),
                                            err.read_text(errors="replace"))
        return subprocess.CompletedProcess(["paratrain", *args], proc.exitcode, out.read_text(errors="replace"),
                                           err.read_text(errors="replace"))
