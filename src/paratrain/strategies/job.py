"""What a strategy tells the config, the launcher, ``verify`` and ``bench`` about the job it needs:
class methods of :class:`JobSpec`, a mixin of :class:`~paratrain.strategies.base.Strategy`."""
from __future__ import annotations

from typing import Any

from ..env import DistEnv


class JobSpec:
    """The job description part of a strategy (overridden per strategy)."""

    @classmethod
    def check_dist(cls, dist) -> None:
        """Raise UsageError (naming the key and the fix) for a ``[dist]`` config this strategy cannot run."""

    @classmethod
    def check_config(cls, cfg) -> None:
        """Raise UsageError for a whole config (other sections with ``[dist]``) this strategy cannot run.
        Default: the precision (:meth:`check_precision`)."""
        cls.check_precision(cfg.train.precision)

    @classmethod
    def check_global_batch(cls, cfg) -> None:
        """Raise UsageError for a ``train.batch_size`` this strategy cannot split, beyond its division
        over the ranks (:meth:`paratrain.config.Config.check_world`, run for recipes, not for a
        user's own loop, whose batches are its own). Default: nothing."""

    @classmethod
    def processes_per_node(cls, dist) -> int:
        """Processes the launcher starts on every node (workers, plus servers for a parameter server)."""
        return dist.nproc

    @classmethod
    def data_parallel_ranks(cls, dist) -> int:
        """Processes among which the global batch is split (pipeline: the replicas, not their stages)."""
        return dist.nproc * dist.nnodes

    @classmethod
    def towers(cls, dist) -> int:
        """Replicas inside one process (tower mode); 1 otherwise."""
        return 1

    @classmethod
    def dist_for_replicas(cls, n: int) -> dict[str, Any]:
        """``[dist]`` values that give ``n`` data-parallel replicas (``paratrain verify`` and ``bench``)."""
        return {"nproc": n}

    @classmethod
    def options(cls, cfg) -> dict[str, Any]:
        """Constructor options from a :class:`~paratrain.config.Config` (the trainer's door)."""
        return {}

    @classmethod
    def init_process(cls, settings) -> tuple[DistEnv, dict] | None:
        """Join the job as this process: ``(DistEnv of this rank, extra constructor options)``, or None
        when this process has done its whole part and must exit (a parameter server's servers).

        ``settings`` is a :class:`~paratrain.env.ProcessSettings`. Every process of the job calls it.
        """
        from ..env import init

        return init(settings), {}

    @classmethod
    def supervised(cls, dist, rank: int) -> bool:
        """True when ``paratrain train`` should run this rank's training in a child process, so that
        the job survives the rank's death (parameter servers that tolerate dead workers)."""
        return False
