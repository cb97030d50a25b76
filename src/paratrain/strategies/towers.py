"""Towers: one process drives several devices; every training forward splits the batch
along its batch dimension over the devices and joins the outputs (the semantics of
``torch.nn.DataParallel``; TensorFlow's towers, PaddleFluid's ParallelDo).

* CUDA devices: ``torch.nn.DataParallel`` itself (replicas broadcast from the
  master each forward, forwards in threads, outputs gathered on ``devices[0]``,
  gradients reduced back through autograd).
* CPU virtual devices (``cpu:0,cpu:1,...``), which ``DataParallel`` does not
  support: :class:`CPUTowers`. Tower 0 is the model itself; towers 1.. are shallow
  replicas that share its parameter tensors (one memory) and hold their own
  buffers, refreshed from tower 0 before every forward (DataParallel's rule: only
  tower 0's buffer updates persist). The forwards run in threads, one per tower,
  each with ``threads // towers`` intra-op threads; the outputs are concatenated
  along the batch dimension, so the user's loss and its single ``backward()`` see
  one graph and autograd sums the towers' gradients into the shared ``.grad``. The join,
  the loss and the backward run in the calling thread with every intra-op thread (measured
  on 2 cores: backward calls in tower threads started from inside autograd ran 3-4x slower;
  a loss left at tower 0's one thread took 1.7x as long on gpt_wt2's logits).

Random numbers (dropout masks): every tower draws from a generator of its own, seeded each
forward from one draw of the process's default generator (which the training loop seeds per
step from (seed, rank, step)) and the tower index, so masks differ between towers and do not
depend on thread scheduling. CUDA towers: each device's default generator is seeded this way
before the forward (``torch.manual_seed`` would give every device the same masks). CPU towers
share one default generator, so each tower thread runs under :class:`TowerRandom`, which hands
the tower's generator to every random operation that was given none.

Measurement modes: a dispatch mode the caller entered around the step (torch's ``MemTracker``
or ``FlopCounterMode``: ``train.track_memory_step``, MFU's FLOP count) is thread-local, so it
would see tower 0's forward alone (on the digits CNN it counted 17% fewer FLOPs than one device
running the same global batch, and half the towers' activations). :class:`CPUTowers` hands each
such mode to every tower thread through :class:`SharedMode`, which lets one dispatched operation
at a time reach it (the modes' counters are plain Python dicts); :class:`SeededDataParallel` does the same
for DataParallel's replica threads.

Input splitting (:func:`scatter`) walks tensors, tuples, lists and dicts; a tensor
whose size along the batch dimension is not divisible by the number of towers is an
error; tensors without that dimension and other objects go to every tower unchanged.
:func:`gather` concatenates tensors along the batch dimension and stacks 0-dim ones.
"""
from __future__ import annotations

import contextlib
import copy
import threading
import warnings
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack, _pop_mode, _push_mode

from .tower_random import TowerRandom, tower_seeds

_TOWER = threading.local()


def current_tower() -> int:
    """Index of the tower whose forward runs in this thread (0 outside towers)."""
    return getattr(_TOWER, "index", 0)


def scatter(obj: Any, n: int, dim: int) -> list[Any]:
    """``obj`` split into ``n`` parts along ``dim`` (see the module docstring). Raises ValueError
    when a tensor's size along ``dim`` is not divisible by ``n``."""
    if isinstance(obj, torch.Tensor):
        if obj.dim() <= dim:
            return [obj] * n
        if obj.size(dim) % n:
            raise ValueError(f"a batch of {obj.size(dim)} along dimension {dim} does not split over {n} towers; "
                             f"use a batch that is a multiple of {n}")
        return list(obj.chunk(n, dim))
    if isinstance(obj, (tuple, list)):
        parts = [scatter(x, n, dim) for x in obj]
        return [type(obj)(p[i] for p in parts) if not hasattr(obj, "_fields") else type(obj)(*(p[i] for p in parts))
                for i in range(n)]
    if isinstance(obj, dict):
        parts = {k: scatter(v, n, dim) for k, v in obj.items()}
        return [{k: v[i] for k, v in parts.items()} for i in range(n)]
    return [obj] * n


def gather(outs: Sequence[Any], dim: int) -> Any:
    """Join the towers' outputs: tensors concatenated along ``dim`` (0-dim ones stacked), containers
    walked; other objects are tower 0's."""
    first = outs[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            return torch.stack([o.to(first.device) for o in outs])
        return torch.cat([o.to(first.device) for o in outs], dim)
    if isinstance(first, (tuple, list)):
        parts = [gather([o[i] for o in outs], dim) for i in range(len(first))]
        return type(first)(*parts) if hasattr(first, "_fields") else type(first)(parts)
    if isinstance(first, dict):
        return {k: gather([o[k] for o in outs], dim) for k in first}
    return first


class SeededDataParallel(nn.DataParallel):
    """``torch.nn.DataParallel`` whose towers draw different, reproducible random numbers: before
    each forward, device ``device_ids[t]``'s default generator is seeded with :func:`tower_seeds`.

    Each replica's forward runs with :func:`current_tower` set to its index, so tower-level
    collectives (sync BatchNorm's :class:`~paratrain.strategies.sync_batchnorm.TowerReducer`) meet
    by tower, not by device. The parts of the batch are made contiguous (see :meth:`scatter`).

    ``device_ids`` may repeat a device (soft placement puts ``cuda:0,cuda:1`` on a one-GPU machine
    on cuda:0 twice). The maths is the same; the towers that share a device then share its
    generator, so with dropout their masks depend on thread order. A warning says so."""

    def __init__(self, module: nn.Module, device_ids: Sequence[int] | None = None, *, group: TowerGroup | None = None,
                 **kwargs: Any) -> None:
        super().__init__(module, device_ids=device_ids, **kwargs)
        self.group = group  # the towers' meetings (sync BatchNorm): repaired before a forward, broken by a failure
        if len(set(self.device_ids)) < len(self.device_ids):
            warnings.warn(f"towers on devices {list(self.device_ids)} share a device: they compute the same "
                          "result, but their dropout masks share its generator and are not reproducible",
                          stacklevel=2)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self.training and len(self.device_ids) > 1:
            for d, seed in zip(self.device_ids, tower_seeds(len(self.device_ids))):
                torch.cuda.default_generators[d].manual_seed(seed)
        if self.group is not None:
            self.group.ready()
        return super().forward(*inputs, **kwargs)

    def scatter(self, inputs: Any, kwargs: Any, device_ids: Sequence[int]) -> Any:
        """DataParallel's scatter, every tensor part made contiguous. The part that stays on
        ``device_ids[0]`` is a view of the input, strided when the batch dimension is not the first:
        an LSTM's hidden state (layers, B, H) split along B, which cuDNN's RNN refuses ("rnn: hx is not
        contiguous"; found on an H100)."""
        inputs, kwargs = super().scatter(inputs, kwargs, device_ids)
        return contiguous_parts(inputs), contiguous_parts(kwargs)

    def parallel_apply(self, replicas: Sequence[nn.Module], inputs: Sequence[Any], kwargs: Any) -> list[Any]:
        """DataParallel's threaded forwards (every replica in a thread of its own), each with
        :func:`current_tower` set to its index and the caller's measurement modes shared to it
        (see the module doc)."""
        modes = measurement_modes() if len(replicas) > 1 else []  # one replica runs in this thread, under them
        lock = threading.RLock()
        return super().parallel_apply([_Tower(r, t, modes, lock, self.group) for t, r in enumerate(replicas)],
                                      inputs, kwargs)


def contiguous_parts(obj: Any) -> Any:
    """``obj`` (tensors in tuples, lists, dicts, named tuples) with every tensor made contiguous."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda x: x.contiguous() if isinstance(x, torch.Tensor) else x, obj)


class _Tower(nn.Module):
    """``module`` called as tower ``index`` (:func:`current_tower`) in the calling thread, under
    :func:`shared_modes` (``modes``, ``lock``) when there are modes to share. A failure breaks
    ``group``'s meetings, so the other towers raise instead of waiting for this one."""

    def __init__(self, module: nn.Module, index: int, modes: Sequence[TorchDispatchMode],
                 lock: threading.RLock, group: TowerGroup | None = None) -> None:
        super().__init__()
        self.module, self.index, self.modes, self.lock, self.group = module, index, modes, lock, group

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        before, _TOWER.index = current_tower(), self.index
        try:
            with shared_modes(self.modes, self.lock, caller=False):
                return self.module(*args, **kwargs)
        except BaseException:
            if self.group is not None:
                self.group.abort()
            raise
        finally:
            _TOWER.index = before


def shallow_replica(module: nn.Module) -> nn.Module:
    """A copy of ``module`` that shares its parameter tensors and holds clones of its buffers."""
    r = copy.copy(module)
    r._buffers = {k: (None if b is None else b.clone()) for k, b in module._buffers.items()}
    r._modules = {k: (None if m is None else shallow_replica(m)) for k, m in module._modules.items()}
    return r


def run_threads(fns: Sequence[Callable[[], Any]], on_error: Callable[[], None] | None = None) -> list[Any]:
    """Run ``fns[t]`` as tower t (fns[0] in this thread, the others in threads); return their results.
    The first exception is re-raised here after every thread ended (``on_error`` runs first so
    that towers waiting for the failed one are released)."""
    out: list[Any] = [None] * len(fns)
    errors: list[BaseException] = []

    def run(t: int) -> None:
        _TOWER.index = t
        try:
            out[t] = fns[t]()
        except BaseException as e:  # noqa: BLE001 - re-raised in the calling thread
            errors.append(e)
            if on_error is not None:
                on_error()
        finally:
            _TOWER.index = 0

    threads = [threading.Thread(target=run, args=(t,), name=f"tower{t}", daemon=True) for t in range(1, len(fns))]
    for th in threads:
        th.start()
    run(0)
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return out


def measurement_modes() -> list[TorchDispatchMode]:
    """This thread's dispatch modes, bottom first (a measurement's: MemTracker, FlopCounterMode), to
    share with the tower threads; none where torch's infrastructure modes (fake tensors,
    functionalisation) are among them: those stay with the thread that has them."""
    modes = _get_current_dispatch_mode_stack()
    return [] if any(m.is_infra_mode() for m in modes) else modes


class SharedMode(TorchDispatchMode):
    """``mode`` (a dispatch mode another thread entered) for this thread too: every dispatched ATen
    call of the threads that enter it reaches ``mode.__torch_dispatch__`` under ``lock``, one at a
    time (a measurement step, so serialised operations cost only time). The mode's other entry points
    (MemTracker's callbacks when a storage is freed) run unlocked, as in one thread; under the GIL
    their single dict updates do not interleave."""

    def __init__(self, mode: TorchDispatchMode, lock: threading.RLock) -> None:
        super().__init__()
        self.mode, self.lock = mode, lock
        # torch's flop counter handles higher-order operators (torch.cond, flex attention) itself
        self.supports_higher_order_operators = getattr(mode, "supports_higher_order_operators", False)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        with self.lock:
            return self.mode.__torch_dispatch__(func, types, args, kwargs or {})


@contextlib.contextmanager
def shared_modes(modes: Sequence[TorchDispatchMode], lock: threading.RLock | None, caller: bool):
    """Inside: ``modes`` (the calling thread's dispatch-mode stack, bottom first) reach this
    thread's operations through :class:`SharedMode`. ``caller``: this thread entered them itself;
    they step aside for their shared stand-ins until the end (so that its operations take the lock
    too)."""
    if not modes:
        yield
        return
    with (_pop_modes(modes) if caller else contextlib.nullcontext()), contextlib.ExitStack() as stack:
        for mode in modes:
            stack.enter_context(SharedMode(mode, lock))
        yield


@contextlib.contextmanager
def _pop_modes(modes: Sequence[TorchDispatchMode]):
    """Inside: ``modes`` (the top of this thread's dispatch-mode stack, bottom first) are off the
    stack; they are pushed back in order at the end, also on an error."""
    for mode in reversed(modes):
        if _pop_mode() is not mode:
            raise RuntimeError("a measurement's dispatch modes are not on top of the stack")
    try:
        yield
    finally:
        for mode in modes:
            _push_mode(mode)


class TowerGroup:
    """The towers of one process meeting inside a forward (sync BatchNorm): :meth:`exchange`
    hands every tower the tensors of all towers, in tower order. A tower that fails aborts the
    group (the others raise ``threading.BrokenBarrierError``) instead of leaving them waiting."""

    def __init__(self, n: int, timeout_s: float = 600.0) -> None:
        self.n = n
        self.barrier = threading.Barrier(n, timeout=timeout_s)
        self.slots: list[Any] = [None] * n

    def exchange(self, index: int, value: Any) -> list[Any]:
        self.slots[index] = value
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()  # every tower has read before the next exchange writes
        return out

    def abort(self) -> None:
        self.barrier.abort()

    def ready(self) -> None:
        """Before a forward: repair the barrier after a failed one."""
        if self.barrier.broken:
            self.barrier.reset()


class CPUTowers(nn.Module):
    """``n`` towers of ``module`` on CPU virtual devices (see the module docstring).

    ``threads``: intra-op threads of the process (each tower forward gets ``threads // n``; the
    join, the loss and the backward get the caller's own count back). ``group``: the
    :class:`TowerGroup` sync BatchNorm uses, or None.
    """

    def __init__(self, module: nn.Module, n: int, batch_dim: int, threads: int,
                 group: TowerGroup | None = None) -> None:
        super().__init__()
        self.n, self.dim, self.group = n, batch_dim, group
        self.threads_forward = max(1, threads // n)
        object.__setattr__(self, "towers", [module] + [shallow_replica(module) for _ in range(n - 1)])
        self.generators = [torch.Generator() for _ in range(n)]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        master = self.towers[0]
        with torch.no_grad():
            for replica in self.towers[1:]:
                for (_, rb), (_, mb) in zip(replica.named_buffers(), master.named_buffers()):
                    rb.copy_(mb)
        caller = torch.get_num_threads()
        parts = scatter((args, kwargs), self.n, self.dim)
        if self.group is not None:
            self.group.ready()
        k = self.threads_forward
        for g, seed in zip(self.generators, tower_seeds(self.n)):
            g.manual_seed(seed)
        # autocast is thread-local: the tower threads take the caller's (as DataParallel's parallel_apply does)
        amp = {"device_type": "cpu", "dtype": torch.get_autocast_dtype("cpu"),
               "enabled": torch.is_autocast_enabled("cpu")}
        modes = measurement_modes()  # a measurement's: see the module doc
        lock = threading.RLock() if modes else None

        def tower(t: int) -> Callable[[], Any]:
            def call() -> Any:
                torch.set_num_threads(k)
                a, kw = parts[t]
                with shared_modes(modes, lock, caller=t == 0), TowerRandom(self.generators[t]), torch.autocast(**amp):
                    return self.towers[t](*a, **kw)
            return call

        try:
            outs = run_threads([tower(t) for t in range(self.n)], self.group.abort if self.group else None)
        finally:  # tower 0 ran here: the join, the user's loss and the backward get the caller's threads back
            torch.set_num_threads(caller)
        return gather(outs, self.dim)
