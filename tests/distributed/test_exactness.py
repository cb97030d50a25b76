"""The core claim: W replicas with global batch B == one device with batch B.

allreduce with W=2 (and gradient accumulation K=2 with no_sync, and global-norm
clipping active) is compared after 10 optimizer steps with single (K=1), in both
batching modes: float64 to 1e-10 relative, float32 to 1e-5. In the same spawn,
the perplexity of a fixed checkpoint is evaluated with W=2 and compared with W=1.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from paratrain.config import from_dict
from paratrain.env import DistEnv
from paratrain.train import Trainer

from .harness import max_rel_diff, run_ranks

STEPS = 10


def tiny_cfg(mode: str, dtype: str, strategy: str, world_size: int, accumulation: int, optimizer: str) -> dict:
    return {
        "name": "exact",
        "data": {"corpus": "ptb", "mode": mode, "bptt": 6, "eval_batch_size": 6},
        "model": {"embed_dim": 12, "hidden_dim": 16, "num_layers": 2, "dropout": 0.0, "init_range": 0.3},
        "train": {"batch_size": 8, "accumulation": accumulation, "max_steps": STEPS, "optimizer": optimizer,
                  "lr": 0.5 if optimizer == "sgd" else 0.01, "momentum": 0.5 if optimizer == "sgd" else 0.0,
                  "clip": 0.3, "convention": "mean_over_tokens", "dtype": dtype, "log_every": 3,
                  "schedule": "constant", "warmup_steps": 4, "seed": 3},
        "dist": {"strategy": strategy, "nproc": world_size},
    }


CASES = [("bptt", "float64", "sgd"), ("sentence", "float64", "adam"), ("bptt", "float32", "sgd")]


def _train(rank: int, world_size: int, cfg_dict: dict, data_dir: str, run_dir: str):
    cfg = from_dict(cfg_dict)
    env = DistEnv(rank, rank, world_size, world_size, "gloo", torch.device("cpu"))
    tr = Trainer(cfg, env, run_dir, data_dir, verbose=False)
    summary = tr.fit()
    state = {k: v.clone() for k, v in tr.strategy.state_dict().items()}
    tr.close()
    metrics = Path(run_dir) / "metrics.jsonl"  # rank 0's: the mean training loss of each logging interval
    losses = [r["loss"] for r in map(json.loads, metrics.read_text().splitlines()) if r["kind"] == "train"] \
        if env.is_main else []
    return {"state": state, "valid_ppl": summary["valid_ppl"], "test_ppl": summary["test_ppl"],
            "steps": summary["steps"], "train_losses": losses}


def _ranks_job(rank: int, world_size: int, data_dir: str, workdir: str):
    """All W=2 checks in one spawn: training per case, then eval of fixed checkpoints."""
    out = {}
    for mode, dtype, opt in CASES:
        cfg = tiny_cfg(mode, dtype, "allreduce", world_size, 2, opt)
        out[(mode, dtype, opt)] = _train(rank, world_size, cfg, data_dir, f"{workdir}/{mode}-{dtype}-w{world_size}")
    # evaluation of a fixed checkpoint (written by the single-process run in the parent)
    for mode in ("bptt", "sentence"):
        cfg = from_dict(tiny_cfg(mode, "float32", "allreduce", world_size, 1, "sgd"))
        env = DistEnv(rank, rank, world_size, world_size, "gloo", torch.device("cpu"))
        tr = Trainer(cfg, env, f"{workdir}/eval-{mode}-w{world_size}", data_dir, verbose=False)
        tr.strategy.load_state_dict(torch.load(f"{workdir}/fixed-{mode}.pt", weights_only=True))
        out[("eval", mode)] = (math.exp(tr.evaluate("valid")), math.exp(tr.evaluate("test")))
        tr.close()
    return out


@pytest.fixture(scope="module")
def results(tiny_data, tmp_path_factory):
    work = tmp_path_factory.mktemp("exact")
    single = {}
    for mode, dtype, opt in CASES:
        cfg = tiny_cfg(mode, dtype, "single", 1, 1, opt)
        single[(mode, dtype, opt)] = _train(0, 1, cfg, str(tiny_data), str(work / f"{mode}-{dtype}-single"))
    # fixed checkpoints for the evaluation check: a few steps of training so they are not at init
    single_eval = {}
    for mode in ("bptt", "sentence"):
        cfg = from_dict(tiny_cfg(mode, "float32", "single", 1, 1, "sgd"))
        tr = Trainer(cfg, DistEnv(), work / f"fixed-{mode}", str(tiny_data), verbose=False)
        tr.fit()
        torch.save(tr.strategy.state_dict(), work / f"fixed-{mode}.pt")
        single_eval[mode] = (math.exp(tr.evaluate("valid")), math.exp(tr.evaluate("test")))
    dist = run_ranks(_ranks_job, 2, work, str(tiny_data), str(work), deadline_s=240)
    return single, single_eval, dist


@pytest.mark.parametrize("case", CASES, ids=["-".join(c) for c in CASES])
def test_allreduce_w2_matches_single(results, case):
    single, _, dist = results
    ref = single[case]
    tol = 1e-10 if case[1] == "float64" else 1e-5
    assert ref["steps"] == STEPS
    for rank, res in enumerate(dist):
        assert res[case]["steps"] == STEPS
        diff = max_rel_diff(res[case]["state"], ref["state"])
        print(f"DIFF {case} rank {rank}: {diff:.3e}")
        assert diff <= tol, f"rank {rank}: max relative difference {diff:.3e} > {tol}"
    # (that these are trained parameters, not two copies of the initial ones: test_training_changed_parameters)


def test_training_changed_parameters(results, tiny_data, tmp_path):
    """Guard against a vacuous comparison: the 10 steps (float64, bptt, SGD) move every parameter tensor
    away from its initial value and lower the loss. The initial parameters are those of a Trainer of
    the same config (same seed) before any step."""
    single, _, _ = results
    res = single[("bptt", "float64", "sgd")]
    tr = Trainer(from_dict(tiny_cfg("bptt", "float64", "single", 1, 1, "sgd")), DistEnv(), tmp_path, str(tiny_data),
                 verbose=False)
    init = {k: v.clone() for k, v in tr.strategy.state_dict().items()}
    init_valid_loss = tr.evaluate("valid")
    tr.close()
    trained = res["state"]
    assert trained.keys() == init.keys()
    for k, v in init.items():  # relative to the tensor's initial scale (the decoder bias starts at 0)
        moved = float((trained[k] - v).abs().max()) / (float(v.abs().max()) or 1.0)
        assert moved > 5e-3, (k, moved)
    # the training loss went down: the last logging interval's mean (steps 10) below the first's (1-3),
    # and the validation loss below the initial model's (about ln 40 = 3.69 for the 40-word corpus)
    losses = res["train_losses"]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.01, losses
    assert math.log(res["valid_ppl"]) < init_valid_loss - 0.05, (math.log(res["valid_ppl"]), init_valid_loss)


@pytest.mark.parametrize("mode", ["bptt", "sentence"])
def test_eval_perplexity_same_for_w1_and_w2(results, mode):
    _, single_eval, dist = results
    for res in dist:
        w2 = res[("eval", mode)]
        for a, b in zip(w2, single_eval[mode]):
            assert a == pytest.approx(b, rel=1e-6)
