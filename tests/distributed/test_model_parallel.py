"""Model parallelism (LSTM layers on 2 CPU virtual devices by a placement plan) and hybrid
(allreduce over 2 processes, each model split over 2 devices) against the unsplit model."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from paratrain.config import from_dict
from paratrain.devices import apply_placement
from paratrain.env import DistEnv
from paratrain.models import LSTMLM
from paratrain.train import Trainer
from paratrain.train.checkpoint import latest

from .harness import max_rel_diff, run_ranks
from .test_exactness import tiny_cfg

PLAN = {"embedding": "cpu:0", "rnn.layers.0": "cpu:0", "rnn.layers.1": "cpu:1", "decoder": "cpu:1"}


def test_layers_on_two_devices_same_loss_and_gradients():
    torch.manual_seed(0)
    ref = LSTMLM(40, 8, 12, 2).double()
    split = LSTMLM(40, 8, 12, 2, layerwise=True).double()
    split.load_state_dict(ref.state_dict())
    rows = apply_placement(split, PLAN)
    assert {r.module.split(".weight")[0].split(".bias")[0]: r.device for r in rows}["rnn.layers.1"] == "cpu:1"
    x, y = torch.randint(0, 40, (7, 3)), torch.randint(0, 40, (7, 3))
    losses = []
    for m in (ref, split):
        logits, _ = m(x)
        loss = F.cross_entropy(logits.view(-1, 40), y.view(-1))
        loss.backward()
        losses.append(loss)
    assert torch.equal(losses[0], losses[1])
    g_ref = {k: p.grad for k, p in ref.named_parameters()}
    from paratrain.models.lstm_lm import convert_state_dict

    g_split = convert_state_dict({k: p.grad for k, p in split.named_parameters()}, layerwise=False)
    assert max_rel_diff(g_split, g_ref) == 0.0


def _hybrid(rank: int, world_size: int, cfg_dict: dict, data_dir: str, run_dir: str):
    tr = Trainer(from_dict(cfg_dict), DistEnv(rank, rank, world_size, world_size, "gloo", torch.device("cpu")),
                 run_dir, data_dir, verbose=False)
    tr.fit()
    devices = sorted({str(p.device) for p in tr.strategy.module.parameters()})
    tr.close()
    return devices


def test_hybrid_two_processes_times_two_devices_equals_single(tiny_data, tmp_path):
    base = tiny_cfg("bptt", "float64", "single", 1, 1, "sgd")
    tr = Trainer(from_dict(base), DistEnv(), tmp_path / "single", str(tiny_data), verbose=False)
    tr.fit()
    tr.close()
    ref = torch.load(latest(tmp_path / "single"), weights_only=True)["model"]
    hybrid = {**base, "model": {**base["model"], "layerwise": True}, "placement": PLAN,
              "dist": {"strategy": "allreduce", "nproc": 2}}
    run_ranks(_hybrid, 2, tmp_path / "spawn", hybrid, str(tiny_data), str(tmp_path / "hybrid"), deadline_s=120)
    got = LSTMLM(41, 12, 16, 2).double()
    got.load_state_dict(torch.load(latest(tmp_path / "hybrid"), weights_only=True)["model"])
    assert max_rel_diff(got.state_dict(), ref) <= 1e-10
