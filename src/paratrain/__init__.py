"""paratrain: train PyTorch models on many devices, processes and machines with one switch, the strategy.

Public API (explicit list). Your own loop, a few changed lines (:mod:`paratrain.api`)::

    import paratrain as pt
    env = pt.init()                                   # strategy: paratrain launch --strategy S, or init(strategy=...)
    model, optimizer = pt.setup(model, optimizer)     # optimizer.step() merges gradients the strategy's way
    data = pt.shard(data)                             # this rank's part of every global batch
    loss = pt.train_step(batch, loss_fn)              # or one whole step (the way to train under pipeline)
    pt.print(...); pt.save(obj, path); obj = pt.load(path); x = pt.all_mean(x); pt.shutdown()

Your model with every feature of ``paratrain train`` (:mod:`paratrain.tasks`): a factory
returning a :class:`Task`, named by ``[task] entry`` or ``--task``.
"""
from .api import (Session, all_mean, backward, barrier, clip_grad_norm_, gather_model, init, join, load, no_sync,
                  print, save, session, setup, shard, shutdown, train_step)
from .config import Config
from .config import load as load_config
from .data.sharding import shard_range
from .env import DistEnv
from .errors import DataError, TrainingStopped, UsageError
from .models.lstm_lm import LSTMLM
from .strategies import STRATEGIES, NoSyncMixin, StepResult, Strategy, get_strategy
from .tasks import Task, TaskBase, TaskEnv, TrainStep

__version__ = "0.2.0"

__all__ = ["init", "setup", "train_step", "gather_model", "shard", "backward", "no_sync", "join", "clip_grad_norm_",
           "print", "save", "load",
           "all_mean", "barrier", "shutdown", "session", "Session", "Config", "load_config", "shard_range", "DistEnv",
           "DataError", "TrainingStopped", "UsageError", "LSTMLM", "STRATEGIES", "NoSyncMixin", "StepResult",
           "Strategy", "get_strategy", "Task", "TaskBase", "TaskEnv", "TrainStep", "__version__"]
