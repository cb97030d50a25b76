"""The one-device profile ``paratrain plan`` predicts from, measured once and cached.

:func:`profile_model` runs the task's model in this process on the recipe's device, its forward under
the recipe's ``train.precision`` as training runs it (bf16, fp16: ``torch.autocast``, float32 outputs to
the loss; :class:`~paratrain.strategies.wrapping.AutocastModule`): warm-up steps,
then timed steps (median) of the forward (the task's loss), the backward and the optimizer, at the
default intra-op threads and, on a CPU with several cores, at one thread (each of two processes'
share). Per block (:func:`paratrain.models.checkpointing.blocks`: Transformer blocks, LSTM layers,
a CNN's children): forward seconds (module hooks), backward seconds (the block's forward share of
the whole backward), parameter bytes, the bytes its forward saves for the backward
(``torch.autograd.graph.saved_tensors_hooks``, each storage once, parameters left out; under a bf16
or fp16 recipe's autocast its casts of the weights apart, ``autocast_copy_bytes``, as they do not grow
with the batch) and its input's bytes (what activation checkpointing keeps); what checkpointing every
block costs the forward and backward (``checkpointing``, paired rounds with a checkpointed copy of the
model, :func:`_checkpointing_cost`). The step's model FLOPs
(:func:`~paratrain.bench.mfu.count_flops`), the optimizer's state bytes after a step, and the peak of
one step's memory by category (``torch.distributed._tools.mem_tracker.MemTracker``: parameters,
gradients, optimizer state, activations, temporaries). The links and what sharing the cores costs
(:func:`~.profile_links.profile_links`: gloo's collectives, a send, RPC, the parameter server's update
and exchange, DTensor steps; on a CPU memory copies, meetings, FSDP2's units, ZeRO-1's and FSDP2's
steps and the bf16 hook between two processes).
``paratrain plan`` adds what allreduce, zero1 and fsdp add to the training loop's step as one rank
(``loop_one_rank_s``, :func:`~.profile_runs.loop_one_rank_overheads`), which prices them in place of
the dispatch terms: a GPU's at every N > 1, a CPU's on a preset interconnect (on this machine's CPU the
two-process terms above price them); on 2 cores, a PS worker's compute in its job (ps-sync's and
ps-async's) beyond side by side (``loop_ps_stolen_s``) and its norm and clip around its exchange there
(``loop_ps_guard_s``, :func:`~.profile_runs_ps.loop_ps`). Pipeline stage
profiles for 2 and 4 stages where the model cuts (:func:`~.strategy_model.strategy_inputs`). Where
the recipe sets ``model.sync_batchnorm``: the input shape of every BatchNorm layer
(``batchnorm_inputs``). What synchronising them costs a step is the training loop's own measurement
where it runs (:func:`~.profile_runs.loop_sync_batchnorm`, on a CPU of several cores); for what it
leaves out, :func:`~.profile_runs.sync_batchnorm_fallbacks` times the layers apart: between two
processes here
(``sync_batchnorm_s``, :func:`~.microbench_meetings.measured_sync_batchnorm`) and, on a CPU of several
cores, between two towers of one process (``tower_sync_batchnorm_s``,
:func:`~.microbench_towers.measured_tower_sync_batchnorm`).
Each layer's meetings there follow the compute that precedes them in the step: the step's forward and
backward, split evenly over the BatchNorm calls (for towers, their forward as ``replicate`` runs it, below).
Every meeting of a layer pays the ranks' drift over that compute, not only the layer's first.
On a CPU of several cores, the forward of one tower per core as the training loop runs it, right after a
training step: :class:`~paratrain.strategies.towers.CPUTowers` on every tower's batch, the join of their
outputs and the loss on it included (``towers_forward_threads``, ``joined``,
:func:`~.microbench_towers.measured_towers_forward`), then their one backward (``backward_seconds``);
for a recipe with sync BatchNorm, the same towers synchronised in turn with the plain ones, whose
difference is the towers' sync BatchNorm term (``sync_batchnorm_s``; the loop then measures the
processes' term alone).

:func:`~.profile_cache.cached_profile` keeps the result in ``DIR/profile.json`` with a key of everything it depends
on (the recipe after overrides, torch and paratrain versions, cores), so re-planning for another
cluster reads it instead of measuring again. Units: seconds, bytes.
"""
from __future__ import annotations

import datetime
import statistics
import time
from typing import Any, Callable

import torch

from ..devices import synchronize
from .profile_blocks import (_BlockProbe, _blocks_and_flops, _bytes, _checkpointing_cost,  # noqa: F401 (API)
                             forward_backward_s, parameter_copy)
from .profile_cache import PROFILE_VERSION  # the versions live with the cache's key

STAGE_COUNTS = (2, 4)


def _timed_steps(model, optimizer, loss_fn: Callable[[], torch.Tensor], draw: Callable[[], Any], device,
                 warmup: int, steps: int) -> dict[str, float]:
    """Median seconds of data / forward / backward / optimizer over ``steps`` after ``warmup``."""
    spans: dict[str, list[float]] = {"data_s": [], "forward_s": [], "backward_s": [], "optimizer_s": []}
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        batch = draw()
        synchronize(device)
        data_s = time.perf_counter() - t0
        forward_s, backward_s = forward_backward_s(lambda: loss_fn(batch), device)
        t3 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        if i >= warmup:
            for key, dt in zip(spans, (data_s, forward_s, backward_s, time.perf_counter() - t3)):
                spans[key].append(dt)
    return {k: statistics.median(v) for k, v in spans.items()}


def _memory_peak(model, optimizer, step: Callable[[], None]) -> dict[str, float]:
    """One step under MemTracker (:func:`~.memory.track_memory`): the peak bytes (``peak_bytes``) and
    their split by kind at that moment."""
    from .memory import track_memory

    _, kinds = track_memory(step, model, [optimizer], per_module=True)
    return {("peak_bytes" if k == "peak" else k): v for k, v in kinds.items()}


def profile_model(task, cfg, *, warmup: int = 2, steps: int = 5, progress: Callable[[str], None] = print,
                  links: bool = True, towers_task: Callable[[int], Any] | None = None,
                  data_dir: str | None = None, out: dict[str, Any] | None = None,
                  phase: Callable[[str, Callable[[], None]], Any] | None = None) -> dict[str, Any]:
    """Measure the task's model on one device (see the module). ``task``: built for one rank
    holding the whole global batch (``build_task(..., world_size=1)``). ``towers_task(batch)``: the
    same task built for one rank holding a global batch of ``batch``, for CPU towers' forward (None:
    not measured; the plan then prices the towers' forwards one after the other). ``data_dir``: the
    task's data, for the links' processes that build the task again (None: the default). ``progress(what)``
    is told of each phase (a tqdm bar in ``paratrain plan``). Three phases, :data:`PHASES`: the
    in-process one, the links, the CPU towers' forward; ``phase(name, run)`` runs ``run()`` unless
    that phase was measured in an earlier sitting (:meth:`~.profile_cache.PartialProfile.phase`;
    default: always). ``out``: the dict the keys go into (default a new one; resumed, it holds the
    earlier sitting's). A phase that runs after an earlier sitting's builds the model again and takes
    ``warmup`` optimizer steps first (the links time the optimizer's step on its state). Returns
    ``out``, JSON-able."""
    out = {} if out is None else out
    phase = phase or (lambda name, run: run())
    built: dict[str, Any] = {}

    def model_and_step() -> dict[str, Any]:
        """The model, its device, batch, loss and optimizer, and one training step of them: built once."""
        if not built:
            from ..train.optim import build_optimizer

            model, device, tokens, draw, loss_fn = _model_and_batch(task, cfg)
            optimizer = build_optimizer(model.parameters(), cfg.train, cfg.train.lr)

            def one_step() -> None:
                loss_fn(draw()).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            built.update(model=model, device=device, tokens=tokens, draw=draw, loss_fn=loss_fn, optimizer=optimizer,
                         one_step=one_step, stepped=False)
        return built

    def stepped() -> dict[str, Any]:
        """:func:`model_and_step`, its optimizer stepped (by the in-process phase, or ``warmup`` steps)."""
        got = model_and_step()
        if not got["stepped"]:
            for _ in range(warmup):
                got["one_step"]()
            got["stepped"] = True
        return got

    def in_process() -> None:
        out.update(_in_process(task, cfg, model_and_step(), warmup, steps, progress))
        built["stepped"] = True  # its warm-up and timed steps stepped the optimizer
    phase(PHASES[0], in_process)
    if links:
        def measure_links() -> None:
            progress("links: gloo all-reduce, all-gather, reduce-scatter, send; rpc, a server's update and exchange "
                     "(alone and among computing workers); DTensor steps; what FSDP2 adds to each unit and ZeRO-1 "
                     "and FSDP2 to the optimizer's step")
            from .profile_links import profile_links

            got = stepped()
            out.update(profile_links(got["model"], got["optimizer"], cfg, got["device"], out, data_dir))
        phase(PHASES[1], measure_links)
    if out["device"] == "cpu" and out["cores"] > 1 and towers_task is not None:  # CPU towers: one per core
        def measure_towers() -> None:
            progress("CPU towers' forward")
            from .microbench_towers import towers_forward

            got = stepped()
            towers = towers_forward(task, got["model"], got["device"], got["one_step"], towers_task, out["cores"],
                                    cfg.train.batch_size, sync_batchnorm=bool(out["batchnorm_inputs"]),
                                    precision=cfg.train.precision)
            if towers:
                out["towers_forward_threads"] = towers
        phase(PHASES[2], measure_towers)
    return out


PHASES = ("in process", "links", "CPU towers' forward")
""":func:`profile_model`'s phases, by the names a resumed profile keeps them under."""


def _in_process(task, cfg, got: dict[str, Any], warmup: int, steps: int,
                progress: Callable[[str], None]) -> dict[str, Any]:
    """:func:`profile_model`'s first phase on ``got`` (its model, optimizer and step): everything but the
    links and the CPU towers."""
    import platform

    from ..consistency import config_text
    from ..env import available_cores
    from .mfu import peak_flops
    from .validate import model_gradient_bytes

    model, device, tokens, draw, loss_fn = (got[k] for k in ("model", "device", "tokens", "draw", "loss_fn"))
    optimizer, one_step = got["optimizer"], got["one_step"]
    out: dict[str, Any] = {"version": PROFILE_VERSION, "date": f"{datetime.datetime.now():%Y-%m-%d %H:%M}",
                           "task": cfg.task.entry, "unit": getattr(task, "unit", "samples"),
                           "batch_size": cfg.train.batch_size, "tokens_per_step": tokens, "device": str(device),
                           "dtype": cfg.train.dtype, "precision": cfg.train.precision, "cores": available_cores(),
                           # what `paratrain plan --profile` checks a profile measured elsewhere against
                           "recipe": config_text(cfg), "host": platform.node()}
    progress("timing steps")
    threads = torch.get_num_threads()
    # in this process, at the default threads: the backward/forward ratio that splits the blocks' time
    # (the step's parts themselves come from the training loop's runs: profile_runs.loop_workloads)
    timed = _timed_steps(model, optimizer, loss_fn, draw, device, warmup, steps)
    out["workloads_in_process"] = {str(threads): timed}
    out["default_threads"] = threads

    progress("blocks, activations and FLOPs")
    out.update(_blocks_and_flops(model, optimizer, loss_fn, draw, device, timed, tokens))
    out["checkpointing"] = _checkpointing_cost(model, loss_fn, draw, device,
                                               timed["forward_s"] + timed["backward_s"])
    counted_dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(cfg.train.precision, cfg.train.dtype)
    peak, source = peak_flops(device, counted_dtype)
    out["peak_flops"], out["peak_flops_source"] = peak, source
    if device.type == "cuda":  # the plan's default --device-memory-gb, also where the profile is planned elsewhere
        props = torch.cuda.get_device_properties(device)
        out["device_name"], out["device_memory_bytes"] = props.name, props.total_memory

    progress("memory of one step")
    out["param_bytes"] = model_gradient_bytes(task, cfg.train.dtype)
    out["param_total_bytes"] = sum(_bytes(p) for p in model.parameters())
    out["buffer_bytes"] = sum(_bytes(b) for b in model.buffers())
    out["memory_measured"] = _memory_peak(model, optimizer, one_step)
    one_step()
    out["optimizer_state_bytes"] = sum(_bytes(v) for st in optimizer.state.values() for v in st.values()
                                       if isinstance(v, torch.Tensor))

    progress("pipeline stages")
    # a CPU's stages at a stage process' threads; a GPU's on the GPU, at this process' threads
    out["strategy_inputs"] = _stage_inputs(task, cfg, out["cores"] if device.type == "cpu" else None, device)
    # what model.sync_batchnorm synchronises (an extra forward, only for a recipe that sets it)
    out["batchnorm_inputs"] = _batchnorm_inputs(model, loss_fn, draw) if cfg.model_value("sync_batchnorm") else []
    return out


def _model_and_batch(task, cfg) -> tuple[torch.nn.Module, torch.device, float, Callable, Callable]:
    """The task's freshly built model (seeded, on ``dist.device`` in ``train.dtype``, training mode)
    and its first training batch: ``(model, device, tokens, draw, loss_fn)``; ``draw()`` gives the
    batch's micro-batches on the device, ``loss_fn(micro_batches)`` the step's loss (mean over its
    ``tokens``; through ``module`` instead of the model when given), the forward under the recipe's
    ``train.precision`` as training runs it (bf16, fp16:
    :class:`~paratrain.strategies.wrapping.AutocastModule`; the loss on its float32
    outputs outside autocast); ``loss_fn.release(module)`` forgets what it keeps of a ``module`` it was
    given. Raises UsageError, as training would, for a bf16 or fp16 recipe on a CPU where the
    model's recurrent layers have no kernel in that dtype."""
    from ..devices import resolve
    from ..strategies.precision import LOW_DTYPES, no_rnn_kernel, rnn_runs_in
    from ..strategies.wrapping import AutocastModule

    device = resolve(cfg.dist.device)
    torch.manual_seed(cfg.train.seed)
    model = task.build_model().to(device=device, dtype=getattr(torch, cfg.train.dtype))
    model.train()
    first = next(iter(task.train_steps(0, 0)))
    tokens = float(first.global_count)

    def draw():
        return [_to(mb, device) for mb in first.micro_batches]

    low = LOW_DTYPES.get(cfg.train.precision)
    if low is not None and device.type == "cpu" and not rnn_runs_in(model, low):
        raise no_rnn_kernel(model, cfg.train.precision, "found before profiling")
    wrapped = {id(model): model if low is None else AutocastModule(model, device.type, low)}  # each made once

    def loss_fn(micro_batches, module: torch.nn.Module | None = None) -> torch.Tensor:
        module = model if module is None else module
        if id(module) not in wrapped:
            wrapped[id(module)] = module if low is None else AutocastModule(module, device.type, low)
        target = wrapped[id(module)]
        total = 0
        for mb in micro_batches:
            loss_sum, _ = task.loss(target, mb)
            total = total + loss_sum / tokens
        return total

    loss_fn.release = lambda module: wrapped.pop(id(module), None)  # type: ignore[attr-defined]
    return model, device, tokens, draw, loss_fn


def batchnorm_inputs_of(task, cfg) -> list[list[int]]:
    """:func:`_batchnorm_inputs` of the task's freshly built model on its first training batch (the
    recipe's per-replica batch when ``task`` is built for one rank): what ``paratrain predict`` needs
    to price ``model.sync_batchnorm``."""
    model, _, _, draw, loss_fn = _model_and_batch(task, cfg)
    return _batchnorm_inputs(model, loss_fn, draw)


def _batchnorm_inputs(model, loss_fn, draw) -> list[list[int]]:
    """The input shape (N, C, *) of every BatchNorm call in the forwards of one step of the profiled
    batch (the recipe's per-replica batch; each micro-batch's forward calls every layer once, as
    ``model.sync_batchnorm`` then synchronises each call: :func:`~.microbench_meetings.measured_sync_batchnorm`).
    The layers are the ones :func:`paratrain.strategies.sync_batchnorm.convert` replaces. The forward
    runs without gradients and leaves the running statistics as one more batch would."""
    shapes: list[list[int]] = []
    hooks = [m.register_forward_pre_hook(lambda _m, args: shapes.append(list(args[0].shape)))
             for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    try:
        if hooks:
            with torch.no_grad():
                loss_fn(draw())
    finally:
        for h in hooks:
            h.remove()
    return shapes


def _to(mb: Any, device: torch.device) -> Any:
    """A micro-batch on ``device`` the way the training loop moves it (:func:`~paratrain.data.batching.move_to`:
    tensors, the LM batch, a task's dataclasses, tuples, lists, dicts)."""
    from ..data.batching import move_to

    return move_to(mb, device, non_blocking=False)


def _stage_inputs(task, cfg, cores: int | None, device: torch.device | None = None) -> dict[str, Any]:
    """:func:`~.strategy_model.strategy_inputs` (fsdp's units, their gathers' ``gather_scale``) and,
    per stage count S of :data:`STAGE_COUNTS` the model cuts into, the pipeline's stage profile at
    M = 2 S micro-batches on ``device`` (default the CPU) in the recipe's precision,
    timed at the intra-op threads each of S processes on ``cores`` CPU cores gets (a CPU's S stages
    run in S processes: one thread each on 2 cores; None: this process' threads, a GPU's)."""
    from types import SimpleNamespace

    from ..env import default_threads, intra_op_threads
    from .strategy_model import strategy_inputs

    def layout(stages: int) -> SimpleNamespace:  # the keys strategy_inputs reads, for S stages
        return SimpleNamespace(train=cfg.train, dist=SimpleNamespace(pipeline_stages=stages, microbatches=2 * stages,
                                                                     pipeline_split=""))

    # fsdp's units are bytes: counted on the CPU (a GPU's memory holds the profile's own model meanwhile)
    whole = strategy_inputs(task, layout(0))
    out: dict[str, Any] = {"units": whole["units"], "gather_scale": whole["gather_scale"], "stage_profiles": {}}
    for s in STAGE_COUNTS:
        with intra_op_threads(default_threads(s, cores) if cores else None):
            got = strategy_inputs(task, layout(s), device)
        if device is not None and device.type == "cuda":  # the stages' model copy goes before the next
            torch.cuda.empty_cache()
        if "activation_bytes" in got:
            keys = ("activation_bytes", "shared_bytes", "stage_param_bytes", "stage_fractions", "microbatch_factor",
                    "stage_saved_bytes")
            out["stage_profiles"][str(s)] = {k: got[k] for k in keys if k in got}
    return out
