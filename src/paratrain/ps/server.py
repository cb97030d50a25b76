"""A parameter server's shard: parameters, their optimizer, versions, and the
synchronous / asynchronous update rules. Pure logic and locks; the RPC endpoints
that call it are in :mod:`paratrain.ps.rpc_api`.

* **sync** (``ps-sync``): the gradients of a step are collected until
  ``required`` workers (all, or W - b with b backup workers; Chen et al. 2016)
  have pushed; they are averaged, clipped by the *global* norm over every shard
  (the servers all-reduce their squared norms), applied, and the version is
  bumped; every waiting worker then gets the new parameters. A gradient for an
  older version is dropped (counted). A step that waits longer than
  ``timeout_s`` fails every waiting worker with an error naming the missing ones; so does a
  step that waits for a worker whose heartbeats stopped (4 intervals: connection lost).
* **async** (``ps-async``): every push is applied on arrival under the shard
  lock; staleness = version at apply time - version the worker pulled, recorded
  for every update; optional staleness-aware lr (lr / staleness; Zhang et al.
  2016, "Staleness-aware Async-SGD").
"""
from __future__ import annotations

import math
import threading
import time
from typing import Callable

import torch
from torch.futures import Future


def heartbeat_interval(timeout_s: float) -> float:
    """Seconds between a PS worker's heartbeats to its servers: min(timeout_s / 4, 5 s), at least 0.5 s."""
    return max(0.5, min(timeout_s / 4, 5.0))


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


class ShardServer:
    """One shard. ``norm_allreduce(t)`` sums a float64 tensor over all shards (sync clipping)."""

    def __init__(self, shard_id: int, num_workers: int, mode: str, *, backup_workers: int = 0,
                 staleness_lr: bool = False, timeout_s: float = 600.0,
                 norm_allreduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.shard_id, self.W, self.mode = shard_id, num_workers, mode
        self.backup, self.staleness_lr, self.timeout_s = backup_workers, staleness_lr, timeout_s
        # a worker whose heartbeats stopped for 4 intervals is gone (its process died, or the network
        # to it): a sync step that waits for it fails then, not after timeout_s (another node's death is
        # seen by no launcher here)
        self.lost_after_s = min(timeout_s, 4 * heartbeat_interval(timeout_s))
        self.norm_allreduce = norm_allreduce or (lambda t: t)
        self.lock = threading.Lock()
        self.ready = threading.Event()
        self.params: list[torch.Tensor] = []
        self.optimizer: torch.optim.Optimizer | None = None
        self.version = 0
        self.lr: float | None = None
        self.pending: dict[int, list[torch.Tensor]] = {}
        self.waiters: list[Future] = []
        self.step_started = 0.0
        self.done: set[int] = set()
        self.dead: set[int] = set()
        self.last_seen: dict[int, float] = {}
        self.busy: set[int] = set()  # workers evaluating or checkpointing: no push expected for a while
        self.staleness: list[int] = []
        self.received = self.applied = self.dropped = 0
        self.update_s = 0.0  # seconds this shard spent averaging, clipping, stepping and copying out updates
        self._sums: list[torch.Tensor] = []  # ps-sync: the mean gradient's buffers, reused every step
        self._sum_busy = False  # a step between _take_sync_step and its update uses them

    # ---- setup and state ---------------------------------------------------
    def init(self, params: list[torch.Tensor], opt_cls: type, opt_defaults: dict) -> None:
        from ..train.optim import optimizer_like  # paratrain.train imports the strategies, which import this

        with self.lock:
            self.params = [p.detach().clone().requires_grad_(True) for p in params]
            self.optimizer = optimizer_like(opt_cls, self.params, opt_defaults) if self.params else None
            self.lr = opt_defaults.get("lr")
            now = time.monotonic()
            self.last_seen = {w: now for w in range(self.W)}
        self.ready.set()

    def pull(self, worker: int = -1, busy: bool = False) -> tuple[int, list[torch.Tensor]]:
        """(version, copies of the parameters); waits for init (rank 0 may still be loading data).
        ``busy``: ``worker`` goes on to evaluate or checkpoint, so it will not push for a while
        (it is declared dead only after ``10 x timeout_s`` of silence; its next push ends that)."""
        wait_s = max(self.timeout_s, 300.0)
        if not self.ready.wait(wait_s):
            raise RuntimeError(f"parameter server {self.shard_id} got no parameters from worker 0 within {wait_s:g} s")
        with self.lock:
            if busy and worker >= 0:
                self.last_seen[worker] = time.monotonic()
                self.busy.add(worker)
            return self.version, [p.detach().clone() for p in self.params]

    def set_params(self, params: list[torch.Tensor]) -> None:
        with self.lock:
            for p, v in zip(self.params, params):
                p.data.copy_(v)

    def optimizer_state(self) -> dict:
        with self.lock:
            return self.optimizer.state_dict() if self.optimizer else {"state": {}, "param_groups": []}

    def snapshot(self, worker: int = -1) -> tuple[int, list[torch.Tensor], dict]:
        """(version, parameters, optimizer state) of one version, taken under the lock (a checkpoint
        of ps-async never mixes parameters and optimizer state of different versions). The worker
        is busy (checkpointing) until its next push."""
        import copy

        with self.lock:
            if worker >= 0:
                self.last_seen[worker] = time.monotonic()
                self.busy.add(worker)
            opt = copy.deepcopy(self.optimizer.state_dict()) if self.optimizer else {"state": {}, "param_groups": []}
            return self.version, [p.detach().clone() for p in self.params], opt

    def load_optimizer_state(self, state: dict) -> None:
        with self.lock:
            if self.optimizer:
                self.optimizer.load_state_dict(state)

    def stats(self, full: bool = True) -> dict:
        """Counters, plus every update's staleness (``full``) or their histogram {staleness: count}."""
        with self.lock:
            out = {"version": self.version, "received": self.received, "applied": self.applied,
                   "dropped": self.dropped, "update_s": self.update_s, "dead": sorted(self.dead),
                   "done": sorted(self.done)}
            if full:
                out["staleness"] = list(self.staleness)
            else:
                hist: dict[int, int] = {}
                for x in self.staleness:
                    hist[x] = hist.get(x, 0) + 1
                out["staleness_hist"] = hist
            return out

    # ---- membership ---------------------------------------------------------
    def alive(self) -> set[int]:
        return set(range(self.W)) - self.done - self.dead

    def required(self) -> int:
        """Gradients a sync step waits for: W - b, fewer once workers finished or died."""
        return max(1, min(self.W - self.backup, len(self.alive())))

    def worker_done(self, worker: int) -> None:
        with self.lock:
            self.done.add(worker)
            self._maybe_apply_sync()

    def recheck(self) -> None:
        """Apply a waiting sync step if membership changes made it complete."""
        with self.lock:
            self._maybe_apply_sync()

    def heartbeat(self, worker: int) -> None:
        """The worker's process is alive (a thread of it posts every few seconds, whatever its
        training thread does: a long evaluation or checkpoint is not silence)."""
        with self.lock:
            self.last_seen[worker] = time.monotonic()

    def check_liveness(self, now: float) -> tuple[list[int], list[tuple[Future, BaseException]]]:
        """Declare workers with no push or heartbeat for timeout_s (10 x timeout_s while busy) dead
        (tolerant modes); fail sync steps past timeout_s."""
        newly_dead, failures = [], []
        with self.lock:
            for w in list(self.alive()):
                limit = self.timeout_s * (10 if w in self.busy else 1)
                if now - self.last_seen.get(w, now) > limit and w not in self.pending:
                    if self.mode == "async" or self.backup > 0:
                        self.dead.add(w)
                        newly_dead.append(w)
            missing = sorted(self.alive() - set(self.pending))
            lost = [w for w in missing if w in self.last_seen and now - self.last_seen[w] > self.lost_after_s]
            late = now - self.step_started > self.timeout_s
            if self.waiters and len(self.pending) < self.required() and (lost or late):
                err = RuntimeError(
                    f"ps-sync step {self.version + 1}: connection to worker(s) {lost} lost (no heartbeat for "
                    f"{self.lost_after_s:g} s); got workers {sorted(self.pending)}" if lost else
                    f"ps-sync step {self.version + 1}: no gradient from worker(s) {missing} within "
                    f"timeout_s={self.timeout_s:g} s (hung or dead); got workers {sorted(self.pending)}")
                failures = [(f, err) for f in self.waiters]
                self.waiters, self.pending = [], {}
        return newly_dead, failures

    # ---- updates ------------------------------------------------------------
    def push(self, worker: int, pulled_version: int, grads: list[torch.Tensor] | None, lr: float | None,
             clip: float, limit: int = 0) -> Future:
        """Hand in a gradient (``None``: this worker's gradient was NaN/Inf; ``limit``: ps-async applies
        no update past that version, the run's last); the future resolves to
        (version, parameters, skipped) after it is handled: ``skipped`` when the version was dropped
        because some worker's gradient was not finite (ps-sync: no part of that step is applied)."""
        fut: Future = Future()
        with self.lock:
            self.last_seen[worker] = time.monotonic()
            self.busy.discard(worker)
            self.received += 1
            if lr is not None and worker == 0:  # rank 0 owns the learning-rate schedule
                self.lr = lr
            if self.mode == "async":
                t0 = time.perf_counter()
                if grads is not None and (limit <= 0 or self.version < limit):
                    self._apply_async(worker, pulled_version, grads)
                elif grads is not None:
                    self.dropped += 1  # past the run's last update (W x steps): the run is over
                out = (self.version, [p.detach().clone() for p in self.params], grads is None)
                self.update_s += time.perf_counter() - t0
                fut.set_result(out)
                return fut
            if pulled_version < self.version or worker in self.pending:
                self.dropped += 1  # late gradient of a step already applied (backup workers)
                fut.set_result((self.version, [p.detach().clone() for p in self.params], False))
                return fut
            if not self.pending:
                self.step_started = time.monotonic()
            self.pending[worker] = grads
            self.waiters.append(fut)
            self.clip = clip
            step = self._take_sync_step()
        if step is not None:
            self._finish_sync_step(*step)
        return fut

    def _maybe_apply_sync(self) -> None:
        """Apply the step if enough gradients are in (lock held on entry; released for the clipping
        all-reduce among the servers, never a blocking collective under the lock)."""
        step = self._take_sync_step()
        if step is not None:
            self.lock.release()
            try:
                self._finish_sync_step(*step)
            finally:
                self.lock.acquire()

    def _take_sync_step(self):
        """(lock held) When ``required`` gradients are in: take them and their waiters out of the
        pending set and return (averaged gradients or None to drop the version, waiters, count)."""
        if self.mode != "sync" or not self.pending or len(self.pending) < self.required():
            return None
        t0 = time.perf_counter()
        workers = sorted(self.pending)
        pending, waiters, self.pending, self.waiters = self.pending, self.waiters, {}, []
        if any(pending[w] is None for w in workers):  # a non-finite gradient: the whole version is dropped
            return None, waiters, len(workers)
        # the mean into buffers kept from step to step: a fresh 8 MB tensor costs this VM ~2 ms of page
        # faults (two per parameter made the ptb_small server's mean 6-16 ms instead of 1-2); the same
        # operations in the same order as clone / += / divide, so the mean is bitwise the same
        first = pending[workers[0]]
        fresh = self._sum_busy or len(self._sums) != len(first) or any(
            b.shape != g.shape or b.dtype != g.dtype for b, g in zip(self._sums, first))
        sums = [torch.empty_like(g) for g in first] if fresh else self._sums
        if not self._sum_busy:
            self._sums, self._sum_busy = sums, True
        for i, g in enumerate(sums):
            g.copy_(first[i])
            for w in workers[1:]:
                g += pending[w][i]
            g.div_(len(workers))
        self.update_s += time.perf_counter() - t0
        return sums, waiters, len(workers)

    def _finish_sync_step(self, grads: list[torch.Tensor] | None, waiters: list[Future], n: int) -> None:
        """(lock not held) Clip by the global norm (an all-reduce among the servers: every server
        takes part, an empty shard or a dropped version with zero), then step under the lock and
        resolve the waiting pushes. ``update_s`` counts this shard's own work: not the all-reduce
        (it waits for the other servers' pushes) nor the wait for the lock."""
        try:
            out = self._update_sync(grads, n)
        except BaseException:
            if grads is not None and grads is self._sums:
                self._sum_busy = False  # the next step may use the buffers again
            raise
        for f in waiters:
            f.set_result(out)

    def _update_sync(self, grads: list[torch.Tensor] | None, n: int) -> tuple:
        """(lock not held) :meth:`_finish_sync_step`'s clipping and step; returns the answer."""
        clip = getattr(self, "clip", 0.0)
        coef, own = None, 0.0
        if clip > 0:
            t0 = time.perf_counter()
            # global norm over every shard, computed as torch.nn.utils.clip_grad_norm_ does (per-tensor
            # norms in the gradients' dtype, then the norm of those), so float32 runs match allreduce
            mine = (torch.stack([torch.linalg.vector_norm(g) for g in grads]).pow(2).sum() if grads
                    else torch.zeros((), dtype=torch.float64))
            own += time.perf_counter() - t0
            total = self.norm_allreduce(mine.double()).sqrt()
            t0 = time.perf_counter()
            coef = (clip / (total + 1e-6)).clamp(max=1.0)
            own += time.perf_counter() - t0
        with self.lock:
            t0 = time.perf_counter()
            if grads is not None:
                for p, g in zip(self.params, grads):
                    p.grad = g.mul_(coef.to(g.dtype)) if coef is not None else g
                self._step(self.lr)
                self.applied += n
                self.staleness.extend([0] * n)
            else:
                self.version += 1  # dropped: the parameters are unchanged, the workers go on together
            out = (self.version, [p.detach().clone() for p in self.params], grads is None)
            if grads is not None and grads is self._sums:
                self._sum_busy = False
            self.update_s += own + time.perf_counter() - t0
        return out

    def _apply_async(self, worker: int, pulled_version: int, grads: list[torch.Tensor]) -> None:
        staleness = self.version - pulled_version
        self.staleness.append(staleness)
        for p, g in zip(self.params, grads):
            p.grad = g
        lr = self.lr / max(1, staleness) if (self.staleness_lr and self.lr is not None) else self.lr
        self._step(lr)
        self.applied += 1

    def _step(self, lr: float | None) -> None:
        if self.optimizer is not None:
            if lr is not None:
                for g in self.optimizer.param_groups:
                    g["lr"] = lr
            self.optimizer.step()
            for p in self.params:
                p.grad = None
        self.version += 1


class StalenessGate:
    """Stale-synchronous admission (Ho et al. 2013, bounded by versions): a worker
    may start a step (pull) only if no update can end up more than ``s`` versions stale.

    Each admitted step i counts o_i, the other steps that overlap it; an update's
    staleness on any shard is at most o_i. A step is admitted when o_j = (steps in
    flight) <= s and every step in flight keeps o_i + 1 <= s. Pushes are never
    blocked, so steps in flight always finish and waiting workers are admitted.
    """

    def __init__(self, max_staleness: int) -> None:
        self.s = max_staleness
        self.lock = threading.Lock()
        self.in_flight: dict[int, int] = {}
        self.queue: list[tuple[int, Future]] = []

    def request(self, worker: int) -> Future:
        """End ``worker``'s previous step (if any) and ask to start its next one."""
        fut: Future = Future()
        with self.lock:
            self.in_flight.pop(worker, None)
            self.queue.append((worker, fut))
            granted = self._grant()
        for f in granted:
            f.set_result(True)
        return fut

    def leave(self, worker: int) -> None:
        """A worker finished or died: it holds no step any more."""
        with self.lock:
            self.in_flight.pop(worker, None)
            self.queue = [(w, f) for w, f in self.queue if w != worker]
            granted = self._grant()
        for f in granted:
            f.set_result(True)

    def _grant(self) -> list[Future]:
        granted = []
        while self.queue:
            worker, fut = self.queue[0]
            n = len(self.in_flight)
            if n > self.s or any(o + 1 > self.s for o in self.in_flight.values()):
                break
            for k in self.in_flight:
                self.in_flight[k] += 1
            self.in_flight[worker] = n
            self.queue.pop(0)
            granted.append(fut)
        return granted
