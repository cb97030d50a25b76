"""Random numbers of towers (:mod:`.towers`): every tower draws from a generator of its own, seeded
each forward from one draw of the process's default generator and the tower index
(:func:`tower_seeds`), so masks differ between towers and do not depend on thread scheduling.
CPU towers share one default generator, so each tower thread runs under :class:`TowerRandom`,
which hands the tower's generator to every random operation that was given none."""
from __future__ import annotations

import re
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..seeding import hash_seed


def tower_seeds(n: int) -> list[int]:
    """``n`` 63-bit seeds, one per tower, from one draw of the default CPU generator: a hash of
    (draw, tower), so towers' streams neither coincide nor shift into each other. Call it in the
    thread that owns the default generator (the caller of the forward)."""
    base = int(torch.empty((), dtype=torch.int64).random_())
    return [hash_seed(base, t) for t in range(n)]


class _InjectGenerator(TorchDispatchMode):
    """Every ATen operation that can take a generator and was given none gets ``generator``:
    in its ``generator`` argument, or through its overload that has one (``rand_like`` ->
    ``rand_like.generator``, ``randint.low`` -> ``randint.low_generator``)."""

    _target: dict[Any, Any] = {}

    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()
        self.generator = generator

    @staticmethod
    def _with_generator(func: Any) -> Any:
        names = [a.name for a in func._schema.arguments]
        if "generator" in names:
            return func
        packet = func.overloadpacket
        for name in packet.overloads():
            other = getattr(packet, name)
            args = [a.name for a in other._schema.arguments]
            if "generator" in args and [a for a in args if a != "generator"] == names:
                return other
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in self._target:
            self._target[func] = self._with_generator(func)
        target = self._target[func]
        if target is not None and kwargs.get("generator") is None:
            return target(*args, **dict(kwargs, generator=self.generator))
        return func(*args, **kwargs)


_RANDOM = re.compile(r"dropout|rand|bernoulli|normal|multinomial|uniform|exponential|cauchy|geometric|poisson|rrelu")
_RNN = {"lstm", "gru", "rnn_tanh", "rnn_relu"}


def _draws(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether the torch call ``func(*args, **kwargs)`` may draw random numbers: random functions,
    dropout with p > 0 in training, attention with ``dropout_p`` > 0, multi-layer RNNs with dropout."""
    name = getattr(func, "__name__", "")
    if name in _RNN:
        return any(type(a) is float and a > 0 for a in args)  # the only float argument is dropout
    if "attention" in name:
        return float(kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)) > 0
    if "dropout" in name and "feature" not in name and "alpha" not in name and name != "dropout_":
        p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
        training = args[2] if len(args) > 2 else kwargs.get("training", kwargs.get("train", True))
        return bool(training) and float(p) > 0
    return bool(_RANDOM.search(name))


class TowerRandom(TorchFunctionMode):
    """Inside it (thread-local), random operations draw from ``generator`` instead of the shared
    default CPU generator. Only calls that may draw (:func:`_draws`) run under the ATen-level
    mode that supplies the generator, so the others cost one Python call (an ATen-level mode
    around a whole LSTM forward made it 6x slower on CPU)."""

    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()
        self.inject = _InjectGenerator(generator)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _draws(func, args, kwargs):
            with self.inject:
                return func(*args, **kwargs)
        return func(*args, **kwargs)
