"""The distributed environment of one process, read from torchrun's variables.

:class:`DistEnv` is passed explicitly (no global state). :func:`init` creates
it from ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` (set by
``torch.distributed.run``; a plain ``python script.py`` is rank 0 of 1), picks
the device and backend (NCCL when every local worker has its own GPU, else
gloo), sets intra-op threads so local workers never oversubscribe the cores,
and joins the default process group (``env://`` rendezvous) when world_size > 1.
:class:`ProcessSettings` says how (device, backend, threads, timeouts, the
strategy's options); a strategy's ``init_process`` reads it.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .errors import UsageError


@dataclass(frozen=True)
class DistEnv:
    """rank in [0, world_size); local_rank in [0, local_world_size) on this node."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    backend: str = "gloo"
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        """True on rank 0, the only rank that prints progress and writes files."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()


def available_cores() -> int:
    """CPU cores this process may run on (affinity-aware)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@contextlib.contextmanager
def intra_op_threads(threads: int | None):
    """torch's intra-op threads set to ``threads`` (at least 1; None: left as they are) inside the block
    and restored after it, also when it raises. Per process: threads started inside see the same count."""
    old = torch.get_num_threads()
    torch.set_num_threads(old if threads is None else max(1, threads))
    try:
        yield
    finally:
        torch.set_num_threads(old)


def default_threads(local_processes: int, cores: int | None = None) -> int:
    """Intra-op threads per process: cores // local processes, at least 1."""
    return max(1, (cores or available_cores()) // max(1, local_processes))


def resolve_device_backend(device: str, backend: str, local_rank: int,
                           local_world_size: int) -> tuple[torch.device, str]:
    """Choose (device, backend). ``auto`` means CUDA + NCCL when this node has at
    least ``local_world_size`` GPUs, else CPU + gloo. Raises UsageError for
    ``cuda`` without enough GPUs or NCCL with CPU tensors."""
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "auto":
        device = "cuda" if n_gpu >= local_world_size else "cpu"
    if device == "cuda":
        if n_gpu < local_world_size:
            raise UsageError(
                f"dist.device = 'cuda' needs one GPU per local worker: {local_world_size} workers, "
                f"{n_gpu} GPUs; use fewer processes or dist.device = 'cpu'"
            )
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if backend == "auto":
        backend = "nccl" if dev.type == "cuda" else "gloo"
    if backend == "nccl" and dev.type != "cuda":
        raise UsageError("dist.backend = 'nccl' needs CUDA devices; use dist.backend = 'gloo' on CPU")
    return dev, backend


@dataclass(frozen=True, kw_only=True)
class ProcessSettings:
    """How this process joins a job: what :func:`init` and a strategy's ``init_process`` read.

    ``rank``, ``world_size``, ``local_rank``, ``local_world_size``: None = torchrun's
    variables (``RANK``, ...; a plain ``python script.py`` is rank 0 of 1).
    ``threads`` = 0: cores // local processes intra-op threads. ``timeout_s``: every
    collective of the process group; joining it may take ``startup_timeout_s``
    (process start-up is not the behaviour a short ``timeout_s`` is meant to bound).
    ``options``: the strategy's own (``num_ps``, ``devices``, ...).
    """

    device: str = "auto"
    backend: str = "auto"
    threads: int = 0
    interop_threads: int = 0
    cpu_allocator: str = "retain"
    timeout_s: float = 600.0
    startup_timeout_s: float = 300.0
    options: dict = field(default_factory=dict)
    rank: int | None = None
    world_size: int | None = None
    local_rank: int | None = None
    local_world_size: int | None = None
    rpc_init_method: str = "env://"

    _ENV = {"rank": ("RANK", 0), "world_size": ("WORLD_SIZE", 1), "local_rank": ("LOCAL_RANK", 0),
            "local_world_size": ("LOCAL_WORLD_SIZE", 1)}

    def resolved(self, key: str) -> int:
        """``rank``, ``world_size``, ``local_rank`` or ``local_world_size``: the given value, else torchrun's."""
        value = getattr(self, key)
        if value is not None:
            return value
        var, default = self._ENV[key]
        return int(os.environ.get(var, default))


def init(settings: ProcessSettings | None = None) -> DistEnv:
    """Create this process' :class:`DistEnv` and join the process group.

    Every rank must call it (collective when world_size > 1). Sets the intra-op
    threads (``settings.threads``, default cores // local processes) and the CUDA
    device, and how host memory is kept between steps (``settings.cpu_allocator``,
    :func:`~paratrain.devices.apply_cpu_allocator`). Raises UsageError for an impossible device/backend.
    """
    from .devices import apply_cpu_allocator

    s = settings or ProcessSettings()
    apply_cpu_allocator(s.cpu_allocator)
    rank, world_size = s.resolved("rank"), s.resolved("world_size")
    local_rank, local_world = s.resolved("local_rank"), s.resolved("local_world_size")
    dev, backend = resolve_device_backend(s.device, s.backend, local_rank, local_world)
    torch.set_num_threads(s.threads or default_threads(local_world))
    if s.interop_threads:
        try:
            torch.set_num_interop_threads(s.interop_threads)
        except RuntimeError:  # already set in this process (it can be set once)
            pass
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    join_process_group(backend, rank, world_size, s, dev)
    return DistEnv(rank, local_rank, world_size, local_world, backend, dev)


def join_process_group(backend: str, rank: int, world_size: int, settings: ProcessSettings,
                       device: torch.device | None = None) -> None:
    """Join the default process group (env:// rendezvous from torchrun's variables) unless this
    process already has one or is alone. Joining and the collectives of set-up may take
    ``settings.startup_timeout_s``; the strategy arms ``timeout_s`` once set-up is over
    (:meth:`~paratrain.strategies.base.Strategy.arm_timeouts`)."""
    if world_size < 2 or dist.is_initialized():
        return
    startup = datetime.timedelta(seconds=startup_timeout(settings))
    kwargs = {"device_id": device} if device is not None and device.type == "cuda" else {}
    kwargs.update(_restart_store(rank, world_size, startup))
    dist.init_process_group(backend, timeout=startup, **kwargs)


def startup_timeout(settings: ProcessSettings) -> float:
    """Seconds start-up (joining, set-up collectives, the first parameter pull) may take."""
    return max(settings.timeout_s, settings.startup_timeout_s)


def _restart_store(rank: int, world_size: int, timeout: datetime.timedelta) -> dict:
    """After torchrun restarted the worker group: the agent's TCPStore under a per-attempt prefix.

    torchrun's env:// handler reuses the agent's store without a prefix in later attempts
    (pytorch/pytorch#167288), so gloo finds the dead attempt's addresses there and fails with
    "connection refused". First attempt (or no agent store): {} (plain env://)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt == "0" or "MASTER_ADDR" not in os.environ:
        return {}
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=rank == 0 and not agent_store, timeout=timeout)
    return {"store": dist.PrefixStore(f"paratrain/attempt{attempt}", store), "rank": rank, "world_size": world_size}


def rpc_init_method(settings: ProcessSettings, rank: int, world_size: int) -> str:
    """The RPC rendezvous: ``settings.rpc_init_method``, except after torchrun restarted the worker
    group, where env:// would find the dead attempt's addresses in the agent's store (see
    :func:`_restart_store`): then a registered ``paratrain-attempt://`` handler hands RPC that store
    under this attempt's prefix."""
    if settings.rpc_init_method != "env://":
        return settings.rpc_init_method
    timeout = datetime.timedelta(seconds=startup_timeout(settings))
    found = _restart_store(rank, world_size, timeout)
    if not found:
        return "env://"
    store = dist.PrefixStore("rpc", found["store"])

    def handler(url: str, **kwargs):
        yield store, rank, world_size

    from torch.distributed.rendezvous import register_rendezvous_handler

    scheme = f"paratrain-attempt{os.environ['TORCHELASTIC_RESTART_COUNT']}"
    try:
        register_rendezvous_handler(scheme, handler)
    except RuntimeError:  # registered earlier in this process
        pass
    return f"{scheme}://"


def leave_group() -> None:
    """``dist.destroy_process_group()`` after collecting reference cycles: a cycle (such as the autograd
    context of a differentiable all-reduce, as in synchronised BatchNorm) can hold the group's last
    reference past its destruction, and gloo then aborts the process at interpreter exit
    ("terminate called without an active exception"). Local: no rank is waited for."""
    import gc

    gc.collect()
    dist.destroy_process_group()


def shutdown(*, at_exit: bool = False) -> None:
    """Stop RPC (a parameter-server job) and leave the process group; safe when neither was started.
    ``at_exit`` (interpreter exit without an orderly end, other ranks perhaps gone): leave only a gloo
    group (NCCL's shutdown can be collective), not after an uncaught exception (its collective may
    still be queued on a rank that is gone: the launcher ends this process instead), never raise."""
    from .ps.runtime import shutdown_rpc

    shutdown_rpc()
    if not (dist.is_available() and dist.is_initialized()):
        return
    if not at_exit:
        leave_group()
    elif dist.get_backend() == "gloo" and getattr(sys, "last_value", None) is None:
        try:
            leave_group()  # shuts this process' backend down; no collective
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
