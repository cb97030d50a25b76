"""CPU towers priced from their step in the training loop (profile_runs_towers.loop_towers,
plan_inputs.loop_towers_parts): the loop's forward, backward, data and optimizer of m towers, one a
core, scaled to n towers, its sync BatchNorm at m taken out and the plan's term at n put in."""
from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from paratrain.bench.costmodel import Link, Workload
from paratrain.config import load

ROOT = Path(__file__).resolve().parents[2]
DIGITS = str(ROOT / "configs" / "digits_cnn.toml")
# digits_cnn's towers as the 2-vCPU EPYC VM timed them (2026-12-01): in process, and in the loop
IN_PROCESS = {"towers": 2, "joined": True, "seconds": 0.0064, "backward_seconds": 0.0033, "sync_batchnorm_s": 0.0025}
LOOP = {"towers": 2, "data_s": 0.0004, "forward_s": 0.0103, "backward_s": 0.0058, "optimizer_s": 0.0007}


def test_n_towers_are_the_loops_m_towers_times_n_over_m_with_the_sync_term_at_m_taken_out():
    from paratrain.bench.plan_inputs import loop_towers_parts

    cfg, off = load(DIGITS, []), load(DIGITS, ["model.sync_batchnorm=false"])
    prof = {"batchnorm_inputs": [[64, 16, 8, 8]], "towers_forward_threads": IN_PROCESS, "loop_towers": LOOP}
    # at m = 2: the loop's parts, its forward and backward less the 2.5 ms of sync BatchNorm (which the plan
    # adds apart) in proportion: 16.1 ms of the two keep 13.6
    kept = (0.0103 + 0.0058 - 0.0025) / (0.0103 + 0.0058)
    assert loop_towers_parts(prof, cfg, 2) == pytest.approx(
        {"forward_s": 0.0103 * kept, "backward_s": 0.0058 * kept, "data_s": 0.0004, "optimizer_s": 0.0007})
    assert sum(loop_towers_parts(prof, cfg, 2)[k] for k in ("forward_s", "backward_s")) == pytest.approx(0.0136)
    # 4 towers on 2 cores: each core runs two in turn; the optimizer's parameters are the same
    assert loop_towers_parts(prof, cfg, 4) == pytest.approx(
        {"forward_s": 0.0206 * kept, "backward_s": 0.0116 * kept, "data_s": 0.0008, "optimizer_s": 0.0007})
    # half the batch per tower; checkpointing's forwards again in the one backward
    assert loop_towers_parts(prof, cfg, 2, ratio=0.5, extra_s=0.001) == pytest.approx(
        {"forward_s": 0.00515 * kept, "backward_s": 0.0029 * kept + 0.001, "data_s": 0.0002, "optimizer_s": 0.0007})
    # a recipe without the key: nothing to take out (the loop ran it without)
    assert loop_towers_parts(prof, off, 2)["forward_s"] == pytest.approx(0.0103)
    # a sync term above the loop's forward and backward: neither goes below 0
    above = {**prof, "towers_forward_threads": {**IN_PROCESS, "sync_batchnorm_s": 0.02}}
    assert loop_towers_parts(above, cfg, 2) == pytest.approx(
        {"forward_s": 0.0, "backward_s": 0.0, "data_s": 0.0004, "optimizer_s": 0.0007})
    # fewer towers than cores (several threads each), or not measured: None
    assert loop_towers_parts(prof, cfg, 1) is None
    assert loop_towers_parts({k: v for k, v in prof.items() if k != "loop_towers"}, cfg, 2) is None


def test_the_towers_row_at_the_measured_n_is_the_loops_step_and_without_it_the_in_process_timing():
    """plan.predict_layout on the shipped digits_cnn profile (EPYC VM, 2026-12-01): with the loop's
    towers the row at N = 2 is their step (its parts add up to 17.2 ms, sync BatchNorm included); at N
    = 4 twice the rest, the optimizer once, and the sync term of 4 towers (3 x 2.5 ms); without
    it the row is what the in-process timing gives (forward, backward and sync BatchNorm of the
    profile's process plus the one-device run's data and optimizer)."""
    from paratrain.bench.plan import Layout, predict_layout

    prof = json.loads((ROOT / "benchmarks/results/plan-amd/digits_cnn-amd-v44/profile.json").read_text())
    prof["towers_forward_threads"] = IN_PROCESS
    cfg = load(DIGITS, [])
    link = Link(name="measured", **prof["links"]["all_reduce"])

    def row(p, n):
        return predict_layout(Layout("replicate", n, {}, "replicate (towers)"), p, cfg, link, on_this_machine=True,
                              global_batch=None)

    looped = row({**prof, "loop_towers": LOOP}, 2)
    assert looped["step_s"] == pytest.approx(0.0103 + 0.0058 + 0.0004 + 0.0007)
    assert looped["optimizer_s"] == pytest.approx(0.0007)
    four = row({**prof, "loop_towers": LOOP}, 4)
    assert four["step_s"] == pytest.approx(2 * (0.0103 + 0.0058 - 0.0025 + 0.0004) + 0.0007 + 3 * 0.0025)
    one = prof["workloads"][str(prof["default_threads"])]
    older = row(prof, 2)
    assert older["step_s"] == pytest.approx(0.0064 + 0.0033 + 0.0025 + one["data_s"] + one["optimizer_s"])
    # elsewhere (a preset's devices) towers are not this machine's threads: neither measurement is passed
    from paratrain.bench.plan import _cpu_towers

    assert _cpu_towers({**prof, "loop_towers": LOOP}, cfg, 2, 1.0, 0.0, shared_cores=False) == {
        "towers_forward_s": None, "towers_backward_s": None, "towers_forward_joined": False}
    here = _cpu_towers({**prof, "loop_towers": LOOP}, cfg, 2, 1.0, 0.0, shared_cores=True)
    assert here["towers_optimizer_s"] == 0.0007
    assert "towers_optimizer_s" not in _cpu_towers(prof, cfg, 2, 1.0, 0.0, shared_cores=True)


def test_the_towers_model_takes_the_loops_data_and_optimizer_on_shared_cores_only():
    from paratrain.bench.costmodel_towers import predict_towers

    w = Workload(forward_s=0.02, backward_s=0.01, data_s=0.001, optimizer_s=0.002, param_bytes=(1000,),
                 tokens_per_step=100.0)
    link = Link(name="t", alpha_s=1e-5, beta_s_per_byte=1e-9, gamma_s_per_byte=0.0)
    shared = predict_towers(w, 2, link, output_bytes=0.0, shared_cores=True, forward_side_by_side_s=0.04, joined=True,
                            backward_measured_s=0.03, data_measured_s=0.003, optimizer_measured_s=0.005)
    assert shared.step_s == pytest.approx(0.04 + 0.03 + 0.003 + 0.005) and shared.optimizer_s == pytest.approx(0.005)
    apart = predict_towers(w, 2, link, output_bytes=0.0, data_measured_s=0.003, optimizer_measured_s=0.005)
    assert apart.compute_s == pytest.approx(0.02 + 0.01 + 0.001 + 0.002) and apart.optimizer_s == pytest.approx(0.002)


def test_loop_towers_runs_replicate_at_one_tower_a_core_and_keeps_the_median_round(monkeypatch, capsys):
    """profile_runs_towers.loop_towers with the runs stubbed: the commands (replicate over ``towers`` CPU devices of one
    process, the
    global batch towers x the recipe's batch, the recipe's keys, round after round) and the round
    kept (the median step, its parts together); a failed run, one that timed no step, or a batch that
    does not split into the micro-batches gives None and one line."""
    from paratrain.bench import report, runner, sweep, validate
    from paratrain.bench.profile_runs_towers import loop_towers

    # (data, forward, backward, optimizer) seconds of each round's rank 0
    rounds = [(0.0004, 0.0110, 0.0060, 0.0007), (0.0004, 0.0103, 0.0058, 0.0007), (0.0004, 0.0090, 0.0050, 0.0006)]
    commands, timed = [], [True]

    def record(i):
        return {"ok": "fail" not in commands[i], "units_per_step": 128, "i": i,
                "train_step_ms": 1000 * sum(rounds[i]) if timed[0] else math.nan}

    def workload(rec, ranks, units):
        data, forward, backward, optimizer = rounds[rec["i"]]
        return SimpleNamespace(data_s=data, forward_s=forward, backward_s=backward, optimizer_s=optimizer)

    monkeypatch.setattr(runner, "run_cmd", lambda cmd, log, timeout_s, env: (commands.append(cmd), (0, None))[1])
    monkeypatch.setattr(sweep, "read_outcome", lambda plan, rc, run_dir: len(commands) - 1)
    monkeypatch.setattr(report, "run_record", record)
    monkeypatch.setattr(validate, "workload_from_record", workload)
    got = loop_towers(DIGITS, None, ("model.sync_batchnorm=true",), None, 64, 90, 2, repeats=3)
    assert got == {"towers": 2, "data_s": 0.0004, "forward_s": 0.0103, "backward_s": 0.0058, "optimizer_s": 0.0007,
                   "rounds_step_s": pytest.approx([sum(r) for r in rounds])}  # the middle of 18.1, 17.2, 15.0 ms
    assert len(commands) == 3 and all(
        c[c.index("--strategy") + 1] == "replicate" and 'dist.devices="cpu:0,cpu:1"' in c and "dist.nproc=1" in c
        and "train.batch_size=128" in c
        and "train.max_steps=90" in c and "model.sync_batchnorm=true" in c for c in commands)
    commands.clear()
    assert loop_towers(DIGITS, None, ("fail",), None, 64, 90, 2) is None
    assert "CPU towers in the loop: not measured (its run failed (exit 0)" in capsys.readouterr().out
    commands.clear()
    timed[0] = False
    assert loop_towers(DIGITS, None, (), None, 64, 90, 2) is None
    assert "no step was timed" in capsys.readouterr().out
    commands.clear()
    assert loop_towers(DIGITS, None, (), None, 64, 90, 2, accumulation=3) is None and not commands
    assert "a batch of 64 per tower does not split into 3 micro-batches" in capsys.readouterr().out
