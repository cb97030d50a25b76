"""Start N worker processes with torchrun's elastic agent (``torch.distributed.run``).

:func:`build_command` is pure: it turns a :class:`LaunchSpec` into the argv of
``python -m torch.distributed.run ...``. :func:`run` hands that argv to
``torch.distributed.run`` in this process and turns every way a job ends into one
line: a worker failure names the rank that failed first (and keeps its exit code),
a node that never arrives names the rendezvous, Ctrl-C / SIGTERM stop every worker.

Single node (the default): c10d rendezvous on ``127.0.0.1`` with port 0, so the
agent picks a free port and nothing listens beyond loopback's address.

Several nodes: every node runs the same command with ``--nnodes``, its own
``--node-rank`` and ``--rdzv-endpoint HOST:PORT`` of node 0. paratrain uses
torchrun's *static* rendezvous there (the ``--master-addr/--master-port`` way):
node 0 hosts the store at HOST:PORT, the others connect to it, in any start
order, and node ``k``'s workers are ranks ``k * nproc .. (k + 1) * nproc - 1``
(``--node-rank`` is honoured; the dynamic c10d rendezvous ignores it and ranks
nodes by join order). The job id (store prefix) is ``--rdzv-id``, else
``$SLURM_JOB_ID`` / ``$PARATRAIN_JOB_ID``, else derived from what every node is
given (endpoint, nnodes, nproc), so two launchers always meet in one rendezvous.
A node that has not arrived within ``rdzv_timeout_s`` ends every waiting node
with one line (exit 2). Static membership means no elastic scaling: a restart
(``--max-restarts``) restarts the same nodes. Workers bind gloo and TensorPipe to
the network interface that reaches HOST, unless ``GLOO_SOCKET_IFNAME`` /
``TP_SOCKET_IFNAME`` are set.

Workers get RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK (the node),
MASTER_ADDR and MASTER_PORT, and die with their launcher (see :mod:`paratrain.child`).
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import signal
import sys
import tempfile
import uuid
from dataclasses import dataclass

LOOPBACK = "127.0.0.1"
DEFAULT_RDZV_TIMEOUT_S = 120


@dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    """What to start. ``target`` is a script path (or a module name when ``module``) and its args."""

    nproc: int
    target: list[str]
    module: bool = False
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str = ""
    rdzv_id: str = ""  # "" = $SLURM_JOB_ID / $PARATRAIN_JOB_ID, else derived (several nodes) or random (one)
    rdzv_timeout_s: int = DEFAULT_RDZV_TIMEOUT_S
    max_restarts: int = 0
    python: str = sys.executable


def job_id(spec: LaunchSpec) -> str:
    """The rendezvous id every node of the job computes alike."""
    if spec.rdzv_id:
        return spec.rdzv_id
    for var in ("PARATRAIN_JOB_ID", "SLURM_JOB_ID"):
        if os.environ.get(var):
            return f"{var.split('_')[0].lower()}-{os.environ[var]}"
    if spec.nnodes == 1:
        return uuid.uuid4().hex[:12]
    key = f"{spec.rdzv_endpoint}|{spec.nnodes}|{spec.nproc}"
    return "paratrain-" + hashlib.sha1(key.encode()).hexdigest()[:12]


def build_command(spec: LaunchSpec) -> list[str]:
    """argv for ``python -m torch.distributed.run`` (pure but for :func:`job_id`; nothing is started).

    The target runs under :mod:`paratrain.child`, which ties the worker's life to its launcher's."""
    cmd = [spec.python, "-m", "torch.distributed.run",
           f"--nproc-per-node={spec.nproc}", f"--nnodes={spec.nnodes}",
           f"--max-restarts={spec.max_restarts}", f"--rdzv-id={job_id(spec)}"]
    if spec.nnodes > 1:
        cmd += ["--rdzv-backend=static", f"--rdzv-endpoint={spec.rdzv_endpoint}", f"--node-rank={spec.node_rank}",
                f"--rdzv-conf=timeout={spec.rdzv_timeout_s}"]
    else:
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint={spec.rdzv_endpoint or LOOPBACK + ':0'}",
                f"--local-addr={LOOPBACK}"]
    cmd += ["--module", "paratrain.child"]
    return cmd + (["-m"] if spec.module else []) + list(spec.target)


def interface_towards(host: str) -> str | None:
    """Name of the network interface whose address this machine uses to reach ``host`` (None if unknown)."""
    import socket

    import psutil

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # UDP: no packet is sent, the kernel only picks the route
            local = s.getsockname()[0]
    except OSError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == local for a in addrs):
            return name
    return None


def run(cmd: list[str], threads_per_process: int | None = None, run_dir=None) -> int:
    """Run a :func:`build_command` argv through ``torch.distributed.run`` in this process.

    Returns 0 when every worker succeeded. Otherwise prints one line per cause to stderr and
    returns: the exit code of the rank that failed first (1 if it was killed by a signal); 2 when
    the nodes never formed a job; 130 / 143 after Ctrl-C / SIGTERM (every worker is stopped).
    """
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.run import parse_args
    from torch.distributed.run import run as torchrun

    assert cmd[1:3] == ["-m", "torch.distributed.run"], cmd
    args = parse_args(cmd[3:])
    if sys.platform.startswith("linux"):
        host = args.rdzv_endpoint.rpartition(":")[0] or LOOPBACK
        ifname = "lo" if args.rdzv_backend != "static" else interface_towards(host)
        if ifname:  # gloo and TensorPipe listen on the interface that reaches the rendezvous host
            os.environ.setdefault("GLOO_SOCKET_IFNAME", ifname)
            os.environ.setdefault("TP_SOCKET_IFNAME", ifname)
    os.environ["OMP_NUM_THREADS"] = str(threads_per_process or os.environ.get("OMP_NUM_THREADS") or 1)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # workers: no c10d socket warnings with C++ frames
    # the agent's own log (worker exit codes, SIGTERMs it sent, exit-barrier traces): the lines below say it once
    for name in [n for n in logging.root.manager.loggerDict if n.startswith(("torch.distributed.elastic",
                                                                            "torch.distributed.run"))]:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory(prefix="paratrain-positions-") as positions:
        os.environ["PARATRAIN_POSITIONS"] = positions  # the workers' watchdogs write their step there
        if not args.log_dir:  # the agent's error files; left to itself it makes a /tmp/torchelastic_* per job
            args.log_dir = os.path.join(positions, "agent")  # read into its exception before this folder goes
        try:
            torchrun(args)
        except (ChildFailedError, SignalException, DistError, RendezvousError):
            if sys.stderr.isatty():  # a worker's progress bar may have been cut mid-line
                sys.stderr.write("\n")
            return _report(sys.exc_info()[1], args, run_dir, positions)
        finally:
            os.environ.pop("PARATRAIN_POSITIONS", None)
    return 0


def _report(e: BaseException, args, run_dir, positions: str) -> int:
    """One line per cause for how the job ended (see :func:`run`); returns the exit code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if isinstance(e, ChildFailedError):
        return _report_failures(e.failures, positions)
    if isinstance(e, SignalException):
        code = 128 + int(e.sigval)
        print(f"paratrain: {signal.Signals(e.sigval).name} received: stopped every worker (exit {code})"
              f"{resume_hint(run_dir)}", file=sys.stderr)
        return code
    print(f"paratrain: {_rendezvous_failure(args, e)}", file=sys.stderr)  # the nodes never formed a job
    return 2


def resume_hint(run_dir) -> str:
    """'; resume from ...' naming the newest checkpoint of ``run_dir`` ('' when no run dir)."""
    if run_dir is None:
        return ""
    from .train.checkpoint import list_checkpoints

    found = list_checkpoints(run_dir)
    return f"; resume from {found[-1]} with --resume {run_dir}" if found else "; no checkpoint had been written yet"


def _report_failures(failures: dict, positions: str) -> int:
    """One line for the rank that failed first (with the step its watchdog last reported), one
    for the ranks stopped because of it."""
    from .watchdog import last_position

    order = sorted(failures.items(), key=lambda kv: (_stopped(kv[1]), kv[1].timestamp, kv[0]))
    rank, first = order[0]
    print(f"paratrain: rank {rank} failed first: {_first_line(first)}{last_position(positions, rank)}",
          file=sys.stderr)
    others = [r for r, f in order[1:]]
    if others:
        print(f"paratrain: stopped the other ranks because of it ({', '.join(map(str, sorted(others)))})",
              file=sys.stderr)
    return first.exitcode if first.exitcode and first.exitcode > 0 else 1


def _stopped(failure) -> bool:
    """Killed by the agent's SIGTERM after another rank failed (not a failure of its own)."""
    return failure.exitcode == -signal.SIGTERM


def _rendezvous_failure(args, e: BaseException) -> str:
    nodes = args.nnodes.split(":")[-1]
    where = args.rdzv_endpoint
    waited = re.search(r"timeout=(\d+)", args.rdzv_conf or "")
    within = f"within {waited.group(1)} s" if waited else "within the timeout"
    joined = re.search(r"(\d+)/(\d+) clients joined", str(e))  # node 0's store counts the nodes that came
    if joined:
        return (f"only {joined.group(1)} of {nodes} nodes joined the rendezvous at {where} {within}; "
                f"start every node with --nnodes {nodes} --rdzv-endpoint {where} (or raise --rdzv-timeout)")
    if int(args.node_rank or 0) > 0:
        return (f"node {args.node_rank} could not reach node 0's rendezvous at {where} {within} "
                f"(1 of {nodes} nodes here); start node 0 with --node-rank 0 --rdzv-endpoint {where}")
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return f"the {nodes} nodes did not form a job at {where}: {first[:200]}"


def _first_line(failure) -> str:
    msg = failure.message
    if isinstance(msg, dict):
        msg = msg.get("message", "")
    msg = str(msg or "").strip()
    if failure.exitcode is not None and failure.exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-failure.exitcode).name}"
        except ValueError:
            pass
    if not msg or msg.startswith("To enable traceback"):
        return f"exit code {failure.exitcode} (its output is above)"
    lines = [ln for ln in msg.splitlines() if ln.strip()]
    return lines[-1][:300] if lines else f"exit code {failure.exitcode}"
