"""The wrapped model and the distributed optimizer that :meth:`Strategy.setup` returns.

:class:`ReplicaModule` is what a user calls instead of their model. Training
forward (``model.training`` and grad enabled) runs the strategy's engine
(DistributedDataParallel, towers, or the module itself); evaluation and
``torch.no_grad()`` forward run the plain module, so no collective happens
outside training steps. Everything else behaves as the user's own model:
attributes fall through to it (``model.init_hidden(...)``), ``state_dict`` and
``named_parameters`` carry no wrapper prefix, ``load_state_dict`` takes a plain
state dict, and pickling (``torch.save(model)``, ``copy.deepcopy``) gives the
plain module.

:func:`distribute_optimizer` makes the user's optimizer distributed the way
Horovod's ``DistributedOptimizer`` does: the same object, its class replaced by
a subclass of its own class whose ``step()`` merges gradients the strategy's way
(``isinstance(optimizer, torch.optim.SGD)`` and LR schedulers keep working; the
optimizer's state and param_groups are untouched).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


def to_float32(obj: Any) -> Any:
    """bf16/fp16 tensors in ``obj`` (tensors, tuples, lists, dicts) as float32; the rest unchanged."""
    if isinstance(obj, torch.Tensor):
        return obj.float() if obj.dtype in (torch.bfloat16, torch.float16) else obj
    if isinstance(obj, (tuple, list)):
        items = [to_float32(x) for x in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, dict):
        return {k: to_float32(v) for k, v in obj.items()}
    return obj


class PlainModuleWrapper(nn.Module):
    """A wrapper that passes for the plain model it holds, ``self.module`` (registered:
    ``parameters()``, ``train()``/``eval()`` reach it): the attributes it lacks are the model's
    (``model.init_hidden(...)``, through :meth:`_module_attribute`), and pickling (``torch.save``,
    ``copy.deepcopy``) gives the plain model."""

    module: nn.Module

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return self._module_attribute(getattr(self._modules["module"], name))

    def _module_attribute(self, value: Any) -> Any:
        """What an attribute of the plain model is through the wrapper (the same, unless overridden)."""
        return value

    def __reduce_ex__(self, protocol):  # pickle / deepcopy: the plain module
        return _plain_module, (self.module,)


class AutocastModule(PlainModuleWrapper):
    """``module``'s forward as a strategy runs it under ``train.precision`` bf16 or fp16
    (:class:`ReplicaModule` without a strategy's engine): under ``torch.autocast(device_type,
    dtype)``, its bf16/fp16 outputs returned as float32 (:func:`to_float32`), for the loss outside
    autocast. The profile of ``paratrain plan`` runs its model's forward through it."""

    def __init__(self, module: nn.Module, device_type: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.module, self.device_type, self.dtype = module, device_type, dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.device_type, dtype=self.dtype):
            out = self.module(*args, **kwargs)
        return to_float32(out)


class ReplicaModule(PlainModuleWrapper):
    """The user-facing model of a strategy (see the module docstring).

    ``module``: the plain model (registered: ``parameters()``, ``train()``/``eval()`` reach it).
    """

    def __init__(self, module: nn.Module, engine: nn.Module, strategy: Any) -> None:
        super().__init__()
        self.module = module
        object.__setattr__(self, "_engine", engine)  # not a registered child: it contains ``module``
        object.__setattr__(self, "_strategy", strategy)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Training (grad enabled): the engine's forward (towers, DDP, ...); otherwise the plain module's.
        Under the strategy's mixed precision (``autocast``), with bf16/fp16 outputs returned as float32."""
        s = self._strategy
        with s.autocast():
            if self.training and torch.is_grad_enabled():
                s.begin_step()
                out = self._engine(*args, **kwargs)
            else:
                s.before_plain_forward()
                out = self.module(*args, **kwargs)
        return out if s.precision == "fp32" else to_float32(out)

    def _module_attribute(self, value: Any) -> Any:
        convert = self._strategy.plain_tensors
        if callable(value) and not isinstance(value, nn.Module) and convert is not None:
            # a method of the user's model (init_hidden) that makes tensors from parameters that are
            # now DTensor shards (fsdp): its results as plain tensors
            def method(*args: Any, **kwargs: Any) -> Any:
                return convert(value(*args, **kwargs))
            return method
        return value

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self.module.named_buffers(prefix, recurse, remove_duplicate)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        """The plain model's state_dict, whole and current (a parameter-server worker pulls first;
        ``fsdp`` all-gathers its shards: then every rank must call it)."""
        self._strategy.before_eval()
        if args or kwargs:
            return self.module.state_dict(*args, **kwargs)
        return self._strategy.state_dict()

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load a plain state_dict into every replica. Every rank must call it (a parameter server
        sends the parameters to its servers)."""
        if assign:
            return self.module.load_state_dict(state_dict, strict, assign)
        return self._strategy.load_state_dict(state_dict, strict=strict)


def _plain_module(module: nn.Module) -> nn.Module:
    """What an unpickled (or deep-copied) :class:`ReplicaModule` becomes: its plain module."""
    return module


class _Distributed:
    """Mixin placed in front of an optimizer's class by :func:`distribute_optimizer`."""

    _paratrain_strategy: Any

    def step(self, closure=None):
        """Merge gradients the strategy's way and update (see the strategy's ``optimizer_step``)."""
        base = super(_Distributed, self).step  # the optimizer's own step
        return self._paratrain_strategy.optimizer_step(self, base, closure)

    def state_dict(self) -> dict:
        """The whole model's optimizer state (a parameter server assembles its servers' shards)."""
        return self._paratrain_strategy.optimizer_state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self._paratrain_strategy.load_optimizer_state_dict(state_dict)


_CLASSES: dict[type, type] = {}


def user_optimizer_class(optimizer: torch.optim.Optimizer) -> type:
    """The user's optimizer class of ``optimizer``, also behind :func:`distribute_optimizer`'s wrapper."""
    cls = type(optimizer)
    return cls.__mro__[2] if issubclass(cls, _Distributed) else cls  # (Distributed<X>, _Distributed, X, ...)


def distribute_optimizer(optimizer: torch.optim.Optimizer, strategy: Any) -> torch.optim.Optimizer:
    """Make ``optimizer`` (in place) step through ``strategy``; returns it."""
    base = user_optimizer_class(optimizer)
    cls = _CLASSES.get(base)
    if cls is None:
        cls = _CLASSES[base] = type(f"Distributed{base.__name__}", (_Distributed, base), {})
    optimizer.__class__ = cls
    optimizer._paratrain_strategy = strategy
    return optimizer


def base_state_dict(optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's own ``state_dict`` (bypassing the strategy)."""
    return super(_Distributed, optimizer).state_dict() if isinstance(optimizer, _Distributed) \
        else optimizer.state_dict()


def base_load_state_dict(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """The optimizer's own ``load_state_dict`` (bypassing the strategy)."""
    if isinstance(optimizer, _Distributed):
        super(_Distributed, optimizer).load_state_dict(state)
    else:
        optimizer.load_state_dict(state)
