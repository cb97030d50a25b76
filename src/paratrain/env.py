"""The distributed environment of one process, read from torchrun's variables.

:class:`DistEnv` is passed explicitly (no global state). :func:`init` creates
it from ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` (set by
``torch.distributed.run``; a plain ``python script.py`` is rank 0 of 1), picks
the device and backend (NCCL when every local worker has its own GPU, else
gloo), sets intra-op threads so local workers never oversubscribe the cores,
and joins the default process group (``env://`` rendezvous) when world_size > 1.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

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


def init(device: str = "auto", backend: str = "auto", threads: int = 0,
         timeout_s: float = 600.0, towers: int = 1, interop_threads: int = 0) -> DistEnv:
    """Create this process' :class:`DistEnv` and join the process group.

    Every rank must call it (collective when world_size > 1). ``threads`` = 0
    sets cores // (LOCAL_WORLD_SIZE x towers) intra-op threads (``interop_threads``
    > 0 sets the inter-op pool). ``timeout_s`` bounds every
    collective of the group. Raises UsageError for an impossible device/backend.
    """
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    dev, backend = resolve_device_backend(device, backend, local_rank, local_world)
    torch.set_num_threads(threads or default_threads(local_world * max(1, towers)))
    if interop_threads:
        try:
            torch.set_num_interop_threads(interop_threads)
        except RuntimeError:  # already set in this process (it can be set once)
            pass
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world_size > 1 and not dist.is_initialized():
        kwargs = {"device_id": dev} if dev.type == "cuda" else {}
        timeout = datetime.timedelta(seconds=timeout_s)
        kwargs.update(_restart_store(rank, world_size, timeout))
        dist.init_process_group(backend, timeout=timeout, **kwargs)
    return DistEnv(rank, local_rank, world_size, local_world, backend, dev)


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


def shutdown() -> None:
    """Leave the process group (safe to call when none was joined)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
