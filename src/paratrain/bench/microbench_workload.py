"""The recipe's own model as a micro-benchmark's workload: what each rank of
:func:`~.microbench_sharded.time_sharded_step` and :func:`~.microbench_sharded.time_fsdp_unit` runs
before every step or pass, so that the step or pass finds the caches and the allocator as a
training step leaves them (profile version 39). A workload is ``{"config": Config, "data_dir": str |
None}``: picklable, it travels to the ranks with their specs, and each rank builds the task from it as
that rank of the group would."""
from __future__ import annotations

from typing import Callable

import torch

_WORKLOADS: dict[tuple, Callable[[], None]] = {}
"""This process' :func:`rank_workload` callables by recipe and rank (a rank times every unit size)."""


def check_workload(workload: dict | None) -> None:
    """Raise ValueError unless ``workload`` is None or ``{"config": Config, "data_dir": str | None}``
    (before it reaches the ranks, where a bad one would fail each of them)."""
    from ..config import Config

    if workload is not None and not (isinstance(workload, dict) and isinstance(workload.get("config"), Config)
                                     and isinstance(workload.get("data_dir"), (str, type(None)))):
        raise ValueError(f"a micro-benchmark's workload is None or {{'config': Config, 'data_dir': str | None}}, "
                         f"not {workload!r}")


def rank_workload(workload: dict | None, rank: int, world_size: int) -> Callable[[], None]:
    """A callable that runs the forward and backward of ``workload``'s model (``{"config": Config,
    "data_dir": str | None}``) on its first training batch as rank ``rank`` of ``world_size`` ranks would
    (:func:`~paratrain.runs.build_task`; :func:`~.profile._model_and_batch`: seeded, on the recipe's
    device, in its dtype, under its precision), its gradients set to None before each; a callable
    that does nothing for None. Built once per process, recipe and rank. The global random generator
    is left as it was, by the build and by each run."""
    if workload is None:
        return lambda: None
    from ..consistency import config_text

    key = (config_text(workload["config"]), workload.get("data_dir"), rank, world_size)
    if key in _WORKLOADS:
        return _WORKLOADS[key]
    from ..runs import build_task
    from .profile import _model_and_batch

    cfg = workload["config"]
    with torch.random.fork_rng(devices=[]):
        task = build_task(cfg, workload.get("data_dir"), rank=rank, world_size=world_size)
        model, _, _, draw, loss_fn = _model_and_batch(task, cfg)

    def run() -> None:
        with torch.random.fork_rng(devices=[]):  # dropout draws from it
            model.zero_grad(set_to_none=True)
            loss_fn(draw()).backward()
    _WORKLOADS[key] = run
    return run


__all__ = ["check_workload", "rank_workload"]
