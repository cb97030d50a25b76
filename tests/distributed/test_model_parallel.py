"""Model parallelism (LSTM layers on 2 devices by a placement plan) and hybrid (allreduce over 2
processes, each model split over 2 devices) against the unsplit model.

On a CPU-only machine ``cpu:0`` and ``cpu:1`` are one physical device, so "on two devices" is checked
as what paratrain does with the plan: the placement records (one per parameter, with the planned
device), the forward pre-hooks that move each placed module's inputs to its planned device (recorded
as they fire), and loss and gradients equal to the unplaced model's, exactly in float64. With two or
more CUDA devices the same test also runs on cuda:0 / cuda:1, where tensors really cross devices."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import paratrain.devices
from paratrain.config import from_dict
from paratrain.devices import apply_placement
from paratrain.env import DistEnv
from paratrain.models import LSTMLM
from paratrain.models.lstm_lm import convert_state_dict
from paratrain.train import Trainer
from paratrain.train.checkpoint import latest

from .harness import max_rel_diff, run_ranks
from .test_exactness import tiny_cfg


def plan_for(d0: str, d1: str) -> dict[str, str]:
    return {"embedding": d0, "rnn.layers.0": d0, "rnn.layers.1": d1, "decoder": d1}


PLAN = plan_for("cpu:0", "cpu:1")
# the parameters of a 2-layer layerwise LSTMLM and the module of the plan that owns each
PARAMS = ["embedding.weight", *(f"rnn.layers.{i}.{w}_{g}_l0" for i in (0, 1) for w in ("weight", "bias")
                                for g in ("ih", "hh")), "decoder.weight", "decoder.bias"]
DEVICE_PAIRS = [("cpu:0", "cpu:1")] + ([("cuda:0", "cuda:1")] if torch.cuda.device_count() >= 2 else [])


def planned(plan: dict[str, str]) -> dict[str, str]:
    """parameter -> the device the plan gives its owning module."""
    return {p: plan[p.rsplit(".", 1)[0]] for p in PARAMS}


def on(actual: torch.device, name: str) -> bool:
    """``actual`` is the device ``name``: the same device for CUDA; for cpu:N (virtual CPU devices,
    which torch keeps as the one CPU) the CPU."""
    want = torch.device(name)
    return actual == want if want.type == "cuda" else actual.type == "cpu"


def record_moves(monkeypatch) -> list:
    """Make paratrain's input-moving hooks (installed by apply_placement) record, each time they fire,
    (module, target device, devices of the tensors they hand to the module)."""
    fired: list = []
    make = paratrain.devices._move_inputs

    def recording(device):
        hook = make(device)

        def wrapped(module, args, kwargs):
            out = hook(module, args, kwargs)
            fired.append((module, str(device), [t.device for t in out[0] if isinstance(t, torch.Tensor)]))
            return out

        return wrapped

    monkeypatch.setattr(paratrain.devices, "_move_inputs", recording)
    return fired


@pytest.mark.parametrize("d0, d1", DEVICE_PAIRS, ids=[p[0].split(":")[0] for p in DEVICE_PAIRS])
def test_layers_on_two_devices_placement_plan_applied_and_exact(d0, d1, monkeypatch):
    plan = plan_for(d0, d1)
    torch.manual_seed(0)
    ref = LSTMLM(40, 8, 12, 2).double()
    split = LSTMLM(40, 8, 12, 2, layerwise=True).double()
    split.load_state_dict(ref.state_dict())
    if d0.startswith("cuda"):
        ref = ref.to(d0)
    fired = record_moves(monkeypatch)
    rows = apply_placement(split, plan)

    # 1. the placement records: every parameter exactly once, on the planned device, its size right
    assert [r.module for r in rows] == [n for n, _ in split.named_parameters()]
    assert {r.module: r.device for r in rows} == planned(plan)
    params = dict(split.named_parameters())
    assert all(r.params == params[r.module].numel() and r.bytes == 8 * r.params for r in rows)
    for name, dev in planned(plan).items():
        assert on(params[name].device, dev), (name, params[name].device, dev)

    # 2. the inputs each placed module receives, seen by pre-hooks registered after paratrain's
    received: dict[str, set] = {}
    for name in plan:
        split.get_submodule(name).register_forward_pre_hook(
            lambda m, args, name=name: received.setdefault(name, set()).update(
                a.device for a in args if isinstance(a, torch.Tensor)))

    x, y = torch.randint(0, 40, (7, 3)), torch.randint(0, 40, (7, 3))
    losses, grads = [], []
    for m in (ref, split):
        logits, _ = m(x.to(d0) if m is ref else x)
        loss = F.cross_entropy(logits.view(-1, 40), y.to(logits.device).view(-1))
        loss.backward()
        losses.append(loss)
        grads.append(convert_state_dict({k: p.grad for k, p in m.named_parameters()}, layerwise=False))

    # the move hooks fired once each, in forward order, moving the inputs to the planned devices
    names = {id(m): n for n, m in split.named_modules()}
    assert [(names[id(m)], dev) for m, dev, _ in fired] == [("", "cpu"), *plan.items()]
    for (_, dev, handed), name in zip(fired[1:], plan):
        assert handed and all(on(d, dev) for d in handed), (name, handed, dev)
        assert received[name] and all(on(d, dev) for d in received[name]), (name, received[name], dev)
    # the gradients were made where the parameters live
    for name, dev in planned(plan).items():
        assert on(params[name].grad.device, dev)

    # 3. same loss and gradients as the unplaced model: exactly on the CPU (the same kernels);
    # across CUDA devices to float64 rounding
    tol = 0.0 if d0.startswith("cpu") else 1e-12
    assert abs(losses[1].item() - losses[0].item()) <= tol * abs(losses[0].item())
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == len(PARAMS)
    assert all(float(g.abs().max()) > 0 for g in grads[0].values())  # every gradient is a real comparison
    assert max_rel_diff({k: v.cpu() for k, v in grads[1].items()}, {k: v.cpu() for k, v in grads[0].items()}) <= tol


def _hybrid(rank: int, world_size: int, cfg_dict: dict, data_dir: str, run_dir: str):
    """One rank of the hybrid run; returns what the placement did in this process."""
    import paratrain.devices as devices

    fired: dict[tuple[int, str], int] = {}  # (id of the module, target device) -> times its move hook fired
    make = devices._move_inputs

    def recording(device):
        hook = make(device)

        def wrapped(module, args, kwargs):
            key = (id(module), str(device))
            fired[key] = fired.get(key, 0) + 1
            return hook(module, args, kwargs)

        return wrapped

    devices._move_inputs = recording  # this spawned process only
    tr = Trainer(from_dict(cfg_dict), DistEnv(rank, rank, world_size, world_size, "gloo", torch.device("cpu")),
                 run_dir, data_dir, verbose=False)
    summary = tr.fit()
    names = {id(m): n for n, m in tr.strategy.module.named_modules()}
    out = {"rows": [(r.module, r.device) for r in tr.placement],
           "params": [n for n, _ in tr.strategy.module.named_parameters()],
           "fired": {(names[i], dev): n for (i, dev), n in fired.items() if i in names},
           "wrapper": type(tr.strategy.engine).__name__, "steps": summary["steps"]}
    tr.close()
    return out


def test_hybrid_two_processes_each_apply_the_two_device_plan_and_equal_single(tiny_data, tmp_path):
    base = tiny_cfg("bptt", "float64", "single", 1, 1, "sgd")
    tr = Trainer(from_dict(base), DistEnv(), tmp_path / "single", str(tiny_data), verbose=False)
    tr.fit()
    tr.close()
    ref = torch.load(latest(tmp_path / "single"), weights_only=True)["model"]
    hybrid = {**base, "model": {**base["model"], "layerwise": True}, "placement": PLAN,
              "dist": {"strategy": "allreduce", "nproc": 2, "log_placement": True}}
    (tmp_path / "hybrid").mkdir()  # (paratrain train creates the run dir before the Trainer writes placement.txt)
    results = run_ranks(_hybrid, 2, tmp_path / "spawn", hybrid, str(tiny_data), str(tmp_path / "hybrid"),
                        deadline_s=120)
    want = planned(PLAN)
    for rank, res in enumerate(results):
        # this process's model is the layerwise one, placed by the plan, and all-reduce wraps it (DDP)
        assert res["params"] == PARAMS, rank
        assert dict(res["rows"]) == want and len(res["rows"]) == len(PARAMS), rank
        assert res["wrapper"] == "DistributedDataParallel" and res["steps"] == 10
        # every training and evaluation forward moved the activations to the planned devices
        assert set(res["fired"]) == {("", "cpu"), *PLAN.items()}, (rank, res["fired"])
        counts = {res["fired"][k] for k in PLAN.items()}
        assert len(counts) == 1 and counts.pop() >= 10, (rank, res["fired"])  # once per forward, >= 1 per step
    # rank 0's placement log in the run dir says the same
    lines = (tmp_path / "hybrid" / "placement.txt").read_text().splitlines()
    rows = {ln.split()[0]: ln.split()[1] for ln in lines[1:] if ln.split() and ln.split()[0] in want}
    assert rows == want and lines[len(want) + 1].split()[0] == "total"
    # and the result equals one process with the unsplit model
    got = LSTMLM(41, 12, 16, 2).double()
    got.load_state_dict(torch.load(latest(tmp_path / "hybrid"), weights_only=True)["model"])
    assert max_rel_diff(got.state_dict(), ref) <= 1e-10
    assert max_rel_diff(got.state_dict(), LSTMLM(41, 12, 16, 2).double().state_dict()) > 1e-3  # it trained
