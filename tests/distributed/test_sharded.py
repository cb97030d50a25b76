"""Sharded data parallel (``fsdp`` with both reshard settings, ``zero1``) at W=2 computes what one
device computes with the same global batch, for ``lstm-lm`` and ``gpt`` (float64, 10 optimizer
steps, clipping active, gradient accumulation K=2 on the sharded side: float64 to 1e-10 relative).
Their DCP checkpoints load under another world size and strategy (fsdp W=2 -> allreduce W=1 ->
zero1 W=2 -> fsdp W=2 continues exactly as one uninterrupted run).

Every spawn runs all its cases (start-up dominates).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from paratrain.train.checkpoint import latest, list_checkpoints

from .harness import fit_rank, max_rel_diff, run_ranks, train_in_process

STEPS = 10
SHARDED = [("fsdp", True), ("fsdp", False), ("zero1", True)]
TASKS = ["lstm-lm", "gpt"]


def cfg_dict(task: str, strategy: str, world: int, accumulation: int, steps: int = STEPS,
             reshard: bool = True) -> dict:
    data = {"corpus": "ptb", "mode": "bptt", "bptt": 6, "eval_batch_size": 4, "eval_fraction": 0.3}
    if task == "gpt":
        model = {"n_layer": 2, "n_head": 2, "d_model": 16, "dropout": 0.0}
        train = {"optimizer": "sgd", "lr": 0.5, "momentum": 0.9, "weight_decay": 1e-3}
    else:
        model = {"embed_dim": 12, "hidden_dim": 16, "num_layers": 2, "dropout": 0.0, "init_range": 0.3}
        train = {"optimizer": "adam", "lr": 0.01}
    dist = {"strategy": strategy, "nproc": world}
    if strategy == "fsdp":
        dist["reshard_after_forward"] = reshard
    return {"name": f"{task}-{strategy}", "task": {"entry": task}, "data": data, "model": model,
            "train": {**train, "batch_size": 8, "accumulation": accumulation, "max_steps": steps, "epochs": 100,
                      "clip": 0.3, "convention": "mean_over_tokens", "dtype": "float64", "log_every": 5,
                      "schedule": "constant", "seed": 7, "checkpoint_every": 5},
            "dist": dist}


def whole_model(run_dir: Path) -> dict:
    """The newest checkpoint's model as a plain state dict (a ``.pt`` file, or a DCP folder read whole)."""
    from paratrain.strategies.sharded import read_whole

    path = latest(run_dir)
    return read_whole(path)["model"] if path.is_dir() else torch.load(path, weights_only=True)["model"]


def train_here(d: dict, data, run_dir: Path, resume: bool = False) -> dict:
    train_in_process(d, data, run_dir, resume)
    return whole_model(run_dir)


def _sharded_job(rank: int, world_size: int, data_dir: str, work: str) -> list:
    for task in TASKS:
        for strategy, reshard in SHARDED:
            fit_rank(rank, world_size, cfg_dict(task, strategy, world_size, 2, reshard=reshard), data_dir,
                     f"{work}/{task}-{strategy}-{reshard}")
    return []


def _resume_job(rank: int, world_size: int, data_dir: str, work: str, strategy: str, steps: int,
                resume: bool) -> list:
    fit_rank(rank, world_size, cfg_dict("gpt", strategy, world_size, 1, steps), data_dir, f"{work}/chain", resume)
    return []


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    work = tmp_path_factory.mktemp("sharded")
    out = {task: train_here(cfg_dict(task, "single", 1, 1), tiny_data, work / f"single-{task}") for task in TASKS}
    run_ranks(_sharded_job, 2, work / "spawn", str(tiny_data), str(work), deadline_s=420)
    return work, out


@pytest.mark.parametrize("strategy,reshard", SHARDED, ids=["fsdp-reshard", "fsdp-no-reshard", "zero1"])
@pytest.mark.parametrize("task", TASKS)
def test_sharded_two_ranks_equal_single(runs, task, strategy, reshard):
    work, single = runs
    run_dir = work / f"{task}-{strategy}-{reshard}"
    assert all(p.suffix == ".dcp" and p.is_dir() for p in list_checkpoints(run_dir))  # DCP, written by every rank
    ranks = {f.name.split("_")[2] for p in list_checkpoints(run_dir) for f in p.glob("__*_*.distcp")}
    assert ranks == {"0", "1"}, ranks
    diff = max_rel_diff(whole_model(run_dir), single[task])
    print(f"DIFF {strategy} (reshard_after_forward {reshard}) x 2 vs single, {task} float64: {diff:.3e}")
    assert diff <= 1e-10


def test_the_comparison_is_not_between_initial_states(runs, tiny_data, tmp_path):
    work, single = runs
    one = cfg_dict("gpt", "single", 1, 1, steps=1)
    one["train"]["lr"] = 1e-12
    assert max_rel_diff(single["gpt"], train_here(one, tiny_data, tmp_path / "init")) > 1e-3


def test_dcp_checkpoint_moves_between_world_sizes_and_strategies(runs, tiny_data, tmp_path):
    """fsdp W=2 (steps 1-4, a DCP folder) -> allreduce W=1 reading it whole (5-8, a .pt file) -> zero1
    W=2 (9-12, DCP) -> fsdp W=2 (13-16) equals one uninterrupted single run of 16 steps."""
    work, chain = tmp_path, tmp_path / "chain"
    run_ranks(_resume_job, 2, work / "spawn1", str(tiny_data), str(work), "fsdp", 4, False)
    assert latest(chain).name == "checkpoint-00000004.dcp"
    train_here(cfg_dict("gpt", "allreduce", 1, 1, steps=8), tiny_data, chain, resume=True)
    assert latest(chain).name == "checkpoint-00000008.pt"
    run_ranks(_resume_job, 2, work / "spawn2", str(tiny_data), str(work), "zero1", 12, True)
    assert latest(chain).name == "checkpoint-00000012.dcp"
    run_ranks(_resume_job, 2, work / "spawn3", str(tiny_data), str(work), "fsdp", 16, True)
    assert latest(chain).name == "checkpoint-00000016.dcp"
    ref = train_here(cfg_dict("gpt", "single", 1, 1, steps=16), tiny_data, work / "ref")
    diff = max_rel_diff(whole_model(chain), ref)
    print(f"DIFF fsdp W=2 -> allreduce W=1 -> zero1 W=2 -> fsdp W=2 vs single, 16 steps: {diff:.3e}")
    assert diff <= 1e-10
