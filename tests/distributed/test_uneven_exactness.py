"""Uneven inputs in the Task trainer: sentence mode with ``data.drop_last = false`` trains the epoch's
last, shorter global batch (601 lines, global batch 8: one line left). With W=2 and accumulation 2,
rank 1 has no line of it and rank 0's first micro-batch none: they run masked padding micro-batches,
so every rank runs the same steps (nothing hangs, fsdp's collective forwards included) and the
result equals one process on the same lines, float64 to 1e-10."""
from __future__ import annotations

import pytest

from .harness import fit_rank, max_rel_diff, run_ranks
from .test_exactness import tiny_cfg

pytestmark = pytest.mark.slow
STRATEGIES = ("allreduce", "fsdp", "zero1")


def cfg(strategy: str, world_size: int, accumulation: int, drop_last: bool = False) -> dict:
    c = tiny_cfg("sentence", "float64", strategy, world_size, accumulation, "adam")
    c["train"].pop("max_steps")
    c["train"]["epochs"] = 1
    c["data"]["drop_last"] = drop_last
    return c


def _ranks_job(rank: int, world_size: int, data_dir: str, workdir: str) -> dict:
    return {s: fit_rank(rank, world_size, cfg(s, world_size, 2), data_dir, f"{workdir}/{s}") for s in STRATEGIES}


@pytest.fixture(scope="module")
def results(tiny_data, tmp_path_factory):
    work = tmp_path_factory.mktemp("uneven")
    single = fit_rank(0, 1, cfg("single", 1, 1), str(tiny_data), str(work / "single"))
    dropped = fit_rank(0, 1, cfg("single", 1, 1, drop_last=True), str(tiny_data), str(work / "dropped"))
    dist = run_ranks(_ranks_job, 2, work, str(tiny_data), str(work), deadline_s=300)
    return single, dropped, dist


def test_the_last_short_batch_is_trained(results):
    single, dropped, _ = results
    assert (single["steps"], dropped["steps"]) == (76, 75)  # ceil(601 / 8), 601 // 8
    assert max_rel_diff(single["state"], dropped["state"]) > 1e-6


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_w2_with_an_empty_rank_in_the_last_batch_matches_single(results, strategy):
    single, _, dist = results
    for res in dist:
        assert res[strategy]["steps"] == 76
        assert max_rel_diff(res[strategy]["state"], single["state"]) < 1e-10
