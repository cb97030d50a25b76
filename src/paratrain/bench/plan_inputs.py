"""What ``paratrain plan`` reads from a cached profile (:mod:`.profile`) for one layout: the
one-device step at a thread count and batch (:func:`workload`), the memory inputs, the pipeline
stages' outputs, and the measured costs that only some layouts pay (synchronised BatchNorm between
processes and between CPU towers, DDP's broadcast of the buffers, CPU towers' side-by-side forward).
Pure functions of the profile."""
from __future__ import annotations

import math

from .costmodel import Link, Workload
from .plan_memory import MemoryInputs


STEP_PARTS = ("data_s", "forward_s", "backward_s", "optimizer_s")
"""The parts of a one-device step in a profile's ``workloads`` entry (:func:`~.profile_runs.loop_workloads`)."""


def step_s(parts: dict[str, float]) -> float:
    """Seconds of a one-device step: the sum of its :data:`STEP_PARTS`."""
    return sum(parts[k] for k in STEP_PARTS)


def in_process_step_s(prof: dict) -> float:
    """Seconds of the profile's one-device step timed in its own process at the default threads
    (``workloads_in_process``, the sum of its parts: a guess of a run's step before the loop's runs
    measure it)."""
    return sum(prof["workloads_in_process"][str(prof["default_threads"])].values())


def measured_workload(prof: dict, threads: int | None = None) -> dict | None:
    """The profile's ``workloads`` entry at the measured thread count nearest ``threads`` (None: the
    default run's, the most threads); None where the profile has none."""
    measured = {int(k): v for k, v in (prof.get("workloads") or {}).items()}
    if not measured:
        return None
    want = threads or max(measured)  # None: the default run (the most threads)
    return measured[min(measured, key=lambda t: (abs(t - want), -t))]  # the nearest thread count measured


def workload(prof: dict, threads: int | None = None, ratio: float = 1.0) -> Workload:
    """The profile's one-device step at the measured thread count nearest ``threads`` (None: the
    default run's) with the per-replica batch scaled by ``ratio``: compute linear in the batch, its
    spread from step to step by sqrt(ratio) (between noise independent per sample, sqrt, and jitter
    of the machine that no batch size changes, constant; unvalidated: the validation runs ratio 1)."""
    w = measured_workload(prof, threads)
    return Workload(forward_s=w["forward_s"] * ratio, backward_s=w["backward_s"] * ratio, data_s=w["data_s"] * ratio,
                    optimizer_s=w["optimizer_s"], param_bytes=tuple(prof["param_bytes"]),
                    tokens_per_step=prof["tokens_per_step"] * ratio,
                    local_sd_s=w.get("local_sd_s", 0.0) * math.sqrt(ratio))


def recompute_fraction(prof: dict) -> float:
    """What activation checkpointing adds to a step, as a share of the one-device forward (Chen et
    al. 2016, "Training Deep Nets with Sublinear Memory Cost": each checkpointed segment's forward
    once more in the backward): since profile version 42 measured, the checkpointed model's forward
    and backward less the plain model's, over the plain forward (``checkpointing``,
    :func:`~.profile._checkpointing_cost`: the recompute and ``torch.utils.checkpoint``'s own work per
    block), but never below the blocks' own forward seconds (``blocks``, timed in its process at
    the default threads) over that process' whole forward there (the loss included), at most 1: the
    recompute runs each block's forward once more, so a measured difference below that is the
    machine's noise (on the 2-vCPU Xeon VM, 2026-11-29, ptb_small's paired rounds timed the
    checkpointed copy 6.7 ms a step faster than the model, where its LSTM's forward took a third of
    the forward; the FLOP counter counts the recompute as 0.51 of 6.34 GFLOP a step). From an older
    profile the blocks' share alone, which leaves ``torch.utils.checkpoint``'s own work out
    (digits_cnn's three blocks: 0.9 ms of the 2.5 ms measured). 0 where the profile has no blocks
    (nothing is checkpointed)."""
    blocks = sum(b.get("forward_s", 0.0) for b in prof.get("blocks", []))
    whole = (prof.get("workloads_in_process") or {}).get(str(prof.get("default_threads")), {}).get("forward_s")
    share = min(1.0, blocks / whole) if blocks > 0 and whole else 0.0
    got = prof.get("checkpointing")
    if got and got.get("plain_forward_s", 0) > 0:
        extra = (got["checkpointed_forward_s"] + got["checkpointed_backward_s"]
                 - got["plain_forward_s"] - got["plain_backward_s"])
        return max(share, extra / got["plain_forward_s"])
    return share


def memory_inputs(prof: dict) -> MemoryInputs:
    mem = prof["memory_measured"]
    return MemoryInputs(params=prof["param_total_bytes"] + prof.get("buffer_bytes", 0),
                        optimizer=prof["optimizer_state_bytes"], activations=prof["activation_bytes"],
                        temporaries=mem.get("temporaries", 0.0),
                        largest_unit=max(prof["strategy_inputs"]["units"] or [0]),
                        root_unit=(prof["strategy_inputs"]["units"] or [0])[0],
                        blocks_saved=tuple(b["activation_bytes"] for b in prof["blocks"]),
                        blocks_input=tuple(b["input_bytes"] for b in prof["blocks"]),
                        autocast_copies=prof.get("autocast_copy_bytes", 0.0),
                        blocks_copies=tuple(b.get("autocast_copy_bytes", 0.0) for b in prof["blocks"]),
                        gather_scale=prof["strategy_inputs"].get("gather_scale", 1.0),
                        data_bytes=prof.get("data_bytes", 0.0))


def stage_outputs(prof: dict, stages: int, ratio: float = 1.0) -> list[float] | None:
    """Bytes each of ``stages`` pipeline stages outputs for the profiled batch x ``ratio``: the stage
    boundary's activations (measured after stage 0; a Transformer's or an LSTM's boundaries all carry
    the hidden states) and, on the last stage, the model's output. None for a model that does not cut."""
    pipe = prof["strategy_inputs"].get("stage_profiles", {}).get(str(stages))
    if not pipe:
        return None
    return [pipe["activation_bytes"] * ratio] * (stages - 1) + [prof.get("output_bytes", 0.0) * ratio]


FORWARD_MEETINGS, MEETINGS = 2, 3  # a synchronised BatchNorm layer's all-reduces: in its forward, in a step


def batchnorm_rings_s(prof: dict, cfg, k: int, link: Link, forward_only: bool = False) -> float:
    """Seconds of a step's synchronised BatchNorm all-reduces, by the ring's formula at k processes
    (:func:`~.costmodel.allreduce_s`: a cluster's trees where faster), for every BatchNorm layer of
    ``prof["batchnorm_inputs"]`` (C channels): the forward's count and sums (C + 1 numbers) and variance (C), and unless
    ``forward_only`` the backward's two sums (2 C); numbers of 8 bytes for a float64 recipe, else 4
    (:class:`~paratrain.strategies.sync_batchnorm.GroupBatchNorm`'s statistics: float32 at least)."""
    from .costmodel import allreduce_s

    size = 8 if cfg.train.dtype == "float64" else 4
    return sum(allreduce_s((shape[1] + 1) * size, k, link) + allreduce_s(shape[1] * size, k, link)
               + (0.0 if forward_only else allreduce_s(2 * shape[1] * size, k, link))
               for shape in prof.get("batchnorm_inputs") or [])


def _measured_sync_batchnorm(prof: dict, on_this_machine: bool) -> float | None:
    """The profile's measured term at two processes (the loop's, else the layers'), where it prices this machine."""
    from .profile_runs import sync_batchnorm_strategies

    processes, _ = sync_batchnorm_strategies()
    measured = (prof.get("loop_sync_batchnorm_s") or {}).get(processes, prof.get("sync_batchnorm_s"))
    return measured if on_this_machine else None


def sync_batchnorm_s(prof: dict, cfg, n: int, link: Link, on_this_machine: bool) -> float:
    """Seconds per step that ``model.sync_batchnorm`` adds to n processes that step together: three
    ring all-reduces per BatchNorm layer and step (:func:`batchnorm_rings_s`: the forward's count and
    sums, C + 1 numbers, and variance, C; the backward's two sums, 2 C:
    :class:`~paratrain.strategies.sync_batchnorm.GroupBatchNorm`; four of C + 1 until 2026-11-30, when
    autograd differentiated the forward's); on this machine the
    profile's measurement at two processes plus what the ring adds beyond two processes. That
    measurement is the training loop's own (``loop_sync_batchnorm_s`` of the processes' strategy of
    :func:`~.profile_runs.sync_batchnorm_strategies`: its step with the key on minus off,
    :func:`~.profile_runs.loop_sync_batchnorm`) where the profile has it,
    else the layers' micro-benchmark (``sync_batchnorm_s``: the model's BatchNorm input shapes, each
    layer after the step's compute). More processes than this machine's cores take turns on them:
    each meeting waits for every process' compute before it (n / cores turns) and the ring wakes its
    2 (n - 1) hops one after another, both linear in n; where the profile measured the loop at
    m > cores replicas too (``loop_sync_batchnorm_oversubscribed``, m = 4 on fewer cores), n > cores
    is the straight line through the measurements at 2 and m (beyond m: extrapolated; at least 0). On the 2-vCPU
    VM, digits_cnn paid 29 ms a step at 2 processes and 85 ms at 4 (version 43; 14.1 and 53.9 ms at
    version 44, on the Xeon VM), where the ring's latency beyond 2 adds 10 ms. 0 without BatchNorm,
    without the key or at n = 1."""
    return _sync_batchnorm(prof, cfg, n, link, on_this_machine)[0]


def _sync_batchnorm(prof: dict, cfg, n: int, link: Link, on_this_machine: bool) -> tuple[float, bool]:
    """:func:`sync_batchnorm_s`'s seconds, and whether a measurement of this machine priced them
    (False: the rings' formula alone, or no term)."""
    if n < 2 or not prof.get("batchnorm_inputs") or not cfg.model_value("sync_batchnorm", False):
        return 0.0, False
    measured = _measured_sync_batchnorm(prof, on_this_machine)
    if measured is None:
        return batchnorm_rings_s(prof, cfg, n, link), False
    over = prof.get("loop_sync_batchnorm_oversubscribed")
    if over and above_the_cores(prof, n) and over["processes"] > 2:
        return max(0.0, _through_two(measured, over["seconds"], over["processes"], n)), True
    return measured + batchnorm_rings_s(prof, cfg, n, link) - batchnorm_rings_s(prof, cfg, 2, link), True


def sync_batchnorm_recompute_s(prof: dict, cfg, n: int, link: Link, on_this_machine: bool) -> float:
    """Seconds per step that activation checkpointing adds to :func:`sync_batchnorm_s`: the recomputed
    forward's two all-reduces per BatchNorm layer (count and sums, the variance) again, in the
    backward. Where the term is measured here: two thirds of it (3 meetings a layer become 5; half, 4
    becoming 6, until 2026-11-30), waits included, since in the recompute, as in the forward, each
    layer's meetings follow the compute before it, over which the ranks drift apart (every BatchNorm
    layer taken to be inside a block). Elsewhere (a preset, a GPU's profile): the forward's two rings
    alone (:func:`batchnorm_rings_s`). On the 2-vCPU EPYC VM (2026-11-29, version 42's four meetings)
    digits_cnn's checkpointed rows at N = 2 paid 4.8 (allreduce; its two runs 27.8 and 36.3 ms), 11.1
    (zero1), 11.5 (ps-sync) and 11.9 ms (fsdp) more a step, where the recompute measured 2.9 ms and
    half the term 9.8 ms; the ring's latency alone, without the waits, priced 0.5 ms. 0 where
    :func:`sync_batchnorm_s` is."""
    term, measured = _sync_batchnorm(prof, cfg, n, link, on_this_machine)
    if term == 0.0 or measured:
        return FORWARD_MEETINGS / MEETINGS * term
    return batchnorm_rings_s(prof, cfg, n, link, forward_only=True)


def sends_buffers(prof: dict, cfg) -> bool:
    """Whether DDP (``allreduce``, ``zero1``) broadcasts rank 0's buffers before every forward for the
    profiled model under recipe ``cfg``, as :class:`~paratrain.strategies.allreduce.AllReduce` decides
    it: the model has buffers, ``dist.broadcast_buffers`` is on, and ``model.sync_batchnorm`` is off
    (with it, the strategy makes its statistics group and turns the broadcast off, BatchNorm layers or
    not)."""
    return (bool(prof.get("buffer_bytes")) and bool(cfg.dist.broadcast_buffers)
            and not cfg.model_value("sync_batchnorm", False))


def buffer_broadcast_s(prof: dict, cfg, cls, n: int, link: Link, on_this_machine: bool) -> float:
    """Seconds per step that DDP's broadcast of rank 0's buffers (BatchNorm's running statistics)
    adds to n processes of strategy class ``cls``: DDP's strategies (``broadcast_buffers`` among
    their keys, on in the recipe) broadcast them before every forward, a blocking collective,
    unless the model has none or synchronises BatchNorm (``model.sync_batchnorm`` with BatchNorm
    layers: paratrain turns it off, the replicas' statistics already agree). On a cluster, a
    binomial-tree broadcast of ``buffer_bytes``: ceil(log2 n) (alpha + bytes beta) (Thakur et al.
    2005). On this machine, the profile's measurement in the training loop at two processes
    (``loop_buffer_broadcast_s``: DDP with and without it, :func:`~.profile_runs.loop_buffer_broadcast`)
    plus what the tree adds beyond two: the meeting
    costs the ranks' skew over the step, not only the link's latency (digits_cnn's 920 bytes cost
    rank 0 1.5-2 ms a step on a 2-vCPU Xeon, the link's alpha 0.16 ms). Where that was not measured
    (a single core, a failed run), the tree. Above the cores (n processes taking turns on them) this
    is likely short: it is measured at two processes only, while sync BatchNorm's meetings cost three
    times as much at 4 processes on 2 cores as at 2 (:func:`sync_batchnorm_s`). 0 at n = 1 and where
    DDP sends none (:func:`sends_buffers`)."""
    if n < 2 or "broadcast_buffers" not in cls.dist_keys or not sends_buffers(prof, cfg):
        return 0.0
    from ..strategies import DEFAULT
    from .costmodel import tree_broadcast_s

    def tree(k: int) -> float:
        return tree_broadcast_s(prof["buffer_bytes"], k, link)

    measured = (prof.get("loop_buffer_broadcast_s") or {}).get(DEFAULT)
    if not on_this_machine or measured is None:
        return tree(n)
    return measured + tree(n) - tree(2)


def above_the_cores(prof: dict, n: int) -> bool:
    """Whether n processes here take turns on the profile's cores, so that its oversubscribed
    measurements price them: n above the cores, and above 2 (on one core, the two-process
    measurements are n = 2's own)."""
    return n > max(2, prof.get("cores", n))


def _through_two(at_two: float, at_m: float, m: int, n: int) -> float:
    """The straight line through (2, at_two) and (m, at_m), at n."""
    return at_two + (at_m - at_two) * (n - 2) / (m - 2)


def meetings(prof: dict, n: int) -> list | None:
    """The measured (compute seconds, seconds) points of a blocking collective inside a step
    (:func:`~.costmodel_sharded.meeting_seconds`) for n processes here: measured between two
    processes, and for n above the cores also between the m processes the profile ran oversubscribed
    (``meetings_oversubscribed``, m = 4 on fewer cores). Above the cores each point's seconds is the
    straight line in n through the two tables (n = 3 between them; beyond m extrapolated; at least
    0), as :func:`sync_batchnorm_s`: each meeting waits for the processes still computing, n / cores
    turns of them. Where the two tables' compute points differ, the m processes' table unchanged.
    None where not measured (a GPU's profile)."""
    over, two = prof.get("meetings_oversubscribed"), prof.get("meetings")
    if not over or not above_the_cores(prof, n) or over["processes"] <= 2:
        return two
    if n == over["processes"] or two is None or [c for c, _ in two] != [c for c, _ in over["points"]]:
        return over["points"]
    return [[c, max(0.0, _through_two(t2, tm, over["processes"], n))]
            for (c, t2), (_, tm) in zip(two, over["points"])]


def towers_forward_s(prof: dict, n: int, ratio: float = 1.0) -> float | None:
    """Seconds of n CPU towers' forwards side by side on this machine's cores, each tower thread with
    its share of the threads: the profile's forward of ``cores`` towers after a training step
    (``towers_forward_threads``, :func:`~.microbench_towers.measured_towers_forward`; since version
    26 ``joined``: with the join of their outputs and the loss on it; before, the towers' forwards
    alone; from an older profile still, its one-thread forward measured ``concurrent`` = cores
    processes at once),
    times n / cores (n >= cores: each core runs n / cores towers in turn), the batch scaled by
    ``ratio``. None where neither was measured or n < cores (towers of several threads each)."""
    got = prof.get("towers_forward_threads")
    if got:
        cores, seconds = int(got["towers"]), got["seconds"]
    else:
        one = prof.get("workloads", {}).get("1")
        cores = int(one.get("concurrent", 0)) if one else 0
        seconds = one["forward_s"] if cores else 0.0
    return _towers_share(seconds, cores, n, ratio)


def _towers_share(seconds: float, cores: int, n: int, ratio: float) -> float | None:
    """n towers' seconds from a measurement of ``cores`` towers (one per core): times n / cores (each
    core runs n / cores towers in turn), the batch scaled by ``ratio``; None where nothing was
    measured or n < cores (towers of several threads each)."""
    if not cores or n < cores:
        return None
    return seconds * ratio * n / cores


def towers_backward_s(prof: dict, n: int, ratio: float = 1.0, extra_s: float = 0.0) -> float | None:
    """Seconds of the one backward of n CPU towers on this machine's cores, through every tower's
    graph in the calling thread: the profile's, timed after the towers' forward as ``replicate``
    runs it (``towers_forward_threads["backward_seconds"]``, since version 36,
    :func:`~.microbench_towers.measured_towers_forward`), times n / cores, the batch scaled by
    ``ratio``, plus ``extra_s`` (activation checkpointing's forwards again, every tower's in turn in
    that thread). None where it was not measured (an older profile: the plan then prices n one-device
    backwards) or n < cores."""
    got = prof.get("towers_forward_threads") or {}
    if "backward_seconds" not in got:
        return None
    measured = _towers_share(got["backward_seconds"], int(got["towers"]), n, ratio)
    return None if measured is None else measured + extra_s


def loop_towers_parts(prof: dict, cfg, n: int, ratio: float = 1.0, extra_s: float = 0.0) -> dict[str, float] | None:
    """n CPU towers' step parts on this machine's cores from the training loop's step of m towers, one
    per core (``loop_towers``, :func:`~.profile_runs_towers.loop_towers`; an optional key since 2026-12-01):
    ``{"forward_s", "backward_s", "data_s", "optimizer_s"}``. The loop's forward and backward hold the
    synchronised BatchNorm of m towers (:func:`tower_sync_batchnorm_s` at m; its meetings sit in both),
    which the plan adds at n apart: it is taken out of the two in proportion to their seconds (neither
    below 0). Then the data, forward and backward times n / m (each core runs n / m towers in turn), the
    batch scaled by ``ratio`` (the data part holds the loop's bookkeeping around the step too,
    :func:`~.validate.workload_from_record`, which does not grow with n: a small over-count above m);
    the backward plus ``extra_s`` (activation checkpointing's forwards again, every tower's in turn);
    the optimizer as measured (the parameters do not change with n or the batch). At n = m and ratio 1
    the parts add up, with the sync term at n, to the loop's step. None where not measured (an older
    profile, a GPU's, a failed run: the plan then prices the towers from their timing in the
    profile's process, :func:`towers_forward_s` and :func:`towers_backward_s`) or n < m (towers of
    several threads each)."""
    got = prof.get("loop_towers")
    if not got or n < int(got["towers"]):
        return None
    m = int(got["towers"])
    share = ratio * n / m
    both = got["forward_s"] + got["backward_s"]
    kept = max(0.0, both - tower_sync_batchnorm_s(prof, cfg, m, True)) / both if both > 0 else 0.0
    return {"forward_s": got["forward_s"] * kept * share,
            "backward_s": got["backward_s"] * kept * share + extra_s,
            "data_s": got["data_s"] * share, "optimizer_s": got["optimizer_s"]}


def tower_sync_batchnorm_s(prof: dict, cfg, n: int, on_this_machine: bool) -> float:
    """Seconds per step that ``model.sync_batchnorm`` adds to n CPU towers of one process here: the
    profile's measurement at m towers, times (n - 1) / (m - 1) (each meeting waits for every other
    tower: beyond m an extrapolation, not measured). Since version 36 the towers' steps plain and
    synchronised in turn in one process, m = the cores (``towers_forward_threads["sync_batchnorm_s"]``,
    :func:`~.microbench_towers.measured_towers_forward`); before, m = 2: the training loop's own
    (``loop_sync_batchnorm_s`` of the towers' strategy, :func:`~.profile_runs.loop_sync_batchnorm`),
    else ``tower_sync_batchnorm_s`` (:func:`~.microbench_towers.measured_tower_sync_batchnorm`: the
    tower threads meet twice per BatchNorm layer in the forward). The loop's runs with the key on and
    off, a minute apart, moved with the machine: digits_cnn's term was 0.17, 0.67 and 1.85 ms in three
    profiles on the 2-vCPU EPYC VM, where its towers paid 1.1-2.1 ms (2026-11-29). 0 without
    BatchNorm, without the key, at n = 1, and for a cluster's devices (their towers exchange C + 1
    numbers per layer between device threads: not modelled)."""
    if n < 2 or not on_this_machine or not prof.get("batchnorm_inputs") or not cfg.model_value("sync_batchnorm", False):
        return 0.0
    from .profile_runs import sync_batchnorm_strategies, towers_sync_in_process

    _, towers = sync_batchnorm_strategies()
    in_process = prof.get("towers_forward_threads") or {}
    if towers_sync_in_process(prof) and int(in_process["towers"]) > 1:
        return in_process["sync_batchnorm_s"] * (n - 1) / (int(in_process["towers"]) - 1)
    measured = (prof.get("loop_sync_batchnorm_s") or {}).get(towers, prof.get("tower_sync_batchnorm_s", 0.0))
    return measured * (n - 1)
