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
Every meeting pair of a layer pays the ranks' drift over that compute, not only the layer's first.
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
from .profile_cache import PROFILE_VERSION  # the versions live with the cache's key

STAGE_COUNTS = (2, 4)


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


_VIEWS = frozenset({"TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0", "UnsafeViewBackward0",
                    "ReshapeAliasBackward0", "AliasBackward0", "ExpandBackward0", "SqueezeBackward0",
                    "UnsqueezeBackward0"})


def parameter_copy(t: torch.Tensor, params: set[int]) -> bool:
    """Whether ``t``, saved for the backward, is a cast of a whole parameter (its storage a parameter's
    elements in ``t``'s dtype), or a view of one: autograd's history from ``t`` runs through views
    and casts only (``ToCopyBackward0``, at least one) to the ``AccumulateGrad`` of a parameter whose
    storage is in ``params`` (data pointers). ``torch.autocast`` saves such a cast of each weight that
    a lower-precision op uses (Linear, conv; a tied weight once), cached for the autocast region:
    bytes that do not grow with the batch."""
    node, cast = t.grad_fn, False
    for _ in range(16):
        if node is None:
            return False
        name = type(node).__name__
        if name == "AccumulateGrad":
            v = node.variable
            return (cast and v.untyped_storage().data_ptr() in params
                    and t.untyped_storage().nbytes() == v.numel() * t.element_size())
        if name == "ToCopyBackward0":
            cast = True
        elif name not in _VIEWS:
            return False
        following = [f for f, _ in node.next_functions if f is not None]
        if len(following) != 1:
            return False
        node = following[0]
    return False


class _BlockProbe:
    """Forward seconds, input bytes and saved bytes per block over one forward: activations, and
    autocast's casts of the parameters apart (:func:`parameter_copy`)."""

    def __init__(self, model: torch.nn.Module, blocks: list[torch.nn.Module], device: torch.device) -> None:
        self.blocks, self.device = blocks, device
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.stack: list[int] = []
        self.reset()
        self.handles = []
        self.output_bytes = 0
        self.handles.append(model.register_forward_hook(lambda m, args, out: self._output(out)))
        for i, b in enumerate(blocks):
            self.handles.append(b.register_forward_pre_hook(lambda m, args, i=i: self._enter(i, args)))
            self.handles.append(b.register_forward_hook(lambda m, args, out, i=i: self._leave(i)))

    def reset(self) -> None:
        k = len(self.blocks)
        self.forward_s, self.saved, self.inputs, self.copies = [0.0] * k, [0] * k, [0] * k, [0] * k
        self.seen: set[int] = set()
        self.t0 = [0.0] * k
        self.total_saved = self.total_copies = 0

    def _enter(self, i: int, args) -> None:
        synchronize(self.device)
        self.stack.append(i)
        self.inputs[i] += sum(_bytes(a) for a in args if isinstance(a, torch.Tensor))
        self.t0[i] = time.perf_counter()

    def _leave(self, i: int) -> None:
        synchronize(self.device)
        self.forward_s[i] += time.perf_counter() - self.t0[i]
        self.stack.pop()

    def _output(self, out) -> None:
        """The model's output bytes (what towers gather to device 0): its tensors, first one of a tuple."""
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        self.output_bytes = _bytes(first) if isinstance(first, torch.Tensor) else 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.params and ptr not in self.seen:
            self.seen.add(ptr)
            n = t.untyped_storage().nbytes()
            copy = parameter_copy(t, self.params)
            if copy:
                self.total_copies += n
            else:
                self.total_saved += n
            if self.stack:
                (self.copies if copy else self.saved)[self.stack[-1]] += n
        return t

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _timed_steps(model, optimizer, loss_fn: Callable[[], torch.Tensor], draw: Callable[[], Any], device,
                 warmup: int, steps: int) -> dict[str, float]:
    """Median seconds of data / forward / backward / optimizer over ``steps`` after ``warmup``."""
    spans: dict[str, list[float]] = {"data_s": [], "forward_s": [], "backward_s": [], "optimizer_s": []}
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        batch = draw()
        synchronize(device)
        t1 = time.perf_counter()
        loss = loss_fn(batch)
        synchronize(device)
        t2 = time.perf_counter()
        loss.backward()
        synchronize(device)
        t3 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        t4 = time.perf_counter()
        if i >= warmup:
            for key, dt in zip(spans, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                spans[key].append(dt)
    return {k: statistics.median(v) for k, v in spans.items()}


def _checkpointing_cost(model, loss_fn, draw, device, step_s: float, rounds: int = 5) -> dict[str, float] | None:
    """What activation checkpointing costs the model's step here: the model plain and a deep copy
    with every block checkpointed (:func:`paratrain.models.checkpointing.enable`, as
    ``model.activation_checkpointing`` does; its RNN weights flattened into one chunk, as the
    model's), timed in turn over ``rounds`` paired rounds of the same number of forwards and
    backwards each (about 0.2 s of each model a round, at least 2; one warm-up of each first); the
    copy is freed after (``loss_fn.release``). None where there is no room for the copy on the
    device. Returns the medians ``plain_forward_s``, ``plain_backward_s``,
    ``checkpointed_forward_s``, ``checkpointed_backward_s``; None where the model has no block. The
    difference is the blocks' forward again in the backward plus ``torch.utils.checkpoint``'s own work
    per block (its hooks, the random state it keeps for the recompute): on the 2-vCPU EPYC VM
    digits_cnn's three blocks cost 2.5 ms a step where their forward was 0.9 ms (2026-11-29)."""
    import copy

    from ..models.checkpointing import blocks, enable

    if not [b for b in blocks(model) if b is not model]:
        return None
    try:
        twin = copy.deepcopy(model)
    except torch.cuda.OutOfMemoryError:  # no room for a second copy on the device: not measured
        return None
    for module in twin.modules():  # a deep copy's RNN weights are apart: one chunk again, as the model's
        if isinstance(module, torch.nn.RNNBase):
            module.flatten_parameters()
    enable(twin)
    per_round = max(2, round(0.2 / max(step_s, 1e-6)))
    spans: dict[str, list[float]] = {k: [] for k in ("plain_forward_s", "plain_backward_s",
                                                     "checkpointed_forward_s", "checkpointed_backward_s")}
    for r in range(rounds + 1):  # the first round warms both up
        for name, module in (("plain", model), ("checkpointed", twin)):
            for _ in range(per_round if r else 1):
                batch = draw()
                synchronize(device)
                t0 = time.perf_counter()
                loss = loss_fn(batch, module)
                synchronize(device)
                t1 = time.perf_counter()
                loss.backward()
                synchronize(device)
                t2 = time.perf_counter()
                module.zero_grad(set_to_none=True)
                if r:
                    spans[f"{name}_forward_s"].append(t1 - t0)
                    spans[f"{name}_backward_s"].append(t2 - t1)
    release = getattr(loss_fn, "release", None)
    if release is not None:  # the loss' wrapper of the copy (bf16, fp16) holds it
        release(twin)
    del twin
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {k: statistics.median(v) for k, v in spans.items()}


def _memory_peak(model, optimizer, step: Callable[[], None]) -> dict[str, float]:
    """One step under MemTracker (:func:`~.mfu.track_memory`): the peak bytes (``peak_bytes``) and
    their split by kind at that moment."""
    from .memory import track_memory

    _, kinds = track_memory(step, model, optimizer, per_module=True)
    return {("peak_bytes" if k == "peak" else k): v for k, v in kinds.items()}


def profile_model(task, cfg, *, warmup: int = 2, steps: int = 5, progress: Callable[[str], None] = print,
                  links: bool = True, towers_task: Callable[[int], Any] | None = None,
                  data_dir: str | None = None) -> dict[str, Any]:
    """Measure the task's model on one device (see the module). ``task``: built for one rank
    holding the whole global batch (``build_task(..., world_size=1)``). ``towers_task(batch)``: the
    same task built for one rank holding a global batch of ``batch``, for CPU towers' forward (None:
    not measured; the plan then prices the towers' forwards one after the other). ``data_dir``: the
    task's data, for the links' processes that build the task again (None: the default). ``progress(what)``
    is told of each phase (a tqdm bar in ``paratrain plan``). Returns a JSON-able dict."""
    import platform

    from ..consistency import config_text
    from ..env import available_cores
    from ..train.optim import build_optimizer
    from .mfu import peak_flops
    from .validate import model_gradient_bytes

    model, device, tokens, draw, loss_fn = _model_and_batch(task, cfg)
    optimizer = build_optimizer(model.parameters(), cfg.train, cfg.train.lr)

    def one_step() -> None:
        loss_fn(draw()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

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
    if links:
        progress("links: gloo all-reduce, all-gather, reduce-scatter, send; rpc, a server's update and exchange "
                 "(alone and among computing workers); DTensor steps; what FSDP2 adds to each unit and ZeRO-1 "
                 "and FSDP2 to the optimizer's step")
        from .profile_links import profile_links

        out.update(profile_links(model, optimizer, cfg, device, out, data_dir))
    if device.type == "cpu" and out["cores"] > 1 and towers_task is not None:  # CPU towers: one per core
        progress("CPU towers' forward")
        from .microbench_towers import towers_forward

        towers = towers_forward(task, model, device, one_step, towers_task, out["cores"], cfg.train.batch_size,
                                sync_batchnorm=bool(out["batchnorm_inputs"]), precision=cfg.train.precision)
        if towers:
            out["towers_forward_threads"] = towers
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


def _blocks_and_flops(model, optimizer, loss_fn, draw, device, w: dict[str, float], tokens: float) -> dict[str, Any]:
    """Per block: forward seconds (mean of 2 steps), backward seconds (its forward share of the
    measured backward ``w``), parameter bytes, bytes saved for the backward (activations; autocast's
    casts of the parameters apart, ``autocast_copy_bytes``: 0 in fp32), input bytes; the whole
    forward's saved bytes (the same two) and output bytes; the step's counted FLOPs (total and per unit)."""
    from ..models.checkpointing import blocks as model_blocks
    from .mfu import count_flops

    blocks = [b for b in model_blocks(model) if b is not model]
    probe = _BlockProbe(model, blocks, device)
    try:
        with torch.autograd.graph.saved_tensors_hooks(probe.pack, lambda t: t):
            loss_fn(draw()).backward()  # what each block saves for the backward, and its inputs
        saved, inputs, total_saved, output_bytes = probe.saved, probe.inputs, probe.total_saved, probe.output_bytes
        copies, total_copies = probe.copies, probe.total_copies
        optimizer.zero_grad(set_to_none=True)
        probe.reset()
        for _ in range(2):
            loss_fn(draw()).backward()
            optimizer.zero_grad(set_to_none=True)
        block_forward = [t / 2 for t in probe.forward_s]
    finally:
        probe.close()
    _, flops = count_flops(lambda: loss_fn(draw()).backward())
    optimizer.zero_grad(set_to_none=True)
    names = {id(m): n for n, m in model.named_modules()}
    backward_per_forward = w["backward_s"] / max(w["forward_s"], 1e-12)
    rows = [{"name": names.get(id(b), type(b).__name__), "param_bytes": sum(_bytes(p) for p in b.parameters()),
             "forward_s": block_forward[i], "backward_s": block_forward[i] * backward_per_forward,
             "activation_bytes": saved[i], "autocast_copy_bytes": copies[i], "input_bytes": inputs[i]}
            for i, b in enumerate(blocks)]
    return {"blocks": rows, "activation_bytes": total_saved, "autocast_copy_bytes": total_copies,
            "output_bytes": output_bytes, "flops_per_step": flops, "flops_per_unit": flops / tokens}


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
            keys = ("activation_bytes", "shared_bytes", "stage_param_bytes", "stage_fractions", "microbatch_factor")
            out["stage_profiles"][str(s)] = {k: got[k] for k in keys}
    return out
