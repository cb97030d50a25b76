"""Start N worker processes with torchrun's elastic agent (``torch.distributed.run``).

:func:`build_command` is pure: it turns a :class:`LaunchSpec` into the argv of
``python -m torch.distributed.run ...``. :func:`run` hands that argv to
``torch.distributed.run`` in this process and turns a worker failure into one
summary line per failed rank (exit code 1) instead of pages of tracebacks.

Single node (the default): c10d rendezvous on ``127.0.0.1`` with port 0, so
the agent picks a free port and nothing listens beyond loopback's address.
Several nodes: every node runs the same command with ``--nnodes``,
``--node-rank`` and ``--rdzv-endpoint HOST:PORT`` of node 0 (torchrun's
c10d rendezvous). Workers get RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR and MASTER_PORT.
"""
from __future__ import annotations

import os
import sys
import uuid
from dataclasses import dataclass, field

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    """What to start. ``target`` is a script path (or a module name when ``module``) and its args."""

    nproc: int
    target: list[str]
    module: bool = False
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str = ""
    rdzv_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    max_restarts: int = 0
    python: str = sys.executable


def build_command(spec: LaunchSpec) -> list[str]:
    """argv for ``python -m torch.distributed.run`` (pure; nothing is started)."""
    cmd = [spec.python, "-m", "torch.distributed.run",
           f"--nproc-per-node={spec.nproc}", f"--nnodes={spec.nnodes}",
           f"--max-restarts={spec.max_restarts}", "--rdzv-backend=c10d",
           f"--rdzv-id={spec.rdzv_id}"]
    if spec.nnodes > 1:
        cmd += [f"--rdzv-endpoint={spec.rdzv_endpoint}", f"--node-rank={spec.node_rank}"]
    else:
        cmd += [f"--rdzv-endpoint={spec.rdzv_endpoint or LOOPBACK + ':0'}", f"--local-addr={LOOPBACK}"]
    if spec.module:
        cmd.append("--module")
    return cmd + list(spec.target)


def run(cmd: list[str], threads_per_process: int | None = None) -> int:
    """Run a :func:`build_command` argv through ``torch.distributed.run`` in this process.

    Returns 0 when every worker succeeded, else 1 after printing
    ``rank R failed: <first line of its error>`` per failed rank to stderr.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args
    from torch.distributed.run import run as torchrun

    assert cmd[1:3] == ["-m", "torch.distributed.run"], cmd
    if f"--rdzv-endpoint={LOOPBACK}:0" in cmd and sys.platform.startswith("linux"):
        # one node: gloo and TensorPipe listen on the loopback interface, whatever the hostname resolves to
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("TP_SOCKET_IFNAME", "lo")
    if threads_per_process:
        os.environ["OMP_NUM_THREADS"] = str(threads_per_process)
    try:
        torchrun(parse_args(cmd[3:]))
    except ChildFailedError as e:
        for rank, failure in sorted(e.failures.items()):
            print(f"paratrain: rank {rank} failed: {_first_line(failure)}", file=sys.stderr)
        return 1
    return 0


def _first_line(failure) -> str:
    msg = failure.message
    if isinstance(msg, dict):
        msg = msg.get("message", "")
    msg = str(msg or "").strip()
    if failure.exitcode is not None and failure.exitcode < 0:
        import signal

        try:
            return f"killed by signal {signal.Signals(-failure.exitcode).name}"
        except ValueError:
            pass
    if not msg or msg.startswith("To enable traceback"):
        return f"exit code {failure.exitcode} (its output is above)"
    lines = [ln for ln in msg.splitlines() if ln.strip()]
    return lines[-1][:300] if lines else f"exit code {failure.exitcode}"
