"""Worker side of the parameter-server strategies (between-graph replication).

Each worker holds a full replica. A step: (ps-async with a staleness bound:
wait for admission and pull) forward and backward on this worker's shard of
the global batch, push the gradient of every parameter shard to its server
concurrently (``rpc_async``), and load the parameters each server answers
with. The optimizer lives on the servers; the worker's own optimizer only
carries the learning rate set by the schedule (rank 0's rules the servers).
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch import nn

from ..strategies.base import IndependentReplicasMixin, StepResult, Strategy
from . import rpc_api
from .layout import PSLayout
from .sharding import shard_by_bytes


def staleness_summary(hist: dict[int, int]) -> dict[str, float]:
    """mean, p50, p99, max of a staleness histogram {staleness: count}."""
    n = sum(hist.values())
    if not n:
        return {"staleness_mean": 0.0, "staleness_p50": 0.0, "staleness_p99": 0.0, "staleness_max": 0.0}
    keys = sorted(hist)

    def q(f: float) -> float:  # nearest-rank percentile
        rank, seen = max(0, math.ceil(f * n) - 1), 0
        for k in keys:
            seen += hist[k]
            if seen > rank:
                return float(k)
        return float(keys[-1])

    return {"staleness_mean": sum(k * c for k, c in hist.items()) / n, "staleness_p50": q(0.5),
            "staleness_p99": q(0.99), "staleness_max": float(keys[-1])}


class ParameterServerStrategy(IndependentReplicasMixin, Strategy):
    """Options: ``layout`` (PSLayout), ``worker_group`` (c10d group of the workers),
    ``backup_workers``, ``max_staleness`` (-1 = unbounded), ``staleness_lr``."""

    mode = "sync"

    def __init__(self, env, **options: Any) -> None:
        super().__init__(env, **options)
        if "layout" not in options:
            from ..errors import UsageError

            raise UsageError(f"strategy {self.name!r} runs under paratrain train/launch with --num-ps; "
                             f"it needs parameter-server processes")
        self.layout: PSLayout = options["layout"]
        self.worker_group = options.get("worker_group")
        self.gated = self.mode == "async" and options.get("max_staleness", -1) >= 0
        self.wait_s = 0.0

    # ---- setup ---------------------------------------------------------------
    def _wrap(self, module: nn.Module) -> nn.Module:
        return module

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        super().setup(model, optimizer)
        self.params = list(self.module.parameters())
        self.shards = shard_by_bytes([p.numel() * p.element_size() for p in self.params], self.layout.num_servers)
        self.servers = [self.layout.name("server", k) for k in range(self.layout.num_servers)]
        self.versions = [0] * len(self.servers)
        if self.env.rank == 0:
            defaults = dict(optimizer.defaults)
            futs = [rpc.rpc_async(srv, rpc_api.init_shard,
                                  args=(k, [self.params[i].detach().cpu() for i in self.shards[k]], type(optimizer), defaults))
                    for k, srv in enumerate(self.servers)]
            torch.futures.wait_all(futs)
        self._pull()
        self.barrier()  # start together: otherwise a fast-starting worker runs ahead of the others
        return self.model, optimizer

    def _load(self, answers: list[tuple[int, list[torch.Tensor]]]) -> None:
        for a in answers:  # a server that failed the step answers with the error
            if isinstance(a, BaseException):
                raise RuntimeError(f"[rank {self.env.rank}] {a}")
        with torch.no_grad():
            for k, (version, tensors) in enumerate(answers):
                self.versions[k] = version
                for i, t in zip(self.shards[k], tensors):
                    self.params[i].copy_(t)

    def _pull(self) -> None:
        t0 = time.perf_counter()
        futs = [rpc.rpc_async(srv, rpc_api.pull, args=(k,)) for k, srv in enumerate(self.servers)]
        self._load(torch.futures.wait_all(futs))
        self.wait_s += time.perf_counter() - t0

    # ---- the step --------------------------------------------------------------
    def train_step(self, micro_batches: Sequence[Any], loss_fn: Callable[[nn.Module, Any], torch.Tensor],
                   clip: float = 0.0) -> StepResult:
        """Compute this worker's gradient, push it to every server, load the answers.

        Called by every worker independently (no collective among workers).
        """
        c, spans = self.clock, []
        if self.gated:  # bounded staleness: wait for admission (other workers), then pull
            t0 = c.mark()
            rpc.rpc_sync(self.servers[0], rpc_api.gate_request, args=(self.env.rank,))
            t1 = c.mark()
            self._pull()
            spans += [("idle", t0, t1), ("comm", t1, c.mark())]
        total = None
        for mb in micro_batches:
            t0 = c.mark()
            loss = loss_fn(self.model, mb)
            t1 = c.mark()
            loss.backward()
            spans += [("forward", t0, t1), ("backward", t1, c.mark())]
            total = loss.detach() if total is None else total + loss.detach()
        t0, server_clip = c.mark(), clip
        if self.mode == "async" and clip > 0:  # the worker has the whole gradient of its update
            norm = nn.utils.clip_grad_norm_(self.params, clip, foreach=True)
            server_clip = 0.0
        else:
            norm = nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None], foreach=True)
        spans.append(("optimizer", t0, c.mark()))
        finite = bool(torch.isfinite(norm))
        if not finite and self.mode == "async":  # drop this gradient: nothing is pushed
            for p in self.params:
                p.grad = None
            m1 = c.mark()
            self._pull()
            spans.append(("comm", m1, c.mark()))
            return StepResult(total, norm, spans, None, skipped=True)
        t1 = time.perf_counter()
        m1 = c.mark()
        # ps-sync needs every worker's push for the version to complete: a non-finite gradient goes as zeros
        grads = [(p.grad if p.grad is not None and finite else torch.zeros_like(p)).detach().cpu() for p in self.params]
        lr = self.optimizer.param_groups[0]["lr"]
        futs = [rpc.rpc_async(srv, rpc_api.push,
                              args=(k, self.env.rank, self.versions[k], [grads[i] for i in self.shards[k]], lr, server_clip))
                for k, srv in enumerate(self.servers)]
        answers = [f.wait() for f in futs]
        if not self.gated:
            self._load(answers)
        else:
            errors = [a for a in answers if isinstance(a, BaseException)]
            if errors:
                raise RuntimeError(f"[rank {self.env.rank}] {errors[0]}")
        for p in self.params:
            p.grad = None
        self.wait_s += time.perf_counter() - t1
        m2 = c.mark()
        # push + (servers' update) + answer: ps-sync waits here for the slowest worker
        spans.append(("comm", m1, m2))
        return StepResult(total, norm, spans, (m1, m2) if self.mode == "sync" else None, skipped=not finite)

    def peer_max(self, tensor: torch.Tensor) -> torch.Tensor:
        """ps-sync without backup workers: the workers move in lock-step, max over the worker
        group. Otherwise workers are at different steps: no per-step comparison (identity)."""
        if self.mode == "sync" and not self.options.get("backup_workers") and self.worker_group is not None \
                and self.env.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.worker_group)
        return tensor

    # ---- state -------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        self._pull()
        return self.module.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Every worker calls it; rank 0 sends the parameters to the servers, then all pull."""
        self.module.load_state_dict(state)
        if self.env.rank == 0:
            futs = [rpc.rpc_async(srv, rpc_api.set_params, args=(k, [self.params[i].detach().cpu() for i in self.shards[k]]))
                    for k, srv in enumerate(self.servers)]
            torch.futures.wait_all(futs)
        self.barrier()
        self._pull()

    def optimizer_state_dict(self) -> dict:
        """The servers' optimizer states as one state_dict of the whole model (rank 0)."""
        full = self.optimizer.state_dict()
        full["state"] = {}
        for k, srv in enumerate(self.servers):
            part = rpc.rpc_sync(srv, rpc_api.optimizer_state, args=(k,))
            for local, st in part.get("state", {}).items():
                full["state"][self.shards[k][int(local)]] = st
        return full

    def load_optimizer_state_dict(self, state: dict) -> None:
        """Split a whole-model optimizer state over the servers (rank 0 sends)."""
        if self.env.rank != 0:
            return
        group = state["param_groups"][0]
        for k, srv in enumerate(self.servers):
            part = {"state": {j: state["state"][i] for j, i in enumerate(self.shards[k]) if i in state["state"]},
                    "param_groups": [dict(group, params=list(range(len(self.shards[k]))))]}
            rpc.rpc_sync(srv, rpc_api.load_optimizer_state, args=(k, part))

    # ---- reductions and metrics -------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return tensor  # replicas do not talk to each other: rank-local

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        return tensor

    def barrier(self) -> None:
        if self.worker_group is not None and self.env.world_size > 1:
            dist.barrier(group=self.worker_group)

    def server_stats(self) -> list[dict]:
        """Every server's counters and staleness histogram (one RPC each, issued concurrently)."""
        futs = [rpc.rpc_async(srv, rpc_api.stats, args=(k, False)) for k, srv in enumerate(self.servers)]
        return [f.wait() for f in futs]

    def metrics(self) -> dict[str, float]:
        """Staleness (mean, p50, p99, max over every shard update), dropped gradients,
        updates, dead workers, and this worker's seconds waiting for servers."""
        st = self.server_stats()
        hist: dict[int, int] = {}
        for s in st:
            for k, n in s["staleness_hist"].items():
                hist[int(k)] = hist.get(int(k), 0) + n
        return {"updates": st[0]["version"], "grads_received": st[0]["received"],
                "grads_dropped": sum(s["dropped"] for s in st), **staleness_summary(hist),
                "dead_workers": len(st[0]["dead"]), "wait_s": self.wait_s}

    def finished(self, local_steps: int, total_steps: int) -> bool:
        """Stop on the servers' count, not this worker's: ps-sync after ``total_steps``
        versions (backup workers: a straggler stops with the rest), ps-async after
        W x ``total_steps`` applied updates (fast workers keep going while a straggler lags)."""
        target = total_steps * (self.env.world_size if self.mode == "async" else 1)
        return max(self.versions) >= target or (self.mode == "sync" and local_steps >= total_steps)

    def before_eval(self) -> None:
        """Evaluate the servers' current parameters (in ps-async the local copy may lag)."""
        self._pull()

    def words_trained(self, local_words: int, local_steps: int) -> int:
        """Target tokens in gradients the servers applied (server 0's count)."""
        if local_steps == 0:
            return 0
        per_push = local_words / local_steps / self.env.world_size
        return int(self.server_stats()[0]["applied"] * per_push)

    def teardown(self) -> None:
        """Tell every server this worker is done (they stop once all are done or dead)."""
        for k, srv in enumerate(self.servers):
            rpc.rpc_sync(srv, rpc_api.worker_done, args=(k, self.env.rank))
