"""The Strategy interface: how replicas are set up and how their gradients meet.

The training loop calls only these methods and never asks which strategy it
has. A strategy is constructed with the process' :class:`~paratrain.env.DistEnv`,
then ``setup(model, optimizer)`` once, ``train_step`` every optimizer step,
``teardown`` at the end.

Gradient contract: strategies *average* the replicas' gradients (all-reduce
mean, like DistributedDataParallel). A loss normalised by a global count must
therefore be divided by ``count / num_replicas`` on each replica, so that the
average of the replicas' gradients is the gradient of the global mean.

Optional abilities are mixins checked with ``isinstance``:
:class:`NoSyncMixin` (skip gradient communication on accumulation micro-steps).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Sequence

import torch
from torch import nn

from ..bench.timing import StepClock
from ..env import DistEnv


@dataclass
class StepResult:
    """loss: sum of the micro-batch losses on this replica (detached, 0-dim).
    grad_norm: global L2 norm of the merged gradient before clipping (0-dim), or
    None when clipping is off. spans: labelled (label, start, end) marks of
    ``self.clock`` (labels in :data:`paratrain.bench.timing.CATEGORIES`).
    collective: (start, end) marks of the gradient merge that waits for the other
    replicas, or None (no such wait); the loop uses it to split idle time off.
    skipped: the merged gradient was not finite, so the optimizer did not step."""

    loss: torch.Tensor
    grad_norm: torch.Tensor | None
    spans: list = field(default_factory=list)
    collective: tuple | None = None
    skipped: bool = False  # the merged gradient was not finite (NaN/Inf): no update was made


class NoSyncMixin:
    """Ability: a context in which backward does not communicate (gradient accumulation)."""

    def no_sync(self) -> ContextManager:  # pragma: no cover - interface
        raise NotImplementedError


class IndependentReplicasMixin:
    """Ability marker: replicas never talk to each other (parameter server).

    ``all_reduce`` is rank-local, evaluation runs on rank 0 over the whole
    split, and checkpoints carry no BPTT hidden state (it cannot be gathered).
    """


class Strategy(ABC):
    """Base class. Subclasses set ``name`` and implement ``_wrap`` plus collectives."""

    name: str = ""
    in_process: bool = False  # True: runs in the paratrain process itself (no launcher)

    def __init__(self, env: DistEnv, **options: Any) -> None:
        self.env = env
        self.options = options
        self.model: nn.Module | None = None  # the wrapped model (what forward is called on)
        self.module: nn.Module | None = None  # the plain model (state dicts, evaluation)
        self.optimizer: torch.optim.Optimizer | None = None
        self._clock: StepClock | None = None
        self._grads_ready = None  # mark set by a communication hook when the last gradient bucket is ready

    @property
    def clock(self) -> StepClock:
        """The clock the step's spans are marked on (CUDA events on a GPU device)."""
        if self._clock is None:
            self._clock = StepClock(self.device)
        return self._clock

    @property
    def num_replicas(self) -> int:
        """How many replicas' gradients are averaged each step."""
        return self.env.world_size

    @property
    def towers(self) -> int:
        """Replicas inside this process (tower mode); the loop hands over accumulation x towers micro-batches."""
        return 1

    @property
    def device(self) -> torch.device:
        return self.env.device

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Place the model, make replicas identical, wrap for communication.

        Every rank must call it (collective). ``optimizer`` must already hold
        ``model``'s parameters. Returns (wrapped model, optimizer).
        """
        # a model placed by a placement plan (model parallel) stays where the plan put it
        self.module = model if self.options.get("placed") else model.to(self.device)
        self.optimizer = optimizer
        self.model = self._wrap(self.module)
        return self.model, optimizer

    @abstractmethod
    def _wrap(self, module: nn.Module) -> nn.Module:
        """Return the module forward should be called on."""

    def train_step(self, micro_batches: Sequence[Any], loss_fn: Callable[[nn.Module, Any], torch.Tensor],
                   clip: float = 0.0) -> StepResult:
        """One optimizer step over this replica's micro-batches.

        ``loss_fn(model, micro_batch) -> loss`` (0-dim) is called once per
        micro-batch; gradients of the micro-batch losses are *summed* locally and
        averaged over replicas (communication only on the last micro-batch when
        the strategy has :class:`NoSyncMixin`). Then, on the merged gradient:
        global-norm clipping to ``clip`` (0 = off; Pascanu et al. 2013), the
        optimizer update and ``zero_grad`` (no update when the gradient is not
        finite: ``StepResult.skipped``). Every rank must call it (collective).
        """
        c, spans = self.clock, []
        self._grads_ready = None
        total = None
        last = len(micro_batches) - 1
        for i, mb in enumerate(micro_batches):
            ctx = self.no_sync() if (i < last and isinstance(self, NoSyncMixin)) else nullcontext()
            with ctx:
                t0 = c.mark()
                loss = loss_fn(self.model, mb)
                t1 = c.mark()
                loss.backward()
                t2 = c.mark()
            spans += [("forward", t0, t1), ("backward", t1, t2)]
            total = loss.detach() if total is None else total + loss.detach()
        collective = None
        if self._grads_ready is not None:  # DDP: backward() returned after the all-reduce finished
            spans[-1] = ("backward", t1, self._grads_ready)
            spans.append(("comm", self._grads_ready, t2))
            collective = (self._grads_ready, t2)
        norm, ok = self._update(clip)
        spans.append(("optimizer", t2, c.mark()))
        return StepResult(total, norm, spans, collective, skipped=not ok)

    def _update(self, clip: float) -> tuple[torch.Tensor, bool]:
        """On the merged gradient: global L2 norm (Pascanu et al. 2013 clipping to ``clip`` when
        > 0), then the optimizer step and ``zero_grad``, unless the norm is NaN/Inf: then the
        gradient is dropped and no parameter changes. Returns (norm before clipping, stepped).
        The check reads one scalar per step (a device sync on CUDA)."""
        params = [p for p in self.module.parameters() if p.grad is not None]
        if clip > 0:
            norm = nn.utils.clip_grad_norm_(params, clip, foreach=True)
        else:
            norm = nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        ok = bool(torch.isfinite(norm))
        if ok:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm, ok

    # collectives: every rank must call them, in the same order
    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place all-reduce of ``tensor`` (``op`` in sum, max, min); returns it."""

    @abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """In-place broadcast of ``tensor`` from rank ``src``; returns it."""

    @abstractmethod
    def barrier(self) -> None:
        """Wait until every rank arrives."""

    def optimizer_state_dict(self) -> dict:
        """The optimizer's state_dict for the whole model (what a checkpoint stores)."""
        return self.optimizer.state_dict()

    def load_optimizer_state_dict(self, state: dict) -> None:
        """Load a whole-model optimizer state_dict (from any strategy)."""
        self.optimizer.load_state_dict(state)

    def peer_max(self, tensor: torch.Tensor) -> torch.Tensor:
        """Element-wise max over the replicas that wait for each other every step (collective
        among them; used to split idle time off communication). Default: ``all_reduce(max)``."""
        return self.all_reduce(tensor, "max")

    def metrics(self) -> dict[str, float]:
        """Strategy-specific numbers for the metrics file and summary (rank 0 reads them)."""
        return {}

    def finished(self, local_steps: int, total_steps: int) -> bool:
        """True when training should stop; synchronous replicas stop after ``total_steps`` of their own."""
        return local_steps >= total_steps

    def before_eval(self) -> None:
        """Make the parameters evaluation reads current (every rank calls it before evaluating)."""

    def words_trained(self, local_words: int, local_steps: int) -> int:
        """Tokens trained on by all replicas, given rank 0's count of global-batch tokens."""
        return local_words

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The plain model's state_dict (no wrapper prefixes); same on every rank."""
        return self.module.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a plain model state_dict (from any strategy or world_size) on every rank."""
        self.module.load_state_dict(state)

    def teardown(self) -> None:
        """Release communication resources. Every rank must call it."""
