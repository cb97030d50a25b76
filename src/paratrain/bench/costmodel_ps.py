"""The parameter server's communication in the alpha-beta-gamma model (:mod:`.costmodel`): how
paratrain shards a model over K servers (:func:`ps_largest_shard_bytes`), the bytes each end moves
(:func:`ps_bytes`) and one synchronous push + pull (:func:`ps_step_s`). Li et al. 2014, "Scaling
Distributed Machine Learning with the Parameter Server" (OSDI). The plan's parameter server (its
update, its link, the asynchronous rate) is :mod:`.plan_ps`'s. Units and errors as :mod:`.costmodel`'s."""
from __future__ import annotations

import functools
from typing import Sequence

from .costmodel import Link, _check_n


def ps_largest_shard_bytes(param_bytes: Sequence[float], shards: int) -> float:
    """Bytes on the busiest of ``shards`` parameter servers as paratrain shards a model: whole
    parameters, greedy largest-first by bytes (:func:`~paratrain.ps.sharding.shard_by_bytes`, LPT,
    Graham 1969). A parameter is never split, so one large tensor sets it: gpt_wt2's tied embedding
    is 17.0 of its 17.8 MB, and its busiest of 2 servers holds 96% of the bytes, not 50%. Equal to
    ``sum(param_bytes) / shards`` only where the parameters balance. Cached: a plan asks it of the
    same model for every PS row. Raises UsageError for shards < 1."""
    _check_n(shards, "shards")
    return _largest_shard(tuple(param_bytes), shards)


@functools.lru_cache(maxsize=64)
def _largest_shard(sizes: tuple[float, ...], shards: int) -> float:
    from ..ps.sharding import shard_by_bytes

    return float(max(sum(sizes[i] for i in s) for s in shard_by_bytes(list(sizes), shards)))


def ps_bytes(nbytes: float, workers: int, shards: int, largest_shard_bytes: float | None = None) -> dict[str, float]:
    """Bytes per step through a parameter server with ``shards`` servers: a worker pushes its
    gradient and pulls the parameters (nbytes each way); the busiest server receives and sends
    ``workers x largest_shard_bytes`` (:func:`ps_largest_shard_bytes`; None: nbytes / shards, an
    even split)."""
    _check_n(workers, "workers")
    _check_n(shards, "shards")
    server = workers * (nbytes / shards if largest_shard_bytes is None else largest_shard_bytes)
    return {"worker_sent": float(nbytes), "worker_received": float(nbytes),
            "server_received": server, "server_sent": server}


def ps_step_s(nbytes: float, workers: int, shards: int, link: Link, largest_shard_bytes: float | None = None,
              streams: int = 1, copy_fraction: float = 1.0) -> float:
    """Seconds of one synchronous push + pull, every machine with its own ``link``.

    Push, then the servers reduce and update, then pull. Each phase lasts as long as its busiest
    end: a server receives (sends) ``workers`` messages of nbytes/shards and handles them one after
    another (torch.distributed.rpc runs each request's Python handler under the GIL, so their fixed
    costs do not overlap), i.e. ``workers (alpha + nbytes/shards beta)``; a worker sends (receives) one message
    per shard, i.e. ``shards alpha + nbytes beta``. The server then sums ``workers`` gradients of
    nbytes/shards and applies the result: ``workers nbytes/shards gamma`` ((workers-1) adds + 1
    update). Total: ``2 max(server phase, worker phase) + workers nbytes/shards gamma``, where the
    busiest server's ``largest_shard_bytes`` (:func:`ps_largest_shard_bytes`) stands for nbytes/shards
    where given: its phases are the step's (None: an even split, as before 2026-11-27). (Until
    2026-11-27 the workers' messages counted one alpha at the server, as if handled at once: on the
    2-vCPU Xeon, digits_cnn's ps-sync at N = 2, whose 96 KB messages cost about 0.36 ms of fixed
    handling each, was then 16% under its measured step, and 9% under with the alphas in turn.)

    ``streams``: how many of a server's messages move their bytes at once: 1 on a network, where the
    server's link carries them in turn; on one host, the ``copy_fraction`` of beta that is copies
    of bytes (C++ threads, no GIL; :func:`~.plan_ps.ps_copy_fraction`) runs on up to
    ``min(streams, workers)`` cores side by side (a synchronous server's waiting workers leave them
    free, :func:`~.plan_ps.ps_streams`), and the rest (Python per tensor, under the GIL) in turn:
    the server phase's bytes cost ``server_received beta ((1 - f) + f / min(streams, workers))``.
    Measured on the 2-vCPU EPYC on 2026-11-28: ptb_small's ps-sync at N = 2, K = 1 (18.6 MB each
    way) exchanged in 35, 36 ms on rank 0, its one-worker round trip less the async update plus the
    sync update, as if its two workers' messages ran side by side, where the bytes in turn priced it
    60, 67 ms. digits_cnn's (96 KB, f = 0.06-0.08: its per-byte cost is mostly Python per tensor)
    barely moves: 7.2 ms priced in turn, 7.1 ms side by side, 7 ms measured (comm + idle).
    Raises ValueError for streams < 1 or a copy_fraction outside [0, 1]."""
    if streams < 1 or not 0.0 <= copy_fraction <= 1.0:
        raise ValueError(f"ps_step_s: streams >= 1 and copy_fraction in [0, 1], got {streams}, {copy_fraction}")
    b = ps_bytes(nbytes, workers, shards, largest_shard_bytes)
    side_by_side = (1.0 - copy_fraction) + copy_fraction / min(streams, workers)
    server_phase = workers * link.alpha_s + b["server_received"] * link.beta_s_per_byte * side_by_side
    worker_phase = shards * link.alpha_s + nbytes * link.beta_s_per_byte
    return 2 * max(server_phase, worker_phase) + b["server_received"] * link.gamma_s_per_byte
