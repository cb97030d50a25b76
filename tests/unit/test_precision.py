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
from paratrain.strategies.precision import rnn_runs_in
from paratrain.train import Trainer
from paratrain.train.checkpoint import latest

from ..distributed.harness import max_rel_diff
from ..distributed.test_exactness import tiny_cfg
from ..distributed.test_task_exactness import task_cfg


def cfg(precision: str, strategy: str = "single", steps: int = 12, task: str | None = None, **train) -> dict:
    """lstm-lm for fp32/bf16, gpt for fp16 (oneDNN has no float16 LSTM on CPU) or where ``task="gpt"``."""
    c = (task_cfg("gpt", "float32", strategy, 1, 1) if (task or ("gpt" if precision == "fp16" else "lstm")) == "gpt"
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
    # gpt: a CPU without bfloat16 instructions has no bf16 LSTM (test_an_rnn_without_a_low_precision_kernel_...)
    for p in ("fp32", "bf16"):
        fit(cfg(p, steps=12, task="gpt"), tiny_data, tmp_path / p)
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


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_a_low_precision_lstm_on_this_cpu_trains_or_is_one_clear_error_naming_what_runs(tiny_data, tmp_path, precision):
    """The real LSTM on this machine's CPU: it trains where the probe says its kernel runs, else one line
    names the precision that does (bf16 where this CPU has a bf16 LSTM, else fp32)."""
    c = tiny_cfg("bptt", "float32", "single", 1, 1, "sgd")
    c["train"] = {**c["train"], "precision": precision, "max_steps": 2}
    low = {"fp16": torch.float16, "bf16": torch.bfloat16}[precision]
    tr = Trainer(from_dict(c), DistEnv(), tmp_path / "r", str(tiny_data), verbose=False)
    try:
        if rnn_runs_in(nn.LSTM(2, 2), low):
            tr.fit()
            assert [r["step"] for r in records(tmp_path / "r", "train")][-1] == 2  # trained
        else:
            better = "bf16" if precision == "fp16" and rnn_runs_in(nn.LSTM(2, 2), torch.bfloat16) else "fp32"
            with pytest.raises(UsageError, match=f'has no .* kernel on this CPU .*use train.precision = "{better}"'):
                tr.fit()
    finally:
        tr.close()


class _Failing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(2, 2)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("runs", [True, False])
def test_an_rnn_without_a_low_precision_kernel_is_named_and_any_other_error_is_kept(monkeypatch, runs, precision):
    """Low precision on a CPU: a RuntimeError in the forward of a model with an RNN becomes one UsageError
    naming fp32 only where that RNN's kernel does not run here in that dtype (the probe, set by hand);
    else it is raised as it was."""
    from paratrain.strategies import precision as mp

    monkeypatch.setattr(mp, "rnn_runs_in", lambda model, dtype: runs)
    s = STRATEGIES["single"](DistEnv(), precision=precision)
    model = _Failing()
    s.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))

    def loss_fn(m, mb):
        raise RuntimeError("could not create a primitive descriptor\nsecond line")

    if runs:
        with pytest.raises(RuntimeError, match="primitive descriptor") as e:
            s._forward(loss_fn, None)
        assert not isinstance(e.value, UsageError)
    else:
        low = {"bf16": "bfloat16", "fp16": "float16"}[precision]
        with pytest.raises(UsageError, match=f'"{precision}": a recurrent layer of this model has no {low} kernel on '
                                             r'this CPU \(could not create a primitive descriptor\); use '
                                             r'train.precision = "fp32"'):
            s._forward(loss_fn, None)


def test_the_rnn_probe_keeps_the_random_state_and_passes_models_without_an_rnn():
    lstm = nn.LSTM(2, 2)
    torch.manual_seed(5)
    before = torch.get_rng_state()
    rnn_runs_in(lstm, torch.bfloat16)
    assert torch.equal(torch.get_rng_state(), before)
    assert rnn_runs_in(nn.Linear(2, 2), torch.float16)
    both = nn.Sequential(nn.GRU(2, 2), nn.LSTM(2, 2))  # every kind of layer is tried, not the first alone
    assert rnn_runs_in(both, torch.bfloat16) == rnn_runs_in(nn.LSTM(2, 2), torch.bfloat16)


def test_bad_precision_settings_are_refused():
    with pytest.raises(UsageError, match="train.dtype"):
        from_dict({**cfg("bf16"), "train": {**cfg("bf16")["train"], "dtype": "float64"}})
    with pytest.raises(UsageError, match="bf16"):
        from_dict({**cfg("fp16"), "dist": {"strategy": "ps-sync", "nproc": 1, "num_ps": 1}})
    with pytest.raises(UsageError, match="precision"):
        from_dict(cfg("fp8"))


class _InferenceOnlyLSTM(nn.Module):
    """A recurrent layer whose kernel runs under no_grad and fails in training, as oneDNN's fp16 LSTM on a
    Xeon with AVX512-FP16 (2026-11-27: "could not create a primitive descriptor for the LSTM forward
    propagation primitive"). Its own arithmetic, so the test does not depend on this CPU's kernels."""

    def __init__(self, *sizes):
        super().__init__()

    def forward(self, x, hx=None):
        if torch.is_grad_enabled():
            raise RuntimeError("could not create a primitive descriptor for the LSTM forward propagation primitive")
        return x.clone(), hx


def test_the_low_precision_probe_trains_the_layer_not_only_runs_its_forward(monkeypatch):
    from paratrain.strategies import precision

    monkeypatch.setitem(precision._RNN_LAYERS, "LSTM", _InferenceOnlyLSTM)
    with torch.no_grad():  # whatever the caller's grad mode: the probe trains
        assert not rnn_runs_in(nn.LSTM(3, 4), torch.bfloat16)
    assert not rnn_runs_in(nn.LSTM(3, 4), torch.bfloat16)
    assert rnn_runs_in(nn.Linear(3, 4), torch.bfloat16)  # no recurrent layer: nothing to probe
