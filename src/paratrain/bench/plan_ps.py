"""The parameter server's part of ``paratrain plan``'s model (dispatched by
:func:`~.strategy_model.predict_model`): its step (:func:`predict_ps`), the servers' update
(:func:`ps_update_s`), the link its messages take (:func:`ps_message_link`, :func:`slower`), what an
exchange waits for a core while the other workers compute on the same ones
(:func:`ps_exchange_wait_s`), what the others' exchanges take of a worker's compute
(:func:`ps_compute_stolen_s`; measured in the training loop: :func:`loop_stolen`), a worker's own
work around its exchange (:func:`loop_guard`) and the rate of asynchronous workers
(:func:`ps_async_rate`). Units: seconds, bytes."""
from __future__ import annotations

from dataclasses import replace

from ..errors import UsageError
from .costmodel import Link, Prediction, Workload, _check_n, prediction
from .costmodel_ps import ps_largest_shard_bytes, ps_step_s
from .costmodel_sharded import piecewise


def ps_update_s(measured: dict[str, float] | None, n: int, k: int, synchronous: bool = True,
                share: float | None = None) -> float:
    """Seconds the busiest of k servers spends on an update of its shard, from the profile's
    measurement of one server holding them all (``ps_update_s``,
    :func:`~.microbench_rpc.measured_ps_update`). Synchronous, n workers: the mean of n gradients is
    one copy and n - 1 additions, so the time is linear in n through the one- and two-worker
    measurements, ``sync_1 + (n - 1)(sync_2 - sync_1)``; asynchronous: ``async`` per update. Both
    times ``share``, the busiest server's fraction of the parameter bytes
    (:func:`~.costmodel_ps.ps_largest_shard_bytes` over the total; None: 1/k, an even split): the update
    is elementwise, so its time follows the bytes. 0 without a measurement. The servers keep their
    parameters on the CPU, so on a cluster this is this machine's CPU time too (an assumption)."""
    if not measured:
        return 0.0
    part = 1 / k if share is None else share
    if not synchronous:
        return measured["async"] * part
    one, two = measured["sync_1"], measured["sync_2"]
    return (one + (n - 1) * max(0.0, two - one)) * part  # a second gradient never makes it cheaper (noise)


def ps_busiest_share(param_bytes, k: int) -> float | None:
    """The busiest of k servers' fraction of the parameter bytes
    (:func:`~.costmodel_ps.ps_largest_shard_bytes` over the total), for :func:`ps_update_s` and the
    server's memory; None for a model without parameters (an even split of nothing)."""
    total = sum(param_bytes)
    return ps_largest_shard_bytes(param_bytes, k) / total if total > 0 else None


def ps_message_link(rpc: Link, round_trip_s: float, update_s: float, nbytes: float) -> Link:
    """The parameter server's link as its exchange measures it: one ``ps-async`` worker's push of
    ``nbytes`` of gradient, the server's update and its answer of ``nbytes`` of parameters took
    ``round_trip_s`` (:func:`~.microbench_rpc.measured_ps_round_trip`), of which ``update_s`` is the
    update (:func:`ps_update_s`); so with the echo's latency ``rpc.alpha_s`` (:func:`~.microbench_rpc.measured_rpc`),
    ``round_trip = 2 (alpha + nbytes beta) + update`` gives ``beta = (round_trip - update - 2 alpha) /
    (2 nbytes)`` (>= 0), and :func:`~.costmodel_ps.ps_step_s` of one worker and one server is the measured round
    trip. The beta holds what the echo of one tensor leaves out: the many tensors of a model, the
    server's and the worker's copies and their fresh buffers. Raises UsageError for ``nbytes <= 0``."""
    if not nbytes > 0:
        raise UsageError(f"ps_message_link needs the exchanged bytes > 0, got {nbytes}")
    beta = max(0.0, (round_trip_s - update_s - 2 * rpc.alpha_s) / (2 * nbytes))
    return Link(name="measured-ps", alpha_s=rpc.alpha_s, beta_s_per_byte=beta, gamma_s_per_byte=0.0)


def slower(a: Link, b: Link) -> Link:
    """The link no faster than either: each of alpha, beta and gamma the larger of ``a``'s and
    ``b``'s (a parameter server's messages on a cluster: the cluster's network, and at best the RPC
    exchange measured on one host, :func:`ps_message_link`)."""
    return Link(name=f"slower of {a.name}, {b.name}", alpha_s=max(a.alpha_s, b.alpha_s),
                beta_s_per_byte=max(a.beta_s_per_byte, b.beta_s_per_byte),
                gamma_s_per_byte=max(a.gamma_s_per_byte, b.gamma_s_per_byte))


LOADED_PS_KEYS = {2: "ps_round_trips_loaded", 4: "ps_round_trips_loaded_4"}
"""The profile's keys of :func:`~.microbench_rpc.measured_ps_round_trips_loaded` by its number of
workers (a CPU's profile; 4 since profile version 24)."""


def loaded_exchange(prof: dict, n: int) -> dict | None:
    """The profile's loaded exchange (:data:`LOADED_PS_KEYS`) for ``n`` ``ps-async`` workers: the one
    measured with the most workers that is at most ``n`` (the 2 workers' below 2), or None where
    the profile has none (a GPU's; before version 23). Measured on the 2-vCPU Xeon on 2026-11-27:
    ptb_small's exchange took a mean of 27 ms with 2 workers computing and 48 ms with 4, digits_cnn's
    2.7-4.3 and 4.9-6.9 ms; with the 2 workers' table at N = 4, ps-async's steps were predicted 16%
    (ptb_small) and 28% (digits_cnn without sync BN) under their measured ones, with the 4 workers'
    6% and 13%."""
    measured = [(w, prof[k]) for w, k in sorted(LOADED_PS_KEYS.items()) if prof.get(k)]
    if not measured:
        return None
    return next((t for w, t in reversed(measured) if w <= n), measured[0][1])


def ps_exchange_wait_s(loaded: dict | None, idle_s: float | None, compute_s: float) -> float:
    """Seconds one ``ps-async`` worker's exchange takes, among workers that compute on the same cores
    for ``compute_s`` between their exchanges, beyond ``idle_s``: the price the step's formula already
    gives it (:func:`ps_async_rate`'s ``ps_step_s`` over the exchange's link,
    :func:`ps_message_link`, is the median exchange of one worker alone,
    :func:`~.microbench_rpc.measured_ps_round_trip`). ``loaded["points"]``: the mean exchange of
    ``loaded["workers"]`` workers that compute about c seconds each between exchanges
    (:func:`~.microbench_rpc.measured_ps_round_trips_loaded`), linear in c between the measured
    points and the nearest end's value outside them; at least 0. What it holds beyond ``idle_s``: the
    hand-offs of an exchange (the worker's and the server's RPC threads, the handler) waiting for a
    core that a computing worker holds, more often the longer the stretches of compute; the workers'
    exchanges meeting at the server; the long tail a mean holds and a median not (the same workers
    sleeping between exchanges, ``loaded["idle_s"]``, measure the last two alone; a worker's steps
    add up the mean). Measured with 2 and with 4 workers and 1 server (:func:`loaded_exchange` picks
    the table for n) and held flat for more workers and for K > 1 (not measured). 0 without
    the measurements (a GPU's profile; a preset: each worker on its own machine). Raises UsageError
    for malformed points."""
    if not loaded or not idle_s:
        return 0.0
    mean = piecewise(loaded["points"], "ps_round_trips_loaded", "compute seconds", proportional_above=False)
    return max(0.0, mean(compute_s) - idle_s)


def loop_stolen(prof: dict, n: int, strategy: str) -> float | None:
    """What ``strategy``'s workers' compute was measured to take longer in the training loop's job of
    2 workers than side by side (``loop_ps_stolen_s``, :func:`~.profile_runs_ps.loop_ps`, ps-sync's and
    ps-async's, a CPU's profile since version 33; ``loop_ps_async_stolen_s``, ps-async's, since 29), for
    ``n`` workers where :func:`loaded_exchange` prices them from the 2 workers' tables (fewer than 4
    where the profile holds the 4 workers' table); None elsewhere (n = 1, more workers, an older
    profile, a GPU's, a CPU of more cores, a run that failed, or a synchronous strategy with synchronised
    BatchNorm, whose job's compute holds the layers' meetings that the plan prices apart, which
    :func:`~.profile_runs_ps.loop_ps` leaves out since version 34): for ps-async
    :func:`ps_compute_stolen_s` of the micro-benchmark then prices it, for ps-sync nothing. Measured
    with K = 1 server and held flat for K > 1; at 4 workers and more the 4 workers' micro-benchmark
    prices ps-async's, though on the 2-vCPU EPYC VM the 2 workers' products lost about half of what
    the loop measured (digits_cnn: 1.1 against 2.3 ms)."""
    loop = prof["loop_ps_stolen_s"] if "loop_ps_stolen_s" in prof else prof.get("loop_ps_async_stolen_s")
    measured = (loop or {}).get(strategy)
    if measured is None or n < 2 or loaded_exchange(prof, n) is not prof.get(LOADED_PS_KEYS[2]):
        return None
    return float(measured)


def loop_guard(prof: dict, n: int, strategy: str) -> float | None:
    """A parameter server's worker's own work around its exchange (``paratrain train`` times it as the
    worker's optimizer, though the worker steps none): the gradient's norm for the non-finite guard
    or the clip, a ps-async worker's clip scaling it, and what waits for a core among the others'
    exchanges meanwhile; measured in the training loop's job of ``strategy`` (``ps-sync`` or ``ps-async``)
    with 2 workers and K = 1 (``loop_ps_guard_s``, :func:`~.profile_runs_ps.loop_ps`, a CPU's profile
    since version 33), for ``n`` >= 2 workers on this machine, held flat for every n and K. None at
    n = 1 (one device steps its own optimizer, priced by the workload), for another strategy, without
    the measurement (an older profile, a GPU's, a failed job, ps-async under sync BatchNorm) and off
    this machine (the caller's), where the plan prices none of it."""
    if n < 2:
        return None
    measured = (prof.get("loop_ps_guard_s") or {}).get(strategy)
    return None if measured is None else float(measured)


def ps_compute_stolen_s(loaded: dict | None, compute_s: float) -> float:
    """Seconds longer that one ``ps-async`` worker's ``compute_s`` of compute takes among workers
    that exchange with their server on the same cores than side by side with none: the threads of
    the other workers' exchanges, the server's handlers and its update hold a core the worker
    computes on. ``loaded["stolen"]``: measured after each stretch c of compute
    (:func:`~.microbench_rpc.measured_ps_round_trips_loaded`, since profile version 27), linear in c
    between the points and the nearest end's value outside them (the cores an exchange takes are
    bounded by the exchange, not the stretch). 0 without it (a GPU's profile, an older one, a
    preset: each worker on its own machine). Where the training loop measured it
    (:func:`loop_stolen`), the plan uses that instead: the micro-benchmark's compute (products of a
    64 x 64 matrix) fits in the first-level cache, and lost 0.2-0.5 ms where digits_cnn's workers lost
    2-4 ms (2-vCPU EPYC VM, 2026-11-28). Raises UsageError for malformed points."""
    if not loaded or not loaded.get("stolen"):
        return 0.0
    return piecewise(loaded["stolen"], "ps_round_trips_loaded stolen", "compute seconds",
                     proportional_above=False)(compute_s)


def worker_stolen_s(loop_s: float | None, loaded: dict | None, compute_s: float) -> float:
    """What an async worker's ``compute_s`` of compute takes longer among the others' exchanges:
    ``loop_s``, measured in the training loop (:func:`loop_stolen`), where it was (not None); else
    :func:`ps_compute_stolen_s` of the micro-benchmark's ``loaded`` points."""
    return loop_s if loop_s is not None else ps_compute_stolen_s(loaded, compute_s)


def ps_async_rate(w: Workload, n: int, k: int, link: Link, update_s: float = 0.0,
                  wait_s: float = 0.0, stolen_s: float = 0.0, guard_s: float = 0.0) -> tuple[float, float]:
    """(updates per second of the whole job, seconds of one worker's step) for n asynchronous
    workers and k servers: each worker steps on its own, so the rate is the smaller of the workers'
    (n / (local + guard + push + pull + update + wait), :func:`~.costmodel_ps.ps_step_s` of one worker) and the
    busiest server's (it receives, applies and sends back its shard of every update:
    ``S (2 beta + gamma) + update`` seconds, S its bytes, :func:`~.costmodel_ps.ps_largest_shard_bytes`;
    P/k for an even split of P; Li et al. 2014). ``update_s``: seconds the busiest server spends
    applying its shard of one update (:func:`ps_update_s`); a worker's push waits for it, and it
    bounds that server. ``wait_s``: what each exchange waits beyond the link's price for cores the
    other workers compute on (:func:`ps_exchange_wait_s`), in the worker's step only; ``stolen_s``: what
    its compute takes longer for the cores the others' exchanges hold (:func:`ps_compute_stolen_s`),
    likewise (or :func:`loop_stolen`, measured in the loop); ``guard_s``: the worker's own work around
    its exchange (:func:`loop_guard`), likewise."""
    nbytes = sum(w.param_bytes)
    largest = ps_largest_shard_bytes(w.param_bytes, k)
    worker_step = w.local_s() + stolen_s + guard_s + ps_step_s(nbytes, 1, k, link, largest) + update_s + wait_s
    server_update = largest * (2 * link.beta_s_per_byte + link.gamma_s_per_byte) + update_s
    rate = min(n / worker_step, 1 / server_update if server_update > 0 else float("inf"))
    return rate, worker_step


def ps_streams(cores: int, servers: int) -> int:
    """How many of one server's messages move their bytes side by side on this machine's ``cores``
    (:func:`~.costmodel_ps.ps_step_s`'s ``streams``): each of the ``servers`` its share of the cores,
    at least 1. A synchronous step's workers wait while the servers exchange, so the cores are the
    servers'. (On a cluster: 1, each server's link carrying its messages in turn.)"""
    return max(1, cores // max(1, servers))


def ps_copy_fraction(rpc: Link, exchange: Link) -> float:
    """The fraction of the exchange's per-byte cost (``exchange``, :func:`ps_message_link`) that is
    copies of bytes: the echo's beta of one tensor (``rpc``, :func:`~.microbench_rpc.measured_rpc`)
    over it, at most 1 (0 where the exchange has no per-byte cost). The rest is what one tensor's
    echo leaves out: a model's many tensors handled one by one in Python (pickling, fresh buffers,
    the handler), which a server does in turn under the GIL (:func:`~.costmodel_ps.ps_step_s`). On
    the 2-vCPU EPYC on 2026-11-28: ptb_small 0.88 (18.6 MB in 9 tensors), digits_cnn 0.08 (96 KB).
    A profile without the exchange's measurement (before version 20) prices the messages by the
    echo itself: all copies, 1."""
    if not exchange.beta_s_per_byte > 0:
        return 0.0
    return min(1.0, rpc.beta_s_per_byte / exchange.beta_s_per_byte)


def predict_ps(w: Workload, n: int, k: int, link: Link, *, synchronous: bool = True, update_s: float = 0.0,
               wait_s: float = 0.0, stolen_s: float = 0.0, compute_scale: float = 1.0, streams: int = 1,
               copy_fraction: float = 1.0, guard_s: float = 0.0) -> Prediction:
    """One step of n workers and k parameter servers (Li et al. 2014, "Scaling Distributed Machine
    Learning with the Parameter Server"), each worker with ``w``'s batch; ``link``: the servers'
    messages (:func:`ps_message_link`); ``update_s``: the busiest server's update of its shard
    (:func:`ps_update_s`); ``compute_scale`` multiplies the measured times. Every exchange is paced
    by the busiest server, which holds :func:`~.costmodel_ps.ps_largest_shard_bytes` (whole parameters:
    with one dominant tensor, more servers barely shorten it).

    Synchronous: step = local (forward + backward + data) + stolen + guard + push + pull
    (:func:`~.costmodel_ps.ps_step_s`) + update (``stolen_s``: what the workers' compute takes longer
    beside the server's process, :func:`loop_stolen`); the workers do not step an optimizer (the servers do:
    in the exchange), but ``guard_s`` (:func:`loop_guard`: the gradient's norm and what waits with it;
    the prediction's optimizer part, where ``paratrain train`` times it) comes before the push. n = 1 is one
    device: local + its optimizer; ``streams``, ``copy_fraction``: a server's messages moving their
    bytes at once and the share of the bytes' cost that can (:func:`ps_streams`,
    :func:`ps_copy_fraction` on one host; 1 on a cluster). Asynchronous: each worker steps on its
    own, and the job's rate is :func:`ps_async_rate`'s (``wait_s``: what each exchange waits among computing workers,
    :func:`ps_exchange_wait_s`; ``stolen_s``: what each worker's compute takes longer among exchanging
    workers, :func:`ps_compute_stolen_s` or :func:`loop_stolen`, part of its compute), reported as n
    replicas each taking ``n / rate`` seconds a step (the staleness it implies, about n - 1 versions,
    is the plan's to show). What processes that meet pay beyond this (a synchronous PS's wait for its last worker,
    synchronised BatchNorm) is :func:`~.strategy_model.sync_overhead_s`'s. (``paratrain predict
    --algorithm ps`` prices an all-reduce strategy's gradients through k servers with
    :func:`~.costmodel.predict` instead: the workers step their own optimizer and no server update
    is measured.) Raises UsageError for n or k < 1."""
    _check_n(n, "workers")
    _check_n(k, "servers")
    s = compute_scale
    compute = (w.forward_s + w.backward_s + w.data_s) * s
    guard = guard_s if n > 1 else 0.0
    stolen = stolen_s if n > 1 else 0.0
    if synchronous:
        optimizer = guard if n > 1 else w.optimizer_s * s
        compute += stolen
        step = compute + optimizer + (ps_step_s(sum(w.param_bytes), n, k, link,
                                                ps_largest_shard_bytes(w.param_bytes, k), streams, copy_fraction)
                                      + update_s if n > 1 else 0.0)
        return prediction(w, n, step, compute + optimizer, "ps", optimizer_s=optimizer)  # strategy_model.PS
    scaled = replace(w, forward_s=w.forward_s * s, backward_s=w.backward_s * s, data_s=w.data_s * s, optimizer_s=0.0)
    rate, _ = ps_async_rate(scaled, n, k, link, update_s, wait_s if n > 1 else 0.0, stolen, guard)
    return prediction(w, n, n / rate, compute + stolen + guard, "ps", optimizer_s=guard)
