"""RPC endpoints of a parameter-server process and the loop that serves them.

A server process keeps its :class:`ShardServer` in ``_SHARDS`` (the endpoint
table of that process, filled by :func:`register` before its RPC agent starts and emptied when
:func:`serve` returns):
RPC calls name module-level functions, so the table is how they find the shard.
Gradients and parameters travel as lists of CPU tensors through TensorPipe.
"""
from __future__ import annotations

import time

import torch
import torch.distributed.rpc as rpc
from torch.futures import Future

from ..errors import TrainingStopped
from .server import ShardServer, StalenessGate

_SHARDS: dict[int, ShardServer] = {}
_GATE: dict[int, StalenessGate] = {}


def _shard(k: int) -> ShardServer:
    return _SHARDS[k]


def init_shard(k: int, params: list[torch.Tensor], opt_cls: type, opt_defaults: dict) -> None:
    _shard(k).init(params, opt_cls, opt_defaults)


def pull(k: int, worker: int = -1, busy: bool = False) -> tuple[int, list[torch.Tensor]]:
    return _shard(k).pull(worker, busy)


@rpc.functions.async_execution
def push(k: int, worker: int, pulled_version: int, grads: list[torch.Tensor] | None, lr: float | None,
         clip: float, limit: int = 0) -> Future:
    return _shard(k).push(worker, pulled_version, grads, lr, clip, limit)


def set_params(k: int, params: list[torch.Tensor]) -> None:
    _shard(k).set_params(params)


def optimizer_state(k: int) -> dict:
    return _shard(k).optimizer_state()


def snapshot(k: int, worker: int = -1) -> tuple[int, list[torch.Tensor], dict]:
    return _shard(k).snapshot(worker)


def load_optimizer_state(k: int, state: dict) -> None:
    _shard(k).load_optimizer_state(state)


def stats(k: int, full: bool = True) -> dict:
    return _shard(k).stats(full)


def heartbeat(k: int, worker: int) -> None:
    _shard(k).heartbeat(worker)


def worker_done(k: int, worker: int) -> None:
    _shard(k).worker_done(worker)
    if 0 in _GATE:
        _GATE[0].leave(worker)


@rpc.functions.async_execution
def gate_request(worker: int) -> Future:
    return _GATE[0].request(worker)


def register(shard: ShardServer, gate: StalenessGate | None = None) -> None:
    """Put ``shard`` (and the staleness gate) in this process's endpoint table. Called before this
    process starts its RPC agent: ``init_rpc`` is collective, so no worker can call an endpoint before
    every server's shard is there (a worker that built its model sooner than its server built the
    shard found an empty table: ``KeyError``)."""
    _SHARDS[shard.shard_id] = shard
    if gate is not None:
        _GATE[0] = gate


def unregister(shard_id: int) -> None:
    """Take shard ``shard_id`` (and the staleness gate) out of this process's endpoint table, if there."""
    _SHARDS.pop(shard_id, None)
    _GATE.pop(0, None)


def serve(shard: ShardServer, gate: StalenessGate | None = None, poll_s: float = 0.2) -> dict:
    """Serve ``shard`` (:func:`register`-ed) until every worker is done or declared dead; returns its
    final stats, and takes the shard out of the table.

    Runs on the server's main thread while RPC threads handle pushes and pulls.
    """
    try:
        while shard.alive():
            time.sleep(poll_s)
            newly_dead, failures = shard.check_liveness(time.monotonic())
            for w in newly_dead:
                print(f"[ps {shard.shard_id}] worker {w} silent for {shard.timeout_s:g} s: declared dead; "
                      f"training continues with workers {sorted(shard.alive())}", flush=True)
                if gate is not None:
                    gate.leave(w)
            for fut, err in failures:
                fut.set_exception(err)
            if failures:  # the step cannot complete: end this server too (torchrun ends the job)
                time.sleep(1.0)  # let the errors reach the workers first
                raise TrainingStopped(f"parameter server {shard.shard_id}: {failures[0][1]}; this server stops "
                                      f"(the workers were told)")  # one line from worker.main, no traceback
            if newly_dead:
                shard.recheck()  # a sync step may need fewer gradients now
        time.sleep(2 * poll_s)  # let the answer to the last worker_done leave before RPC shuts down
        return shard.stats()
    finally:
        unregister(shard.shard_id)
