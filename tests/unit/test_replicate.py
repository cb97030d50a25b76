"""Tower mode: replicate over 2 and 4 CPU virtual devices == single with the same global batch."""
from __future__ import annotations

import pytest
import torch

from paratrain.config import from_dict
from paratrain.env import DistEnv
from paratrain.train import Trainer
from paratrain.train.checkpoint import latest

from ..distributed.harness import max_rel_diff
from ..distributed.test_exactness import tiny_cfg


def train(cfg_dict: dict, data, run_dir) -> dict:
    tr = Trainer(from_dict(cfg_dict), DistEnv(), run_dir, str(data), verbose=False)
    tr.fit()
    tr.close()
    return torch.load(latest(run_dir), weights_only=True)["model"]


@pytest.mark.parametrize("mode,opt", [("bptt", "sgd"), ("sentence", "adam")])
@pytest.mark.parametrize("towers", [2, 4])
def test_replicate_matches_single(tiny_data, tmp_path, mode, opt, towers):
    base = tiny_cfg(mode, "float64", "single", 1, 1, opt)
    ref = train(base, tiny_data, tmp_path / "single")
    devices = ",".join(f"cpu:{i}" for i in range(towers))
    rep = {**base, "train": {**base["train"], "accumulation": 2 if towers == 2 else 1},
           "dist": {"strategy": "replicate", "nproc": 1, "devices": devices}}
    got = train(rep, tiny_data, tmp_path / "rep")
    assert max_rel_diff(got, ref) <= 1e-10


def test_replicate_checkpoint_resumes_under_single(tiny_data, tmp_path):
    base = tiny_cfg("bptt", "float64", "single", 1, 1, "sgd")
    ref = train(base, tiny_data, tmp_path / "ref")
    six = {**base, "train": {**base["train"], "max_steps": 6},
           "dist": {"strategy": "replicate", "nproc": 1, "devices": "cpu:0,cpu:1"}}
    train(six, tiny_data, tmp_path / "r")
    tr = Trainer(from_dict(base), DistEnv(), tmp_path / "r", str(tiny_data), verbose=False)
    tr.restore(latest(tmp_path / "r"))
    tr.fit()
    tr.close()
    assert max_rel_diff(torch.load(latest(tmp_path / "r"), weights_only=True)["model"], ref) <= 1e-10
