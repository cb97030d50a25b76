"""``paratrain plan``'s model: per strategy and layout, the step time split into compute, exposed
communication, bubble and optimizer (the peak memory per device is :mod:`.plan_memory`'s). Pure
arithmetic on a profile (:mod:`.profile`) and a :class:`~.costmodel.Link`. The step formulas, with
their sources, are :func:`~.strategy_model.predict_model`'s: :mod:`.costmodel` (all-reduce),
:mod:`.costmodel_sharded` (ZeRO-1, FSDP), :mod:`.costmodel_towers`, :mod:`.costmodel_pipeline` and :mod:`.plan_ps`
(a parameter server, synchronous or asynchronous), each with what its processes pay for meeting
every step (:func:`~.strategy_model.sync_overhead_s`: synchronised BatchNorm, DDP's buffer
broadcast, the wait for the last rank). This module splits a layout's prediction into those parts
and adds the strategy's own work measured as one rank (``one_rank_s``); :func:`refusal` says why
a recipe cannot run a :class:`Layout` (the profile's loop runs ask it too, below the plan).

ZeRO-1 and FSDP step the optimizer on DTensor shards: 1/n of the plain step's arithmetic plus the
DTensors' per-operation dispatch, measured in one process (``sharded_optimizer_s``); FSDP's guard
adds the norm of its DTensor gradients (``sharded_norm_s``). On this machine's CPU a CPU profile
prices both by their whole optimizer steps measured between two processes instead
(``zero1_step_s``, ``fsdp_step_s``). A GPU's profile measures instead what all-reduce, ZeRO-1 and
FSDP add to the one-device step as one rank (``one_rank_s``: DDP's reducer, the DTensor step, FSDP2's
hooks and copies; :func:`~.profile_runs.loop_one_rank_overheads`), which every n > 1 adds in their
place; so does a CPU's profile planned on a preset interconnect.

An asynchronous parameter server's updates are about n - 1 versions stale (each of the other workers
pushes once while one computes; Dean et al. 2012, "Large Scale Distributed Deep Networks"; Ho et al.
2013, SSP): the plan shows it beside the rate (:func:`~.plan_ps.predict_ps`).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any, Callable

from .costmodel import Link, Workload, pick_bucket
from .costmodel_hooks import compress_hook_bucket_s, hook_payload_ratio
from .costmodel_pipeline import pipeline_schedule_s, stage_microbatch_s
from .strategy_model import PS, RING, STAGES, TOWERS, predict_model


@dataclass
class Layout:
    """A strategy with its layout: the ``dist`` keys it sets (``overrides``), devices ``n``."""

    strategy: str
    n: int
    overrides: dict[str, Any] = field(default_factory=dict)
    label: str = ""


def step_parts(cls, layout: Layout, w: Workload, link: Link, cfg, inputs: dict[str, Any], *,
               compute_scale: float = 1.0, overlap: bool = True, links: dict[str, Link] | None = None
               ) -> dict[str, float] | None:
    """Predicted step of a layout: ``step_s``, ``compute_s`` (forward + backward + data; a PS worker's
    with what the others' exchanges or the server take of it, measured in the loop,
    :func:`~.plan_ps.loop_stolen`, or for ps-async :func:`~.plan_ps.ps_compute_stolen_s`),
    ``optimizer_s``, ``bubble_s``, ``comm_s`` (exposed), ``units_per_s``, ``replicas``; None where
    the layout does not exist (a model that does not pipeline). The step is
    :func:`~.strategy_model.predict_model`'s for the strategy's cost model (``cls.cost_model``, its
    ``synchronous``) with the layout's ``dist`` keys, ``overlap``, ``links`` and ``inputs`` (its
    formula's measured terms and :func:`~.strategy_model.sync_overhead_s`'); its optimizer part is
    the formula's (:attr:`~.costmodel.Prediction.optimizer_s`), and a pipeline's bubble is its
    schedule less a device's share of the work. ``inputs["one_rank_s"]`` (a GPU's profile, or a
    CPU's on a preset: :func:`~.profile_runs.loop_one_rank_overheads`, this layout's strategy
    measured as one rank of ``paratrain train`` less the one-device step: ``step_s``,
    ``compute_s``, ``optimizer_s``) is the strategy's own work around its compute (DDP's reducer,
    ZeRO-1's DTensor step, FSDP2's hooks and copies), added at every n > 1 to the step and to those
    parts; it holds the DTensors' dispatch, which the formulas then do not add again. A bf16
    compression hook is 2 bytes an element on ``link`` (``Workload.payload_ratio``: half of float32's), or where
    ``inputs["bf16_hook"]`` holds its cost measured here (a CPU's profile, this machine:
    :func:`~.microbench_hooks.measured_compress_hook`) that cost per bucket
    (:func:`~.costmodel_hooks.compress_hook_bucket_s`)."""
    parts = _step_parts(cls, layout, w, link, cfg, inputs, compute_scale=compute_scale, overlap=overlap, links=links)
    own = (inputs.get("one_rank_s") if layout.n > 1 else None) or {"step_s": 0.0, "compute_s": 0.0, "optimizer_s": 0.0}
    if parts is None or not own["step_s"]:
        return parts
    step = parts["step_s"] + own["step_s"]
    return _parts(step, parts["compute_s"] + own["compute_s"], parts["optimizer_s"] + own["optimizer_s"],
                  parts["bubble_s"], parts["units_per_s"] * parts["step_s"] / step, parts["replicas"])


def _step_parts(cls, layout: Layout, w: Workload, link: Link, cfg, inputs: dict[str, Any], *,
                compute_scale: float, overlap: bool, links: dict[str, Link] | None) -> dict[str, float] | None:
    s, n, model = compute_scale, layout.n, cls.cost_model or RING
    compute = (w.forward_s + w.backward_s + w.data_s) * s
    bubble, replicas = 0.0, n
    if model == STAGES:
        stages = layout.overrides["pipeline_stages"]
        got = inputs.get("stage_profiles", {}).get(str(stages))
        if not got or n % stages:
            return None
        d = replace_dist(cfg, **layout.overrides)
        p = predict_model(model, w, n, link, d, got, compute_scale=s, overlap=overlap, links=links)
        replicas = n // stages
        f = got.get("stage_fractions") or [1 / stages] * stages
        factor = got.get("microbatch_factor", 1.0)
        per_mb = stage_microbatch_s(w, f, d.dist.microbatches, factor)
        whole = (w.forward_s + w.backward_s) * factor  # on a core of its own
        pipelined = pipeline_schedule_s(per_mb, d.dist.microbatches, s)
        compute = s * whole / stages + w.data_s * s  # a device's share of the work; the rest of the schedule is bubble
        bubble = max(0.0, pipelined - s * whole / stages)
        return _parts(p.step_s, compute, p.optimizer_s, bubble, p.words_per_s, replicas)
    d = replace_dist(cfg, **layout.overrides)
    ww, bucket_s = hooked(w, n, layout.overrides.get("comm_hook"), inputs.get("bf16_hook"), cfg.train.dtype, s)
    if bucket_s is not None:  # measured on this machine's CPUs: priced per bucket
        inputs = {**inputs, "hook_bucket_s": bucket_s}
    p = predict_model(model, ww, n, link, d, inputs, compute_scale=s, bucket_mb=layout.overrides.get("bucket_mb"),
                      overlap=overlap, links=links, synchronous=cls.synchronous)
    optimizer = p.optimizer_s  # the formula's: its share, the measured sharded step (ZeRO-1, FSDP), a PS worker's guard
    if model == TOWERS:  # the towers' compute is the formula's (side-by-side forwards, their one backward)
        compute = p.compute_s - optimizer
    elif model == PS:  # a worker's: with what the others' exchanges or the server take of it (not its guard)
        compute = p.compute_s - optimizer
    return _parts(p.step_s, compute, optimizer, 0.0, p.words_per_s, replicas)


def _parts(step: float, compute: float, optimizer: float, bubble: float, rate: float, replicas: int) -> dict:
    return {"step_s": step, "compute_s": compute, "optimizer_s": optimizer, "bubble_s": bubble,
            "comm_s": max(0.0, step - compute - optimizer - bubble), "units_per_s": rate, "replicas": replicas}


def replace_dist(cfg, **changes: Any) -> SimpleNamespace:
    """``cfg`` with ``dist`` keys replaced, for the step formulas (no config validation: a layout's
    keys may be another strategy's)."""
    dist = {k: getattr(cfg.dist, k) for k in cfg.dist.__dataclass_fields__}
    return SimpleNamespace(train=cfg.train, task=cfg.task, dist=SimpleNamespace(**{**dist, **changes}))


def best_bucket(w: Workload, n: int, link: Link, compute_scale: float = 1.0, overlap: bool = True,
                hook: str | None = None, measured_hook: dict | None = None, dtype: str = "float32") -> float:
    """DDP's bucket (MiB) the model predicts fastest at n (:func:`~.costmodel.pick_bucket`), each
    bucket priced as the layout's step is (:func:`step_parts`): with a compression ``hook`` ("fp16",
    "bf16") 2 bytes an element of ``dtype`` on ``link`` (:func:`~.costmodel_hooks.hook_payload_ratio`),
    or for bf16 where ``measured_hook`` holds its cost measured here (``inputs["bf16_hook"]``) that
    cost per bucket (:func:`~.costmodel_hooks.compress_hook_bucket_s`)."""
    w, bucket_s = hooked(w, n, hook, measured_hook, dtype, compute_scale)
    return pick_bucket(w, n, link, "ring", compute_scale=compute_scale, overlap=overlap, bucket_s=bucket_s)


def hooked(w: Workload, n: int, hook: str | None, measured_hook: dict | None, dtype: str, compute_scale: float
           ) -> tuple[Workload, Callable[[float], float] | None]:
    """How a layout's compression ``hook`` is priced, for its step (:func:`step_parts`) and its bucket
    (:func:`best_bucket`) alike: (the workload, 2 bytes an element of ``dtype`` on the link for "fp16"
    and "bf16", :func:`~.costmodel_hooks.hook_payload_ratio`; a bucket's seconds where bf16's cost was
    measured here, ``measured_hook``: :func:`~.costmodel_hooks.compress_hook_bucket_s`, else None)."""
    if hook in ("fp16", "bf16"):
        w = replace(w, payload_ratio=hook_payload_ratio(dtype))
    measured = hook == "bf16" and measured_hook
    return w, (compress_hook_bucket_s(n, measured_hook, compute_scale) if measured else None)


def layout_batch(layout: Layout, recipe_batch: int, global_batch: int | None = None) -> int:
    """The global batch (``train.batch_size``) a layout's run trains: ``global_batch`` (``--global-batch``)
    where given, else weak scaling, the recipe's batch ``recipe_batch`` per replica x its replicas
    (n / pipeline_stages), as :func:`~.plan_command.command_line` sets it."""
    return global_batch or recipe_batch * (layout.n // layout.overrides.get("pipeline_stages", 1))


def refusal(config: str, task: str | None, overrides: list[str], layout: Layout,
            global_batch: int | None = None) -> str | None:
    """Why the recipe cannot run this layout (the strategy's own config check, one line), or None.
    ``global_batch``: the layout's ``train.batch_size`` (:func:`layout_batch`), which the check splits
    into replicas and micro-batches; None: the recipe's."""
    import json

    from .. import config as configuration
    from ..errors import UsageError
    from ..strategies import STRATEGIES

    sets = [*overrides, f"dist.strategy={json.dumps(layout.strategy)}"]
    if global_batch is not None:
        sets.append(f"train.batch_size={global_batch}")
    if STRATEGIES[layout.strategy].cost_model == TOWERS:
        sets += ["dist.nproc=1", f"dist.devices={json.dumps(','.join(f'cpu:{i}' for i in range(layout.n)))}"]
    else:
        sets.append(f"dist.nproc={layout.n}")
    sets += [f"dist.{k}={json.dumps(v)}" for k, v in layout.overrides.items()]
    try:
        cfg = configuration.load(config, sets, {"task": {"entry": task}} if task else None)
        STRATEGIES[layout.strategy].check_global_batch(cfg)
    except UsageError as e:
        return str(e)
    return None
