"""The wait for the slowest rank: ranks that meet every step wait for the last of them, the
expected maximum of n normal local times over their mean (order statistics: Tippett 1925, Harter
1961; the straggler effect: Dean & Barroso 2013, "The Tail at Scale"; Chen et al. 2016, "Revisiting
Distributed Synchronous SGD"). Pure arithmetic; units: seconds."""
from __future__ import annotations

import functools
import math


@functools.lru_cache(maxsize=None)
def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normal variables]: 0 for n = 1, 1/sqrt(pi) = 0.5642 for 2,
    1.0294 for 4, 1.4236 for 8, 3.2482 for 1024 (order statistics: Tippett 1925, Harter 1961). The integral
    ``int x n phi(x) Phi(x)^(n-1) dx`` by Simpson's rule over [-12, 12] (4,800 intervals).
    Raises ValueError for n < 1."""
    if n < 1:
        raise ValueError(f"expected_max_normal needs n >= 1 variables, got {n}")
    if n == 1:
        return 0.0
    lo, hi, m = -12.0, 12.0, 4800
    h = (hi - lo) / m

    def f(x: float) -> float:
        return x * n * math.exp(-x * x / 2) / math.sqrt(2 * math.pi) * (0.5 * math.erfc(-x / math.sqrt(2))) ** (n - 1)

    total = f(lo) + f(hi) + sum((4 if i % 2 else 2) * f(lo + i * h) for i in range(1, m))
    return total * h / 3


def straggle_s(n: int, local_sd_s: float) -> float:
    """Seconds per step that n ranks which meet every step wait for the last of them: each rank's
    local time (its step less communication) varies from step to step with standard deviation
    ``local_sd_s`` (measured: :meth:`~.timing.RankTimer.summary`'s ``local_jitter_ms`` of the profile's
    one-device runs, from successive differences: a drift of the machine that all ranks share makes
    none of them wait), and a collective ends only after the slowest rank arrives, so the step is the
    mean local time plus ``E[max of n] - mean = local_sd_s * expected_max_normal(n)`` (ranks
    independent and normal: the straggler effect that backup workers answer, Chen et al. 2016,
    "Revisiting Distributed Synchronous SGD"; Dean & Barroso 2013, "The Tail at Scale"). One meeting
    a step: a strategy that meets several times a step (FSDP's units, synchronised BatchNorm) waits at
    each, which this leaves out. 0 for n = 1."""
    return expected_max_normal(n) * local_sd_s if n > 1 and local_sd_s > 0 else 0.0
