"""Predictions for every modelled strategy from one measured single-device step: the model's own
numbers the cost model needs (:func:`strategy_inputs`) and the dispatch to the right formula by the
strategy's ``cost_model`` (:func:`predict_strategy`: ``ring`` by :mod:`.costmodel`, ``zero1``,
``fsdp`` and ``pipeline`` by :mod:`.costmodel_sharded`)."""
from __future__ import annotations

from typing import Any

from .costmodel import Link, Prediction, Workload, predict
from .costmodel_sharded import predict_fsdp, predict_pipeline, predict_zero1

MODELS = ("ring", "zero1", "fsdp", "pipeline")  # Strategy.cost_model values predict_strategy handles


def predicted() -> list[str]:
    """Registered strategies :func:`predict_strategy` can predict (from the registry)."""
    from ..strategies import STRATEGIES

    return [n for n, cls in STRATEGIES.items() if cls.cost_model in MODELS]


def strategy_inputs(task, cfg) -> dict[str, Any]:
    """From the task's model (built on the CPU in the run's dtype): ``units``, fsdp's shard units'
    parameter bytes in forward order (the root's own parameters first: its embeddings gather
    first); for a model that pipelines, ``activation_bytes`` (what stage 0 sends stage 1 for one
    replica's batch, measured by running stage 0 on the task's first training batch) and
    ``shared_bytes`` (parameters in several stages)."""
    import torch

    from ..strategies.fsdp import shard_units

    torch.manual_seed(0)
    model = task.build_model().to(getattr(torch, cfg.train.dtype))
    units, seen = [], set()
    for unit in shard_units(model):
        own = [p for p in unit.parameters() if id(p) not in seen]
        seen.update(id(p) for p in own)
        units.append(sum(p.numel() * p.element_size() for p in own))
    root = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in seen)
    out: dict[str, Any] = {"units": [root, *units]}
    if hasattr(model, "pipeline_stages") and hasattr(task, "pipeline_input"):
        stages = model.pipeline_stages(cfg.dist.pipeline_stages)
        batch = next(iter(task.train_steps(1, 0))).micro_batches[0]
        x = task.pipeline_input(batch)
        with torch.no_grad():
            act = stages[0](x)
        owners: dict[int, int] = {}
        for part in stages:
            for p in part.parameters():
                owners[id(p)] = owners.get(id(p), 0) + 1
        # for one replica's batch of train.batch_size rows (the measured single-device step's)
        out["activation_bytes"] = act.numel() * act.element_size() * cfg.train.batch_size / x.size(0)
        out["shared_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters() if owners.get(id(p), 0) > 1)
    return out


def predict_strategy(strategy: str, w: Workload, n: int, link: Link, cfg, inputs: dict[str, Any], *,
                     compute_scale: float = 1.0, bucket_mb: float | None = None) -> Prediction | None:
    """The predicted step of ``strategy`` with ``n`` processes (weak scaling: each replica with the
    measured per-replica batch), or None where it has no such layout (a pipeline needs a multiple of
    its stages; a model that does not pipeline). ``bucket_mb``: DDP's bucket (default the recipe's)."""
    from ..strategies import STRATEGIES

    d = cfg.dist
    bucket = bucket_mb or d.bucket_mb
    model = STRATEGIES[strategy].cost_model
    if model == "ring":
        return predict(w, n, link, algorithm="ring", bucket_mb=bucket, compute_scale=compute_scale)
    if model == "zero1":
        return predict_zero1(w, n, link, bucket_mb=bucket, compute_scale=compute_scale)
    if model == "fsdp":
        return predict_fsdp(w, n, link, unit_bytes=inputs["units"], reshard=d.reshard_after_forward,
                            compute_scale=compute_scale)
    if model == "pipeline":
        if "activation_bytes" not in inputs or n % d.pipeline_stages:
            return None
        return predict_pipeline(w, n // d.pipeline_stages, d.pipeline_stages, d.microbatches, link,
                                activation_bytes=inputs["activation_bytes"], shared_bytes=inputs["shared_bytes"],
                                compute_scale=compute_scale)
    raise ValueError(f"no cost model for strategy {strategy!r}; modelled: {', '.join(predicted())}")
