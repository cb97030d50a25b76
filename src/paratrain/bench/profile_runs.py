"""The training loop's own step for ``paratrain plan``'s profile: ``single`` runs of ``paratrain train``
through the bench sweep, at each thread count the plan needs (:func:`loop_workloads`); for a recipe
with ``model.sync_batchnorm`` on a CPU, what synchronised BatchNorm adds to the loop's two-replica steps
and, on fewer cores than :data:`OVERSUBSCRIBED`, to its steps of that many replicas
(:func:`loop_sync_batchnorm`), with the layers timed apart for what it leaves out
(:func:`sync_batchnorm_fallbacks`); for a recipe whose DDP broadcasts the model's buffers (no sync
BatchNorm), what that broadcast adds to the loop's two-replica steps (:func:`loop_buffer_broadcast`;
both pair runs through :func:`_paired_runs`); what each strategy's own work adds to the step as one rank
(:func:`loop_one_rank_overheads`: a GPU's prices every N, a CPU's the presets); on a 2-core CPU, what an
asynchronous parameter server's workers compute longer in their job than side by side
(:mod:`.profile_runs_ps`); on a CPU of several cores, the towers' step
(:mod:`.profile_runs_towers`). Each run goes through
:func:`loop_run`. The rest of the profile is
measured in process (:mod:`.profile`)."""
from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Any, Callable


def loop_spec(config: str, task_entry: str | None, overrides: tuple[str, ...], data_dir: str | None,
               strategies: tuple[str, ...], nprocs: tuple[int, ...], scaling: str, steps: int):
    """The bench sweep's spec of the profile's training runs: ``steps`` steps, a third of them warm-up,
    no checkpoints, about six log intervals (each timed interval wholly after the warm-up)."""
    from .sweep import BenchSpec

    return BenchSpec(config=config, task=task_entry, strategies=strategies, nprocs=nprocs, scaling=(scaling,),
                     steps=steps, warmup_steps=max(1, steps // 3), data_dir=data_dir,
                     overrides=(*overrides, "train.checkpoint_every=0", f"train.log_every={max(1, steps // 6)}"))


def loop_run(spec, plan, run_dir: Path) -> tuple[dict[str, Any], int, str]:
    """One ``paratrain train`` run of the profile (``spec``, ``plan``: the bench sweep's) into ``run_dir``,
    its log beside it: (its record, :func:`~.report.run_record`; its exit code; its log's last line,
    at most 200 characters, for a failure's line)."""
    from .report import run_record
    from .runner import run_cmd
    from .sweep import read_outcome, train_command

    log = run_dir.with_name(f"{run_dir.name}.log")
    rc, _ = run_cmd(train_command(spec, plan, run_dir), log, spec.timeout_s, dict(os.environ))
    said = log.read_text().strip().splitlines()[-1:] if log.exists() else []
    return run_record(read_outcome(plan, rc, run_dir)), rc, (said or ["no output"])[0][:200]


def loop_runs(spec, plans: list, tmp: Path | str) -> list[tuple[dict[str, Any], int, str]]:
    """:func:`loop_run` of each of ``plans`` at once (side by side), each into ``tmp`` under its name,
    in order; an interrupt of the caller ends them all (:func:`~.runner.runs_at_once`)."""
    from .runner import runs_at_once

    return runs_at_once(lambda plan: loop_run(spec, plan, Path(tmp) / plan.name), plans)


def loop_workloads(config: str, task_entry: str | None, overrides: tuple[str, ...], data_dir: str | None,
                   batch: int, steps: int, threads: tuple[int | None, ...], concurrent: int = 1, repeats: int = 1
                   ) -> dict[str, dict[str, float]]:
    """The one-device step as ``paratrain train`` runs it: :func:`median_rounds` of
    :func:`loop_workload_rounds` (the same arguments), keyed by the threads each ran with."""
    return median_rounds(loop_workload_rounds(config, task_entry, overrides, data_dir, batch, steps, threads,
                                              concurrent=concurrent, repeats=repeats))


def loop_workload_rounds(config: str, task_entry: str | None, overrides: tuple[str, ...], data_dir: str | None,
                         batch: int, steps: int, threads: tuple[int | None, ...], concurrent: int = 1,
                         repeats: int = 1) -> dict[str, list[dict[str, float]]]:
    """The one-device step as ``paratrain train`` runs it (the training loop's clipping, checks and
    bookkeeping included): a ``single`` run of ``steps`` per thread count (None: the default) and
    round, rank 0's forward / backward / data (with the loop's remaining overhead) / optimizer seconds
    (:func:`~.validate.workload_from_record`) and the standard deviation of its steps' local time from
    step to step (``local_sd_s``: :func:`~.timing.successive_difference_sd`, for
    :func:`~.straggler.straggle_s`) and, on a CPU, its host memory at the end (``host_private_bytes``,
    ``host_shared_bytes``: :func:`~paratrain.devices.host_memory_split`, for
    :func:`~.plan_feasible.host_demand`): {threads it ran with: [one dict per round]}. One-thread runs go
    ``concurrent`` at a time (the mean of their steps): what each of that many processes computes
    while the others compute beside it on the same cores (shared caches, memory bandwidth and, on
    SMT machines, the cores' execution units), as N processes of a job do. ``repeats``: rounds over
    the thread counts (within a round, a slow spell of the machine hits each alike; a profile adds
    later default-thread rounds of its own, :func:`~.plan_profile.load_profile`). Raises UsageError
    where a run fails."""
    import tempfile
    from ..errors import UsageError
    from ..strategies import REFERENCE
    from .plan_inputs import STEP_PARTS
    from .sweep import RunPlan
    from .validate import workload_from_record

    spec = loop_spec(config, task_entry, overrides, data_dir, (REFERENCE,), (1,), "weak", steps)
    rounds: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="paratrain-profile-") as tmp:
        for r in range(repeats):
            for t in threads:
                copies = concurrent if t == 1 else 1
                plans = [RunPlan(strategy=REFERENCE, n=1, global_batch=batch, threads=t, repeat=r * copies + c)
                         for c in range(copies)]
                done = loop_runs(spec, plans, tmp)
                parts = []
                for rec, rc, said in done:
                    if not rec["ok"]:
                        raise UsageError(f"the one-device run for the profile failed (exit {rc}): {said}")
                    w = workload_from_record(rec, [0], rec["units_per_step"])
                    parts.append({**{k: getattr(w, k) for k in STEP_PARTS},
                                  "local_sd_s": rec["rank0_timing_ms"].get("local_jitter_ms", 0.0) / 1000,
                                  **{f"host_{k}_bytes": rec[f"host_{k}_mb"] * 2**20 for k in ("private", "shared")
                                     if f"host_{k}_mb" in rec}})
                    key = str(rec["threads_per_process"])
                got = {k: statistics.fmean(p[k] for p in parts) for k in parts[0] if all(k in p for p in parts)}
                if copies > 1:
                    got["concurrent"] = copies
                rounds.setdefault(key, []).append(got)
    return rounds


def median_rounds(rounds: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per thread count of :func:`loop_workload_rounds`, the round with the median step (data +
    forward + backward + optimizer; the lower middle of an even count), with every round's step in
    seconds, in the order they ran (``rounds_step_s``), where there were several."""
    from .plan_inputs import step_s

    out = {}
    for key, got in rounds.items():
        steps = [step_s(g) for g in got]
        middle = sorted(range(len(got)), key=lambda i: steps[i])[(len(got) - 1) // 2]
        out[key] = {**got[middle], **({"rounds_step_s": steps} if len(got) > 1 else {})}
    return out


OVERSUBSCRIBED = 4
"""On a CPU of fewer cores, the processes of the profile's measurements of N above the cores: the
loop's second sync BatchNorm measurement (its replicas) and the meeting micro-benchmark's second
table (``meetings_oversubscribed``); the largest N ``paratrain plan`` predicts for this machine by
default (1, 2, 4)."""


def sync_batchnorm_strategies() -> tuple[str, str]:
    """(processes, towers): the registry's strategies whose two-replica steps price synchronised
    BatchNorm (:func:`loop_sync_batchnorm`): the default one for several processes (DDP's all-reduce)
    and the one the towers' cost model describes."""
    from ..strategies import DEFAULT, modelled
    from .strategy_model import TOWERS

    return DEFAULT, modelled(TOWERS)[0]


def loop_sync_batchnorm(config: str, task_entry: str | None, overrides: tuple[str, ...], data_dir: str | None,
                        batch: int, steps: int, strategies: tuple[str, ...] | None = None,
                        repeats: int = 1, accumulation: int = 1, replicas: int = 2) -> dict[str, float]:
    """{strategy: seconds per step that ``model.sync_batchnorm = true`` adds to rank 0's compute
    (forward + backward + data) in ``paratrain train``'s own step of ``replicas`` replicas of batch
    ``batch`` each (the recipe's batch per replica, as the plan's rows and ``--validate`` run them:
    at half of it, digits_cnn's two processes paid 4 ms a step less)}: each strategy run with the key on
    and off, ``repeats`` rounds (on and off side by side in each), the median of each minus the
    other, at least 0. DDP's key-off runs leave out its broadcast of rank 0's buffers every forward
    (``dist.broadcast_buffers = false``), as its key-on runs do: otherwise the term is sync BatchNorm
    less that broadcast, which cost digits_cnn's rank 0 1.5-2 ms a step on a 2-vCPU Xeon (2026-11-27).
    More replicas than cores (:data:`OVERSUBSCRIBED`) price the processes taking
    turns on the cores: each meeting then waits for every process' compute before it, and gloo's
    ring hands the sums from process to process, each woken in turn.

    Why the loop and not a micro-benchmark of the layers alone: on a CPU the meetings sit between
    the model's own compute in both processes (or tower threads), and their cost is the drift of the
    ranks over that compute plus gloo's (or the threads') wake-ups. On the 2-vCPU EPYC VM the layers
    timed alone, with the step's compute put before each (:func:`~.microbench_meetings.measured_sync_batchnorm`,
    :func:`~.microbench_towers.measured_tower_sync_batchnorm`), gave 27.6 and 4.4 ms a step where the
    loop paid 33.5 and 12 ms for digits_cnn (benchmarks/RESULTS.md). ``strategies``: default
    :func:`sync_batchnorm_strategies`; the processes' term prices every layout of processes
    (:func:`~.plan_inputs.sync_batchnorm_s`), the towers' the CPU towers
    (:func:`~.plan_inputs.tower_sync_batchnorm_s`). A strategy whose run fails, or that the recipe
    does not allow (a batch that does not split into its micro-batches), is left out, with a
    line: the plan then prices it with the micro-benchmark's value (at 2 replicas), or from 2
    replicas and the ring (at more)."""
    from ..strategies import STRATEGIES

    strategies = strategies or sync_batchnorm_strategies()

    def keys(strategy: str, on: bool) -> tuple[str, ...]:
        sends = () if on or "broadcast_buffers" not in STRATEGIES[strategy].dist_keys else (
            "dist.broadcast_buffers=false",)  # as with the key on: DDP sends no buffers
        return (f"model.sync_batchnorm={'true' if on else 'false'}", *sends)

    medians, left_out = _paired_runs(config, task_entry, overrides, data_dir, batch, steps,
                                     {s: {"the key on": keys(s, True), "the key off": keys(s, False)}
                                      for s in strategies},
                                     repeats, accumulation, replicas)
    for strategy, why in left_out.items():
        print(f"[plan] sync BatchNorm in the loop at {replicas} replicas: {strategy} left out ({why}); "
              + ("its term comes from the micro-benchmark" if replicas == 2 else
                 "above the cores it is priced from 2 replicas and the ring"), flush=True)
    return {s: max(0.0, medians[s, "the key on"] - medians[s, "the key off"]) for s in strategies if s not in left_out}


def loop_buffer_broadcast(config: str, task_entry: str | None, overrides: tuple[str, ...], data_dir: str | None,
                          batch: int, steps: int, repeats: int = 1, accumulation: int = 1) -> dict[str, float]:
    """{strategy: seconds that DDP's broadcast of rank 0's buffers before every forward adds to rank
    0's compute (forward + backward + data) in ``paratrain train``'s own step of 2 replicas of batch
    ``batch`` each}, for the registry's default strategy of several processes (DDP's all-reduce;
    zero1 wraps the same DDP): its runs with ``dist.broadcast_buffers`` true (the default) and
    false, ``model.sync_batchnorm = false`` in both, ``repeats`` rounds side by side, the median of
    each minus the other, at least 0. Only for a model with buffers whose recipe keeps the broadcast
    (:func:`~.plan_inputs.buffer_broadcast_s` prices it). The meeting costs the ranks' skew over the
    step, not only the link's latency: digits_cnn's 920 bytes of BatchNorm statistics cost rank 0
    1.5-2 ms a step on a 2-vCPU Xeon, where gloo's alpha is 0.16 ms (2026-11-27). A failed run
    leaves the strategy out, with a line (the plan then prices the broadcast as a binomial tree)."""
    from ..strategies import DEFAULT

    both = {DEFAULT: {"the broadcast": ("model.sync_batchnorm=false", "dist.broadcast_buffers=true"),
                      "no broadcast": ("model.sync_batchnorm=false", "dist.broadcast_buffers=false")}}
    medians, left_out = _paired_runs(config, task_entry, overrides, data_dir, batch, steps, both, repeats,
                                     accumulation, 2)
    for strategy, why in left_out.items():
        print(f"[plan] DDP's buffer broadcast in the loop: {strategy} left out ({why}); it is priced as a "
              f"binomial tree of the link", flush=True)
    return {s: max(0.0, medians[s, "the broadcast"] - medians[s, "no broadcast"]) for s in both if s not in left_out}


def _paired_runs(config: str, task_entry: str | None, overrides: tuple[str, ...], data_dir: str | None, batch: int,
                 steps: int, variants: dict[str, dict[str, tuple[str, ...]]], repeats: int, accumulation: int,
                 replicas: int) -> tuple[dict[tuple[str, str], float], dict[str, str]]:
    """Each strategy of ``variants`` ({strategy: {variant's name: its --set keys}}) run at ``replicas``
    replicas of batch ``batch`` each for each of its variants, ``repeats`` rounds (a round runs
    every variant side by side): ({(strategy, variant): median of rank 0's data + forward +
    backward seconds}, {strategy left out: why}). A strategy is left out when a run fails or the
    batch does not split into ``accumulation`` micro-batches."""
    import tempfile

    from .sweep import RunPlan
    from .validate import workload_from_record

    strategies = tuple(variants)
    specs = {(s, v): loop_spec(config, task_entry, (*overrides, *keys), data_dir, strategies, (replicas,), "strong",
                                steps) for s, vs in variants.items() for v, keys in vs.items()}
    seen: dict[tuple[str, str], list[float]] = {}
    left_out: dict[str, str] = {}
    if batch % accumulation:
        left_out = {s: f"a batch of {batch} per replica does not split into {accumulation} micro-batches"
                    for s in strategies}
    global_batch = batch * replicas
    with tempfile.TemporaryDirectory(prefix="paratrain-profile-pairs-") as tmp:
        for r in range(repeats):
            for strategy, vs in variants.items():
                for i, v in enumerate(vs):
                    if strategy in left_out:
                        continue
                    plan = RunPlan(strategy=strategy, n=replicas, global_batch=global_batch, repeat=r)
                    rec, rc, said = loop_run(specs[strategy, v], plan, Path(tmp) / f"{plan.name}-{i}")
                    if not rec["ok"]:
                        left_out[strategy] = f"its run with {v} failed (exit {rc}): {said}"
                        continue
                    w = workload_from_record(rec, [0], rec["units_per_step"])
                    seen.setdefault((strategy, v), []).append(w.data_s + w.forward_s + w.backward_s)
    return {k: statistics.median(x) for k, x in seen.items()}, left_out


def towers_sync_in_process(prof: dict[str, Any]) -> bool:
    """Whether the profile timed the CPU towers' sync BatchNorm in its own process (since version 36:
    ``towers_forward_threads["sync_batchnorm_s"]``, :func:`~.microbench_towers.measured_towers_forward`),
    so neither the loop's towers pair nor the layers' micro-benchmark is needed for it."""
    return "sync_batchnorm_s" in (prof.get("towers_forward_threads") or {})


def sync_batchnorm_fallbacks(prof: dict[str, Any], measured_in_loop: dict[str, float],
                             progress: Callable[[str], None] = lambda what: None) -> None:
    """Add to ``prof`` the layers' micro-benchmarks of ``model.sync_batchnorm`` that the training
    loop's own measurement (``measured_in_loop``: :func:`loop_sync_batchnorm`'s answer,
    by strategy; {} where it did not run) leaves out: between processes (``sync_batchnorm_s``,
    :func:`~.microbench_meetings.measured_sync_batchnorm`; a replica's compute between one layer's
    meetings and the next, as in its step: this process' forward and backward split evenly over the
    BatchNorm calls) unless the loop measured the processes' strategy, and between CPU towers
    (``tower_sync_batchnorm_s``, :func:`~.microbench_towers.measured_tower_sync_batchnorm`; the towers'
    forward split over the layers, as the profile measured it: since version 26 with their join and
    the loss on it) unless it measured the towers' strategy or (since version 36) the towers' steps
    plain and synchronised were timed in one process (``towers_forward_threads["sync_batchnorm_s"]``,
    :func:`~.microbench_towers.measured_towers_forward`). Nothing
    without BatchNorm inputs or links (``profile.profile_model(links=False)``); the towers' only
    where their forwards were measured (a CPU of several cores); the processes' only for a CPU's
    profile (``prof["device"]``, a CPU where absent): a GPU's is planned on its measured link at N = 1
    alone, and on a preset link by the ring's formula (:func:`~.plan_inputs.sync_batchnorm_s`), so the
    seconds of CPU processes would go unread. ``progress`` is told which runs, for the profile's
    progress bar. Call in the profiling process, at its default threads."""
    shapes = prof.get("batchnorm_inputs")
    if not shapes or "links" not in prof:
        return
    processes, towers = sync_batchnorm_strategies()
    if processes not in measured_in_loop and prof.get("device", "cpu") == "cpu":
        from .microbench_meetings import measured_sync_batchnorm

        progress("sync BatchNorm micro-benchmark: 2 processes")
        timed = prof["workloads_in_process"][str(prof["default_threads"])]
        calls = len(shapes)
        prof["sync_batchnorm_s"] = measured_sync_batchnorm(
            shapes, compute_s=(timed["forward_s"] / calls, timed["backward_s"] / calls), repeats=80)
    if towers not in measured_in_loop and prof.get("towers_forward_threads") and not towers_sync_in_process(prof):
        from .microbench_towers import measured_tower_sync_batchnorm

        progress("sync BatchNorm micro-benchmark: CPU towers")
        per_layer = prof["towers_forward_threads"]["seconds"] / len(shapes)
        prof["tower_sync_batchnorm_s"] = measured_tower_sync_batchnorm(shapes, repeats=60, compute_s=per_layer)


def one_rank_strategies() -> tuple[str, ...]:
    """The registry's strategies of several processes whose step the plan prices as the one-device
    step plus their communication and their own terms (all-reduce, ZeRO-1, FSDP: the cost models
    ``ring``, ``sharded_optimizer``, ``sharded_parameters``): those whose own per-step work
    :func:`loop_one_rank_overheads` measures at one rank."""
    from ..strategies import modelled
    from .strategy_model import RING, SHARDED_OPTIMIZER, SHARDED_PARAMETERS

    return tuple(s for model in (RING, SHARDED_OPTIMIZER, SHARDED_PARAMETERS) for s in modelled(model))


def loop_one_rank_overheads(config: str, task_entry: str | None, overrides: tuple[str, ...], data_dir: str | None,
                            batch: int, steps: int, strategies: tuple[str, ...] | None = None, repeats: int = 1
                            ) -> dict[str, dict[str, float]]:
    """{strategy: {"step_s", "compute_s", "optimizer_s"}}: seconds per step that each strategy's own
    work adds to ``paratrain train``'s one-device step (``single``) when it runs one rank
    (``--nproc 1``) of batch ``batch`` on the profile's device. Each round runs ``single`` and then every
    strategy (``strategies``, default :func:`one_rank_strategies`), ``repeats`` rounds. Of each strategy,
    and of ``single``, the round with the median step is kept (its parts add up with it). The answer is
    that round's whole step less ``single``'s (``step_s``, at least 0), and of it the forward +
    backward + data (``compute_s``, within [0, ``step_s``]) and the optimizer (``optimizer_s``, within
    [0, ``step_s`` - ``compute_s``]); the rest is exposed at one rank.

    What it holds: DDP's reducer (its autograd hooks, the copies into the buckets and the bucket's
    collective over one rank), ZeRO-1's DTensor wrap, sharded step and gather, FSDP2's hooks, its
    copies into and out of the collectives' buffers and its DTensor guard: the work a rank does around
    its compute whatever the link. On a GPU of small kernels that work is launch- and Python-bound and
    a large share of the step. On an H200, gpt_wt2 in bf16 stepped in 7.8 ms alone, and allreduce,
    zero1 and fsdp added 0.5, 6.9 and 13.6 ms as one rank over NCCL (benchmarks/RESULTS.md), where the
    plan had priced 0, 2.2 and 2.7 ms (the DTensor dispatch micro-benchmarks). The collectives between
    ranks are priced apart, by the link; at one rank they move nothing.

    Measured with the recipe's keys at its batch; the plan applies it unchanged to the strategy's
    variants (ZeRO-2, a compression hook, activation checkpointing) and to other batches
    (``--global-batch``): host work scales with the kernels and tensors, not with the batch, but those
    variants were not measured. A strategy whose run fails or times no step is left out, with a line
    (the plan then prices it without this term); a failing ``single`` ends the profile with one line
    (UsageError)."""
    import math
    import tempfile

    from ..errors import UsageError
    from ..strategies import REFERENCE
    from .sweep import RunPlan
    from .validate import workload_from_record

    strategies = strategies or one_rank_strategies()
    spec = loop_spec(config, task_entry, overrides, data_dir, (REFERENCE, *strategies), (1,), "weak", steps)
    seen: dict[str, list[tuple[float, float, float]]] = {}
    left_out: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="paratrain-profile-one-rank-") as tmp:
        for r in range(repeats):
            for strategy in (REFERENCE, *strategies):
                if strategy in left_out:
                    continue
                plan = RunPlan(strategy=strategy, n=1, global_batch=batch, repeat=r)
                rec, rc, said = loop_run(spec, plan, Path(tmp) / plan.name)
                if not (rec["ok"] and math.isfinite(rec["train_step_ms"])):
                    why = said if not rec["ok"] else "no step was timed (too few steps)"
                    if strategy == REFERENCE:
                        raise UsageError(f"the one-device run for the profile failed (exit {rc}): {why}")
                    left_out[strategy] = f"its run failed (exit {rc}): {why}"
                    continue
                w = workload_from_record(rec, [0], rec["units_per_step"])
                seen.setdefault(strategy, []).append((rec["train_step_ms"] / 1000,
                                                      w.data_s + w.forward_s + w.backward_s, w.optimizer_s))
    for strategy, why in left_out.items():
        print(f"[plan] {strategy} at one rank: left out ({why}); the plan prices it without its own step's work "
              f"(a CPU's: on a preset interconnect)", flush=True)

    def median_round(runs: list[tuple[float, float, float]]) -> tuple[float, float, float]:
        return sorted(runs)[(len(runs) - 1) // 2]  # the round with the median step (its parts add up with it)

    base = median_round(seen[REFERENCE])
    out = {}
    for strategy in strategies:
        if strategy in left_out:
            continue
        step, compute, optimizer = (x - b for x, b in zip(median_round(seen[strategy]), base))
        step = max(0.0, step)
        compute = min(step, max(0.0, compute))
        out[strategy] = {"step_s": step, "compute_s": compute, "optimizer_s": min(step - compute, max(0.0, optimizer))}
    return out

