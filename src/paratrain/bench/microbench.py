"""Collective micro-benchmark on this machine: gloo all-reduce times, local reduction cost, and
the fitted :class:`~paratrain.bench.costmodel.Link` (``paratrain bench --validate-model``).

:func:`measure_allreduce` starts ``world_size`` processes (:func:`run_ranks`: forked from a
preloaded fork server) that meet through a ``torch.distributed.FileStore`` in a temporary
folder (no ports), each with one intra-op thread and gloo pinned to loopback
(``GLOO_SOCKET_IFNAME=lo`` unless set). Per size: ``warmup`` untimed all-reduces, then ``repeats``
times: barrier, time one all-reduce of float32 zeros (zeros: the sums never overflow), take the max over ranks (a
one-element all-reduce with MAX, outside the timed block). The result is the median of those
maxima. Rank 0 writes the results as JSON; the parent kills every rank still running after
``timeout_s`` and raises RuntimeError.

:func:`measure_gamma` times ``a.add_(b)`` on one thread in this process (gloo reduces on the
CPU, one thread per rank). :func:`measured_link` fits alpha and beta with gamma known
(:func:`~paratrain.bench.costmodel.fit_alpha_beta`).
"""
from __future__ import annotations

import datetime
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Sequence

import torch

from ..env import leave_group
from .costmodel import FLOAT32_BYTES, Link, fit_alpha_beta

DEFAULT_SIZES_BYTES = tuple(4 ** k for k in range(1, 14))
"""4 B, 16 B, ..., 64 MiB: 13 sizes, a factor 4 apart."""


def _rank_main(rank: int, workdir: str, world_size: int, sizes_bytes: Sequence[int], repeats: int,
               warmup: int, timeout_s: float, op: str = "all_reduce") -> None:
    """One rank (a process of :func:`run_ranks`): time every size, rank 0 writes ``results.json``;
    errors to ``error-<rank>.txt``."""
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    try:
        store = dist.FileStore(str(Path(workdir) / "filestore"), world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        try:
            from .microbench_hooks import time_compress_hook
            from .microbench_meetings import _time_meeting, _time_sync_batchnorm
            from .microbench_sharded import time_fsdp_unit, time_sharded_step

            timer = {"all_reduce": _time_allreduce, "p2p": _time_p2p, "all_gather": _time_all_gather,
                     "reduce_scatter": _time_reduce_scatter, "sync_batchnorm": _time_sync_batchnorm,
                     "meeting": _time_meeting, "fsdp_unit": time_fsdp_unit,
                     "sharded_step": time_sharded_step, "bf16_hook": time_compress_hook}[op]
            # each size by its index: an item (a sharded_step spec, an optimizer's defaults) need not be JSON
            results = [(i, timer(size, repeats, warmup)) for i, size in enumerate(sizes_bytes)]
        finally:
            leave_group()
        if rank == 0:
            (Path(workdir) / "results.json.tmp").write_text(json.dumps(results))
            os.replace(Path(workdir) / "results.json.tmp", Path(workdir) / "results.json")
    except BaseException:
        (Path(workdir) / f"error-{rank}.txt").write_text(traceback.format_exc())
        raise
    # done, the group left: end without interpreter finalization, where gloo's remains can still abort
    # the process ("terminate called without an active exception", rarely, after synchronised BatchNorm)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _time_allreduce(nbytes: int, repeats: int, warmup: int) -> float:
    """Median over ``repeats`` of the slowest rank's seconds for one all-reduce of ``nbytes``
    (float32 elements, at least one). Collective: every rank calls it with the same arguments."""
    import torch.distributed as dist

    x = torch.zeros(max(1, nbytes // FLOAT32_BYTES), dtype=torch.float32)
    return _time_collective(lambda: dist.all_reduce(x), repeats, warmup)


def _time_collective(run, repeats: int, warmup: int) -> float:
    """Median over ``repeats`` of the slowest rank's seconds for ``run()`` (a collective)."""
    import torch.distributed as dist

    for _ in range(warmup):
        run()
    slowest = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        run()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        slowest.append(float(dt))
    return statistics.median(slowest)


def _collective(name: str, older: str):
    """``torch.distributed``'s collective ``name`` (torch >= 2.13), else its ``older`` name (deprecated
    in 2.13): the same collective on the torch a GPU image carries (2.11)."""
    import torch.distributed as dist

    return getattr(dist, name, None) or getattr(dist, older)


def all_gather_single(out, part) -> None:
    """``dist.all_gather_single``, or ``all_gather_into_tensor`` on an older torch (:func:`_collective`)."""
    _collective("all_gather_single", "all_gather_into_tensor")(out, part)


def reduce_scatter_single(part, whole) -> None:
    """``dist.reduce_scatter_single``, or ``reduce_scatter_tensor`` on an older torch (:func:`_collective`)."""
    _collective("reduce_scatter_single", "reduce_scatter_tensor")(part, whole)


def _time_all_gather(nbytes: int, repeats: int, warmup: int) -> float:
    """Seconds of an all-gather whose result is ``nbytes`` (FSDP's parameter gather, ZeRO's update)."""
    import torch.distributed as dist

    n = dist.get_world_size()
    out = torch.zeros(max(n, nbytes // FLOAT32_BYTES) // n * n, dtype=torch.float32)
    part = torch.zeros(out.numel() // n, dtype=torch.float32)
    return _time_collective(lambda: all_gather_single(out, part), repeats, warmup)


def _time_reduce_scatter(nbytes: int, repeats: int, warmup: int) -> float:
    """Seconds of a reduce-scatter (sum) of ``nbytes`` (FSDP's gradient reduction)."""
    import torch.distributed as dist

    n = dist.get_world_size()
    whole = torch.zeros(max(n, nbytes // FLOAT32_BYTES) // n * n, dtype=torch.float32)
    part = torch.zeros(whole.numel() // n, dtype=torch.float32)
    return _time_collective(lambda: reduce_scatter_single(part, whole), repeats, warmup)


def _time_p2p(nbytes: int, repeats: int, warmup: int) -> float:
    """Median over ``repeats`` of half a round trip (rank 0 sends ``nbytes`` to rank 1, which sends
    them back): the seconds of one point-to-point message. Ranks 0 and 1 call it."""
    import torch.distributed as dist

    x = torch.zeros(max(1, nbytes // FLOAT32_BYTES), dtype=torch.float32)
    rank = dist.get_rank()

    def round_trip() -> None:
        if rank == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        elif rank == 1:
            dist.recv(x, 0)
            dist.send(x, 0)

    for _ in range(warmup):
        round_trip()
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        round_trip()
        times.append((time.perf_counter() - t0) / 2)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.broadcast(t, 0)
    return float(t)


def _failure(procs: list, workdir: Path, timeout_s: float, what: str) -> str | None:
    """The error message (naming ``what``) for ranks that hung (killed here) or failed, None if all exited 0."""
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    errors = "".join(f"\n--- rank {r}:\n{(workdir / f'error-{r}.txt').read_text()}"
                     for r in range(len(procs)) if (workdir / f"error-{r}.txt").exists())
    errors = errors or " (no traceback written: the ranks' own output is on stderr)"
    if hung:
        return (f"{what}: ranks {hung} still running after timeout_s = {timeout_s} s (killed); "
                f"raise timeout_s, or measure fewer or smaller sizes, or fewer repeats{errors}")
    bad = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode != 0}
    if bad:
        return f"{what}: ranks failed with exit codes {bad}{errors}"
    return None


def measure_allreduce(world_size: int = 2, sizes_bytes: Sequence[int] = DEFAULT_SIZES_BYTES, repeats: int = 10,
                      warmup: int = 2, timeout_s: float = 120.0, op: str = "all_reduce") -> list[tuple[int, float]]:
    """[(bytes, median seconds)] of a gloo all-reduce (sum) of float32 tensors among
    ``world_size`` local processes, one per size in ``sizes_bytes`` (rounded down to whole
    float32 elements, at least one; the bytes returned are the ones sent).

    Raises RuntimeError when a rank fails, or when the ranks have not finished within
    ``timeout_s`` seconds of starting (they are killed); the message holds their tracebacks.
    ``op="p2p"``: the seconds of one send from rank 0 to rank 1 instead (half a round trip);
    ``all_gather`` / ``reduce_scatter``: those collectives; ``sync_batchnorm``: ``sizes_bytes`` are
    ``{"shape": (N, C, *), "compute_s": [before, between]}`` items (BatchNorm inputs), returned as
    given with :func:`_time_sync_batchnorm`'s seconds;
    ``meeting``: sizes are microseconds of compute (:func:`_time_meeting`); ``fsdp_unit``: a list of
    seconds per size or per unit's parameters (:func:`~.microbench_sharded.time_fsdp_unit`);
    ``sharded_step``: the items are
    :func:`~.microbench_sharded.time_sharded_step`'s specs (a model's parameters and optimizer);
    ``bf16_hook``: a list [cast, payload all-reduce, whole hook] of seconds per bucket size
    (:func:`~.microbench_hooks.time_compress_hook`).
    """
    if world_size < 2 or repeats < 1 or warmup < 0 or not sizes_bytes:
        raise ValueError(f"need world_size >= 2 (got {world_size}), repeats >= 1 (got {repeats}), "
                         f"warmup >= 0 (got {warmup}) and at least one size")
    sizes = (list(sizes_bytes) if op in ("sync_batchnorm", "sharded_step")  # BatchNorm inputs; a model's parameters
             or (op == "fsdp_unit" and isinstance(sizes_bytes[0], dict))  # a unit's parameters
             else [int(s) for s in sizes_bytes] if op in ("meeting", "fsdp_unit")  # microseconds; bytes
             else [max(1, int(s) // FLOAT32_BYTES) * FLOAT32_BYTES for s in sizes_bytes])
    got = run_ranks(_rank_main, world_size, (world_size, sizes, repeats, warmup, timeout_s, op), timeout_s,
                    "all-reduce benchmark")
    return [(sizes[i], t if isinstance(t, list) else float(t)) for i, t in got]


RANK_PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "torch.distributed.rpc",
                "paratrain.bench.microbench", "paratrain.bench.microbench_meetings", "paratrain.bench.microbench_rpc",
                "paratrain.bench.microbench_sharded", "paratrain.bench.microbench_hooks")
"""What the ranks' fork server imports once (torch's optimizers import torch._dynamo on first use)."""


def rank_context():
    """The context :func:`run_ranks` starts ranks from: ``multiprocessing``'s forkserver, its server
    preloading :data:`RANK_PRELOAD` when it starts (the first :func:`run_ranks` of this process;
    a server already started by this program is used as it is). Each rank is a fresh fork of
    that single-threaded server, which has run nothing: it starts in milliseconds instead of the
    4-5 s of CPU that a spawned interpreter spends importing torch, and shares no state with this
    process or the other benchmarks' ranks. A rank ends with ``os._exit`` when its target returns
    (the fork server's children skip the interpreter's exit). The ranks get the environment this
    process had when the server started; they set what they need (``GLOO_SOCKET_IFNAME``,
    threads) themselves."""
    ctx = torch.multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(RANK_PRELOAD))
    return ctx


def run_ranks(target, world_size: int, args: tuple, timeout_s: float, what: str):
    """Run ``target(rank, workdir, *args)`` in ``world_size`` new processes (:func:`rank_context`),
    sharing a temporary ``workdir``; returns the JSON that rank 0 wrote to ``workdir/results.json``. A rank
    writes its traceback to ``error-<rank>.txt``. Raises RuntimeError naming ``what``: at once when a
    rank fails (the others, which would wait for it in a collective or ``rpc.shutdown``, are killed;
    the message names the failed rank and its error), or when ranks are still running ``timeout_s``
    after the start (killed; the message holds their tracebacks)."""
    ctx = rank_context()
    with tempfile.TemporaryDirectory(prefix="paratrain-bench-") as tmp:
        procs = [ctx.Process(target=target, args=(r, tmp, *args), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        end = time.monotonic() + timeout_s
        while any(p.is_alive() for p in procs) and time.monotonic() < end:
            if any(p.exitcode not in (None, 0) for p in procs):  # one failed: the others would wait for it
                for p in procs:
                    if p.is_alive():
                        p.kill()
                        p.join()
                break
            time.sleep(0.05)
        failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0, -signal.SIGKILL)]
        if failed:  # the rank that failed, with its error (the others were stopped here)
            error = Path(tmp) / f"error-{failed[0]}.txt"
            lines = error.read_text().strip().splitlines() if error.exists() else [""]
            errors = [ln for ln in lines if re.match(r"[A-Za-z_][\w.]*(Error|Exception)\b", ln)]
            said = (errors or lines)[-1]  # an RPC error ends with the remote frames, after its message
            raise RuntimeError(f"{what}: rank {failed[0]} failed (exit {procs[failed[0]].exitcode}): {said}")
        message = _failure(procs, Path(tmp), timeout_s, what)
        if message:
            raise RuntimeError(message)
        return json.loads((Path(tmp) / "results.json").read_text())


def median_seconds(run, repeats: int, warmup: int) -> float:
    """Median seconds of ``run()`` over ``repeats`` calls after ``warmup`` untimed ones, in this process
    (its result is dropped as soon as it returns)."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_gamma(nbytes: int = 16 * 2 ** 20, repeats: int = 20, warmup: int = 2) -> float:
    """Seconds per byte of a local float32 reduction ``a.add_(b)`` on one CPU thread (median over
    ``repeats``; the caller's thread count is restored)."""
    a = torch.zeros(max(1, nbytes // FLOAT32_BYTES), dtype=torch.float32)
    b = torch.ones_like(a)
    from ..env import intra_op_threads

    with intra_op_threads(1):
        seconds = median_seconds(lambda: a.add_(b), repeats, warmup)
    return seconds / (a.numel() * FLOAT32_BYTES)


def measured_link(world_size: int = 2, *, sizes_bytes: Sequence[int] = DEFAULT_SIZES_BYTES, repeats: int = 10,
                  warmup: int = 2, timeout_s: float = 120.0, gamma_bytes: int = 16 * 2 ** 20) -> Link:
    """``Link(name="measured")`` of this machine's loopback gloo: gamma from :func:`measure_gamma`,
    alpha and beta fitted to :func:`measure_allreduce` with the ring model (relative errors)."""
    gamma = measure_gamma(gamma_bytes)
    points = measure_allreduce(world_size, sizes_bytes, repeats=repeats, warmup=warmup, timeout_s=timeout_s)
    alpha, beta = fit_alpha_beta([s for s, _ in points], [t for _, t in points], world_size, gamma)
    return Link(name="measured", alpha_s=alpha, beta_s_per_byte=beta, gamma_s_per_byte=gamma)


def fit_latency_bandwidth(sizes_bytes: Sequence[float], times_s: Sequence[float]) -> tuple[float, float]:
    """(alpha_s, beta_s_per_byte) of one message, t = alpha + beta * bytes (Hockney), least squares of
    the relative error, both >= 0 (a negative one is set to 0 and the other refitted)."""
    import numpy as np

    x, t = np.asarray(sizes_bytes, dtype=float), np.asarray(times_s, dtype=float)
    a = np.column_stack([np.ones_like(x), x]) / t[:, None]
    alpha, beta = np.linalg.lstsq(a, np.ones_like(t), rcond=None)[0]
    if alpha < 0:
        alpha, beta = 0.0, float(a[:, 1] @ np.ones_like(t) / (a[:, 1] @ a[:, 1]))
    elif beta < 0:
        alpha, beta = float(a[:, 0] @ np.ones_like(t) / (a[:, 0] @ a[:, 0])), 0.0
    return float(alpha), float(beta)


def measure_copies(sizes_bytes: Sequence[int], parts: int = 2, repeats: int = 5,
                   warmup: int = 1) -> list[list[float]]:
    """``[bytes, seconds]`` per size: joining ``parts`` float32 tensors of that total size into a new
    one with ``torch.cat`` in this process at its threads, a fresh result every time (as CPU towers
    gather their outputs onto the master, :class:`~paratrain.strategies.towers.CPUTowers`, and FSDP2
    copies parameters and gradients in and out of its collectives' buffers); median of ``repeats``
    after ``warmup``. For :func:`~.costmodel_sharded.copy_seconds`."""
    out = []
    for size in sorted(set(int(s) for s in sizes_bytes if s > 0)):
        pieces = [torch.zeros(max(1, size // parts // FLOAT32_BYTES)) for _ in range(parts)]
        seconds = median_seconds(lambda: torch.cat(pieces), repeats, warmup)
        out.append([float(sum(p.numel() for p in pieces) * FLOAT32_BYTES), seconds])
    return out


def measured_p2p(*, sizes_bytes: Sequence[int] = DEFAULT_SIZES_BYTES, repeats: int = 10, warmup: int = 2,
                 timeout_s: float = 120.0) -> Link:
    """``Link(name="measured-p2p")``: alpha and beta of one gloo send between two local processes
    (:func:`fit_latency_bandwidth` on half round trips); no reduction (gamma 0)."""
    points = measure_allreduce(2, sizes_bytes, repeats=repeats, warmup=warmup, timeout_s=timeout_s, op="p2p")
    alpha, beta = fit_latency_bandwidth([s for s, _ in points], [t for _, t in points])
    return Link(name="measured-p2p", alpha_s=alpha, beta_s_per_byte=beta, gamma_s_per_byte=0.0)


def measured_collective(op: str, world_size: int = 2, *, sizes_bytes: Sequence[int] = DEFAULT_SIZES_BYTES,
                        repeats: int = 10, warmup: int = 2, timeout_s: float = 120.0) -> Link:
    """``Link(name=f"measured-{op}")`` for ``op`` = all_gather or reduce_scatter among ``world_size``
    local gloo processes: alpha and beta fitted to the ring model of that collective,
    t = (n-1) alpha + (n-1)/n bytes beta (:func:`fit_latency_bandwidth` on (n-1) alpha and
    (n-1)/n bytes); a reduce-scatter's reduction is in its beta (gamma 0)."""
    points = measure_allreduce(world_size, sizes_bytes, repeats=repeats, warmup=warmup, timeout_s=timeout_s, op=op)
    k = world_size - 1
    alpha, beta = fit_latency_bandwidth([s * k / world_size for s, _ in points], [t for _, t in points])
    return Link(name=f"measured-{op}", alpha_s=alpha / k, beta_s_per_byte=beta, gamma_s_per_byte=0.0)


def measured_links() -> dict[str, dict[str, float]]:
    """This machine's links (2 local processes): gloo all-reduce, all-gather, reduce-scatter and send,
    and one RPC message, as {name: {alpha_s, beta_s_per_byte, gamma_s_per_byte}}."""
    from .microbench_rpc import measured_rpc

    found = {"all_reduce": measured_link(2), "all_gather": measured_collective("all_gather"),
             "reduce_scatter": measured_collective("reduce_scatter"), "p2p": measured_p2p(), "rpc": measured_rpc()}
    return {k: v.terms() for k, v in found.items()}
