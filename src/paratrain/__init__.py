"""paratrain: train PyTorch models on many devices, processes and machines with one switch, the strategy.

Public API (explicit list)::

    import paratrain as pt
    env = pt.init()                                   # rank, world_size, device; joins the process group
    strategy = pt.get_strategy("allreduce", env)      # or "single"
    model, optimizer = strategy.setup(model, optimizer)
    result = strategy.train_step([batch], loss_fn, clip=1.0)
    strategy.teardown(); pt.shutdown()
"""
from .config import Config
from .config import load as load_config
from .data.batching import shard_range
from .env import DistEnv, init, shutdown
from .errors import DataError, UsageError
from .models.lstm_lm import LSTMLM
from .strategies import STRATEGIES, NoSyncMixin, StepResult, Strategy, get_strategy

__version__ = "0.1.0"

__all__ = ["Config", "load_config", "shard_range", "DistEnv", "init", "shutdown", "DataError", "UsageError",
           "LSTMLM", "STRATEGIES", "NoSyncMixin", "StepResult", "Strategy", "get_strategy", "__version__"]
