"""Worker side of the parameter-server strategies (between-graph replication).

Each worker holds a full replica. ``optimizer.step()`` (the wrapped optimizer of
:meth:`Strategy.setup`, in the user's own loop or in the trainer) pushes the
gradient of every parameter shard to its server concurrently (``rpc_async``),
with the learning rate of the optimizer's param group and, for ps-sync, the
clipping threshold given to :meth:`clip_grad_norm_`; then it loads the
parameters each server answers with. The optimizer's state lives on the servers;
the worker's optimizer carries only the learning rate (rank 0's rules the
servers). ps-async with a staleness bound asks for admission to each step and
pulls before its first forward (:meth:`begin_step`).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch import nn

from ..errors import UsageError
from ..strategies.base import Strategy, StepRecord
from ..strategies.wrapping import base_state_dict, user_optimizer_class
from . import rpc_api
from .calls import ServerCalls
from .layout import PSLayout
from .server import staleness_summary  # noqa: F401 (also a public name here)
from .sharding import shard_by_bytes


def require_optimizer(strategy: Strategy) -> None:
    if strategy.optimizer is None:
        raise UsageError(f"strategy {strategy.name!r} needs an optimizer: pass it to setup "
                         f"(pt.setup(model, optimizer)), the parameter servers run its updates")



class ParameterServerStrategy(ServerCalls, Strategy):
    """Options: ``layout`` (PSLayout), ``worker_group`` (c10d group of the workers),
    ``backup_workers``, ``max_staleness`` (-1 = unbounded), ``staleness_lr``."""

    mode = "sync"
    cost_model = "ps"
    merged_before_step = False  # the servers merge the pushed gradients in optimizer.step()
    supports_fp16 = False  # each worker would scale and skip on its own; bf16 needs no scaler
    dist_keys = ("num_ps",)
    launch_env = {"TORCH_CPP_LOG_LEVEL": "ERROR"}  # TensorPipe warns per closed connection at the local RPC shutdown

    # ---- the job -----------------------------------------------------------------------------
    @classmethod
    def processes_per_node(cls, dist_cfg) -> int:
        return dist_cfg.nproc + dist_cfg.num_ps

    @classmethod
    def options(cls, cfg) -> dict[str, Any]:
        d = cfg.dist
        return {"num_ps": d.num_ps, "backup_workers": d.backup_workers, "max_staleness": d.max_staleness,
                "staleness_lr": d.staleness_lr}

    @classmethod
    def init_process(cls, settings):
        from .runtime import join

        return join(settings, cls.mode)

    @classmethod
    def supervised(cls, dist_cfg, rank: int) -> bool:
        """Workers other than 0 run in a child process where losing a worker is tolerated."""
        layout = PSLayout(dist_cfg.nproc, dist_cfg.num_ps, dist_cfg.nnodes)
        role, index = layout.role(rank)
        tolerant = cls.mode == "async" or dist_cfg.backup_workers > 0
        return role == "worker" and index != 0 and tolerant

    # ---- construction ------------------------------------------------------------------------
    def __init__(self, env, **options: Any) -> None:
        super().__init__(env, **options)
        if "layout" not in options:
            raise UsageError(f"strategy {self.name!r} runs under paratrain train/launch with --num-ps; "
                             f"it needs parameter-server processes")
        self.layout: PSLayout = options["layout"]
        self.worker_group = options.get("worker_group")
        self.gated = self.mode == "async" and options.get("max_staleness", -1) >= 0
        self._update_limit = 0  # ps-async: the run's last update (W x steps), set by finished()
        self.wait_s = 0.0
        self._server_clip = 0.0

    @property
    def lockstep(self) -> bool:
        """ps-sync without backup workers: every worker takes every step. Otherwise workers run at
        their own pace (async) or a straggler stops early (backup workers)."""
        return self.mode == "sync" and not self.options.get("backup_workers")

    @classmethod
    def check_config(cls, cfg) -> None:
        """Also refuse ``model.sync_batchnorm`` where the workers do not step together (before any
        process starts; :meth:`stats_group` says the same at set-up for the minimal-change API)."""
        super().check_config(cfg)
        if cfg.model_value("sync_batchnorm", False) and (cls.mode != "sync" or cfg.dist.backup_workers):
            raise UsageError(cls._sync_batchnorm_refusal(bool(cfg.dist.backup_workers)))

    @classmethod
    def _sync_batchnorm_refusal(cls, backup: bool) -> str:
        return (f"sync_batchnorm needs workers that step together; {cls.name}{' with backup workers' if backup else ''}"
                f" does not: use ps-sync without backup workers, or turn model.sync_batchnorm off")

    def _wrap(self, module: nn.Module, batch_dim: int) -> nn.Module:
        return module

    def _groups(self) -> list:
        return [self.worker_group] if self._group_ok() else []

    def stats_group(self):
        if not self.lockstep:
            raise UsageError(self._sync_batchnorm_refusal(self.mode == "sync"))
        return self.worker_group if self.env.world_size > 1 else None

    def _after_setup(self) -> None:
        require_optimizer(self)
        if len(self.optimizer.param_groups) != 1:
            raise UsageError(f"strategy {self.name!r} supports an optimizer with one parameter group "
                             f"(got {len(self.optimizer.param_groups)}): the servers run one update rule")
        self.params = list(self.module.parameters())
        self.shards = shard_by_bytes([p.numel() * p.element_size() for p in self.params], self.layout.num_servers)
        self.servers = [self.layout.name("server", k) for k in range(self.layout.num_servers)]
        self.versions = [0] * len(self.servers)
        if self.env.rank == 0:
            defaults = dict(self.optimizer.defaults)
            opt_cls = user_optimizer_class(self.optimizer)
            futs = [rpc.rpc_async(srv, rpc_api.init_shard,
                                  args=(k, self._shard_tensors(k), opt_cls, defaults))
                    for k, srv in enumerate(self.servers)]
            torch.futures.wait_all(futs)
        self._pull()
        self.barrier()  # start together: otherwise a fast-starting worker runs ahead of the others
        self._admitted = False  # bounded staleness: admitted to the current step

    # ---- parameters to and from the servers ------------------------------------------------------
    def _load(self, answers: list[tuple[int, list[torch.Tensor]]]) -> None:
        for a in answers:  # a server that failed the step answers with the error
            if isinstance(a, BaseException):
                raise RuntimeError(f"[rank {self.env.rank}] {a}")
        self.dropped_version = any(len(a) > 2 and a[2] for a in answers)  # ps-sync: a worker's gradient was not finite
        with torch.no_grad():
            for k, (version, tensors, *_) in enumerate(answers):
                self.versions[k] = version
                for i, t in zip(self.shards[k], tensors):
                    self.params[i].copy_(t)

    def _pull(self, busy: bool = False) -> None:
        """Load the servers' current parameters. ``busy``: no push follows soon (evaluation, checkpoint)."""
        t0 = time.perf_counter()
        futs = [rpc.rpc_async(srv, rpc_api.pull, args=(k, self.env.rank, busy)) for k, srv in enumerate(self.servers)]
        self._load(self._answers(futs))
        self.wait_s += time.perf_counter() - t0

    # ---- the step ------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Bounded staleness: wait until the servers admit this worker's next step (other workers'
        steps in flight), then pull the parameters it will compute on. Once per step."""
        if not self.gated or self._admitted:
            return
        c = self.clock
        m0 = c.mark()
        self._answers([rpc.rpc_async(self.servers[0], rpc_api.gate_request, args=(self.env.rank,))])
        m1 = c.mark()
        self._pull()
        self.record.spans += [("idle", m0, m1), ("comm", m1, c.mark())]
        self._admitted = True

    def clip_grad_norm_(self, max_norm: float, parameters: Iterable[torch.Tensor] | None = None,
                        norm_type: float = 2.0) -> torch.Tensor:
        """ps-async: clip this worker's gradient now (it is the whole gradient of its update).
        ps-sync: the servers clip the *merged* gradient to ``max_norm`` in the next ``step()``
        (global norm over every shard); returns this worker's local norm."""
        if parameters is not None and {id(p) for p in self._params(parameters)} != \
                {id(p) for p in self.module.parameters() if p.grad is not None}:
            raise UsageError(f"{self.name} clips the whole model's gradient; pass model.parameters()")
        if norm_type != 2.0:
            raise UsageError(f"{self.name} clips by the L2 norm; drop norm_type={norm_type}")
        if self.mode == "async":
            return super().clip_grad_norm_(max_norm)
        self._server_clip = max_norm
        self.record.norm = self._total_norm()
        return self.record.norm

    def optimizer_step(self, optimizer: torch.optim.Optimizer, base_step: Callable, closure=None):
        """Push this worker's gradient to every server (ps-sync: they wait for all W, or W - b,
        average, clip, update), load the parameters they answer with. With ``skip_nonfinite`` a
        NaN/Inf gradient is not used: ps-async drops it; ps-sync pushes a vote to drop the
        step, and the servers drop that whole version (no part of it is applied; every worker
        learns it from the answer, so all of them count the step as skipped). Called by every
        worker independently (no collective among workers)."""
        c = self.clock
        rec, self.record = self.record, StepRecord()
        out = None
        if closure is not None:
            with torch.enable_grad():
                out = closure()
        t0 = c.mark()
        finite = True
        if self.skip_nonfinite:
            rec.norm = rec.norm if rec.norm is not None else self._total_norm()
            finite = bool(torch.isfinite(rec.norm))
        rec.spans.append(("optimizer", t0, c.mark()))
        rec.skipped = not finite
        server_clip, self._server_clip = self._server_clip, 0.0
        m1 = c.mark()
        if finite or self.mode == "sync":  # ps-sync: a non-finite gradient is a vote to drop the whole version
            self._push([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().cpu() for p in self.params]
                       if finite else None, optimizer.param_groups[0]["lr"], server_clip)
            rec.skipped = rec.skipped or (self.mode == "sync" and self.dropped_version)
        for p in self.params:
            p.grad = None
        m2 = c.mark()
        rec.spans.append(("comm", m1, m2))  # push + (servers' update) + answer: ps-sync waits for the slowest
        if self.mode == "sync":
            rec.collective = (m1, m2)
        if not finite and not self.gated:  # async, dropped: continue from the servers' current parameters
            self._pull()
        self._admitted = False  # the next step asks for admission again (begin_step)
        self.last_step = rec
        return out

    def _push(self, grads: list[torch.Tensor] | None, lr: float, clip: float) -> None:
        t1 = time.perf_counter()
        futs = [rpc.rpc_async(srv, rpc_api.push, args=(k, self.env.rank, self.versions[k],
                                                       None if grads is None else [grads[i] for i in self.shards[k]],
                                                       lr, clip, self._update_limit))
                for k, srv in enumerate(self.servers)]
        answers = self._answers(futs)
        if not self.gated:
            self._load(answers)
        else:
            errors = [a for a in answers if isinstance(a, BaseException)]
            if errors:
                raise RuntimeError(f"[rank {self.env.rank}] {errors[0]}")
        self.wait_s += time.perf_counter() - t1

    # ---- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The servers' parameters, each shard's taken with its optimizer state in one snapshot (the
        next :meth:`optimizer_state_dict` returns that state: a checkpoint holds one version)."""
        t0 = time.perf_counter()
        futs = [rpc.rpc_async(srv, rpc_api.snapshot, args=(k, self.env.rank)) for k, srv in enumerate(self.servers)]
        snaps = self._answers(futs)
        self._load([(version, params) for version, params, _ in snaps])
        self._snapshot_opt = ([opt for _, _, opt in snaps], list(self.versions))
        self.wait_s += time.perf_counter() - t0
        return self.module.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True):
        """Every worker calls it; rank 0 sends the parameters to the servers, then all pull."""
        out = self.module.load_state_dict(state, strict=strict)
        if self.env.rank == 0:
            futs = [rpc.rpc_async(srv, rpc_api.set_params, args=(k, self._shard_tensors(k)))
                    for k, srv in enumerate(self.servers)]
            torch.futures.wait_all(futs)
        self.barrier()
        self._pull()
        return out

    def optimizer_state_dict(self) -> dict:
        """The servers' optimizer states as one state_dict of the whole model."""
        full = base_state_dict(self.optimizer)
        full["state"] = {}
        taken, self._snapshot_opt = getattr(self, "_snapshot_opt", None), None
        snapshot = taken[0] if taken and taken[1] == self.versions else None  # only right after state_dict()
        for k, srv in enumerate(self.servers):
            part = snapshot[k] if snapshot else self._answers([rpc.rpc_async(srv, rpc_api.optimizer_state, args=(k,))],
                                                             first=k)[0]
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
            self._answers([rpc.rpc_async(srv, rpc_api.load_optimizer_state, args=(k, part))], first=k)

    # ---- collectives among the workers (the worker group) --------------------------------------------
    def _group_ok(self) -> bool:
        return self.worker_group is not None and self.env.world_size > 1

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self._group_ok():
            ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
            dist.all_reduce(tensor, op=ops[op], group=self.worker_group)
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self._group_ok():
            dist.broadcast(tensor, self.layout.global_rank("worker", src), group=self.worker_group)
        return tensor

    def barrier(self) -> None:
        if self._group_ok():
            dist.barrier(group=self.worker_group)

    def all_gather_object(self, obj: Any) -> list[Any]:
        if not self._group_ok():
            return [obj]
        out: list = [None] * self.env.world_size
        dist.all_gather_object(out, obj, group=self.worker_group)
        return out

    # ---- what differs from all-reduce ------------------------------------------------------------------
    def evaluation_share(self) -> tuple[int, int] | None:
        """Workers that step together share evaluation; otherwise rank 0 evaluates the whole split."""
        if self.lockstep:
            return super().evaluation_share()
        return (0, 1) if self.env.rank == 0 else None

    def server_stats(self) -> list[dict]:
        """Every server's counters and staleness histogram (one RPC each, issued concurrently)."""
        futs = [rpc.rpc_async(srv, rpc_api.stats, args=(k, False)) for k, srv in enumerate(self.servers)]
        return [f.wait() for f in futs]

    def metrics(self) -> dict[str, float]:
        """Staleness (mean, p50, p99, max over every shard update), dropped gradients,
        updates, dead workers, this worker's seconds waiting for servers, and the busiest server's
        seconds spent on updates (``server_update_s``: means, clipping, optimizer steps, answers' copies)."""
        st = self.server_stats()
        hist: dict[int, int] = {}
        for s in st:
            for k, n in s["staleness_hist"].items():
                hist[int(k)] = hist.get(int(k), 0) + n
        return {"updates": st[0]["version"], "grads_received": st[0]["received"],
                "grads_dropped": sum(s["dropped"] for s in st), **staleness_summary(hist),
                "dead_workers": len(st[0]["dead"]), "wait_s": self.wait_s,
                "server_update_s": max(s.get("update_s", 0.0) for s in st)}

    def finished(self, local_steps: int, total_steps: int) -> bool:
        """Stop on the servers' count, not this worker's: ps-sync after ``total_steps``
        versions (backup workers: a straggler stops with the rest), ps-async after
        W x ``total_steps`` applied updates (fast workers keep going while a straggler lags)."""
        target = total_steps * (self.env.world_size if self.mode == "async" else 1)
        self._update_limit = target if self.mode == "async" else 0  # the servers apply no update past it
        return max(self.versions) >= target or (self.mode == "sync" and local_steps >= total_steps)

    def before_eval(self) -> None:
        """Evaluate the servers' current parameters (in ps-async the local copy may lag); the servers
        know this worker is busy, not dead, until its next push."""
        self._pull(busy=True)

    def units_trained(self, local_units: int, local_steps: int) -> int:
        """Units in gradients the servers applied (server 0's count)."""
        if local_steps == 0:
            return 0
        per_push = local_units / local_steps / self.env.world_size
        return int(self.server_stats()[0]["applied"] * per_push)

    def describe(self) -> list[str]:
        return [f"parameter server {k}: {len(s)} parameter tensors" for k, s in enumerate(self.shards)]

    def arm_timeouts(self, timeout_s: float) -> None:
        super().arm_timeouts(timeout_s)
        self._start_heartbeats(timeout_s)

    def teardown(self) -> None:
        self.release()

    def release(self) -> None:
        """Tell every server this worker is done (they stop once all are done or dead). Waits for no worker."""
        self._leave()
