"""Parameter sharding over K parameter servers, balanced by bytes.

Greedy largest-first (LPT, Graham 1969): parameters sorted by size, each given to
the server that holds the fewest bytes so far. Every parameter lives on exactly
one server; the largest server holds at most 4/3 of the optimum.
"""
from __future__ import annotations


def shard_by_bytes(sizes: list[int], num_shards: int) -> list[list[int]]:
    """Parameter indices per shard (each list ascending) for parameter byte ``sizes``.

    Raises ValueError when ``num_shards`` < 1. Shards may be empty when there
    are fewer parameters than shards.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    load = [0] * num_shards
    shards: list[list[int]] = [[] for _ in range(num_shards)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        k = min(range(num_shards), key=lambda k: (load[k], k))
        shards[k].append(i)
        load[k] += sizes[i]
    return [sorted(s) for s in shards]
