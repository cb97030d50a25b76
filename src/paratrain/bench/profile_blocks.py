"""The profile's per-block measurements (:mod:`.profile`): what each block of the model saves for the
backward (activations, and autocast's casts of the weights apart), its input, its forward seconds,
the step's FLOPs, and what checkpointing every block costs the step. Units: seconds, bytes."""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

from ..devices import synchronize


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


def batch_tensors(obj: Any, depth: int = 0) -> list[torch.Tensor]:
    """Every tensor in a batch: tensors, :class:`LMBatch` and other objects by their attributes,
    dataclasses, tuples, lists, dicts (4 levels deep)."""
    if depth > 4:
        return []
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        items = list(obj)
    elif isinstance(obj, dict):
        items = list(obj.values())
    elif hasattr(obj, "__dict__"):
        items = list(vars(obj).values())
    else:
        return []
    return [t for x in items for t in batch_tensors(x, depth + 1)]


def data_set_storages(obj: Any) -> set[int]:
    """The data pointers of the storages that a batch's tensors (:func:`batch_tensors`; give the
    step's every micro-batch) are views of and that hold more than all of them together: the data
    set's tensor the batch is cut from, which a saved view of the batch keeps whole. A language
    model's batch (``LMBatch``: inputs and targets are rows of its rank's batchified corpus) is such a
    view; a batch collated into tensors of its own (digits), or cut into views of one (a sequence's
    inputs and targets ``seq[:, :-1]``, ``seq[:, 1:]``), is not."""
    viewed: dict[int, list] = {}
    for t in batch_tensors(obj):
        st = t.untyped_storage()
        viewed.setdefault(st.data_ptr(), [st.nbytes(), 0])[1] += _bytes(t)
    return {ptr for ptr, (whole, seen) in viewed.items() if whole > seen}


class _BlockProbe:
    """Forward seconds, input bytes and saved bytes per block over one forward: activations, and
    autocast's casts of the parameters apart (:func:`parameter_copy`); of the activations, what is
    the data set's storage the batch views (``data``: data pointers, :func:`data_set_storages`) in
    ``total_data``."""

    def __init__(self, model: torch.nn.Module, blocks: list[torch.nn.Module], device: torch.device,
                 data: set[int] = frozenset()) -> None:
        self.blocks, self.device, self.data = blocks, device, data
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
        self.seen: dict[int, int] = {}  # storage data pointer: bytes, of every saved tensor but the parameters
        self.t0 = [0.0] * k
        self.total_saved = self.total_copies = self.total_data = 0

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
            n = self.seen[ptr] = t.untyped_storage().nbytes()
            copy = parameter_copy(t, self.params)
            if copy:
                self.total_copies += n
            else:
                self.total_saved += n
                self.total_data += n if ptr in self.data else 0
            if self.stack and ptr not in self.data:  # the data set's storage is no block's: D apart
                (self.copies if copy else self.saved)[self.stack[-1]] += n
        return t

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def stage_saved(stages, model, batch, x, microbatches: int, loss_of: Callable[[Any, int, int], Any],
                autocast: Callable[[], Any] | None = None) -> dict[str, list[float]]:
    """What each stage saves for its backward, measured on one micro-batch (``x``'s first rows /
    ``microbatches``; ``x``: stage 0's input for a replica's batch ``batch``) as the pipeline runs it:
    each stage on the previous one's output, the last with the task's loss ``loss_of(output, lo, hi)``
    on rows [lo, hi), under ``autocast()``; no backward runs. ``stage_saved_bytes``, per stage for the
    replica's whole batch (the micro-batch's bytes x ``microbatches``): the storages of the tensors it
    saves (:class:`_BlockProbe`: not the parameters nor autocast's casts of them) but the batch's
    tensors and what they view (the loop holds the batch whole, once: a language model's corpus shard
    is the plan's D, :func:`data_set_storages`) and the stage's own output (the plan counts it apart,
    ``stage_outputs``). Bytes. The plan splits the one-device activations over the stages by these
    (:func:`~.plan_memory.memory_per_device`)."""
    import contextlib

    amp = autocast or contextlib.nullcontext
    given = {t.untyped_storage().data_ptr() for t in batch_tensors(batch) + [x]}
    rows = max(1, x.size(0) // microbatches)
    saved = []
    h = x[:rows]
    for s, stage in enumerate(stages):
        probe = _BlockProbe(model, [], x.device, given)
        try:
            h = h.detach().requires_grad_(h.is_floating_point())
            with torch.autograd.graph.saved_tensors_hooks(probe.pack, lambda t: t), amp():
                out = stage(h)
                if s == len(stages) - 1:
                    loss_of(out, 0, rows)
        finally:
            probe.close()
        ptr = out.untyped_storage().data_ptr()
        own = probe.total_saved - probe.total_data - (probe.seen.get(ptr, 0) if ptr not in given else 0)
        saved.append(float(own) * microbatches)
        h = out
    return {"stage_saved_bytes": saved}


def forward_backward_s(forward: Any, device) -> tuple[float, float]:
    """Seconds of one forward (``forward()`` returns the loss, a scalar tensor) and of its loss'
    backward, each timed between two synchronisations of ``device``."""
    synchronize(device)
    t0 = time.perf_counter()
    loss = forward()
    synchronize(device)
    t1 = time.perf_counter()
    loss.backward()
    synchronize(device)
    return t1 - t0, time.perf_counter() - t1


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
                forward_s, backward_s = forward_backward_s(lambda: loss_fn(batch, module), device)
                module.zero_grad(set_to_none=True)
                if r:
                    spans[f"{name}_forward_s"].append(forward_s)
                    spans[f"{name}_backward_s"].append(backward_s)
    release = getattr(loss_fn, "release", None)
    if release is not None:  # the loss' wrapper of the copy (bf16, fp16) holds it
        release(twin)
    del twin
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {k: statistics.median(v) for k, v in spans.items()}


def _blocks_and_flops(model, optimizer, loss_fn, draw, device, w: dict[str, float], tokens: float) -> dict[str, Any]:
    """Per block: forward seconds (mean of 2 steps), backward seconds (its forward share of the measured
    backward ``w``), parameter bytes, bytes saved for the backward (activations; autocast's casts of the
    parameters apart, ``autocast_copy_bytes``: 0 in fp32), input bytes; the whole forward's saved bytes
    (the same two; ``data_bytes``: the part of the activations that is the data set's storage the batch
    views, :func:`data_set_storages`: a language model's corpus shard) and output bytes; the step's
    counted FLOPs (total and per unit)."""
    from ..models.checkpointing import blocks as model_blocks
    from .mfu import count_flops

    blocks = [b for b in model_blocks(model) if b is not model]
    batch = draw()
    probe = _BlockProbe(model, blocks, device, data_set_storages(batch))
    try:
        with torch.autograd.graph.saved_tensors_hooks(probe.pack, lambda t: t):
            loss_fn(batch).backward()  # what each block saves for the backward, and its inputs
        saved, inputs, total_saved, output_bytes = probe.saved, probe.inputs, probe.total_saved, probe.output_bytes
        copies, total_copies, data_bytes = probe.copies, probe.total_copies, probe.total_data
        del batch
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
            "data_bytes": data_bytes, "output_bytes": output_bytes, "flops_per_step": flops,
            "flops_per_unit": flops / tokens}
