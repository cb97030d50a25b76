"""Predictions for every modelled strategy from one measured single-device step: the model's own
numbers the cost model needs (:func:`strategy_inputs`) and the dispatch to the right formula by the
strategy's ``cost_model`` (:func:`predict_model`: ``ring`` by :mod:`.costmodel`,
``sharded_optimizer`` (ZeRO-1), ``sharded_parameters`` (FSDP) and ``towers`` (one process over
several devices) by :mod:`.costmodel_sharded`, ``stages`` (a pipeline) by :mod:`.costmodel_pipeline`,
``ps`` (a parameter server, synchronous or not) by :mod:`.plan_ps`), each with what its processes pay
for meeting every step (:func:`sync_overhead_s`)."""
from __future__ import annotations

from typing import Any, Callable

from .costmodel import Link, Prediction, Workload, predict, with_extra_step_s
from .costmodel_pipeline import predict_pipeline
from .costmodel_sharded import copy_seconds, meeting_seconds, predict_fsdp, predict_zero1, unit_paths
from .costmodel_towers import predict_towers
from .plan_ps import predict_ps, ps_busiest_share, ps_exchange_wait_s, ps_update_s, worker_stolen_s
from .straggler import straggle_s

RING, SHARDED_OPTIMIZER, SHARDED_PARAMETERS, STAGES, TOWERS, PS = (
    "ring", "sharded_optimizer", "sharded_parameters", "stages", "towers", "ps")
MODELS = (RING, SHARDED_OPTIMIZER, SHARDED_PARAMETERS, STAGES, TOWERS)
"""``Strategy.cost_model`` values :func:`predict_strategy` (``paratrain predict``) predicts;
:func:`predict_model` (``paratrain plan``) predicts these and :data:`PS`."""
STEP_PATHS = {SHARDED_OPTIMIZER: "zero1_step_s", SHARDED_PARAMETERS: "fsdp_step_s"}
"""The profile key (and plan input) holding what each sharded formula's optimizer step adds to
allreduce's, measured between 2 processes (:func:`~.microbench_sharded.measured_sharded_step`)."""


def meeting_fns(inputs: dict[str, Any]) -> tuple[Callable[[float], float] | None, Callable[[float], float] | None]:
    """(``meeting_s``, ``path_meeting_s``): :func:`~.costmodel_sharded.meeting_seconds` of
    ``inputs["meetings"]`` (the n processes' table) and of ``inputs["path_meetings"]`` (the 2
    processes' the measured paths were timed between); None where not given."""
    return tuple(meeting_seconds(inputs[k]) if inputs.get(k) else None for k in ("meetings", "path_meetings"))


def meets_every_step(model: str | None, synchronous: bool) -> bool:
    """Whether a strategy of cost model ``model`` (``Strategy.cost_model``, None: ``ring``) runs
    processes that all wait for one another every step: all-reduce, ZeRO-1, FSDP and a synchronous
    PS do; towers meet in their own process, a pipeline's stages pass micro-batches along, an
    asynchronous PS's workers never wait for each other. These pay :func:`sync_overhead_s`."""
    return bool(synchronous) and (model or RING) in (RING, SHARDED_OPTIMIZER, SHARDED_PARAMETERS, PS)


def pays_sync_batchnorm(cls) -> bool:
    """Whether strategy class ``cls`` pays synchronised BatchNorm's collectives between processes
    (:func:`meets_every_step`; a pipeline refuses BatchNorm models, an asynchronous PS refuses
    ``model.sync_batchnorm``)."""
    return meets_every_step(cls.cost_model, cls.synchronous)


def sync_overhead_s(model: str | None, n: int, w: Workload, link: Link, inputs: dict[str, Any], *,
                    synchronous: bool = True, compute_scale: float = 1.0, overlap: bool = True,
                    backup_workers: int = 0) -> float:
    """Seconds per step that the processes of a strategy pay for meeting every step, beyond its
    formula's collectives, all exposed (nothing overlaps them); 0 for n = 1. Where
    :func:`meets_every_step`:

    * ``inputs["sync_batchnorm_s"]``: synchronised BatchNorm between the processes
      (:mod:`paratrain.strategies.sync_batchnorm`: each layer's forward all-reduces its count and
      sums, then its variance, and the backward the two sums of its gradient; three blocking
      collectives a layer; :func:`~.plan_inputs.sync_batchnorm_s`);
    * ``inputs["buffer_broadcast_s"]``: DDP's broadcast of rank 0's buffers before every forward
      (:func:`~.plan_inputs.buffer_broadcast_s`; 0 for other strategies);
    * the wait for the last rank (:func:`straggler_wait_s`).

    Towers (``towers``) synchronise BatchNorm in their own process and pay
    ``inputs["tower_sync_batchnorm_s"]`` instead (their threads meeting inside the forward). A
    pipeline's stages pass micro-batches along rather than all waiting at once, and the replicas of
    a hybrid (DP x PP) layout, which do all-reduce every step, are not priced for it either: not
    modelled. A pipeline refuses BatchNorm models; an asynchronous PS refuses ``model.sync_batchnorm``."""
    if n < 2:
        return 0.0
    if meets_every_step(model, synchronous):
        return (inputs.get("sync_batchnorm_s", 0.0) + inputs.get("buffer_broadcast_s", 0.0)
                + straggler_wait_s(model or RING, n, w, link, inputs, compute_scale=compute_scale, overlap=overlap,
                                   backup_workers=backup_workers))
    return inputs.get("tower_sync_batchnorm_s", 0.0) if model == TOWERS else 0.0


def straggler_wait_s(model: str, n: int, w: Workload, link: Link, inputs: dict[str, Any], *,
                     compute_scale: float = 1.0, overlap: bool = True, backup_workers: int = 0) -> float:
    """What n processes that meet every step wait there for the last of them:
    :func:`~.straggler.straggle_s` of the one-device step's spread (``w.local_sd_s`` times
    ``compute_scale``); for DDP's all-reduce (``ring``, and ZeRO-1's, which wraps the same
    DDP) and a synchronous PS (its servers answer when the last worker's gradient is in) on this
    machine's CPU (no overlap), where the profile measured what one blocking collective costs ranks
    coming from c seconds of compute (``inputs["meetings"]``, :func:`~.costmodel_sharded.meeting_seconds`),
    the larger of that and the meeting after the step's compute (forward + backward + data) less
    ``link``'s alpha (the latency the step's own formula counts once: gloo's all-reduce; for the PS
    the same small latency stands in for its RPC message's, both a fraction of a millisecond here).
    The meeting measures the wait for the last rank and the waking of gloo's threads on cores that
    both processes compute on; the one-device runs' spread leaves out both (on the 2-vCPU Xeon,
    digits_cnn's all-reduce at N = 2 waited 1-2 ms where the spread predicted 0.13 ms). One meeting
    a step: the waits of further buckets ride on the first, and a strategy that meets several times
    a step (FSDP's units, synchronised BatchNorm) waits at each, which the spread's term leaves out.
    A PS with backup workers (``dist.backup_workers``) does not wait for the last worker: the
    straggle, as before."""
    wait = straggle_s(n, w.local_sd_s * compute_scale)
    if (model not in (RING, SHARDED_OPTIMIZER, PS) or overlap or n < 2 or not inputs.get("meetings")
            or (model == PS and backup_workers)):
        return wait
    compute = (w.data_s + w.forward_s + w.backward_s) * compute_scale
    return max(wait, meeting_seconds(inputs["meetings"])(compute) - link.alpha_s)


def fsdp_unit_parameters(model) -> list[list]:
    """The parameters each of ``fsdp``'s shard units holds of its own: the root's first (those no
    unit holds), then each of :func:`~paratrain.strategies.fsdp.shard_units` in its order (a
    parameter in two units counts in the first; :func:`~.costmodel_sharded.predict_fsdp` reads them
    as forward order, which they are for the recipes' models: blocks in the order they run). For
    the units' bytes (:func:`strategy_inputs`) and the shapes
    :func:`~.microbench_sharded.measured_fsdp_units` gives each unit."""
    from ..strategies.fsdp import shard_units

    units, seen = [], set()
    for unit in shard_units(model):
        own = [p for p in unit.parameters() if id(p) not in seen]
        seen.update(id(p) for p in own)
        units.append(own)
    return [[p for p in model.parameters() if id(p) not in seen], *units]


def predicted() -> list[str]:
    """Registered strategies :func:`predict_strategy` can predict (from the registry)."""
    from ..strategies import STRATEGIES

    return [n for n, cls in STRATEGIES.items() if cls.cost_model in MODELS]


def fsdp_gather_scale(cfg) -> float:
    """Bytes that ``fsdp``'s all-gathers move per byte of the parameters as stored (``train.dtype``):
    ``train.precision`` bf16 or fp16 sets FSDP2's ``MixedPrecisionPolicy(param_dtype=...)``, which
    casts each shard to the low dtype before gathering it (0.5 of float32); 1 in fp32."""
    import torch

    from ..strategies.precision import LOW_DTYPES

    low, stored = LOW_DTYPES.get(cfg.train.precision), getattr(torch, cfg.train.dtype)
    return 1.0 if low is None else min(1.0, low.itemsize / stored.itemsize)


def strategy_inputs(task, cfg, device=None) -> dict[str, Any]:
    """From the task's model (built in the run's dtype on ``device``, default the CPU: the device its
    stages run on, which times them): ``units``, fsdp's shard units'
    parameter bytes in forward order (the root's own parameters first: its embeddings gather
    first); for a model that pipelines (:func:`~paratrain.strategies.stages.cut_stages`),
    ``activation_bytes`` (what stage 0 sends stage 1 for one replica's batch, measured by running
    stage 0 on the task's first training batch under the recipe's ``train.precision``'s autocast, as
    the pipeline runs its stages: gpt's residual stream stays in the parameters' dtype, float32 by
    default),
    ``shared_bytes`` (parameters in several stages), ``stage_param_bytes`` (each stage's, shared ones
    in every stage that holds them) and :func:`stage_profile`'s measured ``stage_fractions`` and
    ``microbatch_factor`` on ``device`` under that precision (a GPU's small micro-batches are bound
    by kernel launches, a CPU's much less: the factor is the device's), for the stage plan
    ``dist.pipeline_split``; ``gather_scale`` (:func:`fsdp_gather_scale`)."""
    import torch

    device = torch.device(device or "cpu")
    torch.manual_seed(0)
    model = task.build_model().to(device=device, dtype=getattr(torch, cfg.train.dtype))
    out: dict[str, Any] = {"units": [sum(p.numel() * p.element_size() for p in own)
                                     for own in fsdp_unit_parameters(model)],
                           "gather_scale": fsdp_gather_scale(cfg)}
    from ..errors import UsageError
    from ..strategies.stages import cut_stages, task_hooks

    try:
        stages = cut_stages(model, cfg.dist.pipeline_stages, cfg.dist.pipeline_split)
        feed, chunk = task_hooks(task)  # (UsageError: this model or task does not pipeline)
    except UsageError:
        stages = None
    if stages:
        from ..data.batching import move_to

        # the replica's batch on the device, as the training loop moves it before the schedule feeds stage 0
        batch = move_to(next(iter(task.train_steps(1, 0))).micro_batches[0], device, non_blocking=False)
        x = move_to(feed(batch), device, non_blocking=False)
        amp = precision_autocast(device, cfg.train.precision)
        with torch.no_grad(), amp():
            act = stages[0](x)
        owners: dict[int, int] = {}
        for part in stages:
            for p in part.parameters():
                owners[id(p)] = owners.get(id(p), 0) + 1
        # for one replica's batch of train.batch_size rows (the measured single-device step's)
        out["activation_bytes"] = act.numel() * act.element_size() * cfg.train.batch_size / x.size(0)
        out["shared_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters() if owners.get(id(p), 0) > 1)
        out["stage_param_bytes"] = [sum(p.numel() * p.element_size() for p in part.parameters()) for part in stages]
        out.update(stage_profile(stages, x, cfg.dist.microbatches, autocast=amp))
        from ..strategies.pipeline import _Given

        def loss_of(output, lo: int, hi: int):  # the task's loss on a micro-batch, as the last stage runs it
            return task.loss(_Given(output), chunk(batch, lo, hi))[0]

        from .profile_blocks import stage_saved

        out.update(stage_saved(stages, model, batch, x, cfg.dist.microbatches, loss_of, autocast=amp))
    return out


def precision_autocast(device, precision: str) -> Callable[[], Any]:
    """A factory of the context a stage's forward runs in under ``train.precision`` on ``device``:
    ``torch.autocast`` in bfloat16 ("bf16") or float16 ("fp16"), as the pipeline's stages run
    (:mod:`paratrain.strategies.pipeline`); nothing for "fp32"."""
    import contextlib

    import torch

    from ..strategies.precision import LOW_DTYPES

    low = LOW_DTYPES.get(precision)
    if low is None:
        return contextlib.nullcontext
    return lambda: torch.autocast(torch.device(device).type, dtype=low)


def stage_profile(stages, x, microbatches: int, repeats: int = 5,
                  autocast: Callable[[], Any] | None = None) -> dict[str, Any]:
    """The stages' forward + backward timed on the device of the first stage's input ``x`` (a
    replica's batch), at this process' intra-op threads (the profile sets a stage process' share of
    a CPU's cores), the device synchronised around each stage (a GPU's kernels run asynchronously),
    after one untimed pass: ``stage_fractions``, each stage's share for one micro-batch (``x``'s first rows /
    ``microbatches``; median of ``repeats``), and ``microbatch_factor``, the time of ``microbatches``
    micro-batches through every stage over the time of ``x`` whole (what splitting the batch costs:
    smaller matrix products; on a GPU, as many more kernel launches), the median of ``repeats``
    rounds' ratios, each round timing both back
    to back (a machine whose speed drifts moves both alike). The last stage's backward starts from a
    log-softmax sum (a cross-entropy's cost), the others' from ones. ``autocast()``: the context each
    stage's forward and loss run in (:func:`precision_autocast`; default none); the backward runs
    outside it, as ``torch.autocast`` advises (its ops take the forward's dtypes either way; the
    pipeline's schedule runs it inside)."""
    import contextlib
    import statistics
    import time

    from ..devices import synchronize

    amp = autocast or contextlib.nullcontext

    def chain(inp) -> list[float]:
        spent, h = [], inp
        for s, stage in enumerate(stages):
            h = h.detach().requires_grad_(h.is_floating_point())
            synchronize(x.device)
            t0 = time.perf_counter()
            with amp():
                out = stage(h)
                loss = (out.float().log_softmax(-1) if s == len(stages) - 1 else out).sum()
            loss.backward()
            synchronize(x.device)
            spent.append(time.perf_counter() - t0)
            h = out
        for stage in stages:
            stage.zero_grad(set_to_none=True)
        return spent

    rows = max(1, x.size(0) // microbatches)
    chain(x)
    per_stage = [statistics.median(t) for t in zip(*(chain(x[:rows]) for _ in range(repeats)))]
    ratios = []
    for _ in range(repeats):
        whole = sum(chain(x))
        split = sum(sum(chain(x[i * rows:(i + 1) * rows])) for i in range(microbatches))
        ratios.append(split / whole)
    return {"stage_fractions": [t / sum(per_stage) for t in per_stage], "microbatch_factor": statistics.median(ratios)}


def predict_strategy(strategy: str, w: Workload, n: int, link: Link, cfg, inputs: dict[str, Any], *,
                     compute_scale: float = 1.0, bucket_mb: float | None = None, **kw: Any) -> Prediction | None:
    """The predicted step of ``strategy`` with ``n`` processes (weak scaling: each replica with the
    measured per-replica batch), or None where it has no such layout (a pipeline needs a multiple of
    its stages; a model that does not pipeline). ``bucket_mb``: DDP's bucket (default the recipe's);
    ``kw``: :func:`predict_model`'s."""
    from ..strategies import STRATEGIES

    model = STRATEGIES[strategy].cost_model
    if model not in MODELS:
        raise ValueError(f"no cost model for strategy {strategy!r}; modelled: {', '.join(predicted())}")
    kw.setdefault("synchronous", STRATEGIES[strategy].synchronous)
    return predict_model(model, w, n, link, cfg, inputs, compute_scale=compute_scale, bucket_mb=bucket_mb, **kw)


def predict_model(model: str, w: Workload, n: int, link: Link, cfg, inputs: dict[str, Any], *,
                  compute_scale: float = 1.0, bucket_mb: float | None = None, overlap: bool = True,
                  links: dict[str, Link] | None = None, synchronous: bool = True) -> Prediction | None:
    """:func:`predict_strategy` by the formula's name (a ``Strategy.cost_model`` of :data:`MODELS`, or
    :data:`PS`: :func:`~.plan_ps.predict_ps` with ``cfg.dist.num_ps`` servers, ``synchronous`` or
    not), plus what its processes pay for meeting every step (:func:`sync_overhead_s`, as exposed
    communication). ``synchronous``: the strategy's (``Strategy.synchronous``; an asynchronous PS's
    workers never meet).
    ``overlap``: whether collectives may overlap compute (False on a CPU whose cores all compute);
    ``links``: collectives measured or placed apart (``all_gather``, ``reduce_scatter``, ``p2p``, a
    pipeline's ``stages``: its tied parameters' ring, :func:`~.plan.cluster_links`; ``rpc``: the
    parameter server's messages, :func:`~.plan_ps.ps_message_link`), else ``link``'s ring algorithms.
    ``inputs["hook_bucket_s"]``: a compression hook's measured seconds per bucket of gradient bytes
    (:func:`~.costmodel_hooks.compress_hook_bucket_s`), in place of ``link``'s all-reduce of its payload.
    The parameter server's inputs: ``inputs["ps_update_s"]`` (:func:`~.plan_ps.ps_update_s`),
    ``inputs["ps_loaded"]`` and ``inputs["ps_round_trip_s"]`` (an asynchronous worker's exchange among
    computing workers, :func:`~.plan_ps.ps_exchange_wait_s`, and its compute among exchanging workers,
    :func:`~.plan_ps.ps_compute_stolen_s`; ``inputs["ps_stolen_s"]``, where not None, is that compute's
    loss measured in the training loop instead, :func:`~.plan_ps.loop_stolen`; the choice:
    :func:`~.plan_ps.worker_stolen_s`); ``inputs["ps_guard_s"]``: a worker's own work around its exchange
    (:func:`~.plan_ps.loop_guard`; None or absent: unpriced). ``inputs["memory_copy"]``: measured
    (bytes, seconds) of memory copies (:func:`~.costmodel_sharded.copy_seconds`), for CPU towers' join
    (unless ``inputs["towers_forward_joined"]``: their measured forward ``inputs["towers_forward_s"]``
    holds it; ``inputs["towers_backward_s"]``, where not None: their backward measured after it;
    ``inputs["towers_data_s"]``, ``inputs["towers_optimizer_s"]``, where not None: their data and
    optimizer measured in the training loop, :func:`~.plan_inputs.loop_towers_parts`), FSDP2's
    buffers and ZeRO-1's rows; ``inputs["meetings"]``: measured (compute seconds, seconds) of a
    blocking collective inside a step (:func:`~.costmodel_sharded.meeting_seconds`), for ZeRO-1's and
    FSDP's collectives here and the wait for the last rank (:func:`straggler_wait_s`);
    ``inputs["fsdp_units"]``: what FSDP2 adds to each unit size, measured here
    (:func:`~.costmodel_sharded.unit_paths`), and ``inputs["zero1_step_s"]``, ``inputs["fsdp_step_s"]``:
    what ZeRO-1's and FSDP2's optimizer steps add to allreduce's, measured here
    (:func:`~.microbench_sharded.time_sharded_step`), all
    between the processes of ``inputs["path_meetings"]``' meeting table (2: the paths hold those
    processes' waits after a barrier and almost no compute; each rank runs the model's forward and
    backward before that barrier). ``inputs["sharded_optimizer_s"]`` (and FSDP's
    ``inputs["sharded_norm_s"]``): the DTensors' dispatch measured in one process
    (:func:`~.microbench_sharded.measured_sharded_optimizer`),
    the formulas' ``dispatch_s``, unless ``inputs["one_rank_s"]`` (a measured one-rank overhead,
    :func:`~.profile_runs.loop_one_rank_overheads`) holds it."""
    d, links = cfg.dist, links or {}
    bucket = bucket_mb or d.bucket_mb
    # the DTensors' dispatch measured in one process (the optimizer's; FSDP's guard's norm), unless a
    # measured one-rank overhead holds it
    own = inputs.get("one_rank_s") is not None
    step_dispatch = 0.0 if own else inputs.get("sharded_optimizer_s", 0.0)
    norm_dispatch = 0.0 if own else inputs.get("sharded_norm_s", 0.0)
    p = _formula(model, w, n, link, d, inputs, compute_scale=compute_scale, bucket=bucket, overlap=overlap,
                 links=links, synchronous=synchronous, step_dispatch=step_dispatch, norm_dispatch=norm_dispatch,
                 clipped=cfg.train.clip > 0)
    if p is None:
        return None
    return with_extra_step_s(p, sync_overhead_s(model, n, w, link, inputs, synchronous=synchronous,
                                                compute_scale=compute_scale, overlap=overlap,
                                                backup_workers=getattr(d, "backup_workers", 0)))


def _formula(model: str, w: Workload, n: int, link: Link, d, inputs: dict[str, Any], *, compute_scale: float,
             bucket: float, overlap: bool, links: dict[str, Link], synchronous: bool, step_dispatch: float,
             norm_dispatch: float, clipped: bool = False) -> Prediction | None:
    copy_s = copy_seconds(inputs["memory_copy"]) if inputs.get("memory_copy") else None
    meeting_s, path_meeting_s = meeting_fns(inputs)
    unit_path_s = unit_paths(inputs["fsdp_units"]) if inputs.get("fsdp_units") else None
    if model == RING:
        return predict(w, n, link, algorithm="ring", bucket_mb=bucket, compute_scale=compute_scale, overlap=overlap,
                       bucket_s=inputs.get("hook_bucket_s"))
    if model == PS:
        compute = (w.data_s + w.forward_s + w.backward_s) * compute_scale
        among = n > 1 and not synchronous  # an async worker among others on these cores
        wait = ps_exchange_wait_s(inputs.get("ps_loaded"), inputs.get("ps_round_trip_s"), compute) if among else 0.0
        stolen = worker_stolen_s(inputs.get("ps_stolen_s"), inputs.get("ps_loaded"), compute) if among else (
            inputs.get("ps_stolen_s") or 0.0)  # a synchronous worker's: the loop's measurement alone
        share = ps_busiest_share(w.param_bytes, d.num_ps)
        return predict_ps(w, n, d.num_ps, links.get("rpc") or link, synchronous=synchronous,
                          update_s=ps_update_s(inputs.get("ps_update_s"), n, d.num_ps, synchronous, share),
                          wait_s=wait, stolen_s=stolen, compute_scale=compute_scale,
                          guard_s=inputs.get("ps_guard_s") or 0.0, streams=inputs.get("ps_streams", 1),
                          copy_fraction=inputs.get("ps_copy_fraction", 1.0))
    if model == SHARDED_OPTIMIZER:
        return predict_zero1(w, n, link, bucket_mb=bucket, compute_scale=compute_scale, overlap=overlap,
                             gather_link=links.get("all_gather"), meeting_s=meeting_s, copy_s=copy_s,
                             step_path_s=inputs.get("zero1_step_s"), path_meeting_s=path_meeting_s,
                             dispatch_s=step_dispatch, bucket_s=inputs.get("hook_bucket_s"))
    if model == SHARDED_PARAMETERS:
        return predict_fsdp(w, n, link, unit_bytes=inputs["units"], reshard=d.reshard_after_forward,
                            compute_scale=compute_scale, overlap=overlap, gather_link=links.get("all_gather"),
                            scatter_link=links.get("reduce_scatter"), copy_s=copy_s, meeting_s=meeting_s,
                            unit_path_s=unit_path_s, path_meeting_s=path_meeting_s,
                            step_path_s=inputs.get("fsdp_step_s"),
                            dispatch_s=step_dispatch + norm_dispatch, gather_scale=inputs.get("gather_scale", 1.0))
    if model == STAGES:
        if "activation_bytes" not in inputs or n % d.pipeline_stages:
            return None
        return predict_pipeline(w, n // d.pipeline_stages, d.pipeline_stages, d.microbatches, link,
                                activation_bytes=inputs["activation_bytes"], shared_bytes=inputs["shared_bytes"],
                                compute_scale=compute_scale, stage_fractions=inputs.get("stage_fractions"),
                                stage_param_bytes=inputs.get("stage_param_bytes"),
                                microbatch_factor=inputs.get("microbatch_factor", 1.0), p2p_link=links.get("p2p"),
                                stage_link=links.get("stages"),
                                # the loss and the bubbles (float64, 1 + S), and with clipping the squared norm
                                step_allreduce_bytes=[8 * (1 + d.pipeline_stages)] + ([8] if clipped else []))
    if model == TOWERS:
        return predict_towers(w, n, link, output_bytes=inputs.get("output_bytes", 0.0), compute_scale=compute_scale,
                              shared_cores=inputs.get("shared_cores", False), copy_s=copy_s,
                              forward_side_by_side_s=inputs.get("towers_forward_s"),
                              backward_measured_s=inputs.get("towers_backward_s"),
                              joined=inputs.get("towers_forward_joined", False),
                              data_measured_s=inputs.get("towers_data_s"),
                              optimizer_measured_s=inputs.get("towers_optimizer_s"))
    raise ValueError(f"no cost model named {model!r}; use one of {', '.join((*MODELS, PS))}")
