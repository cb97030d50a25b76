"""Rank consistency check at start and the periodic parameter checksum, on 2 spawned gloo ranks."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from paratrain.consistency import check_ranks, check_sync, first_difference, fingerprint
from paratrain.errors import TrainingStopped

from .harness import run_ranks


def test_first_difference_names_rank_and_cause():
    a = fingerprint(nn.Linear(3, 4), "x = 1")
    assert first_difference([a, dict(a)]) is None
    assert "rank 1 has a different config" in first_difference([a, fingerprint(nn.Linear(3, 4), "x = 2")])
    msg = first_difference([a, a, fingerprint(nn.Linear(3, 5), "x = 1")])
    assert msg.startswith("rank 2 has a different model") and "weight" in msg
    assert "torch version" in first_difference([a, dict(a, torch="0.0")])


def _job(rank: int, world_size: int):
    import torch.distributed as dist

    def gather(obj):
        objs = [None] * world_size
        dist.all_gather_object(objs, obj)
        return objs

    out = {}
    torch.manual_seed(0)
    model = nn.Linear(3, 4 if rank == 0 else 4)
    try:  # same model and config everywhere: passes
        check_ranks(model, "cfg", gather)
        out["same"] = "ok"
    except TrainingStopped as e:
        out["same"] = str(e)
    try:  # rank 1 was started with another --set
        check_ranks(model, "cfg" if rank == 0 else "cfg2", gather)
        out["config"] = "ok"
    except TrainingStopped as e:
        out["config"] = str(e)

    def all_reduce(t):
        dist.all_reduce(t)
        return t

    check_sync(model, all_reduce, rank, world_size, step=10)  # identical replicas
    if rank == 1:
        with torch.no_grad():
            model.bias[0] += 1e-6  # silent drift on one rank
    try:
        check_sync(model, all_reduce, rank, world_size, step=20)
        out["drift"] = "ok"
    except TrainingStopped as e:
        out["drift"] = str(e)
    return out


@pytest.mark.slow
def test_mismatch_and_drift_stop_every_rank_naming_rank_1(tmp_path):
    for res in run_ranks(_job, 2, tmp_path, deadline_s=120):
        assert res["same"] == "ok"
        assert res["config"].startswith("rank 1 has a different config")
        assert res["drift"].startswith("replicas diverged at step 20: rank 1 differs from rank 0 in 1 parameter(s), "
                                       "first bias")
