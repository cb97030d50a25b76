"""model.activation_checkpointing: per-block torch.utils.checkpoint; the run equals the run without
it (the recomputation replays the dropout masks), for lstm-lm and gpt."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from paratrain.config import from_dict
from paratrain.env import DistEnv
from paratrain.errors import UsageError
from paratrain.models import checkpointing
from paratrain.models.gpt import GPT
from paratrain.models.lstm_lm import LSTMLM
from paratrain.train import Trainer
from paratrain.train.checkpoint import latest

from ..distributed.test_exactness import tiny_cfg
from ..distributed.test_task_exactness import task_cfg


def run(c: dict, data, run_dir, on: bool) -> dict:
    c = {**c, "model": {**c["model"], "activation_checkpointing": on, "dropout": 0.3},
         "train": {**c["train"], "max_steps": 6}}
    tr = Trainer(from_dict(c), DistEnv(), run_dir, str(data), verbose=False)
    tr.fit()
    tr.close()
    return torch.load(latest(run_dir), weights_only=True)["model"]


@pytest.mark.parametrize("task", ["lstm-lm", "gpt", "digits-cnn"])
def test_checkpointing_on_equals_off(tiny_data, tmp_path, task):
    """The whole state dict: parameters, and BatchNorm's running statistics (a block's recomputed
    forward must not update them a second time)."""
    c = tiny_cfg("bptt", "float64", "single", 1, 1, "sgd") if task == "lstm-lm" else task_cfg(task, "float64",
                                                                                               "single", 1, 1)
    off, on = run(c, tiny_data, tmp_path / "off", False), run(c, tiny_data, tmp_path / "on", True)
    assert off.keys() == on.keys()
    assert all(torch.equal(off[k], on[k]) for k in off), "checkpointed run differs"


def test_blocks_are_recomputed_in_backward():
    torch.manual_seed(0)
    model = GPT(50, 8, n_layer=3, n_head=2, d_model=16)
    calls = []
    for b in model.blocks:
        b.mlp.register_forward_pre_hook(lambda m, i: calls.append(m))  # inside the checkpointed forward
    names = checkpointing.enable(model)
    assert names == ["blocks.0", "blocks.1", "blocks.2"]
    out = model(torch.randint(0, 50, (2, 8)))
    out = out[0] if isinstance(out, tuple) else out
    assert len(calls) == 3
    out.sum().backward()
    assert len(calls) == 6  # each block ran again in the backward


def test_lstm_blocks_and_a_model_without_blocks():
    plain = LSTMLM(10, 4, 4, 2)
    assert checkpointing.blocks(plain) == [plain.rnn]
    m = LSTMLM(10, 4, 4, 2, layerwise=True)
    assert checkpointing.blocks(m) == list(m.rnn.layers)
    with pytest.raises(ValueError, match="no block"):
        checkpointing.enable(nn.Identity())


def test_checkpointing_with_dropout_on_cpu_towers_is_refused():
    c = tiny_cfg("bptt", "float32", "single", 1, 1, "sgd")
    c["model"] = {**c["model"], "activation_checkpointing": True, "dropout": 0.2}
    c["dist"] = {"strategy": "replicate", "nproc": 1, "devices": "cpu:0,cpu:1"}
    with pytest.raises(UsageError, match="model.dropout = 0"):
        from_dict(c)


@pytest.mark.parametrize("devices", ["cpu:0,cpu:1", "cuda:0,cuda:1"])
def test_checkpointing_with_sync_batchnorm_on_towers_is_refused(devices):
    """The backward's recomputation of a checkpointed block runs one tower at a time, so its sync
    BatchNorm would wait at the towers' meeting for towers that never come (CPU and CUDA alike)."""
    c = tiny_cfg("bptt", "float32", "single", 1, 1, "sgd")
    c["model"] = {**c["model"], "activation_checkpointing": True, "dropout": 0.0, "sync_batchnorm": True}
    c["dist"] = {"strategy": "replicate", "nproc": 1, "devices": devices}
    with pytest.raises(UsageError, match="activation_checkpointing with model.sync_batchnorm on towers"):
        from_dict(c)
    c["model"]["sync_batchnorm"] = False  # either one alone is fine
    from_dict(c)
