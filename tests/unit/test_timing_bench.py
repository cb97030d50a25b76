"""Step-time breakdown arithmetic, the bench's run plan and its scaling tables (no processes)."""
from __future__ import annotations

import math
import random
import statistics

import pytest
import torch

from paratrain.bench.report import markdown, run_record, scaling_rows
from paratrain.bench.sweep import BenchSpec, RunOutcome, RunPlan, plan_runs, train_command
from paratrain.bench.timing import (RankTimer, StepClock, breakdown, split_idle, successive_difference_sd,
                                   summarise_ranks)
from paratrain.bench.validate import cpu_share, validate, workload_from_record
from paratrain.bench.costmodel import Link
from paratrain.errors import UsageError


class FakeClock(StepClock):
    """Marks are the numbers we pass in."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))


def test_split_idle_takes_the_wait_for_the_last_rank_out_of_comm():
    # rank arrives 3 ms early (max arrival 10, own 7): 3 of its 5 ms of comm are idle
    assert split_idle([0.005], [0.007], [0.010]) == pytest.approx([0.003])
    # the last rank to arrive has no idle time
    assert split_idle([0.005], [0.010], [0.010]) == [0.0]
    # idle never exceeds the measured comm; NaN arrivals (no collective) give 0
    assert split_idle([0.002, 0.004], [0.0, math.nan], [0.010, 0.010]) == [0.002, 0.0]


def test_rank_timer_sums_spans_and_splits_idle():
    t = RankTimer(FakeClock())
    # step 0: data 1, forward 2, backward 3, comm 4 (from 6 to 10), optimizer 1; step ends at 12 (1 s overhead)
    spans = [("data", 0, 1), ("forward", 1, 3), ("backward", 3, 6), ("comm", 6, 10), ("optimizer", 10, 11)]
    t.add(0, 0, 12, spans, (6, 10))
    # step 1 starts at 12: data 1, forward 1, backward 1, comm 15..16 (arrival = 15 - 10 = 5)
    t.add(1, 12, 17, [("data", 12, 13), ("forward", 13, 14), ("backward", 14, 15), ("comm", 15, 16),
                      ("optimizer", 16, 17)], (15, 16))
    arrivals = t.flush()
    assert arrivals == [6, 5]  # step 0 from its start, step 1 from the end of step 0's all-reduce
    means = t.finish_interval(arrivals, [8, 5])  # another rank arrived at 8 in step 0
    assert means["idle_ms"] == pytest.approx(1000 * (2 + 0) / 2)
    assert means["comm_ms"] == pytest.approx(1000 * (2 + 1) / 2)
    assert means["step_ms"] == pytest.approx(1000 * (12 + 5) / 2)
    s = t.summary()
    assert s["measured_steps"] == 2 and s["data_ms"] == pytest.approx(1000.0)
    # local time (step less comm and idle): 12 - 4 = 8 s and 5 - 1 = 4 s: mean 6, standard deviation 2
    assert s["local_sd_ms"] == pytest.approx(2000.0)
    # from step to step: |4 - 8| = 4 s, times sqrt(pi) / 2
    assert s["local_jitter_ms"] == pytest.approx(1000.0 * 4 * math.sqrt(math.pi) / 2)
    b = breakdown(s)
    # the parts and "other" add up to the step exactly
    assert sum(v for k, v in b.items() if k != "step_ms") == pytest.approx(b["step_ms"])
    assert b["other_ms"] == pytest.approx(500.0)


def test_jitter_leaves_out_the_step_after_a_pause():
    t = RankTimer(FakeClock())
    # local times 1, 3 | pause (a checkpoint) | 10, 12: only the differences 2 and 2 count, not 7
    for i, (a, b) in enumerate([(0, 1), (1, 4)]):
        t.add(i, a, b, [("forward", a, b)], None)
    t.reset_arrival()
    for i, (a, b) in enumerate([(20, 30), (30, 42)], start=2):
        t.add(i, a, b, [("forward", a, b)], None)
    t.finish_interval(t.flush(), [math.nan] * 4)  # resolved after the pause, as the loop logs
    assert t.summary()["local_jitter_ms"] == pytest.approx(1000.0 * 2 * math.sqrt(math.pi) / 2)


def test_successive_difference_sd_by_hand():
    # 0, 2, 0, 2: every difference is 2, so sqrt(pi) / 2 * 2
    assert successive_difference_sd([0.0, 2.0, 0.0, 2.0]) == pytest.approx(math.sqrt(math.pi))
    # one spike of 1 among 0s: two differences of 1 in four, mean 1/2
    assert successive_difference_sd([0.0, 0.0, 1.0, 0.0, 0.0]) == pytest.approx(math.sqrt(math.pi) / 4)
    assert successive_difference_sd([5.0]) == 0.0 and successive_difference_sd([]) == 0.0


def test_successive_difference_sd_leaves_out_a_drift():
    # a machine slowing by 1 ms a step over 30 steps: the plain standard deviation counts the ramp
    # (8.66 ms), the step-to-step spread only its 1 ms steps
    ramp = [0.1 + 0.001 * i for i in range(30)]
    assert statistics.pstdev(ramp) == pytest.approx(0.008655, rel=1e-3)
    assert successive_difference_sd(ramp) == pytest.approx(0.001 * math.sqrt(math.pi) / 2)
    # the same noise on top of the ramp or without it: the estimate moves by less than the ramp's step
    rng = random.Random(0)
    noise = [rng.gauss(0.0, 0.005) for _ in range(2000)]
    flat, drifting = successive_difference_sd(noise), successive_difference_sd([a + 0.00001 * i for i, a in
                                                                                enumerate(noise)])
    assert flat == pytest.approx(0.005, rel=0.05)  # normal noise: the standard deviation
    assert abs(drifting - flat) < 0.00002


def test_successive_difference_sd_prices_two_ranks_wait_exactly():
    # n = 2: straggle = sd * E[max of 2 normals] = sd / sqrt(pi) = mean |x[i+1] - x[i]| / 2, the mean wait
    # of the faster of two independent draws, here of a non-normal noise (exponential)
    from paratrain.bench.straggler import straggle_s

    rng = random.Random(1)
    xs = [rng.expovariate(100.0) for _ in range(20000)]
    pairs = [(rng.expovariate(100.0), rng.expovariate(100.0)) for _ in range(20000)]
    wait = statistics.fmean(max(a, b) - (a + b) / 2 for a, b in pairs)  # E|X1 - X2| / 2 = 1 / (2 * 100)
    assert straggle_s(2, successive_difference_sd(xs)) == pytest.approx(wait, rel=0.05)
    assert wait == pytest.approx(0.005, rel=0.05)


def test_warmup_intervals_are_not_counted():
    t = RankTimer(FakeClock())
    t.add(0, 0, 1, [("forward", 0, 1)], None)
    t.finish_interval(t.flush(), [math.nan], count=False)
    assert t.summary()["measured_steps"] == 0
    t.add(1, 1, 3, [("forward", 1, 3)], None)  # one counted 2 s step: the 1 s warm-up step adds no spread
    t.finish_interval(t.flush(), [math.nan])
    assert t.summary()["local_sd_ms"] == 0.0 and t.summary()["local_jitter_ms"] == 0.0


def test_summarise_ranks_skew_and_slowest():
    fast = {"step_ms": 10, "forward_ms": 3, "backward_ms": 3, "compute_ms": 0, "comm_ms": 2, "idle_ms": 2,
            "data_ms": 0, "optimizer_ms": 0}
    slow = dict(fast, forward_ms=4, backward_ms=4, idle_ms=0)
    s = summarise_ranks([fast, slow])
    assert s["slowest_rank"] == 1
    assert s["compute_skew"] == pytest.approx((8 - 6) / 7)
    assert s["mean"]["compute_ms"] == pytest.approx(7)


def test_plan_dedupes_baselines_and_skips_impossible_strong_points():
    spec = BenchSpec(config="c.toml", strategies=("single", "allreduce"), nprocs=(1, 2, 3), batches=(20,),
                     repeats=2)
    plans = plan_runs(spec, recipe_batch=99)
    keys = [p.key for p in plans if p.repeat == 0]
    # weak: single b20, allreduce b20/b40/b60; strong: allreduce 20 at n=1 (same), n=2; n=3 does not divide 20
    assert keys == [("single", 1, 20, None), ("allreduce", 1, 20, None), ("allreduce", 2, 40, None),
                    ("allreduce", 3, 60, None), ("allreduce", 2, 20, None)]
    assert len(plans) == 2 * len(keys)


def test_validate_model_adds_its_runs():
    spec = BenchSpec(config="c.toml", strategies=("allreduce",), nprocs=(2,), scaling=("weak",), validate_model=True)
    keys = {p.key for p in plan_runs(spec, recipe_batch=10)}
    assert {("single", 1, 10, 1), ("allreduce", 1, 10, None), ("allreduce", 4, 40, None)} <= keys


def test_train_command_of_each_strategy(tmp_path):
    spec = BenchSpec(config="c.toml", steps=50, warmup_steps=10, num_ps=2)
    """N replicas as each strategy asks for them (Strategy.dist_for_replicas): processes, towers, servers."""
    cmd = train_command(spec, RunPlan(strategy="ps-sync", n=3, global_batch=30), tmp_path)
    assert "dist.nproc=3" in cmd and "dist.num_ps=2" in cmd
    assert "train.timing_warmup_steps=10" in cmd and "train.log_every=10" in cmd and "train.max_steps=50" in cmd
    cmd = train_command(spec, RunPlan(strategy="replicate", n=2, global_batch=20), tmp_path)
    assert 'dist.devices="cpu:0,cpu:1"' in cmd and "dist.nproc=1" in cmd
    cmd = train_command(spec, RunPlan(strategy="single", n=1, global_batch=20), tmp_path)
    assert "dist.nproc=1" in cmd and not any("num_ps" in a or "devices" in a for a in cmd)


@pytest.mark.parametrize("kw, words", [({"strategies": ("nope",)}, "unknown strategy"),
                                       ({"nprocs": (0,)}, "--nproc"), ({"steps": 10, "warmup_steps": 10}, "--steps"),
                                       ({"scaling": ("diagonal",)}, "--scaling")])
def test_bad_specs(kw, words):
    with pytest.raises(UsageError, match=words):
        BenchSpec(config="c.toml", **kw)


# one rank's step-time summary: 2 data + (20 forward + 30 backward) compute + 12 comm + 4 idle + 6 optimizer
# = 74 ms of accounted parts in a 90 ms step
RANK = {"step_ms": 90.0, "data_ms": 2.0, "forward_ms": 20.0, "backward_ms": 30.0, "compute_ms": 0.0,
        "comm_ms": 12.0, "idle_ms": 4.0, "optimizer_ms": 6.0, "measured_steps": 10}


def _outcome(strategy, n, g, words_per_s, repeat=0, rc=0, rank1_compute_ms=None):
    """A finished run with a given throughput; the throughput clock's step is 100 ms; rank 1 (if any)
    computes ``rank1_compute_ms`` instead of 50 ms."""
    summary = {"words_per_s_after_warmup": words_per_s, "unit": "words", "train_step_ms": 100.0,
               "per_replica_batch": g // n, "threads_per_process": 1}
    ranks = [RANK] + [dict(RANK, forward_ms=(rank1_compute_ms or 50.0) - 30.0)] * (n - 1)
    return RunOutcome(RunPlan(strategy=strategy, n=n, global_batch=g, repeat=repeat), rc, None,
                      summary if rc == 0 else {}, ranks if rc == 0 else [])


def test_scaling_rows_speedup_efficiency_and_coverage():
    """Speedup and efficiency from given throughputs: the single-device baseline runs at 100 words/s
    (median of 90, 100, 130), 2 replicas at 180 (weak: median of 170, 180, 200; a failed run left out)
    and 150 (strong), allreduce on 1 replica at 95."""
    spec = BenchSpec(config="c.toml", nprocs=(1, 2), batches=(10,))
    outcomes = [_outcome("single", 1, 10, w, repeat=i) for i, w in enumerate((130.0, 90.0, 100.0))]
    outcomes += [_outcome("allreduce", 1, 10, 95.0)]
    outcomes += [_outcome("allreduce", 2, 20, w, repeat=i, rank1_compute_ms=70.0)
                 for i, w in enumerate((200.0, 170.0, 180.0))]
    outcomes += [_outcome("allreduce", 2, 20, 0.0, repeat=3, rc=1)]
    outcomes += [_outcome("allreduce", 2, 10, 150.0, rank1_compute_ms=70.0)]
    t = scaling_rows([run_record(o) for o in outcomes], spec, recipe_batch=10)
    weak = {(r["strategy"], r["n"]): r for r in t["weak"]}
    strong = {(r["strategy"], r["n"]): r for r in t["strong"]}
    assert sorted(weak) == sorted(strong) == [("allreduce", 1), ("allreduce", 2), ("single", 1)]
    expected = {  # (units/s, speedup, efficiency)
        "weak": {("single", 1): (100.0, 1.0, 1.0), ("allreduce", 1): (95.0, 0.95, 0.95),
                 ("allreduce", 2): (180.0, 1.8, 0.9)},
        "strong": {("single", 1): (100.0, 1.0, 1.0), ("allreduce", 1): (95.0, 0.95, 0.95),
                   ("allreduce", 2): (150.0, 1.5, 0.75)}}
    for scaling, rows in (("weak", weak), ("strong", strong)):
        for key, (wps, speedup, efficiency) in expected[scaling].items():
            r = rows[key]
            assert r["units_per_s"] == pytest.approx(wps), (scaling, key)
            assert r["baseline_units_per_s"] == pytest.approx(100.0), (scaling, key)
            assert r["speedup"] == pytest.approx(speedup), (scaling, key)
            assert r["efficiency"] == pytest.approx(efficiency), (scaling, key)
            # coverage: rank 0's accounted parts, 74 ms, against the 100 ms step of the throughput clock
            assert r["breakdown_coverage"] == pytest.approx(0.74), (scaling, key)
    # the weak point: 2 x 10 samples, 3 of 4 runs ok, spread over the ok repeats
    w2 = weak[("allreduce", 2)]
    assert (w2["global_batch"], w2["per_replica_batch"], w2["runs"], w2["runs_ok"]) == (20, 10, 4, 3)
    assert (w2["units_per_s_min"], w2["units_per_s_max"]) == (pytest.approx(170.0), pytest.approx(200.0))
    # rank-mean breakdown: compute (50 + 70) / 2 = 60, other = 90 - (2 + 60 + 12 + 4 + 6) = 6; skew 20 / 60
    assert w2["breakdown_ms"]["compute_ms"] == pytest.approx(60.0)
    assert w2["breakdown_ms"]["other_ms"] == pytest.approx(6.0)
    assert w2["compute_skew"] == pytest.approx(1 / 3) and w2["slowest_rank"] == 1
    s2 = strong[("allreduce", 2)]
    assert (s2["global_batch"], s2["per_replica_batch"], s2["runs"], s2["runs_ok"]) == (10, 5, 1, 1)
    assert weak[("single", 1)]["units_per_s_min"] == pytest.approx(90.0)
    assert weak[("single", 1)]["units_per_s_max"] == pytest.approx(130.0)
    text = markdown({"date": "d", "machine": {"cpu_cores": 2, "device": "cpu", "torch": "x"}, "command": "c",
                     "scaling": t})
    assert "| allreduce | 2 | 20 | 10 | 180 (170-200) | 1.80 | 0.90 | 100.0 |" in text
    assert "| allreduce | 2 | 10 | 5 | 150 (150-150) | 1.50 | 0.75 | 100.0 |" in text


def test_cpu_share_and_validation_errors():
    assert cpu_share(1, 2) == (2, 1.0) and cpu_share(2, 2) == (1, 1.0) and cpu_share(4, 2) == (1, 2.0)
    rec = {"rank0_timing_ms": {"data_ms": 0, "forward_ms": 20, "backward_ms": 40, "compute_ms": 0,
                               "optimizer_ms": 5}, "train_step_ms": 70.0}
    w = workload_from_record(rec, [1000], 400)
    assert w.local_s() == pytest.approx(0.070)  # loop overhead folded into data: N = 1 reproduces the step
    link = Link(name="x", alpha_s=0.0, beta_s_per_byte=0.0, gamma_s_per_byte=0.0)
    out = validate({1: {"train_step_ms": 70.0}, 4: {"train_step_ms": 150.0}}, {1: w, 2: w}, link, cores=2,
                   bucket_mb=25)
    assert out["points"]["1"]["step_time_rel_error"] == pytest.approx(0.0)
    # N = 4 on 2 cores: compute doubles (140 ms predicted) against 150 measured
    assert out["points"]["4"]["predicted_step_ms"] == pytest.approx(140.0)
    assert out["points"]["4"]["step_time_rel_error"] == pytest.approx(-10 / 150)
    assert "oversubscribed" in out["points"]["4"]["note"]
