"""fp16 under the strategies whose ranks hold different gradients after the merge (``fsdp``: one shard
each; ``pipeline``: one stage each), at W=2 with gloo:

* an overflow in one rank's gradients alone (fsdp: its shard; pipeline: its stage) makes every
  rank skip the step and lower the loss scale (fsdp: the scaler's inf check on DTensor shards
  reduces the flag over the mesh; pipeline: ``ShardedGradScaler`` all-reduces it);
* a run whose first steps overflow skips the same steps on every rank, as the guard's skips, and
  its scale halves once per skip;
* without overflow, fsdp and pipeline train as ``single`` does under fp16 (float16 rounds:
  compared to 1e-2 relative), and log the same losses;
* fsdp's fp16 resume is bitwise, the loss scaler's state included (it is in the DCP checkpoint's
  metadata, and the zero-gradient step with which torch creates a stateless optimizer's state on
  every save is no training step).

Every spawn runs all its cases (start-up dominates).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from .harness import max_rel_diff, run_ranks
from .test_sharded import cfg_dict, whole_model

STEPS = 8
HIGH = 2.0 ** 24  # the first steps of the tiny gpt overflow float16 at this loss scale
STRATEGIES = ("fsdp", "pipeline")


def fp16_cfg(strategy: str, world: int, steps: int = STEPS, momentum: float = 0.9) -> dict:
    d = cfg_dict("gpt", strategy, world, 1, steps)
    d["train"].update(dtype="float32", precision="fp16", clip=1.0, log_every=1, checkpoint_every=4,
                      momentum=momentum)
    if strategy == "pipeline":
        d["dist"].update(pipeline_stages=2, microbatches=2)
    return d


def fit_fp16(d: dict, env, data_dir: str, run_dir, init_scale: float | None = None, resume: bool = False) -> dict:
    """Train ``d`` as ``env``'s rank, the loss scale starting at ``init_scale`` (default: torch's)."""
    from paratrain.config import from_dict
    from paratrain.train import Trainer
    from paratrain.train.checkpoint import latest

    tr = Trainer(from_dict(d), env, run_dir, data_dir, verbose=False)
    if init_scale is not None:
        state = tr.strategy.scaler.state_dict()
        tr.strategy.scaler.load_state_dict({**state, "scale": init_scale})
    if resume:
        tr.restore(latest(Path(run_dir)))
    tr.fit()
    out = {"scaler": type(tr.strategy.scaler).__name__, "scale": tr.strategy.scaler.get_scale(),
           "skips": tr.guards.nonfinite_steps, "state": tr.strategy.scaler.state_dict()}
    tr.close()
    return out


def _shard_local_overflow(env) -> dict:
    """fsdp: one optimizer step of a 4 x 4 linear layer whose gradient overflows float16 in row 3
    only; fsdp shards rows 0-1 to rank 0 and 2-3 to rank 1."""
    from paratrain.strategies import STRATEGIES as REGISTRY

    s = REGISTRY["fsdp"](env, precision="fp16")
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4, bias=False))
    model, opt = s.setup(m, torch.optim.SGD(m.parameters(), lr=0.1))
    weight = torch.tensor([0.25, 0.25, 0.25, 1e4])  # x 65536 (the loss scale): only row 3 overflows float16
    s.backward((model(torch.ones(2, 4)) * weight).sum())
    mine_finite = bool(torch.isfinite(next(iter(m.parameters())).grad.to_local()).all())
    opt.step()
    return {"skipped": s.last_step.skipped, "scale": s.scaler.get_scale(), "mine_finite": mine_finite}


def _stage_local_overflow(env, data_dir: str, run_dir: str) -> dict:
    """pipeline: an optimizer step whose only inf gradient is in a parameter of stage 1 alone."""
    from paratrain.config import from_dict
    from paratrain.train import Trainer

    tr = Trainer(from_dict(fp16_cfg("pipeline", env.world_size)), env, run_dir, data_dir, verbose=False)
    s = tr.strategy
    shared = {id(p) for p in s.shared}
    for p in s.stage_params:
        p.grad = torch.zeros_like(p)
    own = [p for p in s.stage_params if id(p) not in shared]
    if env.rank == 1:
        own[0].grad[0] = float("inf")
    mine_finite = all(bool(torch.isfinite(p.grad).all()) for p in s.stage_params)
    s.optimizer.step()
    out = {"skipped": s.last_step.skipped, "scale": s.scaler.get_scale(), "mine_finite": mine_finite}
    tr.close()
    return out


def _job(rank: int, world: int, data_dir: str, work: str) -> dict:
    from paratrain.env import DistEnv

    env = DistEnv(rank, rank, world, world, "gloo", torch.device("cpu"))
    out = {"local-fsdp": _shard_local_overflow(env),
           "local-pipeline": _stage_local_overflow(env, data_dir, f"{work}/stage-local")}
    for strategy in STRATEGIES:
        out[f"{strategy}-high"] = fit_fp16(fp16_cfg(strategy, world), env, data_dir, f"{work}/{strategy}-high", HIGH)
        out[strategy] = fit_fp16(fp16_cfg(strategy, world), env, data_dir, f"{work}/{strategy}")
    # SGD without momentum keeps no state: torch's get_state_dict creates it with a zero-gradient step
    # on every save, which must not count as a step of the loss scaler
    out["whole"] = fit_fp16(fp16_cfg("fsdp", world, momentum=0.0), env, data_dir, f"{work}/fsdp-whole")
    fit_fp16(fp16_cfg("fsdp", world, STEPS // 2, momentum=0.0), env, data_dir, f"{work}/fsdp-resumed")
    out["resumed"] = fit_fp16(fp16_cfg("fsdp", world, momentum=0.0), env, data_dir, f"{work}/fsdp-resumed",
                              resume=True)
    return out


def records(run_dir: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    from paratrain.env import DistEnv

    work = tmp_path_factory.mktemp("fp16")
    single = {name: fit_fp16(fp16_cfg("single", 1), DistEnv(), str(tiny_data), work / f"single-{name}", scale)
              for name, scale in (("high", HIGH), ("default", None))}
    ranks = run_ranks(_job, 2, work / "spawn", str(tiny_data), str(work), deadline_s=420)
    return work, single, ranks


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_overflow_on_one_rank_alone_is_skipped_by_every_rank(runs, strategy):
    _, _, ranks = runs
    local = [r[f"local-{strategy}"] for r in ranks]
    assert local[0]["mine_finite"] and not local[1]["mine_finite"]  # the inf is in rank 1's shard/stage alone
    assert all(r["skipped"] for r in local)  # (the norm the guard checks is global: both skip in any case)
    assert [r["scale"] for r in local] == [2.0 ** 15] * 2  # both halved the scale: the flag was shared


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_overflowing_steps_are_skipped_together_as_the_guards_skips(runs, strategy):
    work, single, ranks = runs
    got = [r[f"{strategy}-high"] for r in ranks]
    assert {r["scaler"] for r in got} == {"ShardedGradScaler" if strategy == "pipeline" else "GradScaler"}
    assert got[0]["scale"] == got[1]["scale"] and got[0]["skips"] == got[1]["skips"] > 0
    skips = records(work / f"{strategy}-high", "nonfinite")
    assert [r["step"] for r in skips] == list(range(got[0]["skips"]))  # the first steps, in a row
    assert [r["loss_scale"] for r in skips] == [HIGH / 2 ** (k + 1) for k in range(len(skips))]
    assert got[0]["scale"] == HIGH / 2 ** len(skips)
    assert abs(len(skips) - single["high"]["skips"]) <= 1  # fsdp sums the tied embedding's float16 gradients


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fp16_trains_as_single_does(runs, strategy):
    work, single, ranks = runs
    assert single["default"]["skips"] == 0 and all(r[strategy]["skips"] == 0 for r in ranks)
    diff = max_rel_diff(whole_model(work / strategy), whole_model(work / "single-default"))
    print(f"DIFF {strategy} x 2 fp16 vs single fp16, {STEPS} steps: {diff:.3e}")
    assert diff < 1e-2
    ours, ref = records(work / strategy, "train"), records(work / "single-default", "train")
    assert [r["step"] for r in ours] == [r["step"] for r in ref]
    assert all(abs(a["loss"] - b["loss"]) / b["loss"] < 1e-3 for a, b in zip(ours, ref))  # step 1 included


def test_fsdp_fp16_resume_is_bitwise(runs):
    work, _, ranks = runs
    for r in ranks:  # the scaler's whole state: scale and growth tracker (STEPS good steps, saves not counted)
        assert r["resumed"]["state"] == r["whole"]["state"] and r["whole"]["state"]["_growth_tracker"] == STEPS
    whole, resumed = whole_model(work / "fsdp-whole"), whole_model(work / "fsdp-resumed")
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
