"""The core claim for the built-in tasks other than the LSTM: N replicas with global batch B
compute what one device computes with batch B.

For ``gpt`` (on a tiny PTB-style corpus) and ``digits-cnn`` (scikit-learn's digits, BatchNorm with
``model.sync_batchnorm = true``): ``allreduce`` with 2 processes, ``ps-sync`` with 2 workers and a
server, and ``replicate`` with 2 towers train 10 optimizer steps and are compared with ``single``,
parameters and BatchNorm running statistics: float64 to 1e-10 relative, float32 to 1e-5.
Clipping is active; gpt's N-way runs also accumulate 2 micro-batches per step (no_sync). BatchNorm
statistics are per micro-batch, so digits keeps accumulation 1 on both sides. Every spawn runs all
its cases (start-up dominates).

Optimizers: gpt uses Adam in float64 and SGD with momentum in float32. The key part of the
attention's qkv bias has a mathematically zero gradient (a constant added to every key shifts all
of a query's scores equally), so both runs feed Adam only float32 rounding noise there, and Adam
divides by sqrt(v): noise becomes lr-sized steps (1e-3 apart after 10 steps; SGD: 5e-7). The
comparison would then measure Adam's reaction to noise, not the strategy.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from paratrain import config
from paratrain.config import from_dict
from paratrain.env import DistEnv
from paratrain.train import Trainer
from paratrain.train.checkpoint import latest

from .harness import max_rel_diff, run_ranks

pytest.importorskip("sklearn", reason="digits-cnn needs scikit-learn (pip install -e '.[test]')")
STEPS = 10
CASES = [("gpt", "float64"), ("gpt", "float32"), ("digits-cnn", "float64"), ("digits-cnn", "float32")]


def task_cfg(task: str, dtype: str, strategy: str, world: int, accumulation: int) -> dict:
    if task == "gpt":
        data = {"corpus": "ptb", "mode": "bptt", "bptt": 8, "eval_batch_size": 4, "eval_fraction": 0.2}
        model = {"n_layer": 2, "n_head": 2, "d_model": 16, "dropout": 0.0}
        train = ({"optimizer": "adam", "lr": 0.01, "clip": 0.5} if dtype == "float64"
                 else {"optimizer": "sgd", "lr": 0.5, "momentum": 0.9, "clip": 0.5})
    else:
        data = {"valid_size": 50, "test_size": 50, "eval_batch_size": 25}
        model = {"channels1": 4, "channels2": 6, "channels3": 8, "dropout": 0.0, "sync_batchnorm": True}
        train = {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9, "clip": 1.0}
        accumulation = 1
    return {"name": f"{task}-{dtype}", "task": {"entry": task}, "data": data, "model": model,
            "train": {**train, "batch_size": 8, "accumulation": accumulation, "max_steps": STEPS, "epochs": 100,
                      "convention": "mean_over_tokens", "dtype": dtype, "log_every": 5, "schedule": "constant",
                      "seed": 5},
            "dist": {"strategy": strategy, "nproc": world}}


def final_model(run_dir: Path) -> dict:
    return torch.load(latest(run_dir), weights_only=True)["model"]


def train_here(cfg_dict: dict, data, run_dir: Path) -> dict:
    tr = Trainer(from_dict(cfg_dict), DistEnv(), run_dir, str(data), verbose=False)
    tr.fit()
    tr.close()
    return final_model(run_dir)


def _allreduce_job(rank: int, world_size: int, data_dir: str, work: str) -> list:
    env = DistEnv(rank, rank, world_size, world_size, "gloo", torch.device("cpu"))
    for task, dtype in CASES:
        cfg = from_dict(task_cfg(task, dtype, "allreduce", world_size, 2))
        tr = Trainer(cfg, env, f"{work}/allreduce-{task}-{dtype}", data_dir, verbose=False)
        tr.fit()
        tr.close()
    return []


def _ps_job(rank: int, world_size: int, data_dir: str, work: str, case: int) -> dict | None:
    from paratrain.worker import train_worker

    task, dtype = CASES[case]
    return train_worker(Path(work) / f"ps-{task}-{dtype}", False, data_dir, verbose=False, rank=rank,
                        world_size=world_size, local_rank=rank, local_world_size=world_size,
                        rpc_init_method=f"file://{work}/rpc-{case}")


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    work = tmp_path_factory.mktemp("task-exact")
    out: dict = {}
    for task, dtype in CASES:
        out[("single", task, dtype)] = train_here(task_cfg(task, dtype, "single", 1, 1), tiny_data,
                                                  work / f"single-{task}-{dtype}")
        rep = task_cfg(task, dtype, "replicate", 1, 2)
        rep["dist"]["devices"] = "cpu:0,cpu:1"
        out[("replicate", task, dtype)] = train_here(rep, tiny_data, work / f"replicate-{task}-{dtype}")
    run_ranks(_allreduce_job, 2, work / "spawn-ar", str(tiny_data), str(work), deadline_s=420)
    for task, dtype in CASES:
        out[("allreduce", task, dtype)] = final_model(work / f"allreduce-{task}-{dtype}")
    for i, (task, dtype) in enumerate(CASES):
        ps = task_cfg(task, dtype, "ps-sync", 2, 2)
        ps["dist"]["num_ps"] = 1
        run_dir = work / f"ps-{task}-{dtype}"
        run_dir.mkdir()
        (run_dir / "config.toml").write_text(config.to_toml(from_dict(ps)))
        run_ranks(_ps_job, 3, work / f"spawn-ps{i}", str(tiny_data), str(work), i, deadline_s=240)
        out[("ps-sync", task, dtype)] = final_model(run_dir)
    return out


@pytest.mark.parametrize("strategy", ["allreduce", "ps-sync", "replicate"])
@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_task_n_replicas_equal_single(runs, strategy, case):
    task, dtype = case
    ref, got = runs[("single", task, dtype)], runs[(strategy, task, dtype)]
    tol = 1e-10 if dtype == "float64" else 1e-5
    diff = max_rel_diff(got, ref)
    print(f"DIFF {strategy} {task} {dtype}: {diff:.3e}")
    assert diff <= tol, f"{strategy} x 2 vs single, {task} {dtype}: max relative difference {diff:.3e} > {tol}"


@pytest.mark.parametrize("task", ["gpt", "digits-cnn"])
def test_the_comparison_is_not_between_initial_states(runs, tiny_data, tmp_path, task):
    """10 steps moved the parameters (and, for digits, the BatchNorm running statistics)."""
    one = task_cfg(task, "float64", "single", 1, 1)
    one["train"]["max_steps"] = 1
    one["train"]["lr"] = 1e-12
    init = train_here(one, tiny_data, tmp_path / "init")
    assert max_rel_diff(runs[("single", task, "float64")], init) > 1e-3
    if task == "digits-cnn":
        ref = runs[("single", task, "float64")]
        assert any("running_var" in k for k in ref) and float(ref["features.0.1.num_batches_tracked"]) == STEPS
