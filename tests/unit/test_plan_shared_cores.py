"""Two terms of the plan on this machine's shared CPU cores (profile version 23), against hand
computation: an asynchronous parameter server's exchange while the other workers compute
(bench/plan_ps.py, bench/microbench_rpc.py) and FSDP2's optimizer step measured between two
processes (bench/costmodel_sharded.py, bench/microbench_sharded.py)."""
from __future__ import annotations

import math
import time
from types import SimpleNamespace

import pytest
import torch

from paratrain.bench.costmodel import MIB, Link, Workload, ring_allreduce_s
from paratrain.bench.costmodel_ps import ps_step_s
from paratrain.bench.costmodel_sharded import fsdp_step_path_s, predict_fsdp, unit_paths
from paratrain.bench.plan_model import Layout, step_parts
from paratrain.bench.plan_ps import loaded_exchange, ps_async_rate, ps_exchange_wait_s
from paratrain.bench.strategy_model import PS, SHARDED_PARAMETERS
from paratrain.config import Config
from paratrain.errors import UsageError

LINK = Link(name="t", alpha_s=1e-4, beta_s_per_byte=1e-9, gamma_s_per_byte=0.0)
W = Workload(forward_s=0.003, backward_s=0.005, data_s=0.0, optimizer_s=0.002, param_bytes=(MIB, MIB),
             tokens_per_step=64)
LOADED = {"workers": 2, "idle_s": 2e-3, "points": [[0.001, 3e-3], [0.004, 4e-3], [0.016, 7e-3]]}


def test_an_async_exchange_among_computing_workers_waits_the_loaded_mean_less_the_formulas_price():
    # 8 ms of compute: between the 4 ms (4 ms) and 16 ms (7 ms) points, 5 ms; one worker's median exchange
    # (the link's price in the step's formula) 2 ms; the sleeping workers' mean (idle_s) is a diagnostic
    assert ps_exchange_wait_s(LOADED, 2e-3, 0.008) == pytest.approx(3e-3, rel=1e-12)
    assert ps_exchange_wait_s({**LOADED, "idle_s": 4.5e-3}, 2e-3, 0.008) == pytest.approx(3e-3, rel=1e-12)
    assert ps_exchange_wait_s(LOADED, 2e-3, 0.0) == pytest.approx(1e-3, rel=1e-12)  # below: the first point
    assert ps_exchange_wait_s(LOADED, 2e-3, 1.0) == pytest.approx(5e-3, rel=1e-12)  # above: the last, flat
    assert ps_exchange_wait_s(LOADED, 5e-3, 0.001) == 0.0  # never below the formula's price
    assert ps_exchange_wait_s(None, 2e-3, 0.008) == ps_exchange_wait_s(LOADED, None, 0.008) == 0.0
    with pytest.raises(UsageError):
        ps_exchange_wait_s({"workers": 2, "idle_s": 1e-3, "points": [[0.0, 1e-3]]}, 1e-3, 0.001)


def test_the_wait_adds_to_each_async_workers_step_but_not_to_the_servers_bound():
    nbytes = sum(W.param_bytes)
    rate, step = ps_async_rate(W, 2, 1, LINK, 1e-3, 3e-3)
    assert step == pytest.approx(W.local_s() + ps_step_s(nbytes, 1, 1, LINK) + 1e-3 + 3e-3, rel=1e-12)
    assert rate == pytest.approx(2 / step, rel=1e-12)
    # a server bound below the workers' rate is not moved by the wait (it is the workers' cores)
    slow = Link(name="s", alpha_s=1e-4, beta_s_per_byte=1e-8, gamma_s_per_byte=0.0)
    bound = 1 / (nbytes * 2 * 1e-8 + 1e-3)
    assert ps_async_rate(W, 8, 1, slow, 1e-3, 0.0)[0] == pytest.approx(bound, rel=1e-12)
    assert ps_async_rate(W, 8, 1, slow, 1e-3, 3e-3)[0] == pytest.approx(bound, rel=1e-12)


def test_step_parts_price_the_wait_for_async_workers_only_where_the_loaded_exchange_was_measured():
    cls = SimpleNamespace(cost_model=PS, synchronous=False)
    inputs = {"ps_round_trip_s": 2e-3}  # one worker's median exchange: the formula's price of it
    lay = Layout("ps-async", 2, {"num_ps": 1})
    plain = step_parts(cls, lay, W, LINK, Config(), inputs)
    loaded = step_parts(cls, lay, W, LINK, Config(), {**inputs, "ps_loaded": LOADED})
    # the workers' compute is 8 ms: 5 ms mean exchange among computing workers, 3 ms beyond the idle one
    assert loaded["step_s"] == pytest.approx(plain["step_s"] + 3e-3, rel=1e-12)
    assert loaded["comm_s"] == pytest.approx(plain["comm_s"] + 3e-3, rel=1e-12)
    assert loaded["compute_s"] == plain["compute_s"]
    one = Layout("ps-async", 1, {"num_ps": 1})  # one worker: nobody computes beside its exchange
    assert step_parts(cls, one, W, LINK, Config(), {**inputs, "ps_loaded": LOADED}) == step_parts(
        cls, one, W, LINK, Config(), inputs)
    sync = SimpleNamespace(cost_model=PS, synchronous=True)  # ps-sync's workers exchange together
    assert step_parts(sync, lay, W, LINK, Config(), {**inputs, "ps_loaded": LOADED}) == step_parts(
        sync, lay, W, LINK, Config(), inputs)
    # what the others' exchanges take of its 8 ms of compute (1.9 ms, between the 4 and 16 ms points) is compute
    stolen = {**LOADED, "stolen": [[0.004, 1.6e-3], [0.016, 2.5e-3]]}
    robbed = step_parts(cls, lay, W, LINK, Config(), {**inputs, "ps_loaded": stolen})
    assert robbed["step_s"] == pytest.approx(loaded["step_s"] + 1.9e-3, rel=1e-12)
    assert robbed["compute_s"] == pytest.approx(loaded["compute_s"] + 1.9e-3, rel=1e-12)
    assert robbed["comm_s"] == pytest.approx(loaded["comm_s"], rel=1e-12)
    assert step_parts(sync, lay, W, LINK, Config(), {**inputs, "ps_loaded": stolen}) == step_parts(
        sync, lay, W, LINK, Config(), inputs)
    # measured in the training loop's job instead (3.2 ms): it replaces the micro-benchmark's 1.9 ms
    in_loop = step_parts(cls, lay, W, LINK, Config(), {**inputs, "ps_loaded": stolen, "ps_stolen_s": 3.2e-3})
    assert in_loop["compute_s"] == pytest.approx(loaded["compute_s"] + 3.2e-3, rel=1e-12)
    assert in_loop["step_s"] == pytest.approx(loaded["step_s"] + 3.2e-3, rel=1e-12)
    assert step_parts(cls, lay, W, LINK, Config(), {**inputs, "ps_loaded": stolen, "ps_stolen_s": 0.0}) == loaded
    assert step_parts(cls, one, W, LINK, Config(), {**inputs, "ps_stolen_s": 3.2e-3}) == step_parts(
        cls, one, W, LINK, Config(), inputs)  # one worker: nobody exchanges beside its compute
    # ps-sync's workers: only the loop's own measurement of their job (since version 33) adds to their compute
    plain_sync = step_parts(sync, lay, W, LINK, Config(), inputs)
    beside = step_parts(sync, lay, W, LINK, Config(), {**inputs, "ps_stolen_s": 3.2e-3})
    assert beside["compute_s"] == pytest.approx(plain_sync["compute_s"] + 3.2e-3, rel=1e-12)
    assert beside["step_s"] == pytest.approx(plain_sync["step_s"] + 3.2e-3, rel=1e-12)
    assert beside["comm_s"] == pytest.approx(plain_sync["comm_s"], rel=1e-12)
    # a worker's guard is its optimizer part, neither compute nor communication, in both modes
    for strategy in (cls, sync):
        base = step_parts(strategy, lay, W, LINK, Config(), inputs)
        guarded = step_parts(strategy, lay, W, LINK, Config(), {**inputs, "ps_guard_s": 1e-3})
        assert guarded["optimizer_s"] == pytest.approx(base["optimizer_s"] + 1e-3, rel=1e-12)
        assert guarded["step_s"] == pytest.approx(base["step_s"] + 1e-3, rel=1e-12)
        assert (guarded["compute_s"], guarded["comm_s"]) == pytest.approx((base["compute_s"], base["comm_s"]),
                                                                           rel=1e-12)


def test_the_loops_async_compute_prices_the_workers_the_two_workers_tables_price():
    """plan_ps.loop_stolen: the loop's 2-worker measurement for ps-async at n = 2 and 3 (the 2 workers'
    tables), not at n = 1, not at 4 and more where the profile holds the 4 workers' table (at any n
    >= 2 where it does not), not for another strategy, and not from a profile without it."""
    from paratrain.bench.plan_ps import loop_stolen

    prof = {"loop_ps_async_stolen_s": {"ps-async": 2.5e-3}, "ps_round_trips_loaded": {"points": []},
            "ps_round_trips_loaded_4": {"points": []}}
    assert [loop_stolen(prof, n, "ps-async") for n in (1, 2, 3, 4, 8)] == [None, 2.5e-3, 2.5e-3, None, None]
    two_only = {k: v for k, v in prof.items() if k != "ps_round_trips_loaded_4"}
    assert [loop_stolen(two_only, n, "ps-async") for n in (2, 4, 8)] == [2.5e-3, 2.5e-3, 2.5e-3]
    assert loop_stolen(prof, 2, "ps-sync") is None
    assert loop_stolen({"ps_round_trips_loaded": {"points": []}}, 2, "ps-async") is None
    assert loop_stolen({**prof, "loop_ps_async_stolen_s": {}}, 2, "ps-async") is None  # its run failed
    # since version 33: loop_ps_stolen_s, each PS strategy's own (ps-sync's too); the older key is not read then
    new = {**prof, "loop_ps_stolen_s": {"ps-async": 3e-3, "ps-sync": 1e-3}}
    assert [loop_stolen(new, 2, s) for s in ("ps-async", "ps-sync")] == [3e-3, 1e-3]
    assert loop_stolen(new, 4, "ps-sync") is None
    assert loop_stolen({**new, "loop_ps_stolen_s": {}}, 2, "ps-async") is None


def test_loop_ps_is_each_jobs_compute_less_its_rounds_side_by_side_one_thread_runs(monkeypatch, capsys):
    """profile_runs_ps.loop_ps with the runs stubbed, ps-async's alone: each round runs ps-async with 2
    workers of the recipe's batch (global batch 2 B, one server), then 2 one-thread single runs of
    batch B at once; the answer is the median over the rounds of the job's timed compute (data +
    forward + backward + compute, not its exchange, idle or optimizer; the mean of every worker that timed a
    step, rank 0 or not) less its own round's side-by-side mean, at least 0. A recipe the strategy
    refuses (sync BatchNorm), a failed job or one that timed no step leaves it out with a line; a
    failed side-by-side run leaves every strategy out. profile_runs_ps.loop_ps answers with it the
    workers' guard: the median over the rounds of the job's mean optimizer time (its timed workers);
    a line gives each round's job and side-by-side compute beside the term;
    by default for ps-sync too, its own job in each round before the side-by-side runs. With the
    recipe's BatchNorm synchronised, ps-sync's compute is no term (its job timed the layers' meetings as
    compute, which the plan prices apart), while its guard stays."""
    import math
    import threading
    from pathlib import Path

    from paratrain.bench import report, runner, sweep
    from paratrain.bench.profile_runs_ps import loop_ps, ps_loop_applies

    def loop_ps_async_stolen(*args, **kwargs):  # ps-async's compute alone
        return loop_ps(*args, strategies=("ps-async",), **kwargs)[0]

    recipe = str(Path(__file__).resolve().parents[2] / "configs" / "digits_cnn.toml")
    job = [12.0, 13.0, 11.5]  # ms of timed compute; the rounds' side-by-side means 8.0, 8.5, 9.0
    side = [7.0, 9.0, 8.0, 9.0, 8.5, 9.5]  # differences 4.0, 4.5, 2.5: median 4.0 (medians apart: 3.5)
    guard = [0.9, 0.5, 0.6]  # ms the job's workers time as optimizer: median 0.6 (the side-by-side runs' 1.3 unused)
    commands, state = {}, {"ok": True, "side_ok": True, "timed": "both"}
    together = threading.Barrier(2, timeout=10)  # the two single runs of a round run at once

    def run_cmd(cmd, log, timeout_s, env):
        if "ps-async" not in cmd and "ps-sync" not in cmd:
            together.wait()
        commands[cmd[cmd.index("--run-dir") + 1]] = cmd
        return 0, None

    def record(run_dir):
        cmd = commands[run_dir]
        k = int(run_dir.rsplit("-r", 1)[1])  # the plan's repeat: the round (job), 2 x round + copy (side by side)
        sync_job = "ps-sync" in cmd
        job_run = "ps-async" in cmd or sync_job
        ms = (job[k] - 1.0 if sync_job else job[k]) if job_run else side[k]  # ps-sync's 1 ms less
        # timing.breakdown's rows: compute = forward + backward + compute; the exchange and optimizer apart
        row = {"data_ms": 0.5, "compute_ms": ms - 0.5, "comm_ms": 6.0 if job_run else 0.0,
               "idle_ms": 0.5 if job_run else 0.0,  # a wait the answers leave out (a gated async worker's too)
               "optimizer_ms": (guard[k] - 0.2 * sync_job) if job_run else 1.3}
        row["step_ms"] = sum(row.values())
        untimed = {k: 0.0 for k in row}
        rows = [row]
        if job_run:  # two workers: rank 0 may time no step while the other steps on (a late start)
            rows = {"both": [row, row], "rank 1 only": [untimed, row], "none": [untimed, untimed]}[state["timed"]]
        return {"ok": state["ok"] if job_run else state["side_ok"], "units_per_step": 64, "per_rank_ms": rows,
                "rank0_timing_ms": {"data_ms": -99.0}, "train_step_ms": math.nan}  # rank 0's alone: unused

    monkeypatch.setattr(runner, "run_cmd", run_cmd)
    monkeypatch.setattr(sweep, "read_outcome", lambda plan, rc, run_dir: str(run_dir))
    monkeypatch.setattr(report, "run_record", record)
    sets = ("model.sync_batchnorm=false",)
    stolen, guards = loop_ps(recipe, None, sets, None, 64, 12, repeats=3, strategies=("ps-async",))
    assert stolen == pytest.approx({"ps-async": 4.0e-3}) and guards == pytest.approx({"ps-async": 0.6e-3})
    assert len(commands) == 9  # 3 rounds x (the job, 2 side by side)
    assert ("ps-async's compute in the loop: 12.0, 13.0, 11.5 ms a step in its job against 8.0, 8.5, 9.0 side by "
            "side, round by round: 4.0 ms a step taken by the exchanges") in capsys.readouterr().out
    for cmd in commands.values():
        assert "train.max_steps=12" in cmd
        if "ps-async" in cmd:
            assert "dist.nproc=2" in cmd and "train.batch_size=128" in cmd and "dist.num_ps=1" in cmd
        else:
            assert cmd[cmd.index("--strategy") + 1] == "single" and "train.batch_size=64" in cmd
            assert cmd[cmd.index("--threads") + 1] == "1"
    commands.clear()  # both PS strategies (the default): ps-sync's job computes 1 ms less, its guard 0.2 ms less
    stolen, guards = loop_ps(recipe, None, sets, None, 64, 12, repeats=3)
    assert stolen == pytest.approx({"ps-async": 4.0e-3, "ps-sync": 3.0e-3})  # differences 3.0, 3.5, 1.5
    assert guards == pytest.approx({"ps-async": 0.6e-3, "ps-sync": 0.4e-3})
    assert len(commands) == 12 and sum("ps-sync" in cmd for cmd in commands.values()) == 3
    commands.clear()  # sync BatchNorm: ps-sync's job ran (its guard is kept), its compute is no term
    stolen, guards = loop_ps(recipe, None, sets, None, 64, 12, repeats=3, synced_batchnorm=True)
    assert stolen == pytest.approx({"ps-async": 4.0e-3}) and "ps-sync" not in stolen
    assert guards == pytest.approx({"ps-async": 0.6e-3, "ps-sync": 0.4e-3}) and len(commands) == 12
    assert "ps-sync's compute in the loop: not a term" in capsys.readouterr().out
    job[:] = [8.0, 8.0, 8.0]  # no slower than side by side: 0, not a negative term
    commands.clear()
    assert loop_ps_async_stolen(recipe, None, sets, None, 64, 12, repeats=3) == {"ps-async": 0.0}
    commands.clear()
    assert loop_ps_async_stolen(recipe, None, (), None, 64, 12) == {} and not commands  # sync BatchNorm: refused
    assert "ps-async's compute in the loop: left out (sync_batchnorm needs workers that step together" in \
        capsys.readouterr().out
    state["timed"] = "rank 1 only"  # rank 0 started late and timed no step: the other worker's steps
    commands.clear()
    job[:] = [12.0]
    stolen, guards = loop_ps(recipe, None, sets, None, 64, 12, strategies=("ps-async",))
    assert stolen == pytest.approx({"ps-async": 4.0e-3}) and guards == pytest.approx({"ps-async": 0.9e-3})
    commands.clear()
    assert loop_ps_async_stolen(recipe, None, sets, None, 64, 12) == pytest.approx({"ps-async": 4.0e-3})
    state["timed"] = "none"  # a job that timed no step on any worker
    assert loop_ps_async_stolen(recipe, None, sets, None, 64, 12) == {}
    assert "left out (its job timed no step" in capsys.readouterr().out
    state.update(timed="both", side_ok=False)  # a failed side-by-side run: nothing to subtract
    commands.clear()
    assert loop_ps_async_stolen(recipe, None, sets, None, 64, 12) == {}
    assert "left out (a one-thread run side by side failed" in capsys.readouterr().out
    state.update(ok=False, side_ok=True)  # a failed job: left out with a line (the micro-benchmark prices it)
    commands.clear()
    assert loop_ps(recipe, None, sets, None, 64, 12, strategies=("ps-async",)) == ({}, {}) and len(commands) == 1
    assert "ps-async's compute in the loop: left out (its job failed" in capsys.readouterr().out
    # measured only where the job's 3 processes outnumber the cores, so its workers compute on one thread
    assert [ps_loop_applies(c) for c in (1, 2, 3, 16)] == [False, True, False, False]


def test_fsdps_measured_step_replaces_its_optimizer_share_and_the_norms_collective():
    """With ``step_path_s`` (FSDP2's step above allreduce's, measured at 2 ranks) the step's optimizer
    part is O s / n + path + O / 2, which holds the guard's all-reduce at 2 ranks; beyond 2, the
    ring's difference and the meeting's beyond the paths' table are added."""
    rows = [[MIB, 1e-3, 3e-3, 2e-3]]
    kw = dict(unit_bytes=[0, MIB], overlap=False, unit_path_s=unit_paths(rows))
    two = lambda c: 5e-4  # noqa: E731 (2 processes)
    four = lambda c: 2e-3  # noqa: E731 (4 processes on 2 cores)
    compute = W.forward_s + W.backward_s  # data 0
    at2 = predict_fsdp(W, 2, LINK, meeting_s=two, path_meeting_s=two, step_path_s=1.5e-3, **kw)
    assert at2.step_s == pytest.approx(compute + (1e-3 + 3e-3) + 0.002 / 2 + 1.5e-3 + 0.002 / 2, rel=1e-12)
    before = predict_fsdp(W, 2, LINK, meeting_s=two, path_meeting_s=two, **kw)  # without it: the norm's meeting
    assert before.step_s == pytest.approx(compute + (1e-3 + 3e-3) + 0.002 / 2 + 5e-4, rel=1e-12)
    # 4 processes: the norm's ring all-reduce at 4 less at 2, and the 4 processes' meeting beyond the 2's
    at4 = predict_fsdp(W, 4, LINK, meeting_s=four, path_meeting_s=two, step_path_s=1.5e-3, **kw)
    base4 = predict_fsdp(W, 4, LINK, meeting_s=four, path_meeting_s=two, **kw)  # its norm: the 4's meeting
    norm4 = 1.5e-3 + 0.002 / 2 + ring_allreduce_s(4, 4, LINK) - ring_allreduce_s(4, 2, LINK) + (2e-3 - 5e-4)
    assert at4.step_s == pytest.approx(base4.step_s - max(ring_allreduce_s(4, 4, LINK), 2e-3) + norm4, rel=1e-12)
    # the ring model where collectives overlap compute (another machine) does not use the path
    assert predict_fsdp(W, 2, LINK, unit_bytes=[0, MIB], step_path_s=1.5e-3).step_s == pytest.approx(
        predict_fsdp(W, 2, LINK, unit_bytes=[0, MIB]).step_s, rel=1e-12)


def test_a_measured_fsdp_step_is_fsdps_optimizer_part_and_replaces_the_one_process_dispatch():
    cls = SimpleNamespace(cost_model=SHARDED_PARAMETERS, synchronous=True)
    inputs = {"units": [0, MIB], "sharded_optimizer_s": 3e-3, "sharded_norm_s": 1e-3,
              "fsdp_units": [[MIB, 1e-3, 3e-3, 2e-3]], "meetings": [[0.001, 5e-4]], "path_meetings": [[0.001, 5e-4]]}
    lay = Layout("fsdp", 2, {})
    old = step_parts(cls, lay, W, LINK, Config(), inputs, overlap=False)
    new = step_parts(cls, lay, W, LINK, Config(), {**inputs, "fsdp_step_s": 1.5e-3}, overlap=False)
    assert old["optimizer_s"] == pytest.approx(0.002 / 2 + 3e-3 + 1e-3, rel=1e-12)  # the dispatch terms
    assert new["optimizer_s"] == pytest.approx(0.002 / 2 + 1.5e-3 + 0.002 / 2, rel=1e-12)
    # the step: the dispatch (4 ms) and the norm's meeting (0.5 ms) out, the measured step's 2.5 ms in
    assert new["step_s"] == pytest.approx(old["step_s"] - 4e-3 - 5e-4 + 1.5e-3 + 1e-3, rel=1e-12)
    assert new["compute_s"] == old["compute_s"]
    overlapped = [step_parts(cls, lay, W, LINK, Config(), {**inputs, "fsdp_step_s": x}) for x in (None, 1.5e-3)]
    assert overlapped[0] == overlapped[1]  # another machine's link: the dispatch terms stay
    # 4 processes at compute scale 2 (2 cores): the arithmetic's O s / n is scaled, the path's O / 2 not;
    # the norm's ring all-reduce at 4 less at 2 and the 4 processes' meeting beyond the 2's (2 - 0.5 ms)
    four = {**inputs, "fsdp_step_s": 1.5e-3, "meetings": [[0.001, 2e-3]]}
    at4 = step_parts(cls, Layout("fsdp", 4, {}), W, LINK, Config(), four, overlap=False, compute_scale=2.0)
    ring = ring_allreduce_s(4, 4, LINK) - ring_allreduce_s(4, 2, LINK)
    assert at4["optimizer_s"] == pytest.approx(0.002 * 2 / 4 + 1.5e-3 + 0.002 / 2 + ring + 1.5e-3, rel=1e-12)
    # a path below -O / 2 (a large model's sharded step faster than allreduce's): no negative time
    fast = step_parts(cls, lay, W, LINK, Config(), {**inputs, "fsdp_step_s": -0.01}, overlap=False)
    assert fast["optimizer_s"] == pytest.approx(0.002 / 2, rel=1e-12)
    assert fsdp_step_path_s(W, 2, LINK, -0.01) == 0.0


def test_the_sharded_step_microbenchmark_times_fsdps_real_step(monkeypatch):
    """time_sharded_step of ``fsdp`` on a one-rank group: the guard's norm made 10 ms slower is
    measured (FSDP's real step is timed, its gradients DTensor shards); between 2 processes, for
    digits_cnn's shapes, finite and under a second."""
    import torch.distributed as dist

    from paratrain.bench.microbench_sharded import measured_sharded_step, optimizer_spec, time_sharded_step
    from paratrain.strategies.fsdp import FSDP

    shapes = [[10], [10, 64], [64], [64, 32, 3, 3], [16, 1, 3, 3]]
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    sgd = torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=5e-4)
    spec = {**optimizer_spec(sgd), "shapes": shapes, "strategy": "fsdp", "threads": 1}
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        norm = FSDP._grad_norm
        monkeypatch.setattr(FSDP, "_grad_norm", lambda self, *a, **kw: (time.sleep(0.01), norm(self, *a, **kw))[1])
        threads = torch.get_num_threads()
        assert 0.009 <= time_sharded_step(spec, repeats=20, warmup=1) < 0.5
        with pytest.raises(UsageError):
            time_sharded_step({**spec, "strategy": "allreduce"}, repeats=2, warmup=0)
        assert dist.get_world_size() == 1 and torch.get_num_threads() == threads
    finally:
        dist.destroy_process_group()
    monkeypatch.undo()
    got = measured_sharded_step("fsdp", params, sgd, timeout_s=150)
    assert math.isfinite(got) and abs(got) < 1


class SlowAsyncSGD(torch.optim.SGD):
    """SGD whose step sleeps 30 ms first (importable: the benchmark's server process builds it)."""

    def step(self, closure=None):
        time.sleep(0.03)
        return super().step(closure)


def test_the_loaded_exchange_microbenchmark_times_each_compute_lengths_exchanges():
    """Two workers and a server in three processes: the idle phase's mean and one mean per stretch of
    compute, in order; each exchange holds the server's update (30 ms slower here: a sleep a busy
    machine does not shorten); and for each stretch what the compute took longer among exchanges
    than side by side (at least 0). The workers' compute is a fixed number of products, which a
    busy core stretches; the counts follow the exchange's estimate."""
    from paratrain.bench.microbench_meetings import products_per_s
    from paratrain.bench.microbench_rpc import _exchanges, _products, measured_ps_round_trips_loaded

    assert _exchanges(0.001, 150) == 150 and _exchanges(0.016, 150) == 56 and _exchanges(0.064, 150) == 20
    assert _exchanges(0.0, 150, exchange_s=0.02) == 50  # a larger model's slower exchange: fewer of them
    a = torch.randn(64, 64)
    assert products_per_s(a) > 0
    cpu0 = time.process_time()
    took = _products(1000, a)
    # computing, not sleeping: a sleep takes microseconds of CPU, 1000 products of 64 x 64 some ms of it
    # (the CPU time is the work's, whatever share of a busy machine's cores this process gets: 49 ms of
    # a 102 ms stretch in a fresh-clone run with a core kept busy, 2026-11-28)
    assert took > 0 and time.process_time() - cpu0 >= 0.005
    params = [torch.nn.Parameter(torch.randn(100, 10))]
    got = measured_ps_round_trips_loaded(params, SlowAsyncSGD(params, lr=0.5), computes=(0.001, 0.002),
                                         exchanges=20, warmup=1, timeout_s=240)
    assert [c for c, _ in got["points"]] == [0.001, 0.002] and [c for c, _ in got["stolen"]] == [0.001, 0.002]
    assert 0.03 <= got["idle_s"] < 0.5 and all(0.03 <= s < 0.5 for _, s in got["points"])
    assert all(0 <= s < 0.5 for _, s in got["stolen"])
    with pytest.raises(UsageError):
        measured_ps_round_trips_loaded(params, SlowAsyncSGD(params, lr=0.5), computes=(0.0,))


def test_the_loaded_exchanges_answer_is_the_means_and_stolen_is_loaded_less_alone_at_least_0():
    from paratrain.bench.microbench_rpc import _loaded_result

    # two workers; per worker [exchanges (idle, then one list per stretch), alone, loaded]
    got = [[[[2e-3, 4e-3], [3e-3], [5e-3]], [[1.0e-3], [4.0e-3]], [[1.6e-3], [3.0e-3]]],
           [[[3e-3], [5e-3], [7e-3]], [[1.2e-3], [4.2e-3]], [[1.8e-3], [3.2e-3]]]]
    out = _loaded_result((0.001, 0.004), got)
    assert out["idle_s"] == pytest.approx(3e-3) and out["points"] == [[0.001, pytest.approx(4e-3)],
                                                                       [0.004, pytest.approx(6e-3)]]
    # 1 ms: loaded 1.7 less alone 1.1; 4 ms: the loaded stretches ran faster (3.1 < 4.1): 0, not -1 ms
    assert out["stolen"] == [[0.001, pytest.approx(0.6e-3)], [0.004, 0.0]]


def test_an_async_ps_layout_reads_the_exchange_measured_with_its_number_of_workers():
    """plan_ps.loaded_exchange: the table measured with the most workers at most n (2 below 2, 4 above
    4, held flat); a profile without 4 workers' (version 23) keeps 2's everywhere; none: None. And
    the plan's prediction at N = 4 reads the 4 workers' table: with ptb_small's v23 profile and the
    4-worker exchange measured on 2026-11-27 (48 ms against 27 ms with 2), ps-async's step at N = 4
    grows by the difference at its compute, and at N = 2 it does not move."""
    two = {"workers": 2, "idle_s": 2e-3, "points": [[0.001, 3e-3], [0.064, 4e-3]]}
    four = {"workers": 4, "idle_s": 2e-3, "points": [[0.001, 6e-3], [0.064, 7e-3]]}
    prof = {"ps_round_trips_loaded": two, "ps_round_trips_loaded_4": four}
    assert [loaded_exchange(prof, n) is four for n in (1, 2, 3, 4, 8, 64)] == [False, False, False, True, True, True]
    assert loaded_exchange(prof, 1) is two and loaded_exchange(prof, 3) is two
    assert all(loaded_exchange({"ps_round_trips_loaded": two}, n) is two for n in (1, 2, 4, 8))
    assert loaded_exchange({}, 4) is None and loaded_exchange({"ps_round_trips_loaded_4": four}, 2) is four

    import json
    from pathlib import Path

    from paratrain.bench.costmodel import Link
    from paratrain.bench.plan import Layout, predict_layout
    from paratrain.config import load

    root = Path(__file__).resolve().parents[2]
    stored = root / "benchmarks" / "results" / "plan-xeon" / "ptb_small-v23" / "profile.json"
    v23 = json.loads(stored.read_text())
    cfg = load(str(root / "configs" / "ptb_small.toml"), [])
    link = Link(name="measured", **v23["links"]["all_reduce"])
    measured4 = {"workers": 4, "idle_s": 0.0449, "points": [[0.001, 0.0484], [0.004, 0.0483], [0.016, 0.0507],
                                                            [0.064, 0.0485]]}
    v24 = {**v23, "ps_round_trips_loaded_4": measured4}

    def step(prof, n):
        return predict_layout(Layout("ps-async", n, {"num_ps": 1}, "ps-async"), prof, cfg, link,
                              on_this_machine=True, global_batch=None)["step_s"]

    assert step(v24, 2) == step(v23, 2)
    # at N = 4 the compute stretch is above the last point (0.064 s): both tables' last values, 48.5 - 26.1 ms
    last2 = v23["ps_round_trips_loaded"]["points"][-1][1]
    assert step(v24, 4) - step(v23, 4) == pytest.approx(0.0485 - last2, rel=1e-9)


def test_a_towers_forward_measured_with_its_join_prices_no_join_copy_on_this_machine():
    """plan.predict_layout on a stored profile (gpt_wt2, version 25: the towers' forwards alone,
    its logits joined by a measured memory copy): marked ``joined`` (version 26),
    the towers' forward is the measurement, the join's copy is not added to it again; on another
    cluster (own devices) the measurement is not used, joined or not."""
    import json
    from pathlib import Path

    from paratrain.bench.costmodel import PRESETS
    from paratrain.bench.costmodel_sharded import copy_seconds
    from paratrain.bench.plan import Layout, predict_layout
    from paratrain.config import load

    root = Path(__file__).resolve().parents[2]
    v25 = json.loads((root / "benchmarks" / "results" / "plan-xeon" / "gpt_wt2-v25d" / "profile.json").read_text())
    v26 = {**v25, "towers_forward_threads": {**v25["towers_forward_threads"], "joined": True}}
    cfg = load(str(root / "configs" / "gpt_wt2.toml"), [])
    link = Link(name="measured", **v25["links"]["all_reduce"])

    def row(prof, n, on_this_machine=True, at=link):
        return predict_layout(Layout("replicate", n, {}, "replicate (towers)"), prof, cfg, at,
                              on_this_machine=on_this_machine, global_batch=None)

    join = copy_seconds(v25["memory_copy"])(2 * v25["output_bytes"])
    assert join > 0.05  # gpt_wt2's logits: a copy of about a tenth of its step
    assert row(v25, 2)["step_s"] - row(v26, 2)["step_s"] == pytest.approx(join, rel=1e-9)
    assert row(v26, 2)["comm_s"] == pytest.approx(0, abs=1e-12)
    assert row(v25, 2)["comm_s"] == pytest.approx(join, rel=1e-9)
    assert row(v26, 2)["compute_s"] == row(v25, 2)["compute_s"]  # the same measured forward
    for n in (2, 8):  # own devices: the links' formula, whichever the profile measured
        assert row(v26, n, False, PRESETS["nvlink"])["step_s"] == row(v25, n, False, PRESETS["nvlink"])["step_s"]


def test_an_async_workers_compute_among_exchanges_is_the_measured_stolen_time_linear_and_flat_outside():
    """plan_ps.ps_compute_stolen_s against hand computation, and predict_ps: the stolen seconds join
    an async worker's compute and step at n > 1, not a synchronous PS's, not one device's."""
    from paratrain.bench.plan_ps import predict_ps, ps_compute_stolen_s

    loaded = {**LOADED, "stolen": [[0.001, 1e-3], [0.004, 1.6e-3], [0.016, 2.2e-3]]}
    assert ps_compute_stolen_s(loaded, 0.0025) == pytest.approx(1.3e-3, rel=1e-12)  # halfway: 1 + 0.6 / 2 ms
    assert ps_compute_stolen_s(loaded, 0.010) == pytest.approx(1.9e-3, rel=1e-12)
    assert ps_compute_stolen_s(loaded, 0.0005) == pytest.approx(1e-3) and ps_compute_stolen_s(loaded, 1.0) == 2.2e-3
    assert ps_compute_stolen_s(LOADED, 0.01) == 0.0 and ps_compute_stolen_s(None, 0.01) == 0.0  # not measured
    with pytest.raises(UsageError):
        ps_compute_stolen_s({"stolen": [[0.0, 1e-3]]}, 0.01)
    plain = predict_ps(W, 2, 1, LINK, synchronous=False)
    stolen = predict_ps(W, 2, 1, LINK, synchronous=False, stolen_s=2e-3)
    assert stolen.step_s - plain.step_s == pytest.approx(2e-3, rel=1e-9)
    assert stolen.compute_s - plain.compute_s == pytest.approx(2e-3, rel=1e-9)
    one = [predict_ps(W, 1, 1, LINK, synchronous=False, stolen_s=x).step_s for x in (2e-3, 0.0)]
    assert one[0] == one[1]  # one worker: no other exchanges
    # synchronous: the caller passes only the loop's measurement of its job (beside the server's process)
    assert predict_ps(W, 2, 1, LINK, stolen_s=2e-3).step_s == pytest.approx(predict_ps(W, 2, 1, LINK).step_s + 2e-3)


def test_the_profiles_towers_forward_builds_the_towers_batch_and_skips_a_task_that_cannot_give_it(capsys):
    """profile.towers_forward: the task is built for towers x the recipe's batch; its first step's loss
    goes through CPUTowers split along the task's batch dimension (0 for a task without one); a task
    that cannot be built for that batch, or gives no step, leaves the measurement out with a line."""
    from paratrain.bench.microbench_towers import towers_forward
    from paratrain.errors import UsageError
    from paratrain.tasks.base import TrainStep

    shapes, built = [], []

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 1)

        def forward(self, x):
            shapes.append(tuple(x.shape))
            return self.lin(x)

    class Task:  # no batch_dim: a user's task need not have one
        def __init__(self, batch):
            self.batch = batch

        def train_steps(self, epoch, index):
            yield TrainStep([torch.randn(self.batch, 3)], float(self.batch))

        def loss(self, model, mb):
            return model(mb).sum(), mb.shape[0]

    def task_of(batch):
        built.append(batch)
        return Task(batch)

    got = towers_forward(Task(8), Model(), torch.device("cpu"), lambda: None, task_of, 2, 8)
    assert built == [16] and got["towers"] == 2 and got["joined"] is True and got["seconds"] > 0
    assert set(shapes) == {(8, 3)}  # each tower its half of the 16, along dimension 0

    def refuses(batch):
        raise UsageError(f"the training split has fewer than one global batch of {batch}")

    class Empty(Task):
        def train_steps(self, epoch, index):
            return iter(())

    for factory in (refuses, Empty):
        assert towers_forward(Task(8), Model(), torch.device("cpu"), lambda: None, factory, 2, 8) is None
        assert "CPU towers' forward not measured" in capsys.readouterr().out


def test_an_async_workers_lost_compute_is_the_loops_measurement_where_there_is_one():
    from paratrain.bench.plan_ps import worker_stolen_s

    loaded = {"stolen": [[0.001, 0.0002], [0.004, 0.0008]]}
    # no loop measurement: the micro-benchmark's points, linear between them: 0.0002 + (0.0025 - 0.001) * 0.2
    assert worker_stolen_s(None, loaded, 0.0025) == pytest.approx(0.0005)
    # the loop measured it: its value, 0 included (the loop found no loss; no fall back to the points)
    assert worker_stolen_s(0.0023, loaded, 0.0025) == 0.0023
    assert worker_stolen_s(0.0, loaded, 0.0025) == 0.0
    assert worker_stolen_s(None, None, 0.0025) == 0.0


def test_a_sync_servers_messages_move_their_copies_side_by_side_on_this_machine_only(monkeypatch):
    """plan.predict_layout on the stored ptb_small profile (the 2-vCPU EPYC, 2026-11-28): ps-sync at
    N = 2, K = 1 on this machine's 2 cores moves the copies of its two workers' messages side by
    side. The server's phase loses half of its two messages' copy cost, ``2 nbytes beta_rpc / 2``,
    each way: the step is ``2 nbytes beta_rpc`` (19.8 ms) shorter than with the messages in turn; on
    a preset cluster (the server's link carries them in turn) nothing moves. ptb_small's copy
    fraction is the echo's beta over the exchange's, 0.88, by hand from the profile."""
    import json
    from pathlib import Path

    import paratrain.bench.plan as plan
    from paratrain.bench.costmodel import PRESETS
    from paratrain.bench.plan_ps import ps_copy_fraction, ps_message_link, ps_streams
    from paratrain.config import load

    root = Path(__file__).resolve().parents[2]
    stored = root / "benchmarks" / "results" / "plan-amd" / "ptb_small-amd-v31-runoff" / "profile.json"
    prof = json.loads(stored.read_text())
    cfg = load(str(root / "configs" / "ptb_small.toml"), [])
    link = Link(name="measured", **prof["links"]["all_reduce"])
    rpc = Link(name="rpc", **prof["links"]["rpc"])
    nbytes = 18612800  # ptb_small's parameters, float32
    exchange = ps_message_link(rpc, prof["ps_round_trip_s"], prof["ps_update_s"]["async"], nbytes)
    by_hand = (prof["ps_round_trip_s"] - prof["ps_update_s"]["async"] - 2 * rpc.alpha_s) / (2 * nbytes)
    assert exchange.beta_s_per_byte == pytest.approx(by_hand, rel=1e-12)
    assert ps_copy_fraction(rpc, exchange) == pytest.approx(rpc.beta_s_per_byte / by_hand, rel=1e-12)
    assert ps_copy_fraction(rpc, exchange) == pytest.approx(0.88, abs=0.01)
    def at(alpha, beta):
        return Link(name="x", alpha_s=alpha, beta_s_per_byte=beta, gamma_s_per_byte=0.0)

    assert ps_copy_fraction(at(0.0, 1.0), at(0.0, 0.5)) == 1.0  # at most 1
    assert ps_copy_fraction(rpc, at(1e-3, 0.0)) == 0.0  # no per-byte cost
    assert [ps_streams(2, k) for k in (1, 2, 3)] == [2, 1, 1] and ps_streams(16, 3) == 5

    def step(at, here):
        return plan.predict_layout(Layout("ps-sync", 2, {"num_ps": 1}, "ps-sync K=1"), prof, cfg, at,
                                   on_this_machine=here, global_batch=None)["step_s"]

    side_by_side, cluster = step(link, True), step(PRESETS["eth25"], False)
    monkeypatch.setattr(plan, "ps_streams", lambda cores, servers: 1)
    in_turn = step(link, True)
    assert in_turn - side_by_side == pytest.approx(2 * nbytes * rpc.beta_s_per_byte, rel=1e-9)
    assert 2 * nbytes * rpc.beta_s_per_byte == pytest.approx(0.0198, abs=1e-4)
    monkeypatch.undo()
    monkeypatch.setattr(plan, "ps_copy_fraction", lambda rpc, exchange: 0.0)  # no copies: in turn here too
    assert step(link, True) == pytest.approx(in_turn, rel=1e-12)
    # a cluster's server takes its messages in turn: neither the cores nor the copies move its step
    assert step(PRESETS["eth25"], False) == pytest.approx(cluster, rel=1e-12)
    monkeypatch.setattr(plan, "ps_streams", lambda cores, servers: 64)
    monkeypatch.setattr(plan, "ps_copy_fraction", lambda rpc, exchange: 1.0)
    assert step(PRESETS["eth25"], False) == pytest.approx(cluster, rel=1e-12)
