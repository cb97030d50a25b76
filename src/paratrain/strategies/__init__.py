"""Strategy registry: name -> class. A new strategy is one file plus one line here.

Config validation, the command line, ``paratrain launch``, ``verify`` and
``bench`` learn the names, the processes a strategy needs and the config keys it
owns from these classes (see :class:`~paratrain.strategies.base.Strategy`).
"""
from .allreduce import AllReduce
from .base import Strategy
from .fsdp import FSDP
from .pipeline import Pipeline
from .ps_async import PSAsync
from .ps_sync import PSSync
from .replicate import Replicate
from .single import SingleDevice
from .step import NoSyncMixin, StepResult
from .zero1 import Zero1

STRATEGIES: dict[str, type[Strategy]] = {
    "single": SingleDevice,
    "allreduce": AllReduce,
    "replicate": Replicate,
    "ps-sync": PSSync,
    "ps-async": PSAsync,
    "fsdp": FSDP,
    "zero1": Zero1,
    "pipeline": Pipeline,
}

REFERENCE = "single"
"""The strategy every synchronous one is compared with (``verify``, ``bench`` baselines)."""
DEFAULT = "allreduce"
"""What several processes use when nothing names a strategy."""


def default_for(world_size: int) -> str:
    """The strategy when none is named: :data:`DEFAULT` for several processes, :data:`REFERENCE` for one."""
    return DEFAULT if world_size > 1 else REFERENCE


def modelled(cost_model: str) -> list[str]:
    """Strategies whose step the cost model's ``cost_model`` algorithm describes (``ring``, ``ps``)."""
    return [n for n, cls in STRATEGIES.items() if cls.cost_model == cost_model]


def get_strategy(name: str, env, **options) -> Strategy:
    """Instantiate the strategy registered as ``name``; KeyError lists the known names."""
    try:
        cls = STRATEGIES[name]
    except KeyError:
        raise KeyError(f"unknown strategy {name!r}; known: {', '.join(STRATEGIES)}") from None
    return cls(env, **options)


def owners(key: str) -> list[str]:
    """Strategies that read the strategy-specific ``dist.<key>``."""
    return [n for n, cls in STRATEGIES.items() if key in cls.dist_keys]


__all__ = ["STRATEGIES", "REFERENCE", "DEFAULT", "default_for", "modelled", "get_strategy", "owners", "Strategy",
           "StepResult", "NoSyncMixin"]
