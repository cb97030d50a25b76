"""The minimal-change API: your own training loop, any strategy, a few changed lines.

Horovod's ``DistributedOptimizer`` and Lightning Fabric's ``setup`` are the
model: the loop stays yours::

    import paratrain as pt
    env = pt.init()                                  # rank, world_size, device; the strategy's process setup
    model, optimizer = pt.setup(model, optimizer)    # optimizer.step() merges gradients the strategy's way
    train_data = pt.shard(train_data)                # this rank's part of every global batch
    ...                                              # zero_grad / forward / backward / clip / step / lr: unchanged
    pt.print(...); pt.save(obj, path); obj = pt.load(path); x = pt.all_mean(x)

The strategy comes from ``pt.init(strategy=...)``, else ``$PARATRAIN_STRATEGY``,
else ``paratrain launch --strategy S``, else ``allreduce`` under a launcher with
several processes and ``single`` in a plain ``python script.py``. The same script
therefore runs on one device, under ``paratrain launch --nproc N`` (DDP), on
towers (``--strategy replicate --devices cpu:0,cpu:1``: the wrapped model splits
each batch, like ``nn.DataParallel``), or with parameter servers (``--strategy
ps-sync --num-ps K``: ``optimizer.step()`` pushes the gradients and pulls the new
parameters; the server processes run the same script and serve inside
``pt.init()``, which they never leave).

What each call does on every strategy:

* gradient clipping: ``torch.nn.utils.clip_grad_norm_`` between backward and step
  acts on the merged gradient for ``single``, ``allreduce`` and ``replicate``
  (they merge during backward). :func:`clip_grad_norm_` does it on every strategy,
  the parameter server included (its servers clip the merged gradient). Use it.
* gradient accumulation: ``with pt.no_sync(): loss.backward()`` on all but the
  last micro-batch of a step (DDP's ``no_sync``; a no-op where nothing is communicated).
* the learning rate: set ``optimizer.param_groups[i]["lr"]`` or use an LR scheduler
  as before (the parameter server sends group 0's lr with every push).
* one call per step: :func:`train_step` runs forward, backward, merge, clipping and the
  optimizer's step; under ``pipeline`` (each process one stage) it is the way to train, and
  :func:`gather_model` makes the model whole before an evaluation.
* the wrapped model behaves as yours: ``model.init_hidden(...)`` and other
  attributes, ``state_dict()`` without prefixes; evaluation and ``torch.no_grad()``
  forward run the plain module (no collective).

These functions act on the process's *session* (:class:`Session`), made by
:func:`init` and ended by :func:`shutdown`: one per process, by design the only
process-wide state of paratrain (the API is module-level, as Horovod's is).
"""
from __future__ import annotations

import atexit
import builtins
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterable

import torch
from torch import nn

from .env import DistEnv
from .errors import UsageError


@dataclass
class Session:
    """This process' part of the job: its :class:`DistEnv`, the strategy object, its options."""

    env: DistEnv
    strategy: Any
    config: Any
    models: list = field(default_factory=list)


_SESSIONS: list[Session] = []  # at most one: pt.init() makes it, pt.shutdown() ends it


def _current() -> Session:
    if not _SESSIONS:
        raise RuntimeError("paratrain is not initialised in this process: call pt.init() first")
    return _SESSIONS[0]


def session() -> Session:
    """The session :func:`init` made (RuntimeError before it)."""
    return _current()


def _config(strategy: str | None, options: dict[str, Any]):
    """The job's [dist]/[train] settings: ``paratrain launch``'s (``$PARATRAIN_CONFIG``), then
    ``$PARATRAIN_STRATEGY``, then ``strategy`` and ``options`` (they win). Validated like a recipe."""
    from . import config
    from .strategies import STRATEGIES, default_for

    raw = json.loads(os.environ.get("PARATRAIN_CONFIG") or "{}")
    dist = dict(raw.get("dist", {}))
    world = int(os.environ.get("WORLD_SIZE", 1))
    name = strategy or os.environ.get("PARATRAIN_STRATEGY") or dist.get("strategy") or default_for(world)
    if name not in STRATEGIES:
        raise UsageError(f"strategy {name!r} is not registered; use one of {', '.join(STRATEGIES)}")
    dist.update(options, strategy=name)
    if "nproc" not in dist:  # started without paratrain launch: count from torchrun's variables
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        servers = int(dist.get("num_ps", 1)) if "num_ps" in STRATEGIES[name].dist_keys else 0
        dist.update(nproc=max(1, local - servers), nnodes=max(1, world // max(local, 1)))
    return config.from_dict({"dist": dist, "train": raw.get("train", {})})


def init(strategy: str | None = None, **options: Any) -> DistEnv:
    """Join the job with a strategy and return this rank's :class:`DistEnv` (rank, world_size, device).

    Every process of the job must call it. ``strategy``: a registered name (see above for the
    default); ``options``: its ``[dist]`` keys (``devices="cpu:0,cpu:1"``, ``bucket_mb=...``).
    A parameter server's server processes serve here until every worker is done, then exit.
    Raises UsageError for a strategy or option that cannot run here.
    """
    from .strategies import STRATEGIES
    from .worker import process_settings

    if _SESSIONS:
        return _SESSIONS[0].env
    cfg = _config(strategy, options)
    cls = STRATEGIES[cfg.dist.strategy]
    env, extra = cls.init_process(process_settings(cfg))
    if env is None:  # a parameter server: it served the whole job
        from .env import shutdown as leave

        leave()
        sys.exit(0)
    _SESSIONS.append(Session(env, cls(env, **{**cls.options(cfg), **extra}), cfg))
    atexit.register(_at_exit)
    return env


def setup(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, batch_dim: int = 0,
          sync_batchnorm: bool = False, skip_nonfinite: bool = False, precision: str = "fp32"):
    """Wrap ``model`` (and ``optimizer``) for the session's strategy; returns ``model`` or
    ``(model, optimizer)``.

    Every rank must call it (collective: replicas are made identical). ``batch_dim``: the batch
    dimension of the model's inputs and outputs (towers split along it; 1 for (T, B) sequences).
    ``sync_batchnorm``: BatchNorm statistics over every replica. ``skip_nonfinite``:
    ``optimizer.step()`` drops a NaN/Inf merged gradient instead of applying it. One model per
    process (put several in one ``nn.Module``). The parameter server needs an optimizer.
    ``precision``: ``fp32``, ``bf16`` or ``fp16`` (the wrapped model's forward under
    ``torch.autocast``, float32 outputs and master weights; fp16 needs :func:`backward` for the
    loss scale and :func:`clip_grad_norm_` for clipping the unscaled gradient).
    """
    s = _current()
    if s.models:
        raise UsageError("pt.setup was called already; paratrain wraps one model per process (put several "
                         "models in one nn.Module)")
    s.strategy.skip_nonfinite = skip_nonfinite
    s.strategy.set_precision(precision)
    s.strategy.prepare_own_loop(batch_dim)
    wrapped, opt = s.strategy.setup(model, optimizer, batch_dim=batch_dim, sync_batchnorm=sync_batchnorm)
    s.strategy.arm_timeouts(s.config.train.timeout_s)  # set-up is over: collectives time out after timeout_s
    s.models.append(wrapped)
    return wrapped if optimizer is None else (wrapped, opt)


def train_step(batch: Any, loss_fn: Callable[[nn.Module, Any], torch.Tensor], *, clip: float = 0.0) -> float:
    """One whole optimizer step on this rank's ``batch``, the session's strategy's way: forward,
    backward (with fp16's loss scale), the merge, clipping of the merged gradient to global norm
    ``clip`` (0: off), ``optimizer.step()`` and ``optimizer.zero_grad()``. Every rank must call it.

    The one way to train under ``pipeline`` (GPipe, Huang et al. 2019; 1F1B, Narayanan et al.
    2019): each process holds one stage, and the schedule runs its micro-batches' forwards and
    backwards. It works under every other strategy too, in place of the usual five lines.
    ``batch``: a tensor, or a tuple/list of tensors (inputs, targets, ...), rows along dimension 0
    (the pipeline cuts it into ``dist.microbatches`` micro-batches of rows; it feeds stage 0 the
    first tensor). ``loss_fn(model, batch) -> loss``: the mean loss over that batch's rows (0-dim),
    from the model's output on ``batch``'s inputs; it is called once per micro-batch (pipeline:
    on the last stage, with a stand-in model that returns the last stage's output). Returns this
    replica's loss, the mean over ``batch`` (a float; :func:`all_mean` for the global mean).
    UsageError when the strategy cannot run it."""
    s = _current()
    if not s.models:
        raise UsageError("pt.train_step needs the model and optimizer: call pt.setup(model, optimizer) first")
    if s.strategy.optimizer is None:
        raise UsageError("pt.train_step steps the optimizer: pass one to pt.setup(model, optimizer)")
    rows = _rows(batch)
    s.strategy.check_rows(rows)

    def share(model: nn.Module, micro_batch: Any) -> torch.Tensor:  # its part of the mean over the batch
        return loss_fn(model, micro_batch) * (_rows(micro_batch) / rows)

    return float(s.strategy.train_step([batch], share, clip).loss)


def _rows(batch: Any) -> int:
    first = batch[0] if isinstance(batch, (tuple, list)) and batch else batch
    if not isinstance(first, torch.Tensor) or first.dim() == 0:
        raise UsageError(f"pt.train_step needs a batch of tensors with rows along dimension 0 (a tensor, or a "
                         f"tuple/list whose first item is one), not {type(batch).__name__}")
    return first.size(0)


def gather_model() -> None:
    """``pipeline``: every stage's current parameters to the other stages of its replica, so that each
    process holds the whole model (before evaluating it; ``model.state_dict()`` gathers by itself).
    Nothing on the other strategies, whose processes hold the whole model. Every rank must call it."""
    _current().strategy.gather_whole()


def shard(data: Any, *, dim: int | None = None, seed: int = 0, allow_uneven: bool = False) -> Any:
    """This rank's part of ``data`` (see :mod:`paratrain.data.sharding`; under ``pipeline``, its
    replica's part: every stage of a replica reads the same batches): a tensor of B parallel
    streams ``(L, B)`` (its contiguous columns; ``dim`` for another dimension), a ``DataLoader`` of
    global batches (batch B/W, a shared-seed ``DistributedSampler``, ``set_epoch`` at every new
    iteration), a map-style dataset (call ``set_epoch`` on the result each epoch), or an iterable of
    global batches. The union over ranks is exactly the single-process data. ValueError for splits
    that are not even (unless ``allow_uneven``)."""
    from .data.sharding import shard as shard_data

    index, count = _current().strategy.data_share()  # (pipeline: the stages of a replica read the same share)
    return shard_data(data, index, count, dim=dim, seed=seed, allow_uneven=allow_uneven)


def backward(loss: torch.Tensor) -> None:
    """``loss.backward()`` with the session's fp16 loss scale (``torch.amp.GradScaler``) applied; the
    same as ``loss.backward()`` for fp32 and bf16. Every rank calls it once per micro-batch."""
    _current().strategy.backward(loss)


def no_sync() -> ContextManager:
    """Context for gradient accumulation: backward inside it does not communicate; the next backward
    outside it merges the accumulated gradient. Every rank must use it on the same micro-batches."""
    return _current().strategy.no_sync()


def join() -> ContextManager:
    """Context around the training loop for uneven inputs (``pt.shard(..., allow_uneven=True)``, a
    DataLoader with ``drop_last=False``): ranks may run out of batches at different steps and none
    hangs. ``allreduce`` uses torch's ``Join`` (a done rank contributes zero gradients,
    the merge still averages over world_size, and at the end every rank holds the parameters of the
    last rank to finish); one process needs nothing; other strategies raise UsageError. Every rank
    must enter it; keep collectives of your own (``pt.all_mean``) outside it."""
    return _current().strategy.join()


def clip_grad_norm_(parameters: Iterable[torch.Tensor] | torch.Tensor | None, max_norm: float,
                    norm_type: float = 2.0) -> torch.Tensor:
    """Clip the *merged* gradient to global norm ``max_norm`` (between backward and
    ``optimizer.step()``); same signature as ``torch.nn.utils.clip_grad_norm_``. Returns the norm
    before clipping (parameter server: this worker's own gradient's; its servers clip the merge)."""
    return _current().strategy.clip_grad_norm_(max_norm, parameters, norm_type)


def print(*args: Any, **kwargs: Any) -> None:  # noqa: A001 - rank 0's print, by design
    """``print`` on rank 0 only (flushed); every rank may call it."""
    if not _SESSIONS or _SESSIONS[0].env.is_main:
        kwargs.setdefault("flush", True)
        builtins.print(*args, **kwargs)


def _plain(obj: Any) -> Any:
    """What :func:`save` writes: modules and optimizers as state dicts, tensors on the CPU."""
    from .train.checkpoint import to_cpu

    if isinstance(obj, nn.Module):
        obj = obj.state_dict()
    elif isinstance(obj, torch.optim.Optimizer):
        obj = obj.state_dict()
    elif isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    elif isinstance(obj, (list, tuple)):
        return type(obj)(_plain(v) for v in obj)
    return to_cpu(obj)


def save(obj: Any, path: str | os.PathLike) -> None:
    """Write ``obj`` to ``path`` on rank 0 only, atomically (temp file, fsync, rename: a crash never
    leaves a half-written file), loadable with ``torch.load(path, weights_only=True)`` on any device.
    A module (wrapped or not) or optimizer is saved as its plain ``state_dict``; tensors go to the CPU.
    Every rank may call it; ranks that step together wait until the file is there. TypeError for a
    file object (every rank would write it): give a path."""
    from .train.checkpoint import atomic_torch_save

    if not isinstance(path, (str, os.PathLike)):
        raise TypeError("pt.save needs a path, not a file object: every rank would open (and truncate) the file")
    s = _current() if _SESSIONS else None
    state = _plain(obj)
    if s is None or s.env.is_main:
        atomic_torch_save(state, Path(path))
    if s is not None and s.strategy.lockstep:
        s.strategy.barrier()


def load(path: str | os.PathLike, map_location: Any = None) -> Any:
    """``torch.load(path, weights_only=True)`` onto this rank's device (or ``map_location``).
    Every rank may call it."""
    device = map_location if map_location is not None else (_current().env.device if _SESSIONS else "cpu")
    return torch.load(path, map_location=device, weights_only=True)


def all_mean(x: Any) -> Any:
    """The mean of ``x`` (a number or a tensor) over the data-parallel ranks (for logging); a float
    for a number. Every rank must call it (collective)."""
    s = _current()
    t = torch.as_tensor(x, dtype=torch.float64).detach().to(s.env.device).clone()
    s.strategy.all_reduce(t, "sum")
    t /= s.env.world_size
    return float(t) if not isinstance(x, torch.Tensor) else t.to(x.dtype)


def barrier() -> None:
    """Wait until every data-parallel rank arrives (collective)."""
    _current().strategy.barrier()


def shutdown() -> None:
    """End the session: release the strategy (every rank, collective), leave the process group.
    Safe to call twice. At interpreter exit paratrain does the non-blocking part by itself
    (a parameter-server worker tells its servers it is done)."""
    from .env import shutdown as leave

    if not _SESSIONS:
        return
    s = _SESSIONS.pop()
    if s.models:
        s.strategy.teardown()
    leave()


def _at_exit() -> None:
    """Interpreter exit without :func:`shutdown`: nothing that waits for other ranks (one of them
    may have failed); a parameter-server worker tells its servers it is done; a gloo process group is
    left here, while the interpreter is whole (gloo's threads destroyed later, during finalization,
    can abort the process: "terminate called without an active exception", seen with fsdp), unless
    the script ends with an uncaught exception (:func:`paratrain.env.shutdown`)."""
    from .env import shutdown as leave

    if not _SESSIONS:
        return
    s = _SESSIONS.pop()
    if s.models:
        try:
            s.strategy.release()
        except Exception:  # noqa: BLE001 - the servers may be gone already
            pass
    leave(at_exit=True)
