"""Seeds derived by hashing: a cryptographic hash of the parts, so no two part tuples share a seed
or shift into each other's stream (a linear formula such as ``seed*K + rank*R + step`` makes rank r
at step s reuse rank r-1's stream of step s+R)."""
from __future__ import annotations

import hashlib


def hash_seed(*parts: object) -> int:
    """A 63-bit seed (fits ``torch.Generator.manual_seed``) from ``parts``: blake2b of their ``:``-joined text."""
    key = ":".join(map(str, parts)).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1
