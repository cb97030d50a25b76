"""Join a parameter-server job as one of its processes: a server shard or a worker.

Every process of the job (workers and servers; torchrun starts ``nproc + num_ps``
per node, see :mod:`.layout`) calls :func:`join`: it joins the default process
group if needed, creates the servers' group (for the global gradient norm) and
the workers' group (collectives among workers: barriers, sync BatchNorm,
logging), starts the RPC agent (TensorPipe; ``init_method`` env:// under
torchrun), then a server serves until every worker is done or declared dead,
while a worker returns its :class:`~paratrain.env.DistEnv` (rank = worker index,
world_size = number of workers) to train. RPC is shut down without a final
barrier, so a dead worker cannot keep the others waiting.
"""
from __future__ import annotations

import datetime
import os
import warnings

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from ..devices import apply_cpu_allocator
from ..env import (
    DistEnv,
    ProcessSettings,
    default_threads,
    join_process_group,
    resolve_device_backend,
    rpc_init_method,
    startup_timeout,
)
from ..errors import UsageError
from .layout import PSLayout


def layout_of(settings: ProcessSettings) -> PSLayout:
    """Workers and servers per node from the job's size: ``local_world_size - num_ps`` workers."""
    num_ps = int(settings.options.get("num_ps", 1))
    world, local_world = settings.resolved("world_size"), settings.resolved("local_world_size")
    nproc = local_world - num_ps
    if nproc < 1 or world % local_world:
        raise UsageError(f"a parameter-server job of {local_world} process(es) per node has no room for "
                         f"{num_ps} server(s) and a worker; start nproc + num_ps processes per node")
    return PSLayout(nproc, num_ps, world // local_world)


# TensorPipe's transports for RPC, by default libuv's TCP only (``$PARATRAIN_RPC_TRANSPORTS``: a comma list,
# e.g. "shm,uv" or "ibv,uv", gives TensorPipe's own choice back). Its shared-memory transport ("shm", picked by
# default between processes of one machine) runs a reactor thread per process that polls without sleeping:
# on a 2-core VM the three processes of a ps-sync job spent most of their CPU in it (sys time), and a
# ptb_quick step took 223 ms instead of 92 ms (2.4x the words/s with uv). Payloads go through TensorPipe's
# channels (cma between local processes where ptrace rules allow it, else over the transport); between
# machines with InfiniBand, "ibv,uv" may be faster than TCP.
RPC_TRANSPORTS = [t.strip() for t in os.environ.get("PARATRAIN_RPC_TRANSPORTS", "uv").split(",") if t.strip()]


def join(settings: ProcessSettings, mode: str) -> tuple[DistEnv | None, dict]:
    """Join the job: ``(DistEnv, strategy options)`` on a worker; ``(None, {"server_stats": ...})``
    on a server after it served. Every process of the job must call it."""
    layout = layout_of(settings)
    rank = settings.resolved("rank")
    role, index = layout.role(rank)
    apply_cpu_allocator(settings.cpu_allocator)
    join_process_group("gloo", rank, layout.world_size, settings)
    server_group, worker_group = (_group(ranks, settings) for ranks in (layout.server_ranks(), layout.worker_ranks()))
    torch.set_num_threads(settings.threads or default_threads(layout.per_node))
    # a step's RPC ends by the servers' own timeout_s (they fail a step that waits too long); the RPC
    # timeout only bounds what has no such answer, start-up included
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=max(16, 4 * layout.num_workers),
                                           rpc_timeout=max(settings.timeout_s + 30, startup_timeout(settings)),
                                           init_method=rpc_init_method(settings, rank, layout.world_size),
                                           _transports=RPC_TRANSPORTS)
    served = _shard(settings, layout, index, mode, server_group) if role == "server" else None
    with warnings.catch_warnings():  # torch's own rpc start-up passes a gloo Backend where it wants a ProcessGroup
        warnings.filterwarnings("ignore", message="You are using a Backend", category=UserWarning)
        rpc.init_rpc(layout.name(role, index), rank=rank, world_size=layout.world_size, rpc_backend_options=opts)
    if served is not None:
        from .rpc_api import serve

        try:
            return None, {"server_stats": serve(*served)}
        finally:
            shutdown_rpc()
    local_rank = index % layout.nproc
    device, _ = resolve_device_backend(settings.device, "gloo", local_rank, layout.nproc)
    env = DistEnv(index, local_rank, layout.num_workers, layout.nproc, "rpc", device)
    options = {k: v for k, v in settings.options.items() if k in ("backup_workers", "max_staleness", "staleness_lr")}
    return env, {**options, "layout": layout, "worker_group": worker_group}


def _group(ranks: list[int], settings: ProcessSettings):
    """A subgroup with the start-up timeout (the strategy arms ``timeout_s`` after set-up).
    Collective over the whole job (every process creates every group)."""
    return dist.new_group(ranks, timeout=datetime.timedelta(seconds=startup_timeout(settings)))


def shutdown_rpc() -> None:
    """Local shutdown: a graceful one is a barrier over every RPC process and would
    wait forever for a dead or hung peer. By then every worker has told every server
    it is done (or is dead), so nothing is outstanding. Safe when RPC never started."""
    try:
        rpc.shutdown(graceful=False)
    except (RuntimeError, AssertionError):
        pass


def _shard(settings: ProcessSettings, layout: PSLayout, index: int, mode: str, server_group):
    """This server's ``(ShardServer, StalenessGate or None)``, registered in its endpoint table
    (:func:`~.rpc_api.register`: before the RPC agent starts, so that no call finds it missing)."""
    from .rpc_api import register
    from .server import ShardServer, StalenessGate

    def norm_allreduce(t: torch.Tensor) -> torch.Tensor:
        if layout.num_servers > 1:
            dist.all_reduce(t, group=server_group)
        return t

    o = settings.options
    shard = ShardServer(index, layout.num_workers, mode, backup_workers=int(o.get("backup_workers", 0)),
                        staleness_lr=bool(o.get("staleness_lr", False)), timeout_s=settings.timeout_s,
                        norm_allreduce=norm_allreduce)
    s = int(o.get("max_staleness", -1))
    gate = StalenessGate(s) if (index == 0 and mode == "async" and s >= 0) else None
    register(shard, gate)
    return shard, gate
