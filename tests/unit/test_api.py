"""The minimal-change API in one process: what a user's own loop sees after ``pt.init`` and
``pt.setup`` (multi-process runs are in tests/e2e/test_minimal_api.py)."""
from __future__ import annotations

import copy
import pickle
import threading

import pytest
import torch
from torch import nn

import paratrain as pt


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        self.calls: list[tuple[int, str]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, 4) -> (N, 3)
        self.calls.append((x.size(0), threading.current_thread().name))
        return self.body(x)

    def init_state(self, n: int) -> torch.Tensor:
        return torch.zeros(n, 8)


@pytest.fixture()
def single(monkeypatch):
    for var in ("PARATRAIN_STRATEGY", "PARATRAIN_CONFIG", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(var, raising=False)
    env = pt.init()
    yield env
    pt.shutdown()


def test_plain_python_is_single_and_init_twice_is_the_same_session(single):
    assert pt.session().strategy.name == "single" and single.world_size == 1 and single.rank == 0
    assert pt.init() is single


def test_wrapped_model_and_optimizer_behave_as_the_users(single, tmp_path):
    torch.manual_seed(0)
    net = Net()
    plain_keys = list(net.state_dict())
    sgd = torch.optim.SGD(net.parameters(), lr=0.5)
    model, optimizer = pt.setup(net, sgd)
    assert optimizer is sgd and isinstance(optimizer, torch.optim.SGD)
    assert model.init_state(2).shape == (2, 8)  # the user's own methods and attributes
    assert list(model.state_dict()) == plain_keys and [n for n, _ in model.named_parameters()] == \
        [n for n, _ in net.named_parameters()]
    restored = pickle.loads(pickle.dumps(model))  # torch.save(model) / deepcopy give the plain module
    assert type(restored) is Net and type(copy.deepcopy(model)) is Net
    sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.1)  # LR schedulers accept it
    x, y = torch.randn(6, 4), torch.randn(6, 3)
    before = [p.detach().clone() for p in net.parameters()]
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    norm = pt.clip_grad_norm_(model.parameters(), 0.1)
    assert norm > 0.1 and abs(float(torch.nn.utils.get_total_norm([p.grad for p in net.parameters()])) - 0.1) < 1e-6
    optimizer.step()
    sched.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    assert any(not torch.equal(a, b) for a, b in zip(before, net.parameters()))


def test_save_is_atomic_plain_and_loads_weights_only(single, tmp_path):
    model, optimizer = pt.setup(Net(), torch.optim.Adam(Net().parameters()))
    path = tmp_path / "deep" / "best.pt"
    pt.save({"model": model, "step": 3}, path)
    state = torch.load(path, weights_only=True)
    assert state["step"] == 3 and list(state["model"]) == list(model.module.state_dict())
    assert not list(path.parent.glob(".*tmp"))  # no temp file left behind
    model.load_state_dict(pt.load(path)["model"])
    with pytest.raises(TypeError, match="needs a path"):
        with open(tmp_path / "f.pt", "wb") as f:
            pt.save(model, f)


def test_skip_nonfinite_leaves_the_parameters_unchanged(single):
    net = Net()
    model, optimizer = pt.setup(net, torch.optim.SGD(net.parameters(), lr=1.0), skip_nonfinite=True)
    before = [p.detach().clone() for p in net.parameters()]
    (model(torch.randn(2, 4)).sum() * float("nan")).backward()
    optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
    assert pt.session().strategy.last_step.skipped


def test_a_second_model_is_refused(single):
    pt.setup(Net())
    with pytest.raises(pt.UsageError, match="one model per process"):
        pt.setup(Net())


def test_towers_split_each_batch_over_the_devices_like_data_parallel(monkeypatch):
    """replicate on 2 CPU devices: each tower's forward sees half of the batch, in its own thread, and
    loss and gradient are those of the whole batch on one device."""
    for var in ("PARATRAIN_STRATEGY", "PARATRAIN_CONFIG", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    torch.manual_seed(0)
    ref = Net().double()
    net = copy.deepcopy(ref)
    pt.init(strategy="replicate", devices="cpu:0,cpu:1")
    try:
        model, optimizer = pt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        sizes = sorted(net.calls)
        assert [s for s, _ in sizes] == [4, 4] and len({t for _, t in sizes}) == 2  # two towers, two threads
        ref_loss = nn.functional.mse_loss(ref(x), y)
        ref_loss.backward()
        assert float(loss.detach()) == pytest.approx(float(ref_loss.detach()), rel=1e-12)
        for a, b in zip(net.parameters(), ref.parameters()):
            assert torch.allclose(a.grad, b.grad, rtol=1e-10, atol=1e-14)
        net.calls.clear()
        with torch.no_grad():
            model(x)  # evaluation runs the plain module: one call, the whole batch
        assert [s for s, _ in net.calls] == [8]
        with pytest.raises(ValueError, match="does not split over 2 towers"):
            model(torch.randn(5, 4, dtype=torch.float64))
    finally:
        pt.shutdown()


def test_all_mean_and_print_on_one_rank(single, capsys):
    assert pt.all_mean(3.5) == 3.5
    t = pt.all_mean(torch.tensor([1.0, 2.0]))
    assert torch.equal(t, torch.tensor([1.0, 2.0]))
    pt.print("hello", 1)
    assert capsys.readouterr().out == "hello 1\n"
