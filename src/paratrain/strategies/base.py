"""The Strategy interface: how replicas are set up and how their gradients meet.

A strategy is the one place where data parallelism happens. Both doors use the
same objects:

* the minimal-change API (:mod:`paratrain.api`): ``model, optimizer =
  strategy.setup(model, optimizer)``; the user's own loop calls ``model(...)``,
  ``loss.backward()``, ``torch.nn.utils.clip_grad_norm_`` (or
  :meth:`Strategy.clip_grad_norm_`) and ``optimizer.step()``, and the step
  merges gradients the strategy's way;
* the Task trainer (:mod:`paratrain.train`), which calls :meth:`Strategy.train_step`
  once per optimizer step: the micro-batch loop written once, on top of the same
  wrapped model and optimizer.

Gradient contract: the merge *averages* the gradients of ``num_replicas``
replicas (all-reduce mean, like DistributedDataParallel, or the parameter
server's mean). Towers (:mod:`~paratrain.strategies.replicate`) sit inside one
replica: the wrapped model splits the batch over devices and autograd sums their
gradients, as ``nn.DataParallel`` does. A loss normalised by a count over the
*global* batch must therefore be divided by ``count / num_replicas`` on each
replica, so that the merged gradient is the gradient of the global mean.

What differs between strategies is a method or a class attribute here, never a
switch in the loop: who evaluates (:meth:`evaluation_share`), when training
stops (:meth:`finished`), how work is counted (:meth:`units_trained`), whether
the ranks' loops move together so that the loop may use collectives
(:attr:`lockstep`), whether replicas hold identical parameters
(:attr:`synchronous`). Class methods describe the job a strategy needs
(processes per node, towers, config keys, how to ask for N replicas) so that the
config, the launcher, ``verify`` and ``bench`` learn everything from the
registry in :mod:`paratrain.strategies`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Iterable, Sequence

import torch
from torch import nn

from ..bench.timing import StepClock
from ..env import DistEnv
from .job import JobSpec
from .precision import MixedPrecision
from .step import StepRecord, StepResult
from .state import StrategyState
from .wrapping import ReplicaModule, distribute_optimizer


class Strategy(JobSpec, StrategyState, MixedPrecision, ABC):
    """Base class. Subclasses set ``name``, implement ``_wrap`` and the collectives.

    Options (keyword arguments, all optional): ``timing`` (mark step spans on
    :attr:`clock`; the trainer turns it on), ``skip_nonfinite`` (``optimizer.step()``
    drops a NaN/Inf merged gradient instead of applying it), ``placed`` (the
    model was placed by a placement plan: do not move it), ``precision`` (``fp32``,
    ``bf16`` or ``fp16``: :mod:`.precision`), plus each strategy's own.
    """

    name: str = ""
    in_process: bool = False  # True: runs in the process that calls paratrain train (no launcher)
    synchronous: bool = True  # replicas hold identical parameters after every step
    merged_before_step: bool = True  # .grad holds the merged gradient after backward (not so for a parameter server)
    dist_keys: tuple[str, ...] = ()  # dist.* config keys that only this strategy (and others naming them) reads
    launch_env: dict[str, str] = {}  # environment variables the launcher sets for this strategy's jobs
    cost_model: str | None = None  # its step's formula: paratrain.bench.strategy_model.MODELS or PS
    sharded: bool = False  # ranks hold different parts of the state: DCP checkpoints written by every rank
    collective_forward: bool = False  # every forward is a collective (fsdp): ranks run as many forwards

    plain_tensors: Callable[[Any], Any] | None = None  # fsdp: DTensors made from parameters -> plain tensors

    # ---- construction --------------------------------------------------------------------------------
    def __init__(self, env: DistEnv, **options: Any) -> None:
        self.env = env
        self.options = options
        self.module: nn.Module | None = None  # the plain model (state dicts, evaluation)
        self.engine: nn.Module | None = None  # what training forward runs (DDP, towers, the module)
        self.model: ReplicaModule | None = None  # the wrapped model users call
        self.optimizer: torch.optim.Optimizer | None = None  # the user's optimizer, now distributed
        self.timing = bool(options.get("timing", False))
        self.skip_nonfinite = bool(options.get("skip_nonfinite", False))
        self._clock: StepClock | None = None
        self._grads_ready = None  # mark set by a communication hook when the last gradient bucket is ready
        self.record = StepRecord()  # what clip_grad_norm_ and step() see during the current step
        self.last_step = StepRecord()  # the record of the last finished optimizer.step()
        self.set_precision(str(options.get("precision", "fp32")))

    @property
    def clock(self) -> StepClock:
        """The clock step spans are marked on (CUDA events on a GPU device; a no-op without ``timing``)."""
        if self._clock is None:
            self._clock = StepClock(self.device, enabled=self.timing)
        return self._clock

    @property
    def num_replicas(self) -> int:
        """How many replicas' gradients the merge averages (towers do not count: they sum)."""
        return self.env.world_size

    @property
    def replicas(self) -> int:
        """Data-parallel replicas in the whole job (ranks x towers): the global batch is split this many ways."""
        return self.num_replicas * self.towers_per_process

    @property
    def towers_per_process(self) -> int:
        return 1

    def data_share(self) -> tuple[int, int]:
        """(index, count) of this process' share of the training data: its rank among the processes
        the global batch is split over (pipeline: its replica; the stages of one replica share it)."""
        return self.env.rank, self.env.world_size

    @property
    def device(self) -> torch.device:
        return self.env.device

    def state_optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers whose state this process holds (what a memory tracker must count from before
        the step): the user's, where it steps itself; a strategy that steps another holds that one's."""
        return [self.optimizer] if isinstance(self.optimizer, torch.optim.Optimizer) else []

    @property
    def lockstep(self) -> bool:
        """True when every rank runs the same steps together, so a training loop may call the
        collectives (:meth:`all_reduce`) at the same points on every rank."""
        return True

    # ---- setup ---------------------------------------------------------------------------------------
    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, batch_dim: int = 0,
              sync_batchnorm: bool = False) -> tuple[ReplicaModule, torch.optim.Optimizer | None]:
        """Place the model, make replicas identical, wrap it and the optimizer.

        Every rank must call it (collective). ``optimizer`` (optional; the parameter
        server needs one) must hold ``model``'s parameters; it is returned as the same
        object, whose ``step()`` now merges gradients the strategy's way.
        ``batch_dim``: the batch dimension of the model's tensor inputs and outputs
        (towers split and join along it). ``sync_batchnorm``: BatchNorm layers compute
        their batch statistics over every replica (:mod:`.sync_batchnorm`).
        Returns (wrapped model, optimizer). Raises UsageError for a setup this strategy cannot run.
        """
        if sync_batchnorm:
            model = self._sync_batchnorm(model)
        # a model placed by a placement plan (model parallel) stays where the plan put it
        self.module = model if self.options.get("placed") else model.to(self.device)
        self.engine = self._wrap(self.module, batch_dim)
        self.model = ReplicaModule(self.module, self.engine, self)
        self.start_precision()
        if optimizer is not None:
            self.optimizer = distribute_optimizer(optimizer, self)
        self._after_setup()
        return self.model, self.optimizer

    @abstractmethod
    def _wrap(self, module: nn.Module, batch_dim: int) -> nn.Module:
        """The module training forward runs (DDP, towers, or ``module`` itself)."""

    def _after_setup(self) -> None:
        """Hook after wrapping (parameter server: send the parameters to the servers)."""

    def _sync_batchnorm(self, model: nn.Module) -> nn.Module:
        """Replace BatchNorm layers by ones whose statistics span every replica (default: the
        process group of this strategy's ranks)."""
        from .sync_batchnorm import convert, group_reducer

        return convert(model, group_reducer(self.stats_group()))

    def stats_group(self):
        """The c10d group BatchNorm statistics are summed over (None: this process alone)."""
        return None

    def arm_timeouts(self, timeout_s: float) -> None:
        """After set-up (joining, replicas made identical, consistency checked), every collective of
        this strategy's groups times out after ``timeout_s``; set-up itself may take the start-up
        timeout the groups were created with. Every rank calls it once."""
        import datetime

        import torch.distributed as dist

        if not dist.is_initialized():
            return
        td = datetime.timedelta(seconds=timeout_s)
        dist.group.WORLD.set_timeout(td)
        for group in self._groups():
            group.set_timeout(td)

    def _groups(self) -> list:
        """Process groups of this strategy besides the default one."""
        return []

    # ---- the step ------------------------------------------------------------------------------------
    def no_sync(self) -> ContextManager:
        """Context for accumulation micro-steps: backward does not communicate (default: nothing to skip)."""
        return nullcontext()

    def train_step(self, micro_batches: Sequence[Any], loss_fn: Callable[[nn.Module, Any], torch.Tensor],
                   clip: float = 0.0) -> StepResult:
        """One optimizer step over this rank's micro-batches: the data-parallel step (DESIGN.md).

        ``loss_fn(model, micro_batch) -> loss`` (0-dim) is called once per micro-batch
        with the wrapped model; the gradients of the micro-batch losses are summed
        locally and merged over replicas (communication only on the last micro-batch,
        :meth:`no_sync`). Then, on the merged gradient: global-norm clipping to
        ``clip`` (0 = off; Pascanu et al. 2013), ``optimizer.step()`` and
        ``zero_grad``. Every rank must call it (collective where replicas communicate).
        """
        c, spans, total = self.clock, [], None
        self._grads_ready = None
        self.begin_step()
        last = len(micro_batches) - 1
        for i, mb in enumerate(micro_batches):
            with self.no_sync() if i < last else nullcontext():
                t0 = c.mark()
                loss = self._forward(loss_fn, mb)
                t1 = c.mark()
                self.backward(loss)
                t2 = c.mark()
            spans += [("forward", t0, t1), ("backward", t1, t2)]
            total = loss.detach() if total is None else total + loss.detach()
        collective = None
        if self._grads_ready is not None:  # DDP: backward() returned after the all-reduce finished
            spans[-1] = ("backward", t1, self._grads_ready)
            spans.append(("comm", self._grads_ready, t2))
            collective = (self._grads_ready, t2)
        t3 = c.mark()
        if clip > 0:
            self.clip_grad_norm_(clip)
        spans.append(("optimizer", t3, c.mark()))
        self.optimizer.step()
        t4 = c.mark()
        self.optimizer.zero_grad(set_to_none=True)
        spans.append(("optimizer", t4, c.mark()))
        rec = self.last_step
        return StepResult(total, rec.norm, spans + rec.spans, collective or rec.collective, skipped=rec.skipped)

    def join(self) -> ContextManager:
        """Context around a user's training loop whose ranks may run out of batches at different steps
        (uneven inputs): a rank that is done shadows the others' collectives until all are done.
        Default: nothing to shadow with one process; UsageError with several (this strategy has no
        way to let a rank leave early). Every rank must enter it."""
        if self.env.world_size == 1:
            return nullcontext()
        from ..errors import UsageError

        raise UsageError(f"strategy {self.name!r} cannot train on uneven inputs (ranks with different numbers of "
                         f"batches); give every rank the same number (drop_last=True) or use allreduce")

    def prepare_own_loop(self, batch_dim: int) -> None:
        """Before :func:`paratrain.api.setup` wraps a user's model (the minimal-change API, no Task):
        UsageError for a ``batch_dim`` this strategy cannot split along. Default: nothing."""

    def check_rows(self, rows: int) -> None:
        """UsageError for a ``pt.train_step`` batch of ``rows`` rows this strategy cannot take (the
        pipeline: a multiple of its micro-batches, the same every step). Default: any."""

    def before_plain_forward(self) -> None:
        """Before the wrapped model runs the plain module (evaluation, ``torch.no_grad()``): raise
        UsageError where that module is not current (the pipeline before its stages are gathered).
        Default: nothing."""

    def begin_step(self) -> None:
        """Start an optimizer step (before its first forward): :meth:`train_step` calls it, and so does
        the wrapped model's first training forward after a step in a user's own loop. Default: nothing
        (the parameter server with a staleness bound waits for admission and pulls here)."""

    def clip_grad_norm_(self, max_norm: float, parameters: Iterable[torch.Tensor] | None = None,
                        norm_type: float = 2.0) -> torch.Tensor:
        """Clip the *merged* gradient to global norm ``max_norm`` (Pascanu et al. 2013); returns the
        norm before clipping (0-dim). Call it between backward and ``optimizer.step()``.

        Strategies that merge during backward (single, allreduce, replicate) clip the
        gradient ``torch.nn.utils.clip_grad_norm_`` sees there, so the plain torch call works
        too; the parameter server overrides this (the merge happens in ``step()``).
        ``parameters`` defaults to the whole model.
        """
        self._unscale()
        params = self._params(parameters)
        norm = self._grad_norm([p.grad for p in params], norm_type)
        nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)  # (what clip_grad_norm_ does)
        self.record.norm = norm
        return norm

    def _grad_norm(self, grads: list[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
        """The norm of the merged gradient ``grads`` (0-dim; fsdp: all-reduced over the shards)."""
        if not grads:
            return torch.zeros((), device=self.device)
        return nn.utils.get_total_norm(grads, norm_type, foreach=True)

    def _params(self, parameters: Iterable[torch.Tensor] | None) -> list[torch.Tensor]:
        if parameters is None:
            return [p for p in self.module.parameters() if p.grad is not None]
        if isinstance(parameters, torch.Tensor):
            return [parameters]
        return [p for p in parameters if p.grad is not None]

    def optimizer_step(self, optimizer: torch.optim.Optimizer, base_step: Callable, closure=None):
        """What ``optimizer.step()`` does (the wrapped optimizer calls it): here the gradient is
        already merged (in backward), so: the non-finite guard when ``skip_nonfinite``, then the
        optimizer's own step. Returns what the optimizer's step returns."""
        c = self.clock
        t0 = c.mark()
        record, self.record = self.record, StepRecord()  # this step's; the next one starts fresh
        out = None
        if closure is not None:
            with torch.enable_grad():
                out = closure()
        self._unscale(record)
        if self.skip_nonfinite or self.scaler is not None:  # the scaler's inf check is this one
            norm = record.norm if record.norm is not None else self._total_norm()
            record.norm = norm
            record.skipped = not bool(torch.isfinite(norm))
        if record.skipped:
            optimizer.zero_grad(set_to_none=True)
        else:
            base_step()
        self._update_scale()
        record.spans.append(("optimizer", t0, c.mark()))
        self.last_step = record
        return out

    def _total_norm(self) -> torch.Tensor:
        return self._grad_norm([p.grad for p in self.module.parameters() if p.grad is not None])

    def nonfinite_parameters(self) -> list[str]:
        """Names of the parameters that hold NaN/Inf (every rank agrees; fsdp: a collective)."""
        return [n for n, p in self.module.named_parameters() if not bool(torch.isfinite(p).all())]

    # ---- collectives: every rank (of those that step together) must call them, in the same order ----
    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place all-reduce of ``tensor`` over the data-parallel ranks (``op`` in sum, max, min); returns it."""

    @abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """In-place broadcast of ``tensor`` from rank ``src``; returns it."""

    @abstractmethod
    def barrier(self) -> None:
        """Wait until every data-parallel rank arrives."""

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order. Default: this process alone."""
        return [obj]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` (picklable) on every rank. Default: through :meth:`all_gather_object`."""
        return self.all_gather_object(obj)[src]

    # ---- what differs between strategies, as methods --------------------------------------------------
    def evaluation_share(self) -> tuple[int, int] | None:
        """(index, count) of this rank's share of evaluation work, or None when it evaluates nothing.
        Default: every rank evaluates its share and the sums are all-reduced."""
        return self.env.rank, self.env.world_size

    def finished(self, local_steps: int, total_steps: int) -> bool:
        """True when training should stop; synchronous replicas stop after ``total_steps`` of their own."""
        return local_steps >= total_steps

    def eval_context(self) -> ContextManager:
        """Context the evaluation forwards of :attr:`module` run in. Default: none (float32, whatever
        the training precision; fsdp with bf16 needs autocast, its layers' outputs are float32)."""
        return nullcontext()

    def before_eval(self) -> None:
        """Make the parameters evaluation reads current (every rank calls it before evaluating)."""

    def units_trained(self, local_units: int, local_steps: int) -> int:
        """Units (words, samples) trained on by all replicas, given rank 0's count of global-batch units."""
        return local_units

    def metrics(self) -> dict[str, float]:
        """Strategy-specific numbers for the metrics file and summary (rank 0 reads them)."""
        return {}

    def describe(self) -> list[str]:
        """Lines for the placement log (towers, servers); default none."""
        return []

    def teardown(self) -> None:
        """Release communication resources. Every rank must call it."""
        self.release()

    def release(self) -> None:
        """The part of :meth:`teardown` that waits for no other rank (safe at interpreter exit after a
        failure). Default: nothing."""

