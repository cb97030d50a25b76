"""RPC micro-benchmark on this machine: one ``torch.distributed.rpc`` message over TensorPipe (the
parameter server's push and pull) between two local processes (:func:`~.microbench.run_ranks`),
and its fitted
:class:`~paratrain.bench.costmodel.Link` (:func:`measured_rpc`, part of
:func:`~.microbench.measured_links`)."""
from __future__ import annotations

import json
import os
import statistics
import traceback
import warnings
from pathlib import Path
from typing import Sequence

import torch

from .costmodel import Link
from .microbench import DEFAULT_SIZES_BYTES, FLOAT32_BYTES, fit_latency_bandwidth, median_seconds, run_ranks
from .microbench_meetings import products_per_s


def _echo(x: torch.Tensor) -> torch.Tensor:
    return x


def _start_rpc(rank: int, workdir: str, threads: int, timeout_s: float, world_size: int = 2) -> None:
    """This process as RPC agent ``agent<rank>`` of ``world_size``, over the transports the parameter
    server uses, at ``threads`` intra-op threads."""
    import torch.distributed.rpc as rpc

    from ..ps.runtime import RPC_TRANSPORTS

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("TP_SOCKET_IFNAME", "lo")
    torch.set_num_threads(max(1, threads))
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{Path(workdir) / 'rpcstore'}",
                                           rpc_timeout=timeout_s, num_worker_threads=4,
                                           _transports=RPC_TRANSPORTS)  # as the parameter server's
    with warnings.catch_warnings():  # torch's own rpc start-up passes a gloo Backend where it wants a ProcessGroup
        warnings.filterwarnings("ignore", message="You are using a Backend", category=UserWarning)
        rpc.init_rpc(f"agent{rank}", rank=rank, world_size=world_size, rpc_backend_options=opts)


def _stop_rpc(rank: int, workdir: str, result) -> None:
    """Wait for the other agents (graceful ``rpc.shutdown``); rank 0 then writes ``result`` (JSON; a
    callable is called first, once every agent is done)."""
    import torch.distributed.rpc as rpc

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="You are using a Backend", category=UserWarning)
        rpc.shutdown()
    if rank == 0:
        result = result() if callable(result) else result
        (Path(workdir) / "results.json.tmp").write_text(json.dumps(result))
        os.replace(Path(workdir) / "results.json.tmp", Path(workdir) / "results.json")


def _rpc_main(rank: int, workdir: str, sizes_bytes: Sequence[int], repeats: int, warmup: int,
              timeout_s: float) -> None:
    """One of two RPC agents (a process of :func:`~.microbench.run_ranks`): rank 0 times ``rpc_sync``
    round trips of each size."""
    import torch.distributed.rpc as rpc

    try:
        _start_rpc(rank, workdir, 1, timeout_s)
        results = []
        if rank == 0:
            for size in sizes_bytes:
                x = torch.zeros(max(1, size // FLOAT32_BYTES), dtype=torch.float32)
                round_trip = median_seconds(lambda: rpc.rpc_sync("agent1", _echo, args=(x,)), repeats, warmup)
                results.append((int(size), round_trip / 2))
        _stop_rpc(rank, workdir, results)
    except BaseException:
        (Path(workdir) / f"error-{rank}.txt").write_text(traceback.format_exc())
        raise


def measured_rpc(*, sizes_bytes: Sequence[int] = DEFAULT_SIZES_BYTES, repeats: int = 15, warmup: int = 2,
                 timeout_s: float = 120.0) -> Link:
    """``Link(name="measured-rpc")``: alpha and beta of one ``torch.distributed.rpc`` message (TensorPipe,
    what the parameter server's push and pull are) between two local processes, fitted to half round
    trips of an echo (:func:`fit_latency_bandwidth`); gamma 0. Up to 64 MiB, 15 round trips each: with
    16 MiB and 5 the fitted beta moved 4x between profiles on a 2-core VM (1.5e-10 to 5.9e-10 s/B)."""
    sizes = [max(1, int(s) // FLOAT32_BYTES) * FLOAT32_BYTES for s in sizes_bytes]
    points = run_ranks(_rpc_main, 2, (sizes, repeats, warmup, timeout_s), timeout_s, "rpc benchmark")
    alpha, beta = fit_latency_bandwidth([s for s, _ in points], [t for _, t in points])
    return Link(name="measured-rpc", alpha_s=alpha, beta_s_per_byte=beta, gamma_s_per_byte=0.0)


def _ps_spec(params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer) -> tuple[list, dict]:
    """(shapes and dtypes of ``params``, ``optimizer``'s defaults without tensors): what the PS
    benchmarks' processes build their tensors and the server's optimizer from."""
    shapes = [(tuple(p.shape), str(p.dtype).removeprefix("torch.")) for p in params]
    return shapes, {k: v for k, v in optimizer.defaults.items() if not isinstance(v, torch.Tensor)}


def _zeros(shapes: Sequence[tuple[tuple[int, ...], str]]) -> list:
    """Tensors of zeros of ``shapes`` (shape, dtype name): a benchmark's parameters."""
    return [torch.zeros(s, dtype=getattr(torch, d)) for s, d in shapes]


def _worker_tensors(shapes: Sequence[tuple[tuple[int, ...], str]]) -> tuple[list, list]:
    """A benchmark worker's parameters (zeros) and gradient (small random values) of ``shapes``."""
    return _zeros(shapes), [torch.randn(s, dtype=getattr(torch, d)) * 1e-3 for s, d in shapes]


def _exchange(server: str, worker: int, version: int, params: list, grads: list, lr) -> int:
    """One ``ps-async`` worker's exchange, as ``PSClient._push`` and ``_load`` do it: ``grads`` pushed
    to shard 0 on agent ``server``, the answered parameters copied into ``params``; returns the
    answer's version."""
    import torch.distributed.rpc as rpc

    from ..ps import rpc_api

    version, tensors, _ = rpc.rpc_sync(server, rpc_api.push, args=(0, worker, version, grads, lr, 0.0, 0))
    with torch.no_grad():
        for p, t in zip(params, tensors):
            p.copy_(t)
    return version


def _ps_main(rank: int, workdir: str, shapes: Sequence[tuple[tuple[int, ...], str]], opt_cls: type, defaults: dict,
             threads: int, repeats: int, warmup: int, timeout_s: float) -> None:
    """One of two RPC agents (a process of :func:`~.microbench.run_ranks`): rank 1 serves one
    asynchronous :class:`~paratrain.ps.server.ShardServer` (``rpc_api``'s endpoints, as a
    ``ps-async`` server process does); rank 0 is its one worker and times push, answer and load
    (:func:`measured_ps_round_trip`)."""
    import torch.distributed.rpc as rpc

    from ..ps import rpc_api
    from ..ps.server import ShardServer

    try:
        if rank == 1:
            rpc_api.register(ShardServer(0, 1, "async", timeout_s=timeout_s))
        _start_rpc(rank, workdir, threads, timeout_s)
        seconds = None
        if rank == 0:
            params, grads = _worker_tensors(shapes)
            rpc.rpc_sync("agent1", rpc_api.init_shard, args=(0, params, opt_cls, defaults))
            version = [0]

            def round_trip() -> None:  # the gradient out, the parameters back in
                version[0] = _exchange("agent1", 0, version[0], params, grads, defaults.get("lr"))

            seconds = median_seconds(round_trip, repeats, warmup)
        _stop_rpc(rank, workdir, seconds)
    except BaseException:
        (Path(workdir) / f"error-{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        rpc_api.unregister(0)


def measured_ps_round_trip(params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer, *, threads: int = 1,
                           repeats: int = 15, warmup: int = 3, timeout_s: float = 180.0) -> float:
    """Seconds of one ``ps-async`` worker's exchange with one server holding all of ``params``,
    measured between two local processes (:func:`~.microbench.run_ranks`) with nothing else
    running: the push of a gradient of ``params``' shapes and dtypes over ``torch.distributed.rpc``,
    the server's update
    (:class:`~paratrain.ps.server.ShardServer` with ``optimizer``'s class and defaults, no clipping)
    and its answer, and the copy of the answered parameters into the worker's (what
    :class:`~paratrain.ps.client.PSClient` does each step). Median of ``repeats`` after ``warmup``, at
    ``threads`` intra-op threads per process. The echo of one tensor (:func:`measured_rpc`) leaves out
    the many tensors, the server's and the worker's copies and their fresh buffers: on a 2-core VM a
    ptb_small exchange (18.6 MB each way) took 19.8 ms where the echo's fit gave 13.5 ms with the
    update. Raises RuntimeError if a process fails or hangs past ``timeout_s``."""
    shapes, defaults = _ps_spec(params, optimizer)
    return float(run_ranks(_ps_main, 2, (shapes, type(optimizer), defaults, threads, repeats, warmup, timeout_s),
                           timeout_s, "parameter server benchmark"))


LOADED_COMPUTE_S = (0.001, 0.004, 0.016, 0.064)
"""The stretches of compute (seconds) between a worker's exchanges in :func:`measured_ps_round_trips_loaded`."""
IDLE_SLEEP_S = 0.004
"""The sleep between exchanges of its baseline phase: the same exchanges with no core taken."""


def _products(k: int, a: torch.Tensor) -> float:
    """Seconds that ``k`` products of ``a`` take here now: a fixed amount of work, which takes longer
    while other processes' threads hold this core."""
    import time

    t0 = time.perf_counter()
    for _ in range(k):
        torch.mm(a, a)
    return time.perf_counter() - t0


def _exchanges(stretch_s: float, most: int, exchange_s: float = 0.002, seconds: float = 1.0) -> int:
    """How many exchanges :func:`_ps_loaded_main` times after stretches of ``stretch_s``: about
    ``seconds`` of them at ``exchange_s`` an exchange, at least 20, at most ``most``."""
    return max(20, min(most, round(seconds / (stretch_s + exchange_s))))


def _stretches(c: float, most: int, exchange_s: float) -> int:
    """How many stretches of ``c`` :func:`_ps_loaded_main` times in each of its two turns, alone and
    among exchanges: half of :func:`_exchanges`, at least 10."""
    return max(10, _exchanges(c, most, exchange_s) // 2)


def _meet(workdir: str, phase: int, rank: int, workers: int, timeout_s: float) -> None:
    """A barrier of the workers (ranks 1..``workers``) before ``phase``, through files in ``workdir``:
    every worker starts each phase's exchanges with the others (none still in the previous one).
    Raises TimeoutError after ``timeout_s``."""
    import time

    (Path(workdir) / f"phase-{phase}-{rank}").touch()
    deadline = time.monotonic() + timeout_s
    while not all((Path(workdir) / f"phase-{phase}-{r}").exists() for r in range(1, workers + 1)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"worker {rank}: the other workers did not reach phase {phase} in {timeout_s:g} s")
        time.sleep(0.001)


def _loaded_result(computes: Sequence[float], got: Sequence[Sequence[Sequence[Sequence[float]]]]) -> dict:
    """:func:`measured_ps_round_trips_loaded`'s answer from each worker's ``[exchanges, alone,
    loaded]`` seconds (``exchanges``: the idle phase's, then one list per stretch in ``computes``;
    ``alone`` and ``loaded``: one list of compute stretches per c, side by side and among exchanges):
    the means over every worker's samples; ``stolen`` is loaded less alone, at least 0."""
    def means(part: int) -> list[float]:
        return [statistics.fmean(t for w in got for t in w[part][i]) for i in range(len(got[0][part]))]

    exchanged, alone, loaded = means(0), means(1), means(2)
    return {"idle_s": exchanged[0], "points": [[c, m] for c, m in zip(computes, exchanged[1:])],
            "stolen": [[c, max(0.0, b - a)] for c, a, b in zip(computes, alone, loaded)]}


def _ps_loaded_main(rank: int, workdir: str, shapes: Sequence[tuple[tuple[int, ...], str]], opt_cls: type,
                    defaults: dict, workers: int, threads: int, computes: Sequence[float], exchanges: int,
                    exchange_s: float, warmup: int, timeout_s: float) -> None:
    """One of ``workers`` + 1 RPC agents (:func:`~.microbench.run_ranks`): rank 0 serves one asynchronous
    :class:`~paratrain.ps.server.ShardServer`; ranks 1.. are workers that, phase by phase (a barrier
    before each, :func:`_meet`), sleep :data:`IDLE_SLEEP_S` before each exchange with it (push,
    update, answer, load), and then, for each stretch c in ``computes``, compute the products that
    took each worker c seconds after the start line (:func:`~.microbench_meetings.products_per_s`),
    with no exchange (the workers side by side) and before each exchange, in turn twice, half of
    :func:`_exchanges` each time after ``warmup``, timing the exchanges and both phases' compute
    (:func:`measured_ps_round_trips_loaded`).
    Each worker writes its times; rank 0 gathers them once ``rpc.shutdown`` has seen every agent done."""
    import time

    from ..ps import rpc_api
    from ..ps.server import ShardServer

    try:
        if rank == 0:  # the shard exists before any agent can reach it: init_rpc is the start line
            rpc_api.register(ShardServer(0, workers, "async", timeout_s=timeout_s))
            rpc_api.init_shard(0, _zeros(shapes), opt_cls, defaults)
        _start_rpc(rank, workdir, threads, timeout_s, world_size=workers + 1)
        if rank > 0:
            params, grads = _worker_tensors(shapes)
            a = torch.randn(64, 64)
            version, times, alone, loaded = 0, [], [], []

            def exchange() -> float:
                nonlocal version
                t0 = time.perf_counter()
                version = _exchange("agent0", rank - 1, version, params, grads, defaults.get("lr"))
                return time.perf_counter() - t0

            _meet(workdir, 0, rank, workers, timeout_s)
            per_s = products_per_s(a)  # after the start line: every worker calibrates side by side
            got = []
            for i in range(warmup + _exchanges(IDLE_SLEEP_S, exchanges, exchange_s)):
                time.sleep(IDLE_SLEEP_S)
                got.append(exchange())
            times.append(got[warmup:])
            phase = 1
            for c in computes:
                k, half = max(1, round(c * per_s)), _stretches(c, exchanges, exchange_s)
                side, busy, got = [], [], []
                for _ in range(2):  # side by side, then among exchanges, twice: the machine's drift falls on both
                    _meet(workdir, phase, rank, workers, timeout_s)
                    side += [_products(k, a) for _ in range(warmup + half)][warmup:]
                    _meet(workdir, phase + 1, rank, workers, timeout_s)
                    for i in range(warmup + half):
                        took, waited = _products(k, a), exchange()
                        if i >= warmup:
                            busy.append(took)
                            got.append(waited)
                    phase += 2
                times.append(got)
                alone.append(side)
                loaded.append(busy)
            (Path(workdir) / f"times-{rank}.json").write_text(json.dumps([times, alone, loaded]))

        def result() -> dict:  # rank 0, after rpc.shutdown: every worker has written its times
            return _loaded_result(computes, [json.loads((Path(workdir) / f"times-{r}.json").read_text())
                                             for r in range(1, workers + 1)])

        _stop_rpc(rank, workdir, result)
    except BaseException:
        (Path(workdir) / f"error-{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        rpc_api.unregister(0)


def measured_ps_round_trips_loaded(params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer, *,
                                   workers: int = 2, threads: int = 1,
                                   computes: Sequence[float] = LOADED_COMPUTE_S, exchanges: int = 150,
                                   exchange_s: float = 0.002, warmup: int = 5,
                                   timeout_s: float = 300.0) -> dict:
    """``{"idle_s": s, "points": [[c, seconds], ...], "stolen": [[c, seconds], ...]}``: the mean
    seconds of one ``ps-async`` worker's exchange (:func:`measured_ps_round_trip`'s: push, the
    server's update, answer, load) while ``workers`` workers share this machine's cores with their
    server, each computing about c seconds (the products of a 64 x 64 matrix at ``threads`` intra-op
    threads that took it c seconds at its start) between its exchanges, for each c in ``computes``;
    ``stolen``, what that compute took longer then than the same products of the same workers side
    by side with no exchanges (the mean, at least 0): the cores that the other workers' exchanges and
    the server's answers hold while a worker computes (:func:`~.plan_ps.ps_compute_stolen_s`);
    ``idle_s``, the same workers' mean exchange when they sleep
    :data:`IDLE_SLEEP_S` between exchanges instead (no core taken: what their exchanges meeting at
    the server and a mean's tail add to one worker's median exchange alone, apart from the cores'
    contention; a diagnostic, :func:`~.plan_ps.ps_exchange_wait_s`). ``workers`` + 1 local processes
    (:func:`~.microbench.run_ranks`), the workers starting each phase together; about 1 s of
    exchanges timed per worker and phase (20 to ``exchanges``, at ``exchange_s`` an exchange, the
    idle one's estimate) after ``warmup``, and as many stretches side by side: about 11 s in all for
    a small model. The mean, not the
    median: the exchanges that wait for a core are a long tail, and a worker's steps add them all
    up. Until profile version 27 the workers computed for c seconds by the clock, so a stretch
    held less work where exchanges took its core, and ``stolen`` was not measured: digits_cnn's
    two ps-async workers computed 1.4-2.0 ms more a step in training than the plan's 4.4-6.3 ms
    (2026-11-28). On the 2-vCPU Xeon on 2026-11-27, digits_cnn's exchange (96 KB each way) took 1.4-1.8 ms
    with one worker (median), a mean of 1.9 ms with two that slept between exchanges, and a mean of
    2.7-3.2 ms after 1-4 ms of compute and 3.3-4.1 ms after 64 ms with two workers computing: what
    two ``ps-async`` workers' steps measured in training (3.0-3.3 ms), and what
    :func:`measured_ps_round_trip` alone leaves out. Raises UsageError for ``workers`` < 1 or a
    stretch <= 0, RuntimeError if a process fails or hangs past ``timeout_s`` (at least 3 times the
    phases' estimated length)."""
    from ..errors import UsageError

    if workers < 1 or not computes or any(not c > 0 for c in computes):
        raise UsageError(f"measured_ps_round_trips_loaded needs workers >= 1 and compute stretches > 0, "
                         f"got workers={workers}, computes={list(computes)}")
    shapes, defaults = _ps_spec(params, optimizer)
    estimate = (warmup + _exchanges(IDLE_SLEEP_S, exchanges, exchange_s)) * (IDLE_SLEEP_S + exchange_s) + sum(
        2 * (warmup + _stretches(c, exchanges, exchange_s)) * (2 * c + exchange_s)  # alone, loaded
        for c in computes)
    timeout_s = max(timeout_s, 3 * estimate)
    return run_ranks(_ps_loaded_main, workers + 1, (shapes, type(optimizer), defaults, workers, threads,
                                                   tuple(computes), exchanges, exchange_s, warmup, timeout_s),
                     timeout_s, "parameter server benchmark under load")


def measured_ps_update(params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer, clip: float, *,
                       threads: int = 1, repeats: int = 15, warmup: int = 3) -> dict[str, float]:
    """Seconds one parameter server shard holding all of ``params`` spends on an update, measured on
    this machine in this process: :class:`~paratrain.ps.server.ShardServer` (what ``ps-sync`` and
    ``ps-async`` run) with ``optimizer``'s class and defaults and the recipe's ``clip``, the pushes
    handed in from a thread of their own (as RPC handler threads do), at ``threads`` intra-op threads
    (a server's share of this machine's cores). Keys: ``sync_1`` and ``sync_2``, a synchronous step
    with one and two workers' gradients (mean, global-norm clipping, the optimizer's step, the
    parameters copied for the answer); ``async``, one asynchronous update (the step and the copy).
    Medians of ``repeats`` updates. The messages themselves are :func:`measured_rpc`'s."""
    from concurrent.futures import ThreadPoolExecutor

    from ..ps.server import ShardServer

    values = [p.detach().to("cpu", copy=True) for p in params]  # a server keeps its shard on the CPU
    defaults = {k: v for k, v in optimizer.defaults.items() if not isinstance(v, torch.Tensor)}
    grads = [[torch.randn_like(v) * 1e-3 for v in values] for _ in range(2)]

    def median_update(mode: str, workers: int) -> float:
        server = ShardServer(0, workers, mode, timeout_s=600.0)
        server.init(values, type(optimizer), defaults)
        times = []
        for i in range(warmup + repeats):
            before, version = server.update_s, server.version
            answers = [server.push(w, version, grads[w], defaults.get("lr"), clip if mode == "sync" else 0.0)
                       for w in range(workers)]
            torch.futures.wait_all(answers)
            if i >= warmup:
                times.append(server.update_s - before)
        return statistics.median(times)

    from ..env import intra_op_threads

    # torch's thread count is per process: set it here, time in the pool's thread
    with intra_op_threads(threads), ThreadPoolExecutor(1) as pool:
        return {"sync_1": pool.submit(median_update, "sync", 1).result(),
                "sync_2": pool.submit(median_update, "sync", 2).result(),
                "async": pool.submit(median_update, "async", 1).result()}
