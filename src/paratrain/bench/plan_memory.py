"""The peak memory per device that ``paratrain plan`` predicts for each strategy and layout
(:func:`memory_per_device`). Pure arithmetic on a profile's terms (:class:`MemoryInputs`, from
:func:`~.plan_inputs.memory_inputs`); the step times are :mod:`.plan_model`'s.

Memory per device (bytes; P parameters, G gradients = P in the parameters' dtype, O optimizer
state, A the bytes the forward saves for the backward, T the step's other temporaries measured at
one device, U the largest FSDP unit, all for one replica's batch):

* the data set's storage that the batch is a view of (D, ``data_bytes``; in A as the profile measures
  it): a language model's batch is rows of its rank's batchified corpus, and a saved view keeps the
  whole shard. D is the whole corpus at one process: a process holds D / R where R processes split the
  data (n, a pipeline's replicas n / S, one for towers), whatever its batch, and in every phase.
  Until 2026-11-30 it was scaled with the batch as the rest of A: every data-parallel row at N = 2
  was D / 2 high (gpt_wt2: +8.0 MiB, ptb_small: +3.5 MiB, exactly), towers D high;
* the peak is the larger of two phases (Rajbhandari et al. 2020, "ZeRO", section 3, counts the same
  terms): the end of the forward, ``P_d + G_kept + O_d + A_d + T_d``, and the optimizer step,
  ``P_d + G_d + O_d + buffers``;
* one device / all-reduce: ``P_d = P``, ``O_d = O``; DDP keeps its gradient buckets between steps
  (``gradient_as_bucket_view``: G_kept = G), one device frees them (G_kept = 0);
* ZeRO-1 (``sharded_optimizer``): ``O_d = O / n`` and, in the optimizer phase, the all-gather of the
  updated rows: its output (P) and its send buffer (P / n);
* FSDP (``sharded_parameters``): ``P_d = P / n``, ``G_d = G / n``, ``O_d = O / n``; the forward ends
  with every unit resharded (FSDP2 frees a unit's gathered parameters after its forward) but the
  root's own parameters R (kept for the backward), and a third phase, the backward's start, holds the
  last unit gathered again and its unsharded gradient beside the activations: ``P_d + O_d + A + R + 2 U``;
  under a bf16 or fp16 recipe's ``MixedPrecisionPolicy`` the gathered parameters and their unsharded
  gradients are in the low dtype (g = 0.5 of float32, ``gather_scale``) and the gradients are copied
  into a float32 buffer to be reduce-scattered, after the unit is resharded (FSDP2's ``post_backward``,
  ``foreach_reduce``): ``R g`` and ``U (g + 1)`` (the gathered unit and its gradient, ``2 U g``, are
  less); with ``reshard_after_forward`` off (ZeRO-2, ``reshard_after_forward``) no unit is resharded after
  its forward: every unit stays gathered from its forward to its backward, ``P g`` in place of ``R g``,
  and the backward's start adds only the last unit's gradient: ``P_d + O_d + A + P g + U``. Measured
  (2026-11-30, the 2-vCPU Xeon VM; ptb_small, fsdp at N = 2, weak scaling, MemTracker at step 9):
  68.97 MiB resharded, 86.72 MiB not, where this predicts 68.91 and 86.66 (until then 68.91 for both);
  gpt_wt2, whose root unit holds the tied embedding: 881.94 and 883.48 MiB, predicted 881.95 and 883.50;
* pipeline (``stages``): the busiest stage s: its P_s, O P_s / P and, from the first micro-batch's
  backward on, G_s; its replica's data shard D / R (every stage reads the replica's batch; above);
  its share of A - D (by the bytes each stage's forward saves) and its output (kept until the
  micro-batch's backward) for the micro-batches it has in flight (GPipe: all M; 1F1B: min(S - s, M),
  Narayanan et al. 2019); the loss's temporaries on the last stage (GPipe: all M micro-batches';
  1F1B: one micro-batch's);
* parameter server (``ps``): a worker holds P, its gradient and A + T; the busiest of K servers
  holds its shard S (whole parameters: S = P/K only where they balance) and O S/P, and in its step
  the gradients it received (n S synchronous, S an asynchronous update), the mean's buffer (S,
  synchronous) and the answer's copy (S): reported apart;
* towers (``towers``, one process over n devices): device 0 holds P, G, O, its tower's A and the
  loss over every tower's output (n T); CPU virtual devices share one memory: n A;
* activation checkpointing (Chen et al. 2016): the larger of two moments. At the forward's end,
  with the loss's temporaries T, the blocks keep their inputs alone: ``A - sum(blocks' saved) +
  sum(blocks' inputs)``. While a block is recomputed in the backward, one block's saved activations
  are back (the largest: ``+ max(block's saved)``) with its backward's gradients of them (at most
  as many bytes, and at most T: ``min(T, max(block's saved))``), and the loss's temporaries are
  gone, since the backward went through the loss first. Until 2026-11-29 the plan added the
  largest block to the forward's end, with T: ptb_small's one-device peak (one block, the LSTM; a
  30.5 MiB loss) was predicted 81.6 MiB where MemTracker measured 71.3, at the forward's end.
  digits_cnn's peak (a 2.4 MB block of convolutions, its whole model) is the recompute: 3.06 MiB
  measured, 3.13 predicted. Towers: device 0 holds the recompute of its own tower's block, once (on
  GPUs each device recomputes its own tower's). CPU towers (one memory) hold every tower's kept
  bytes at both moments; their one backward thread runs tower 0's graph first (autograd's sequence
  numbers are per thread: the calling thread's are the highest), one block at a time, then the
  other n - 1 towers' graphs together (their threads are new each step, so their nodes share
  numbers and the engine interleaves them): n - 1 blocks recomputed at once, ``max(1, n - 1)``
  blocks' saved bytes (and casts), with one block's gradients of them at a time. Measured
  (2026-11-29, the 2-vCPU Xeon VM; digits_cnn, towers without sync BatchNorm or dropout, one step
  under MemTracker): 3.18, 5.58 and 7.97 MiB at n = 2, 3, 4, where this counts 3.18, 5.57, 8.06
  from the AMD VM's profile (its 2.39 MiB block once more a tower); n blocks, as counted before, 6.3 to 12.5;
* a bf16 or fp16 recipe's autocast keeps, besides A, a cast of each weight its lower-precision ops use
  (C, ``autocast_copies``: measured apart from A, :func:`~.profile.parameter_copy`), held for the
  backward. C does not grow with the batch: one replica's whole C per process (all-reduce, ZeRO-1, a
  PS worker), each tower's own (a tower thread has its own autocast cache: n C on CPU virtual
  devices), a stage's share of it (P_s / P), none under FSDP (``MixedPrecisionPolicy`` gathers the
  parameters in the low dtype: there is nothing to cast). Under checkpointing the blocks' own casts
  (``blocks_copies``) are saved by no one: autocast's cache frees them when its region, the forward,
  ends, before the loss; a block's recompute makes its casts again. So the forward's end holds
  ``C - sum(blocks' casts)`` and a recompute ``+ max(block's casts)``.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import UsageError
from .strategy_model import PS, SHARDED_OPTIMIZER, SHARDED_PARAMETERS, STAGES, TOWERS


@dataclass(frozen=True)
class MemoryInputs:
    """One replica's memory terms in bytes (see the module)."""

    params: float
    optimizer: float
    activations: float
    temporaries: float = 0.0
    largest_unit: float = 0.0
    root_unit: float = 0.0  # FSDP's root unit's own parameter bytes: gathered from its forward to its backward
    blocks_saved: tuple[float, ...] = ()
    blocks_input: tuple[float, ...] = ()
    autocast_copies: float = 0.0  # C: autocast's casts of the weights, kept for the backward (bf16, fp16)
    blocks_copies: tuple[float, ...] = ()  # the part of C each block makes
    gather_scale: float = 1.0  # g: FSDP's gathered bytes per stored byte (MixedPrecisionPolicy: 0.5 of float32)
    data_bytes: float = 0.0  # D: the part of A that is the data set's storage the batch views (an LM's corpus)

    def kept_activations(self) -> float:
        """A at the forward's end with every block checkpointed: the blocks keep their inputs alone
        (see the module)."""
        return max(0.0, self.activations - sum(self.blocks_saved) + sum(self.blocks_input))

    def checkpointed_activations(self) -> float:
        """A while the largest block is recomputed (see the module); A when there are no blocks."""
        if not self.blocks_saved:
            return self.activations
        return self.kept_activations() + max(self.blocks_saved)


@dataclass(frozen=True)
class _Layout:
    """The layout's keys that :func:`memory_per_device` passes to each moment (see there)."""

    synchronous_buckets: bool = True
    stages: int = 1
    microbatches: int = 1
    stage_shares: list[float] | None = None
    stage_params: list[float] | None = None
    stage_outputs: list[float] | None = None
    schedule: str = "1f1b"
    num_ps: int = 1
    stage_saved: list[float] | None = None
    shared_cores: bool = False
    server_share: float | None = None
    reshard_after_forward: bool = True


def memory_per_device(model: str, n: int, m: MemoryInputs, *, synchronous_buckets: bool = True,
                      checkpointing: bool = False, stages: int = 1, microbatches: int = 1,
                      stage_shares: list[float] | None = None, stage_params: list[float] | None = None,
                      stage_outputs: list[float] | None = None, schedule: str = "1f1b",
                      num_ps: int = 1, batch_ratio: float = 1.0, shared_cores: bool = False,
                      server_share: float | None = None, stage_saved: list[float] | None = None,
                      reshard_after_forward: bool = True) -> dict[str, float]:
    """Peak bytes per device of ``model`` (a ``Strategy.cost_model``) at n devices, by term and
    ``total``; ``server`` too for a parameter server: the busiest of ``num_ps``, which holds
    ``server_share`` of the parameter bytes (:func:`~.costmodel_ps.ps_largest_shard_bytes` over the
    total: whole parameters; None: 1/num_ps, an even split). ``batch_ratio``: this layout's per-replica
    batch over the profiled one (activations but D, and temporaries, scale with it); ``shared_cores``:
    towers on CPU virtual devices (one memory). ``stage_saved``: the bytes each pipeline stage's
    forward saves (:func:`~.profile_blocks.stage_saved`), by which the stages split A - D (None: by
    ``stage_shares``, their compute's). ``checkpointing``: the larger of two moments (see the module):
    the forward's end, with the loss's temporaries T, and a block's recompute, with its backward's
    instead. ``reshard_after_forward``: FSDP's (``sharded_parameters``) units resharded after their forward
    (False: ZeRO-2, every unit gathered until its backward; see the module). Bytes in, bytes out. Raises
    :class:`~paratrain.errors.UsageError` where n, stages, microbatches
    or num_ps is below 1."""
    if n < 1 or stages < 1 or microbatches < 1 or num_ps < 1:
        raise UsageError(f"n = {n}, stages = {stages}, microbatches = {microbatches}, num_ps = {num_ps}: use >= 1")
    layout = _Layout(synchronous_buckets=synchronous_buckets, stages=stages, microbatches=microbatches,
                     stage_shares=stage_shares, stage_params=stage_params, stage_outputs=stage_outputs,
                     schedule=schedule, num_ps=num_ps, shared_cores=shared_cores, server_share=server_share,
                     stage_saved=stage_saved, reshard_after_forward=reshard_after_forward)
    # the data set's storage the batch views (D, in A): a process' own shard of it, whatever its batch
    d = min(m.data_bytes, m.activations)
    data = d / data_ranks(model, n, stages)
    if not (checkpointing and m.blocks_saved):
        return _at(model, n, m, layout, (m.activations - d) * batch_ratio, m.temporaries * batch_ratio,
                   m.autocast_copies, data=data)
    kept = max(0.0, m.kept_activations() - d)
    casts = max(0.0, m.autocast_copies - sum(m.blocks_copies))  # autocast's cache freed the blocks' casts
    ends = _at(model, n, m, layout, kept * batch_ratio, m.temporaries * batch_ratio, casts, data=data)
    # a block's recompute: its activations (and casts) back, and its backward's gradients of them (at
    # most those bytes, at most the step's temporaries), the loss's temporaries gone
    # (held once a device; CPU towers: up to n - 1 blocks at once, see the module)
    again = _at(model, n, m, layout, kept * batch_ratio, 0.0, casts,
                once=(max(m.blocks_saved) * batch_ratio, min(m.temporaries, max(m.blocks_saved)) * batch_ratio,
                      max(m.blocks_copies, default=0.0)), data=data)
    return max((ends, again), key=lambda phase: phase["total"])


def data_ranks(model: str, n: int, stages: int = 1) -> int:
    """The processes that split the data set at n devices (each holds its shard): n for one replica
    per process (a parameter server's n workers too), the replicas n / S of a pipeline (every stage of
    a replica reads its batch), 1 for towers (one process)."""
    if model == TOWERS:
        return 1
    if model == STAGES:
        return max(1, n // stages)
    return max(1, n)


def _at(model: str, n: int, m: MemoryInputs, layout: _Layout, act: float, tmp: float,
        copies: float, once: tuple[float, float, float] = (0.0, 0.0, 0.0), data: float = 0.0) -> dict[str, float]:
    """:func:`memory_per_device` at one moment: ``act`` bytes of activations and ``tmp`` of the loss's
    temporaries for one replica's batch, and ``copies`` of autocast's casts (not scaled by the
    batch), as held then; ``once``: activations, temporaries and casts of one block's recompute at
    that moment, in the same three terms: held once a device, not per tower (CPU towers: n - 1
    blocks' activations and casts at once, see the module)."""
    synchronous_buckets = layout.synchronous_buckets
    if model != TOWERS:  # one replica per device: held once is held
        act, tmp, copies = act + once[0], tmp + once[1], copies + once[2]
    p, o, g_kept, gather = m.params, m.optimizer, (m.params if synchronous_buckets and n > 1 else 0.0), 0.0
    root = 0.0  # FSDP's root unit, gathered from its forward to its backward
    out: dict[str, float] = {}
    if model == SHARDED_OPTIMIZER:
        o, gather = m.optimizer / n, m.params * (1 + 1 / n)
    elif model == SHARDED_PARAMETERS:
        gs = m.gather_scale
        kept = m.root_unit if layout.reshard_after_forward else m.params  # gathered from forward to backward
        p, o, g_kept, root = m.params / n, m.optimizer / n, 0.0, (kept * gs if n > 1 else 0.0)
        copies = 0.0  # MixedPrecisionPolicy: the gathered parameters are already in the low dtype
        # the backward's start: the last unit gathered again with its unsharded gradient, beside the
        # activations; then (resharded) that gradient and its copy into the reduce-scatter's float32 buffer
        # (ZeRO-2: the unit is still gathered, in root's P g; its gradient alone)
        again = gs if layout.reshard_after_forward else 0.0
        out["backward_start"] = p + o + act + root + m.largest_unit * (1 + again)
    elif model == STAGES:
        return _stage_memory(n, m, act, tmp, layout, copies, data=data)
    elif model == PS:
        o, g_kept = 0.0, 0.0
        # a server's peak, in its step: its shard and optimizer state, the gradients it received (n when
        # synchronous, one update's when not), the mean's buffer (kept) and the parameters copied for the answer
        received = n if synchronous_buckets else 1
        share = 1 / layout.num_ps if layout.server_share is None else layout.server_share
        out["server"] = (m.params * (received + 1 + (2 if synchronous_buckets else 1)) + m.optimizer) * share
    elif model == TOWERS:
        g_kept = 0.0  # one process, no buckets
        act *= n if layout.shared_cores else 1  # CPU virtual devices: every tower's activations in the one memory
        copies *= n if layout.shared_cores else 1  # and every tower thread's autocast casts
        tmp *= n  # the loss runs on device 0 over every tower's output
        blocks = max(1, n - 1) if layout.shared_cores else 1  # towers 1 ... n - 1 recompute together
        act, tmp, copies = act + blocks * once[0], tmp + once[1], copies + blocks * once[2]
    g = p if model != SHARDED_PARAMETERS else m.params / n
    forward_end = p + g_kept + o + act + data + copies + tmp + root
    optimizer_phase = p + g + o + gather + data
    if "backward_start" in out:
        out["backward_start"] += data
    out.update({"params": p, "grads": g, "optimizer": o, "activations": act + data, "autocast_copies": copies,
                "temporaries": tmp, "total": max(forward_end, optimizer_phase, out.pop("backward_start", 0.0))})
    return out


def _stage_memory(n: int, m: MemoryInputs, act: float, tmp: float, layout: _Layout, copies: float = 0.0,
                  data: float = 0.0) -> dict:
    """The pipeline's busiest stage. Stage s holds its parameters P_s (a tied embedding in each stage
    that uses it), O P_s / P of the optimizer state, autocast's casts of its weights ``copies`` P_s / P
    (one autocast region over the schedule's step: cast once), the data set's storage its replica's
    batch views, ``data`` (every stage reads the replica's batch: a language model's corpus shard), and,
    per micro-batch in flight (GPipe: all M; 1F1B: min(S - s, M), Narayanan et al. 2019), its share of
    the activations ``act`` (without that storage) and its output (``outputs[s]`` for the whole batch:
    what it sends the next stage, the model's output on the last; ``torch.distributed.pipelining`` keeps
    a forward's outputs until that micro-batch's backward). The share is ``stage_saved[s]`` over their
    sum (the bytes each stage's forward saves, :func:`~.profile_blocks.stage_saved`), else, from a
    profile without them, the stage's share of the compute (``stage_shares``). The last stage adds
    the loss's temporaries: every micro-batch's in flight under GPipe (all forwards first), one
    micro-batch's under 1F1B (each micro-batch's backward follows its forward there). The gradients G_s = P_s are held
    from the first micro-batch's backward on: at the in-flight peak where M exceeds the micro-batches in
    flight (1F1B: a later forward runs after the first backward), else at the larger of the
    micro-batches all in flight without them and one fewer with them. Until 2026-11-30 the shares were
    the compute's, D was one of the activations shared out, and G_s was left out: gpt_wt2's last stage
    (of 2, M = 4) was predicted 322.0 MiB where MemTracker measured 351.2 (its gradient 17.0, D 15.9
    held whole, not a fraction of a quarter)."""
    S, M = layout.stages, layout.microbatches
    shares = next((list(x) for x in (layout.stage_saved, layout.stage_shares) if x and sum(x) > 0), [1 / S] * S)
    params = list(layout.stage_params) if layout.stage_params else [m.params / S] * S
    outputs = list(layout.stage_outputs) if layout.stage_outputs else [0.0] * S
    best: dict[str, float] = {}
    for s in range(S):
        p = params[s]
        o = m.optimizer * (p / m.params if m.params else 1 / S)
        in_flight = M if layout.schedule == "gpipe" else min(S - s, M)
        per_micro_batch = (act * shares[s] / sum(shares) + outputs[s]) / M
        c = copies * (p / m.params if m.params else 1 / S)
        # (gradient bytes, micro-batches in flight): DDP's buckets hold the gradients between steps, and a
        # later forward than the first backward runs beside them; else all in flight before it, one fewer after
        held = (layout.synchronous_buckets and n > S) or M > in_flight
        moments = [(p, in_flight)] if held else [(0.0, in_flight), (p, in_flight - 1)]
        for g, k in moments:
            a = per_micro_batch * k + data
            t = (tmp * k / M if layout.schedule == "gpipe" else tmp / M) if s == S - 1 else 0.0
            total = max(p + g + o + a + c + t, 2 * p + o + data)
            if total > best.get("total", -1.0):
                best = {"params": p, "grads": p, "optimizer": o, "activations": a, "autocast_copies": c,
                        "temporaries": t, "total": total, "stage": s}
    return best
