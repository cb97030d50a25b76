"""``paratrain plan``'s model: per strategy and layout, the step time split into compute, exposed
communication, bubble and optimizer (the peak memory per device is :mod:`.plan_memory`'s). Pure
arithmetic on a profile (:mod:`.profile`) and a :class:`~.costmodel.Link`; the step formulas are
:mod:`.costmodel` and :mod:`.costmodel_sharded`'s (with their sources).

Synchronised BatchNorm (``model.sync_batchnorm``, :mod:`paratrain.strategies.sync_batchnorm`): each
layer's forward all-reduces its count and sums, then its variance, and the backward all-reduces the
gradients of both: four blocking collectives per layer and step, which nothing overlaps. On this
machine the profile measures what they cost two processes (the model's own BatchNorm shapes, each
after some compute, as inside a step: the ranks' skew and wake-up, not only the link's latency);
on a cluster, four ring all-reduces of C + 1 numbers per layer.

Ranks that meet every step (all-reduce, ZeRO-1, FSDP, a synchronous PS) wait for the slowest: the
step gains :func:`straggle_s`, the expected maximum of n normal local times over their mean, from
the spread of the one-device step measured by the profile; on this machine's CPU, DDP's all-reduce
(all-reduce, ZeRO-1) and a synchronous PS without backup workers wait at least the profile's measured
meeting after the step's compute (:func:`_last_rank_wait_s`). DDP's layouts of a model with buffers
and without sync BatchNorm also pay its broadcast of rank 0's buffers before every forward
(:func:`~.plan_inputs.buffer_broadcast_s`). ZeRO-1 and FSDP step the optimizer on
DTensor shards: 1/n of the plain step's arithmetic plus the DTensors' per-operation dispatch, measured
in one process (``sharded_optimizer_s``); FSDP's guard adds the norm of its DTensor gradients
(``sharded_norm_s``). On this machine's CPU a CPU profile prices both by their whole optimizer steps
measured between two processes instead (``zero1_step_s``, ``fsdp_step_s``). A GPU's profile measures
instead what all-reduce, ZeRO-1 and FSDP add to the one-device step as one rank (``one_rank_s``: DDP's
reducer, the DTensor step, FSDP2's hooks and copies; :func:`~.profile_runs.loop_one_rank_overheads`),
which every n > 1 adds in their place; so does a CPU's profile planned on a preset interconnect.

Parameter server, synchronous: step = local + push + pull (:func:`~.costmodel.ps_step_s`) + the
servers' update (:func:`~.plan_ps.ps_update_s`: the mean of n gradients, clipping, the optimizer's step and the
copy of the answer, measured on this machine's CPU, where a server keeps its shard).

Asynchronous parameter server (``ps`` without ``synchronous``): each worker steps on its own; the
rate is the smaller of the workers' (n / (local + push + pull + update + wait); the wait, on this
machine's CPU, is what an exchange waits among computing workers, :func:`~.plan_ps.ps_exchange_wait_s`)
and the servers' (K servers each receive, apply and send back 1/K of every update:
``(P/K)(2 beta + gamma) + update`` seconds);
the staleness of an update is about n - 1 versions (each of the other workers pushes once while
one computes; Dean et al. 2012, "Large Scale Distributed Deep Networks"; Ho et al. 2013, SSP).
The parameter server's formulas and links are :mod:`.plan_ps`.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

from .costmodel import Link, Prediction, Workload, pick_bucket, ps_step_s
from .costmodel_pipeline import pipeline_schedule_s, stage_microbatch_s
from .plan_memory import PS
from .plan_ps import ps_async_rate, ps_exchange_wait_s, ps_update_s
from .strategy_model import (RING, SHARDED_OPTIMIZER, SHARDED_PARAMETERS, STAGES, TOWERS, meeting_fns,
                             predict_model)


@dataclass
class Layout:
    """A strategy with its layout: the ``dist`` keys it sets (``overrides``), devices ``n``."""

    strategy: str
    n: int
    overrides: dict[str, Any] = field(default_factory=dict)
    label: str = ""


@functools.lru_cache(maxsize=None)
def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normal variables]: 0 for n = 1, 1/sqrt(pi) = 0.5642 for 2,
    1.0294 for 4, 1.4236 for 8, 3.2482 for 1024 (order statistics: Tippett 1925, Harter 1961). The integral
    ``int x n phi(x) Phi(x)^(n-1) dx`` by Simpson's rule over [-12, 12] (4,800 intervals).
    Raises ValueError for n < 1."""
    if n < 1:
        raise ValueError(f"expected_max_normal needs n >= 1 variables, got {n}")
    if n == 1:
        return 0.0
    lo, hi, m = -12.0, 12.0, 4800
    h = (hi - lo) / m

    def f(x: float) -> float:
        return x * n * math.exp(-x * x / 2) / math.sqrt(2 * math.pi) * (0.5 * math.erfc(-x / math.sqrt(2))) ** (n - 1)

    total = f(lo) + f(hi) + sum((4 if i % 2 else 2) * f(lo + i * h) for i in range(1, m))
    return total * h / 3


def straggle_s(n: int, local_sd_s: float) -> float:
    """Seconds per step that n ranks which meet every step wait for the last of them: each rank's
    local time (its step less communication) varies from step to step with standard deviation
    ``local_sd_s`` (measured: :meth:`~.timing.RankTimer.summary`'s ``local_jitter_ms`` of the profile's
    one-device runs, from successive differences: a drift of the machine that all ranks share makes
    none of them wait), and a collective ends only after the slowest rank arrives, so the step is the
    mean local time plus ``E[max of n] - mean = local_sd_s * expected_max_normal(n)`` (ranks
    independent and normal: the straggler effect that backup workers answer, Chen et al. 2016,
    "Revisiting Distributed Synchronous SGD"; Dean & Barroso 2013, "The Tail at Scale"). One meeting
    a step: a strategy that meets several times a step (FSDP's units, synchronised BatchNorm) waits at
    each, which this leaves out. 0 for n = 1."""
    return expected_max_normal(n) * local_sd_s if n > 1 and local_sd_s > 0 else 0.0


def meets_every_step(cls) -> bool:
    """Whether strategy class ``cls`` runs processes that all wait for one another every step:
    all-reduce, ZeRO-1, FSDP and a synchronous PS do; towers meet in their own process, a pipeline's
    stages pass micro-batches along, an asynchronous PS's workers never wait for each other. These
    pay :func:`straggle_s` and synchronised BatchNorm between processes."""
    return bool(cls.synchronous) and (cls.cost_model or RING) in (RING, SHARDED_OPTIMIZER, SHARDED_PARAMETERS, PS)


def pays_sync_batchnorm(cls) -> bool:
    """Whether strategy class ``cls`` pays synchronised BatchNorm's collectives between processes
    (:func:`meets_every_step`; a pipeline refuses BatchNorm models, an asynchronous PS refuses
    ``model.sync_batchnorm``)."""
    return meets_every_step(cls)


def with_extra_step_s(p: Prediction, extra_s: float) -> Prediction:
    """Prediction ``p`` with ``extra_s`` more seconds of exposed communication per step: step and comm
    grow by it; words/s, speedup and efficiency shrink by step / (step + extra) (weak scaling)."""
    if not extra_s:
        return p
    shrink = p.step_s / (p.step_s + extra_s)
    return replace(p, step_s=p.step_s + extra_s, exposed_comm_s=p.exposed_comm_s + extra_s,
                   words_per_s=p.words_per_s * shrink, speedup=p.speedup * shrink, efficiency=p.efficiency * shrink)


def step_parts(cls, layout: Layout, w: Workload, link: Link, cfg, inputs: dict[str, Any], *,
               compute_scale: float = 1.0, overlap: bool = True, links: dict[str, Link] | None = None
               ) -> dict[str, float] | None:
    """Predicted step of a layout: ``step_s``, ``compute_s`` (forward + backward + data),
    ``optimizer_s``, ``bubble_s``, ``comm_s`` (exposed), ``units_per_s``, ``replicas``; None where
    the layout does not exist (a model that does not pipeline). ``overlap``, ``links``:
    :func:`~.strategy_model.predict_model`'s; ``links["rpc"]``: the parameter server's messages (on
    this machine, :func:`~.plan_ps.ps_message_link` of its measured exchange; on a preset,
    :func:`~.plan_ps.slower` of the preset and that exchange);
    ``inputs["sync_batchnorm_s"]``: seconds per step of synchronised BatchNorm between the processes
    (blocking collectives inside the forward and backward: exposed communication) for all-reduce,
    ZeRO-1, FSDP and a synchronous PS; towers synchronise in their own process and pay
    ``inputs["tower_sync_batchnorm_s"]`` instead (their threads meeting inside the forward), a
    pipeline refuses BatchNorm models, an asynchronous PS refuses ``model.sync_batchnorm``.
    ``inputs["buffer_broadcast_s"]``: DDP's broadcast of rank 0's buffers before every forward
    (:func:`~.plan_inputs.buffer_broadcast_s`; 0 for other strategies), exposed likewise. The same
    processes that meet every step (all but towers, pipelines and an asynchronous PS) wait for the
    slowest rank: :func:`straggle_s` of ``w.local_sd_s`` (times ``compute_scale``), or on this
    machine's CPU for DDP and a synchronous PS at least the measured meeting (:func:`_last_rank_wait_s`),
    as exposed communication. A pipeline's stages pass micro-batches along rather than all waiting at once, and
    the replicas of a hybrid (DP x PP) layout, which do all-reduce every step, are not priced for it
    either: not modelled. The optimizer part is the formula's (:attr:`~.costmodel.Prediction.optimizer_s`):
    ZeRO-1's and FSDP's 1/n of the plain step plus their DTensors' dispatch
    (``inputs["sharded_optimizer_s"]``, FSDP's guard's ``inputs["sharded_norm_s"]``), or on this
    machine's CPU their whole sharded steps measured between two processes (``inputs["zero1_step_s"]``,
    ``inputs["fsdp_step_s"]``: :func:`~.strategy_model.predict_model`).
    ``inputs["one_rank_s"]`` (a GPU's profile, or a CPU's on a preset:
    :func:`~.profile_runs.loop_one_rank_overheads`, this
    layout's strategy measured as one rank of ``paratrain train`` less the one-device step:
    ``step_s``, ``compute_s``, ``optimizer_s``) is the strategy's own work around its compute (DDP's
    reducer, ZeRO-1's DTensor step, FSDP2's hooks and copies), added at every n > 1 to the step and
    to those parts; it holds the DTensors' dispatch, which is then not added again."""
    parts = _step_parts(cls, layout, w, link, cfg, inputs, compute_scale=compute_scale, overlap=overlap, links=links)
    model, meets = cls.cost_model or RING, meets_every_step(cls)
    extra = (inputs.get("sync_batchnorm_s", 0.0) + inputs.get("buffer_broadcast_s", 0.0)
             + _last_rank_wait_s(model, layout.n, w, link, inputs, compute_scale, overlap,
                                 layout.overrides.get("backup_workers", cfg.dist.backup_workers)) if meets
             else inputs.get("tower_sync_batchnorm_s", 0.0) if model == TOWERS else 0.0)
    own = (inputs.get("one_rank_s") if layout.n > 1 else None) or {"step_s": 0.0, "compute_s": 0.0, "optimizer_s": 0.0}
    if parts is None or not (extra or own["step_s"]):
        return parts
    step = parts["step_s"] + extra + own["step_s"]
    return _parts(step, parts["compute_s"] + own["compute_s"], parts["optimizer_s"] + own["optimizer_s"],
                  parts["bubble_s"], parts["units_per_s"] * parts["step_s"] / step, parts["replicas"])


def _last_rank_wait_s(model: str, n: int, w: Workload, link: Link, inputs: dict[str, Any], compute_scale: float,
                      overlap: bool, backup_workers: int = 0) -> float:
    """What n processes that meet every step wait there for the last of them: :func:`straggle_s` of
    the one-device step's spread; for DDP's all-reduce (``ring``, and ZeRO-1's, which wraps the same
    DDP) and a synchronous PS (its servers answer when the last worker's gradient is in) on this
    machine's CPU (no overlap), where the profile measured what one blocking collective costs ranks
    coming from c seconds of compute (``inputs["meetings"]``, :func:`~.costmodel_sharded.meeting_seconds`),
    the larger of that and the meeting after the step's compute (forward + backward + data) less
    ``link``'s alpha (the latency the step's own formula counts once: gloo's all-reduce; for the PS
    the same small latency stands in for its RPC message's, both a fraction of a millisecond here).
    The meeting measures the wait for the last rank and the waking of gloo's threads on cores that
    both processes compute on; the one-device runs' spread leaves out both (on the 2-vCPU Xeon,
    digits_cnn's all-reduce at N = 2 waited 1-2 ms where the spread predicted 0.13 ms). One meeting
    a step: the waits of further buckets ride on the first. A PS with backup workers
    (``dist.backup_workers``) does not wait for the last worker: the straggle, as before."""
    wait = straggle_s(n, w.local_sd_s * compute_scale)
    if (model not in (RING, SHARDED_OPTIMIZER, PS) or overlap or n < 2 or not inputs.get("meetings")
            or (model == PS and backup_workers)):
        return wait
    compute = (w.data_s + w.forward_s + w.backward_s) * compute_scale
    meeting_s, _ = meeting_fns(inputs)
    return max(wait, meeting_s(compute) - link.alpha_s)


def _step_parts(cls, layout: Layout, w: Workload, link: Link, cfg, inputs: dict[str, Any], *,
                compute_scale: float, overlap: bool, links: dict[str, Link] | None) -> dict[str, float] | None:
    s, n, model = compute_scale, layout.n, cls.cost_model or RING
    links = links or {}
    ps_link = links.get("rpc") or link
    compute = (w.forward_s + w.backward_s + w.data_s) * s
    optimizer = w.optimizer_s * s
    bubble, replicas = 0.0, n
    if model == PS:
        k = layout.overrides.get("num_ps", 1)
        update = ps_update_s(inputs.get("ps_update_s"), n, k, cls.synchronous)
        if cls.synchronous:
            step = compute + (ps_step_s(sum(w.param_bytes), n, k, ps_link) + update if n > 1 else optimizer)
            return _parts(step, compute, 0.0 if n > 1 else optimizer, 0.0, n * w.tokens_per_step / step, n)
        scaled = replace(w, forward_s=w.forward_s * s, backward_s=w.backward_s * s, data_s=w.data_s * s,
                         optimizer_s=0.0)
        wait = ps_exchange_wait_s(inputs.get("ps_loaded"), inputs.get("ps_round_trip_s"), compute) if n > 1 else 0.0
        rate, _ = ps_async_rate(scaled, n, k, ps_link, update, wait)
        return _parts(n / rate, compute, 0.0, 0.0, rate * w.tokens_per_step, n)
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
    hook = layout.overrides.get("comm_hook", "none")
    ww = replace(w, payload_ratio=0.5) if hook in ("fp16", "bf16") else w
    p = predict_model(model, ww, n, link, d, inputs, compute_scale=s, bucket_mb=layout.overrides.get("bucket_mb"),
                      overlap=overlap, links=links)
    optimizer = p.optimizer_s  # the formula's: its share, or the measured sharded step (ZeRO-1, FSDP)
    if model == TOWERS:  # the towers' compute is the formula's (side-by-side forwards, n backwards in turn)
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


def best_bucket(w: Workload, n: int, link: Link, compute_scale: float = 1.0, overlap: bool = True) -> float:
    """DDP's bucket (MiB) the model predicts fastest at n (:func:`~.costmodel.pick_bucket`)."""
    return pick_bucket(w, n, link, "ring", compute_scale=compute_scale, overlap=overlap)
