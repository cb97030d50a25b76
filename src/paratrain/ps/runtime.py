"""Run one process of a parameter-server job: a server shard or a worker.

Every process of the job (workers and servers) calls :func:`run_process`: it
joins the default process group if needed, creates the servers' group (for the
global gradient norm) and the workers' group (for the restore barrier), starts
the RPC agent (TensorPipe; ``init_method`` env:// under torchrun), then serves
or trains. RPC is shut down without a final barrier, so a dead worker cannot
keep the others waiting.
"""
from __future__ import annotations

import datetime
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from ..config import Config
from ..env import DistEnv, default_threads, resolve_device_backend
from .layout import PSLayout


def layout_of(cfg: Config) -> PSLayout:
    return PSLayout(cfg.dist.nproc, cfg.dist.num_ps, cfg.dist.nnodes)


def run_process(cfg: Config, run_dir: Path, global_rank: int, *, resume: bool = False,
                data_dir: str | None = None, rpc_init_method: str = "env://", verbose: bool = True,
                run=None) -> dict | None:
    """Serve (server role) or train (worker role) as ``global_rank`` of the PS job.

    Every process of the job must call it. Returns the training summary on
    workers, the shard's stats on servers. ``run(trainer) -> dict`` replaces
    ``trainer.fit()`` on workers (``paratrain verify`` drives the steps itself).
    """
    layout = layout_of(cfg)
    role, index = layout.role(global_rank)
    timeout = datetime.timedelta(seconds=cfg.train.timeout_s)
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=timeout)
    server_group = dist.new_group(layout.server_ranks(), timeout=timeout)
    worker_group = dist.new_group(layout.worker_ranks(), timeout=timeout)
    torch.set_num_threads(cfg.dist.threads or default_threads(layout.per_node))
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=max(16, 4 * layout.num_workers),
                                           rpc_timeout=cfg.train.timeout_s + 30, init_method=rpc_init_method)
    rpc.init_rpc(layout.name(role, index), rank=global_rank, world_size=layout.world_size, rpc_backend_options=opts)
    try:
        if role == "server":
            return _serve(cfg, layout, index, server_group)
        return _train(cfg, layout, index, run_dir, resume, data_dir, worker_group, verbose, run)
    finally:
        _shutdown_rpc()


def _shutdown_rpc() -> None:
    """Local shutdown: a graceful one is a barrier over every RPC process and would
    wait forever for a dead or hung peer. By now every worker has told every server
    it is done (or is dead), so nothing is outstanding."""
    rpc.shutdown(graceful=False)


def _serve(cfg: Config, layout: PSLayout, index: int, server_group) -> dict:
    from .rpc_api import serve
    from .server import ShardServer, StalenessGate

    def norm_allreduce(t: torch.Tensor) -> torch.Tensor:
        if layout.num_servers > 1:
            dist.all_reduce(t, group=server_group)
        return t

    d = cfg.dist
    mode = "sync" if d.strategy == "ps-sync" else "async"
    shard = ShardServer(index, layout.num_workers, mode, backup_workers=d.backup_workers,
                        staleness_lr=d.staleness_lr, timeout_s=cfg.train.timeout_s, norm_allreduce=norm_allreduce)
    gate = StalenessGate(d.max_staleness) if (index == 0 and mode == "async" and d.max_staleness >= 0) else None
    return serve(shard, gate)


def _train(cfg: Config, layout: PSLayout, index: int, run_dir: Path, resume: bool, data_dir: str | None,
           worker_group, verbose: bool, run=None) -> dict:
    from ..train import Trainer
    from ..train.checkpoint import latest, should_resume

    local_rank = index % layout.nproc
    device, _ = resolve_device_backend(cfg.dist.device, "gloo", local_rank, layout.nproc)
    env = DistEnv(index, local_rank, layout.num_workers, layout.nproc, "rpc", device)
    trainer = Trainer(cfg, env, run_dir, data_dir, verbose=verbose,
                      strategy_options={"layout": layout, "worker_group": worker_group,
                                        "max_staleness": cfg.dist.max_staleness,
                                        "backup_workers": cfg.dist.backup_workers})
    try:
        if should_resume(Path(run_dir), resume):
            trainer.restore(latest(Path(run_dir)))
        return run(trainer) if run is not None else trainer.fit()
    finally:
        trainer.close()
