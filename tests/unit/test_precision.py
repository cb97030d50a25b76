"""Mixed precision (train.precision): autocast forward with float32 master weights; fp16's
GradScaler skips are the non-finite guard's skips; clipping sees the unscaled gradient; the
scaler's state is checkpointed and a resumed run is bitwise equal to an uninterrupted one."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from paratrain.config import from_dict
from paratrain.env import DistEnv
from paratrain.errors import UsageError
from paratrain.strategies import STRATEGIES
from paratrain.train import Trainer
from paratrain.train.checkpoint import latest

from ..distributed.harness import max_rel_diff
from ..distributed.test_exactness import tiny_cfg
from ..distributed.test_task_exactness import task_cfg


def cfg(precision: str, strategy: str = "single", steps: int = 12, **train) -> dict:
    """lstm-lm for fp32/bf16; gpt for fp16 (oneDNN has no float16 LSTM on CPU)."""
    c = (task_cfg("gpt", "float32", strategy, 1, 1) if precision == "fp16"
         else tiny_cfg("bptt", "float32", strategy, 1, 1, "sgd"))
    c["train"] = {**c["train"], "precision": precision, "max_steps": steps, "checkpoint_every": 6,
                  "log_every": 1, **train}
    if strategy == "replicate":
        c["dist"] = {"strategy": "replicate", "nproc": 1, "devices": "cpu:0,cpu:1"}
    return c


def fit(c: dict, data, run_dir, resume: bool = False) -> Trainer:
    tr = Trainer(from_dict(c), DistEnv(), run_dir, str(data), verbose=False)
    if resume:
        tr.restore(latest(run_dir))
    tr.fit()
    tr.close()
    return tr


def records(run_dir, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def final(run_dir) -> dict:
    return torch.load(latest(run_dir), weights_only=True)


class Probe(nn.Module):
    """Records the dtype its linear layer computed in."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.seen: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        self.seen.append(y.dtype)
        return y


@pytest.mark.parametrize("precision,low", [("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)])
@pytest.mark.parametrize("strategy", ["single", "replicate"])
def test_forward_runs_in_the_low_dtype_and_returns_float32(precision, low, strategy):
    options = {"devices": [torch.device("cpu")] * 2} if strategy == "replicate" else {}
    s = STRATEGIES[strategy](DistEnv(), precision=precision, **options)
    probe = Probe()
    model, opt = s.setup(probe, torch.optim.SGD(probe.parameters(), lr=0.1))
    out = model(torch.ones(4, 4))
    assert set(probe.seen) == {low} and out.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in probe.parameters())  # master weights
    s.backward(out.sum())
    opt.step()
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in probe.parameters())


def test_bf16_trains_close_to_fp32(tiny_data, tmp_path):
    for p in ("fp32", "bf16"):
        fit(cfg(p, steps=12), tiny_data, tmp_path / p)
    l32, l16 = (records(tmp_path / p, "train")[-1]["loss"] for p in ("fp32", "bf16"))
    assert abs(l16 - l32) / l32 < 0.05, (l32, l16)
    assert max_rel_diff(final(tmp_path / "bf16")["model"], final(tmp_path / "fp32")["model"]) < 0.05


def test_fp16_overflow_is_the_guards_skip_and_lowers_the_scale(tiny_data, tmp_path):
    c = cfg("fp16", steps=12)
    tr = Trainer(from_dict(c), DistEnv(), tmp_path / "r", str(tiny_data), verbose=False)
    tr.strategy.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24)  # the first steps overflow
    before = {k: v.clone() for k, v in tr.strategy.state_dict().items()}
    tr.fit()
    tr.close()
    skips = records(tmp_path / "r", "nonfinite")
    assert skips and [r["step"] for r in skips] == list(range(len(skips)))  # the first steps, in a row
    assert skips[0]["loss_scale"] == 2.0 ** 23 and skips[-1]["loss_scale"] == 2.0 ** (24 - len(skips))
    assert len(skips) == tr.guards.nonfinite_steps  # one count: the scaler's skips are the guard's
    state = final(tmp_path / "r")
    assert state["precision"]["scaler"]["scale"] == 2.0 ** (24 - len(skips))  # no growth within 12 steps
    assert any(not torch.equal(state["model"][k], before[k]) for k in before)  # the later steps updated


def test_clipping_sees_the_unscaled_gradient():
    torch.manual_seed(0)
    norms = {}
    for p in ("fp32", "fp16"):
        s = STRATEGIES["single"](DistEnv(), precision=p)
        torch.manual_seed(0)
        m = nn.Linear(8, 8)
        model, _ = s.setup(m, torch.optim.SGD(m.parameters(), lr=0.1))
        s.backward(model(torch.ones(2, 8)).pow(2).mean())  # small enough for fp16 at scale 2**16
        norms[p] = float(s.clip_grad_norm_(1.0))
    assert norms["fp16"] == pytest.approx(norms["fp32"], rel=1e-2)  # not 65536 times larger


def test_fp16_resume_is_bitwise(tiny_data, tmp_path):
    fit(cfg("fp16", steps=12), tiny_data, tmp_path / "whole")
    fit(cfg("fp16", steps=6), tiny_data, tmp_path / "part")
    fit(cfg("fp16", steps=12), tiny_data, tmp_path / "part", resume=True)
    a, b = final(tmp_path / "whole"), final(tmp_path / "part")
    assert a["step"] == b["step"] == 12
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert a["precision"] == b["precision"]


def test_fp16_lstm_on_cpu_is_one_clear_error(tiny_data, tmp_path):
    c = tiny_cfg("bptt", "float32", "single", 1, 1, "sgd")
    c["train"] = {**c["train"], "precision": "fp16"}
    tr = Trainer(from_dict(c), DistEnv(), tmp_path / "r", str(tiny_data), verbose=False)
    with pytest.raises(UsageError, match='use train.precision = "bf16" on CPU'):
        tr.fit()
    tr.close()


def test_bad_precision_settings_are_refused():
    with pytest.raises(UsageError, match="train.dtype"):
        from_dict({**cfg("bf16"), "train": {**cfg("bf16")["train"], "dtype": "float64"}})
    with pytest.raises(UsageError, match="bf16"):
        from_dict({**cfg("fp16"), "dist": {"strategy": "ps-sync", "nproc": 1, "num_ps": 1}})
    with pytest.raises(UsageError, match="precision"):
        from_dict(cfg("fp8"))
