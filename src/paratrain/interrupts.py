"""SIGTERM raised as an exception (:func:`sigterm_raises`), and SIGINT and SIGTERM held over a few
lines that must not be cut in two, then delivered (:func:`signals_held`).

``signals_held`` is used where an exception raised mid-way would lose work or leave a process behind: a checkpoint's
write and renames (``train.checkpoint``), and the start of a run in a session of its own
(``bench.runner.run_cmd``)."""
from __future__ import annotations

import contextlib
import signal
import threading


class Terminated(BaseException):
    """SIGTERM reached this process (raised by :func:`sigterm_raises`' handler, like KeyboardInterrupt
    for SIGINT)."""


def sigterm_raises(exc: type[BaseException] = Terminated):
    """Make SIGTERM raise ``exc`` in the main thread, so that it unwinds like Ctrl-C: ``finally`` blocks
    run, and a run started in a session of its own is ended by its caller (``bench.runner.run_cmd``)
    instead of left behind by the default action, which ends this process alone.

    Returns the handler it replaced (None where Python did not install it). Call from the main thread
    (``signal.signal`` raises ValueError elsewhere). Used by ``paratrain``'s ``main`` (``Terminated``)
    and the benchmark scripts (``KeyboardInterrupt``)."""
    def terminated(signum, frame):
        raise exc

    return signal.signal(signal.SIGTERM, terminated)


@contextlib.contextmanager
def signals_held(signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)):
    """Hold ``signals`` over the block, then deliver them.

    The held signals are raised again (``signal.raise_signal``) in the order they came, each once,
    under its original handler when the block ends, also when the block raises; the first whose
    handler raises (KeyboardInterrupt, paratrain's SIGTERM) ends that, and those after it are dropped:
    each asked the process to stop, and it is stopping. Only Python-level handlers can be swapped, so this
    acts in the main thread on signals whose handler Python installed (a default or a Python
    function); elsewhere it holds nothing.

    Why, where it is used:
    - a checkpoint's write: an interrupt that arrives mid-write stops the run after the write, with
      the new checkpoint complete, instead of inside ``torch.save``, whose zip writer turns an
      exception raised in its write callback into a failed write ("unexpected pos"), which was then
      reported as a disk that cannot be written;
    - the start of a run in a session of its own: an interrupt raised inside ``subprocess.Popen``,
      after the child started but before the caller knows it, would leave the run behind."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    old = {s: signal.getsignal(s) for s in signals}
    old = {s: h for s, h in old.items() if h is not None and h is not signal.SIG_IGN}
    for s in old:
        signal.signal(s, lambda signum, frame: got.append(signum))
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for s in dict.fromkeys(got):
            signal.raise_signal(s)
