"""Strategy registry: name -> class. A new strategy is one file plus one line here."""
from .allreduce import AllReduce
from .base import IndependentReplicasMixin, NoSyncMixin, StepResult, Strategy
from .ps_async import PSAsync
from .ps_sync import PSSync
from .replicate import Replicate
from .single import SingleDevice

STRATEGIES: dict[str, type[Strategy]] = {
    "single": SingleDevice,
    "allreduce": AllReduce,
    "replicate": Replicate,
    "ps-sync": PSSync,
    "ps-async": PSAsync,
}


def get_strategy(name: str, env, **options) -> Strategy:
    """Instantiate the strategy registered as ``name``; KeyError lists the known names."""
    try:
        cls = STRATEGIES[name]
    except KeyError:
        raise KeyError(f"unknown strategy {name!r}; known: {', '.join(STRATEGIES)}") from None
    return cls(env, **options)


__all__ = ["STRATEGIES", "get_strategy", "Strategy", "StepResult", "NoSyncMixin", "IndependentReplicasMixin",
           "PSSync", "PSAsync", "Replicate", "AllReduce", "SingleDevice"]
