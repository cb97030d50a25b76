"""A worker's life is tied to its launcher's: ``python -m paratrain.child [-m] TARGET ARGS...``.

Every process that ``paratrain launch`` / ``paratrain train`` starts runs through here:

* the parent-death signal (Linux ``prctl(PR_SET_PDEATHSIG, SIGKILL)``; elsewhere a thread
  that watches the parent pid) kills the worker when its launcher dies, even by ``kill -9``,
  so no orphan keeps training and writing into the run dir;
* Ctrl-C reaches every process of the terminal's group: the launcher reports it in one line
  and stops the workers, so a worker leaves quietly (exit 130) instead of printing a traceback;
* then TARGET runs as ``__main__`` (a script path, or a module after ``-m``), with ``sys.argv``
  as if it had been started directly; a ``UsageError`` it raises (a ``pt.*`` call refusing what
  it was given) ends the worker with one line and exit code 2, not a traceback.
"""
from __future__ import annotations

import os
import runpy
import signal
import sys
import threading
import time


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent exits (Linux); elsewhere
    poll the parent pid once a second from a daemon thread."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0:
            if os.getppid() != parent:  # the parent died before prctl took effect
                os.kill(os.getpid(), sig)
            return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), sig)

    threading.Thread(target=watch, name="paratrain-parent-watch", daemon=True).start()


def freeze_before_exit() -> None:
    """Leave everything alive now out of the interpreter's last garbage collection (``gc.freeze``).

    With torch and torch._dynamo (which torch's optimizers import) loaded, that collection costs a
    process about 1.1 s of CPU at exit, and 0.3 s with the freeze (2-vCPU AMD EPYC): a second at the
    end of every ``paratrain`` command and of each of its workers. paratrain's own entry points call
    it when their work is done and their files are closed; a user's script run by :func:`main` ends
    as Python ends it. Objects freed by their reference count still are; objects in reference cycles
    keep their finalisers unrun, which Python never promised to run at exit (the language reference,
    ``object.__del__``): a FileStore's file, for one, stays behind."""
    import gc

    gc.freeze()


def exit_after(main) -> None:
    """``sys.exit(main())`` for a ``__main__`` block of paratrain's own processes, with
    :func:`freeze_before_exit` between them (the exit code is the one ``main`` returned)."""
    code = main()
    freeze_before_exit()
    sys.exit(code)


def main() -> None:
    die_with_parent()
    args = sys.argv[1:]
    module = bool(args) and args[0] == "-m"
    if module:
        args = args[1:]
    if not args:
        print("usage: python -m paratrain.child [-m] TARGET [ARGS...]", file=sys.stderr)
        sys.exit(2)
    target, sys.argv = args[0], list(args)
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            runpy.run_path(target, run_name="__main__")
    except KeyboardInterrupt:
        sys.stderr.flush()
        os._exit(128 + signal.SIGINT)
    except Exception as e:  # paratrain's UsageError from a pt.* call: one line, exit 2, no traceback
        from paratrain.errors import UsageError

        if not isinstance(e, UsageError):
            raise
        rank = os.environ.get("RANK", "?")
        print(f"paratrain: rank {rank}: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
