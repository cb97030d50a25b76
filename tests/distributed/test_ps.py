"""Parameter-server strategies on spawned processes (gloo + TensorPipe RPC through files).

* ps-sync, W=2 workers, K=2 servers == single with the same global batch (float64, 1e-10),
  and its checkpoints resume under single and the other way round;
* ps-async with max_staleness s never applies an update staler than s, though stale updates happen
  (one forced by a worker that waits for another's update); loss goes down;
* ps-sync with a backup worker and a delayed worker drops exactly the late gradients;
* ps-sync with a hung worker fails within timeout_s naming it.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from paratrain.config import from_dict
from paratrain.train.checkpoint import latest

from .harness import max_rel_diff, run_ranks, train_in_process
from .test_exactness import tiny_cfg


def _ps_job(rank: int, world_size: int, cfg_dict: dict, data_dir: str, run_dir: str, work: str, resume: bool = False):
    """One process of a parameter-server job (a server or a worker), through the worker entry point."""
    from paratrain.worker import train_worker

    return train_worker(Path(run_dir), resume, data_dir, verbose=False, rank=rank, world_size=world_size,
                        local_rank=rank, local_world_size=world_size,
                        rpc_init_method=f"file://{work}/rpc-{'resume' if resume else 'init'}")


def write_run(cfg_dict: dict, run_dir: Path) -> None:
    """The run dir a parameter-server job reads its config from (paratrain train writes it)."""
    from paratrain import config

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(config.to_toml(from_dict(cfg_dict)))


def ps_cfg(base: dict, strategy: str, workers: int, servers: int, **dist) -> dict:
    return {**base, "dist": {"strategy": strategy, "nproc": workers, "num_ps": servers, **dist}}


def run_single(cfg_dict: dict, data, run_dir: Path, resume: bool = False) -> dict:
    train_in_process(cfg_dict, data, run_dir, resume)
    return torch.load(latest(run_dir), weights_only=True)["model"]


def final_model(run_dir: Path) -> dict:
    return torch.load(latest(run_dir), weights_only=True)["model"]


@pytest.mark.parametrize("mode,opt", [("bptt", "sgd"), ("sentence", "adam")])
def test_ps_sync_matches_single(tiny_data, tmp_path, mode, opt):
    base = tiny_cfg(mode, "float64", "single", 1, 2, opt)
    ref = run_single(base, tiny_data, tmp_path / "single")
    cfg = ps_cfg(base, "ps-sync", 2, 2)
    write_run(cfg, tmp_path / "ps")
    run_ranks(_ps_job, 4, tmp_path / "spawn", cfg, str(tiny_data), str(tmp_path / "ps"), str(tmp_path / "spawn"),
              deadline_s=120)
    diff = max_rel_diff(final_model(tmp_path / "ps"), ref)
    assert diff <= 1e-10, diff


def test_checkpoints_cross_between_ps_sync_and_single(tiny_data, tmp_path):
    """Sentence mode (no carried state): ps-sync 6 steps -> single to 10; single 6 -> ps-sync to 10."""
    base10 = tiny_cfg("sentence", "float64", "single", 1, 1, "adam")
    base6 = {**base10, "train": {**base10["train"], "max_steps": 6}}
    ref = run_single(base10, tiny_data, tmp_path / "ref")
    # ps-sync first, then single
    write_run(ps_cfg(base6, "ps-sync", 2, 1), tmp_path / "a")
    run_ranks(_ps_job, 3, tmp_path / "s1", ps_cfg(base6, "ps-sync", 2, 1), str(tiny_data), str(tmp_path / "a"),
              str(tmp_path / "s1"), deadline_s=120)
    a = run_single(base10, tiny_data, tmp_path / "a", resume=True)
    assert max_rel_diff(a, ref) <= 1e-10
    # single first, then ps-sync
    run_single(base6, tiny_data, tmp_path / "b")
    write_run(ps_cfg(base10, "ps-sync", 2, 1), tmp_path / "b")
    run_ranks(_ps_job, 3, tmp_path / "s2", ps_cfg(base10, "ps-sync", 2, 1), str(tiny_data), str(tmp_path / "b"),
              str(tmp_path / "s2"), True, deadline_s=120)
    assert max_rel_diff(final_model(tmp_path / "b"), ref) <= 1e-10


def _ps_async_job(rank: int, world_size: int, cfg_dict: dict, data_dir: str, run_dir: str, work: str,
                  hold_rank: int):
    """A ps-async process; worker ``hold_rank``, once admitted to a step and holding its parameters,
    waits (up to 3 s) until another worker's update has landed on the server before it computes and
    pushes, so that this push is stale by construction rather than by timing. It holds until one such
    step happened, at most 20 tries (a try gives up after 3 s when its admission left no room for another
    worker's step: s = 1 and another step already in flight). Returns (job result, steps made stale)."""
    import time

    held = {"stale": 0, "tries": 0}
    if rank == hold_rank:
        import torch.distributed.rpc as rpc

        from paratrain.ps import client, rpc_api

        begin = client.ParameterServerStrategy.begin_step

        def begin_step(self):
            fresh = self.gated and not self._admitted
            begin(self)
            if not fresh or held["stale"] or held["tries"] >= 20:
                return
            held["tries"] += 1
            pulled, end = self.versions[0], time.monotonic() + 3.0
            while time.monotonic() < end:
                if rpc.rpc_sync(self.servers[0], rpc_api.stats, args=(0, False))["version"] > pulled:
                    held["stale"] += 1
                    return
                time.sleep(0.005)

        client.ParameterServerStrategy.begin_step = begin_step
    return _ps_job(rank, world_size, cfg_dict, data_dir, run_dir, work), held["stale"]


def test_ps_async_bounded_staleness_and_learning(tiny_data, tmp_path):
    """3 workers, 1 server, max_staleness s = 1: no update is staler than s (the gate's guarantee,
    whatever the timing), an update is stale (one worker waits for another's update before pushing),
    and the loss goes down."""
    base = tiny_cfg("bptt", "float32", "single", 1, 1, "sgd")
    base = {**base, "model": {**base["model"], "embed_dim": 16, "hidden_dim": 32, "num_layers": 1},
            "train": {**base["train"], "batch_size": 12, "max_steps": 40, "lr": 5.0, "clip": 0.5, "momentum": 0.0,
                      "log_every": 10}}
    s, hold = 1, 2
    cfg = ps_cfg(base, "ps-async", 3, 1, max_staleness=s)
    write_run(cfg, tmp_path / "run")
    results = run_ranks(_ps_async_job, 4, tmp_path / "spawn", cfg, str(tiny_data), str(tmp_path / "run"),
                        str(tmp_path / "spawn"), hold, deadline_s=180)
    stats = results[3][0]  # the server
    assert results[hold][1] == 1  # the held worker computed one step on parameters another update overtook
    assert stats["applied"] == len(stats["staleness"]) == 3 * 40, stats["applied"]
    assert max(stats["staleness"]) <= s and min(stats["staleness"]) >= 0
    assert sum(x >= 1 for x in stats["staleness"]) >= 1  # the bound is not trivially met: stale updates exist
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in recs if r["kind"] == "train"]
    assert losses[-1] < losses[0] - 0.5, losses
    summary = [r for r in recs if r["kind"] == "summary"][-1]
    assert summary["staleness_max"] == max(stats["staleness"]) <= s and 0 < summary["updates"] <= stats["version"]


def test_backup_worker_drops_the_late_gradients(tiny_data, tmp_path):
    base = tiny_cfg("bptt", "float32", "single", 1, 1, "sgd")
    base = {**base, "train": {**base["train"], "batch_size": 6}}
    cfg = ps_cfg(base, "ps-sync", 3, 1, backup_workers=1, slow_rank=2, slow_ms=400.0)
    write_run(cfg, tmp_path / "run")
    results = run_ranks(_ps_job, 4, tmp_path / "spawn", cfg, str(tiny_data), str(tmp_path / "run"),
                        str(tmp_path / "spawn"), deadline_s=120)
    stats, slow = results[3], results[2]
    pushes = sum(r["steps"] for r in results[:3])  # every gradient any worker computed
    assert stats["version"] == 10  # the run ends after max_steps updates, straggler included
    assert stats["applied"] == 2 * 10  # each update aggregated the first W - b = 2 gradients
    assert stats["received"] == pushes and stats["dropped"] == pushes - 2 * 10  # the rest were dropped
    assert stats["dropped"] >= slow["steps"] >= 1  # (the delayed worker's gradients come late)
    assert slow["steps"] < 10  # the straggler stopped with the others instead of finishing alone


def test_ps_sync_hung_worker_fails_naming_it(tiny_data, tmp_path):
    base = tiny_cfg("bptt", "float32", "single", 1, 1, "sgd")
    base = {**base, "train": {**base["train"], "timeout_s": 3.0}}
    cfg = ps_cfg(base, "ps-sync", 2, 1, slow_rank=1, slow_ms=60_000.0)
    write_run(cfg, tmp_path / "run")
    with pytest.raises(AssertionError) as err:  # timeout_s=3: ends well within 30 s of start-up, not the hang's 60
        run_ranks(_ps_job, 3, tmp_path / "spawn", cfg, str(tiny_data), str(tmp_path / "run"),
                  str(tmp_path / "spawn"), deadline_s=30)
    msg = str(err.value)
    assert "--- rank 0:" in msg and "no gradient from worker(s) [1]" in msg  # worker 0 failed naming rank 1
    assert "--- rank 2:" in msg  # and the server ended instead of waiting (rank 1 is the hung one)
