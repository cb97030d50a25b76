"""A parameter server's workers in ``paratrain plan``'s profile: what their compute takes longer in
the recipe's own ps-sync and ps-async jobs than in one-thread one-device runs side by side, and
their own work around the exchange there (:func:`loop_ps`), on a CPU whose cores the jobs' processes
outnumber (:func:`ps_loop_applies`). The runs go through :mod:`.profile_runs`' bench sweep."""
from __future__ import annotations

import statistics
from typing import Any

from .profile_runs import loop_runs, loop_spec


def ps_strategies() -> tuple[str, ...]:
    """The registry's parameter-server strategies (the ``ps`` cost model), synchronous or not: those
    whose workers' compute and guard :func:`loop_ps` measures."""
    from ..strategies import modelled
    from .strategy_model import PS

    return tuple(modelled(PS))


def async_ps_strategies() -> tuple[str, ...]:
    """The registry's asynchronous parameter-server strategies (the ``ps`` cost model, not
    synchronous): those whose compute :func:`~.plan_ps.ps_compute_stolen_s` prices where the loop
    (:func:`loop_ps`) did not measure it."""
    from ..strategies import STRATEGIES, modelled
    from .strategy_model import PS

    return tuple(s for s in modelled(PS) if not STRATEGIES[s].synchronous)


def timed_compute(done: list[tuple[dict[str, Any], int, str]]) -> tuple[tuple[float, float] | None, str]:
    """``done``'s runs' (:func:`~.profile_runs.loop_run`'s answers) mean timed (compute, optimizer)
    seconds a step over every worker that timed a step, or None and why not. Compute: the timed parts
    (data + forward + backward + compute), as a parameter server's worker's step also holds its
    exchange. Every worker, not rank 0 alone: an async job stops on the servers' count of updates, and
    a worker that starts late (a busy machine) may time none while the others step on."""
    computes, optimizers = [], []
    for rec, rc, said in done:
        if not rec["ok"]:
            return None, f"failed (exit {rc}): {said}"
        timed_ranks = [t for t in rec["per_rank_ms"] if t["step_ms"] > 0]
        if not timed_ranks:
            return None, "timed no step (too few steps)"
        computes += [(t["data_ms"] + t["compute_ms"]) / 1000 for t in timed_ranks]
        optimizers += [t.get("optimizer_ms", 0.0) / 1000 for t in timed_ranks]
    return (statistics.fmean(computes), statistics.fmean(optimizers)), ""


PS_LOOP_WORKERS = 2
"""The workers of each of :func:`loop_ps`' jobs (one server: 3 processes)."""


def ps_loop_applies(cores: int) -> bool:
    """Whether :func:`loop_ps` measures on a CPU of ``cores`` cores: more than one, and
    fewer than its job's processes (:data:`PS_LOOP_WORKERS` workers and a server), so that the job's
    workers compute on one thread each, as its one-thread side-by-side runs and the plan's
    one-thread workload of the cores' processes side by side do (2 cores). On more cores the
    workers get more threads (cores // 3) and the plan prices their compute from the
    micro-benchmark's ``stolen``."""
    return 1 < cores < PS_LOOP_WORKERS + 1


def loop_ps(config: str, task_entry: str | None, overrides: tuple[str, ...], data_dir: str | None,
            batch: int, steps: int, repeats: int = 1, workers: int = PS_LOOP_WORKERS,
            strategies: tuple[str, ...] | None = None, synced_batchnorm: bool = False
            ) -> tuple[dict[str, float], dict[str, float]]:
    """(stolen, guard) of each of ``strategies`` (default :func:`ps_strategies`: ps-sync and ps-async),
    each its own job. ``guard``: {strategy: seconds per step of the workers' own work around the
    exchange in the same job, timed as their optimizer (the mean of the workers that timed a step;
    the median over the rounds): the gradient's norm for the non-finite guard or the clip (a
    ps-async worker's clip scaling it too; the worker steps no optimizer, the server does) with
    whatever waits for a core meanwhile. On the 2-vCPU EPYC VM (2026-11-28) a ps-async worker timed
    0.6 (digits_cnn), 3.8 (ptb_small) and 3.3 ms (gpt_wt2) there, a ps-sync worker 0.6, 1.8 and 2.3
    ms, where the norm alone takes 0.03, 0.4 and 0.4 ms in one process; the plan had priced none of
    it (:func:`~.plan_ps.loop_guard`).

    ``stolen``: {strategy: seconds per step that a parameter server's worker computes longer
    (data + forward + backward + compute, the timed parts, not its exchange; the mean of the workers
    that timed a step) in ``paratrain train``'s own job of ``workers`` workers of batch ``batch``
    each and one server (K = 1, as ``--validate`` runs it) than ``workers`` one-thread one-device
    runs of the same batch side by side}. Each of ``repeats``
    rounds runs each job, then the side-by-side runs at once (their mean); the answer is the median
    over the rounds of the job's compute less its own round's side-by-side compute, at least 0; a line
    gives each round's pair beside it. On the 2-vCPU EPYC VM (2026-12-01) ptb_small's ps-async job
    computed 91.5-105.5 ms a step over four rounds where its side-by-side runs, before and after each
    job, held 84.6-88.6 ms: the term (+4 to +21 ms a round) is the job's own spread. gpt_wt2's
    side-by-side runs moved 924-1070 ms from one round to the next, so its term (0 to 43 ms in two
    profiles) is within the noise of two rounds; more ``--profile-repeats`` narrow it. For
    :func:`~.plan_ps.loop_stolen`, which the plan uses in place of
    :func:`~.plan_ps.ps_compute_stolen_s`, on a CPU where :func:`ps_loop_applies`.

    What it holds: while one worker computes, the other workers' exchanges run on the same cores
    (their RPC threads, the server's handler and update, TensorPipe's copies), so the worker waits
    for a core and finds its caches emptied. A synchronous server's workers compute at the same time and
    exchange together, yet in the validations' runs ptb_small's ps-sync workers computed 3-9 ms longer
    than side by side on that VM (the server's process and its RPC threads share the 2 cores with
    them); the profile's own ps-sync job measured 0.9 ms of it (2026-11-28, version 33), so most of
    that stays unpriced; of the 7-13 ms rank 0 of those runs waited for the other worker, the plan
    prices the wait for the last worker of the meetings' micro-benchmark or the step's spread
    (:func:`~.strategy_model.straggler_wait_s`, about 2-4 ms). A micro-benchmark's compute (products of a 64 x 64
    matrix, :func:`~.microbench_rpc.measured_ps_round_trips_loaded`) fits in the first-level cache.
    On the 2-vCPU EPYC VM (2026-11-28) digits_cnn's two ps-async workers computed 12.3 ms a step
    against 7.9 ms side by side, where the products priced 1.4 ms; the workers' main threads waited
    for a core 10% of the time (``/proc/PID/task/TID/schedstat``) and spent about 35% more CPU time
    on the same compute (benchmarks/RESULTS.md, "an async PS worker's compute measured in the loop").
    The recipe's keys at its batch per worker: the plan applies it unchanged at other batches
    (``--global-batch``) and K > 1. A strategy the recipe does not allow (``model.sync_batchnorm``),
    or whose job fails or times no step, is left out with a line; so is every strategy when a
    side-by-side run fails or times no step (the answer is then {}). The plan then prices it from the
    micro-benchmark. ``synced_batchnorm`` (the recipe synchronises BatchNorm, ``model.sync_batchnorm``
    with BatchNorm layers): a synchronous strategy's job times the layers' meetings inside the forward
    and backward it counts as compute, which the plan prices apart (``sync_overhead_s``), so its
    ``stolen`` is left out (digits_cnn's ps-sync: 18 ms of a 19 ms step, 2026-11-28); its guard is kept."""
    import tempfile

    from ..strategies import REFERENCE
    from .plan_model import Layout, refusal
    from .sweep import RunPlan

    strategies = ps_strategies() if strategies is None else strategies
    left_out = {s: why for s in strategies
                if (why := refusal(config, task_entry, list(overrides), Layout(s, workers))) is not None}
    rounds: dict[str, list[tuple[float, float]]] = {}  # (the job's compute, the side-by-side runs') of each round
    guards: dict[str, list[float]] = {}
    spec = loop_spec(config, task_entry, overrides, data_dir, (*strategies, REFERENCE), (workers,), "strong", steps)

    with tempfile.TemporaryDirectory(prefix="paratrain-profile-ps-") as tmp:
        for r in range(repeats):
            jobs = {}
            for strategy in strategies:
                if strategy in left_out:
                    continue
                got, why = timed_compute(loop_runs(spec, [RunPlan(strategy=strategy, n=workers,
                                                                   global_batch=batch * workers, repeat=r)], tmp))
                if got is None:
                    left_out[strategy] = f"its job {why}"
                else:
                    jobs[strategy] = got
            if not jobs:
                break
            base, why = timed_compute(loop_runs(spec, [RunPlan(strategy=REFERENCE, n=1, global_batch=batch, threads=1,
                                                                repeat=r * workers + c) for c in range(workers)], tmp))
            if base is None:
                left_out.update({s: f"a one-thread run side by side {why}" for s in strategies if s not in left_out})
                break
            for strategy, (compute, optimizer) in jobs.items():
                rounds.setdefault(strategy, []).append((compute, base[0]))
                guards.setdefault(strategy, []).append(optimizer)
    for strategy, why in left_out.items():
        print(f"[plan] {strategy}'s compute in the loop: left out ({why}); the plan prices "
              f"{'it from the micro-benchmark' if strategy in async_ps_strategies() else 'none of it'}, nor its "
              f"guard", flush=True)
    kept = [s for s in rounds if s not in left_out]
    from ..strategies import STRATEGIES

    meetings = [s for s in kept if synced_batchnorm and STRATEGIES[s].synchronous]
    for strategy in meetings:
        print(f"[plan] {strategy}'s compute in the loop: not a term (its job synchronised BatchNorm inside the "
              f"compute it timed; the plan prices that apart); its guard is kept", flush=True)
    stolen = {s: max(0.0, statistics.median(job - side for job, side in rounds[s])) for s in kept if s not in meetings}
    for strategy, seconds in stolen.items():  # each round's pair: how far apart they are says how sure the term is
        ms = [", ".join(f"{pair[i] * 1e3:.1f}" for pair in rounds[strategy]) for i in (0, 1)]
        print(f"[plan] {strategy}'s compute in the loop: {ms[0]} ms a step in its job against {ms[1]} side by "
              f"side, round by round: {seconds * 1e3:.1f} ms a step taken by the exchanges (the median "
              f"difference, at least 0)", flush=True)
    return (stolen,
            {s: statistics.median(guards[s]) for s in kept})
