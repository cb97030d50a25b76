"""Resume after a stop equals an uninterrupted run of the same length (bitwise on CPU),
with dropout on and the stop in the middle of an epoch, in both batching modes."""
from __future__ import annotations

import pytest
import torch

from paratrain.config import from_dict
from paratrain.env import DistEnv
from paratrain.train import Trainer
from paratrain.train.checkpoint import latest, list_checkpoints


def cfg(mode: str, max_steps: int, accumulation: int = 1) -> dict:
    return {
        "name": "resume",
        "data": {"corpus": "ptb", "mode": mode, "bptt": 5, "eval_batch_size": 4},
        "model": {"embed_dim": 8, "hidden_dim": 12, "num_layers": 2, "dropout": 0.3},
        "train": {"batch_size": 4, "accumulation": accumulation, "max_steps": max_steps, "optimizer": "adam",
                  "lr": 0.01, "clip": 0.5, "convention": "mean_over_tokens", "schedule": "step",
                  "decay_start_epoch": 0, "checkpoint_every": 3, "log_every": 2, "seed": 7},
        "dist": {"strategy": "single", "nproc": 1},
    }


def run(tmp, data, mode, steps, resume_from=None, accumulation=1):
    tr = Trainer(from_dict(cfg(mode, steps, accumulation)), DistEnv(), tmp, str(data), verbose=False)
    if resume_from is not None:
        tr.restore(latest(resume_from))
    tr.fit()
    state = {k: v.clone() for k, v in tr.strategy.state_dict().items()}
    tr.close()
    return state, tr


@pytest.mark.parametrize("mode,acc", [("bptt", 1), ("bptt", 2), ("sentence", 1)])
def test_resume_equals_uninterrupted(tiny_data, tmp_path, mode, acc):
    full, tr_full = run(tmp_path / "full", tiny_data, mode, 11, accumulation=acc)
    run(tmp_path / "part", tiny_data, mode, 7, accumulation=acc)  # stops mid-epoch, saves at step 7
    assert [p.name for p in list_checkpoints(tmp_path / "part")][-1] == "checkpoint-00000007.pt"
    resumed, tr = run(tmp_path / "part", tiny_data, mode, 11, resume_from=tmp_path / "part", accumulation=acc)
    assert tr.step == 11
    for k in full:
        assert torch.equal(full[k], resumed[k]), k


def test_resume_restores_optimizer_and_schedule(tiny_data, tmp_path):
    run(tmp_path / "a", tiny_data, "bptt", 5)
    ck = torch.load(latest(tmp_path / "a"), weights_only=True)
    assert ck["step"] == 5 and ck["batch_index"] == 5 and ck["epoch"] == 1
    assert ck["optimizer"]["state"], "Adam moments are saved"
    assert set(ck["task"]["hidden"][0][0].shape) == {2, 4, 12}  # (layers, global batch, hidden): the task's state
    assert all(t.device.type == "cpu" for t in ck["model"].values())
