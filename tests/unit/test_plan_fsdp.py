"""FSDP's and ZeRO-1's collectives as the plan prices them on a CPU (bench/costmodel_sharded.py: a blocking
collective's wait inside a step, FSDP2's measured collectives per unit, its hooks) and the micro-benchmarks
that measure them (bench/microbench.py, bench/microbench_sharded.py), against hand computation."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

DIGITS = str(Path(__file__).resolve().parents[2] / "configs" / "digits_cnn.toml")

from paratrain.bench.costmodel import MIB, Link, Workload, ring_allreduce_s
from paratrain.bench.costmodel_sharded import (fsdp_paths_s, meeting_seconds, predict_fsdp, predict_zero1,
                                               ring_allgather_s, ring_reduce_scatter_s, unit_paths)
from paratrain.errors import UsageError

LINK = Link(name="t", alpha_s=1e-4, beta_s_per_byte=1e-9, gamma_s_per_byte=0.0)
W = Workload(forward_s=0.003, backward_s=0.005, data_s=0.0, optimizer_s=0.002, param_bytes=(MIB, MIB),
             tokens_per_step=64)


def test_a_meeting_is_priced_between_the_measured_compute_lengths_and_flat_outside_them():
    wait = meeting_seconds([[0.004, 2e-3], [0.001, 1e-3]])  # any order
    assert wait(0.0) == wait(0.0005) == 1e-3  # below the shortest compute: its time
    assert wait(0.0025) == pytest.approx(1.5e-3)  # linear between
    assert wait(1.0) == 2e-3  # beyond the longest: its time, not extrapolated
    with pytest.raises(UsageError):
        meeting_seconds([])
    with pytest.raises(UsageError):
        meeting_seconds([[0.0, 1e-3]])


def test_fsdp_gathers_the_root_once_skips_empty_units_and_all_reduces_the_norm():
    # the root (1 MiB, first) and a unit (2 MiB), 2 ranks, no overlap: all-gathers of both in the forward,
    # the unit's again in the backward (FSDP2 keeps the root's), reduce-scatters of both, and the guard's norm
    units = [MIB, 2 * MIB]
    p = predict_fsdp(W, 2, LINK, unit_bytes=units, overlap=False)
    compute = W.forward_s + W.backward_s + W.optimizer_s / 2
    ag = [ring_allgather_s(b, 2, LINK) for b in units]
    rs = [ring_reduce_scatter_s(b, 2, LINK) for b in units]
    norm = ring_allreduce_s(4, 2, LINK)
    assert p.step_s == pytest.approx(compute + ag[0] + 2 * ag[1] + sum(rs) + norm, rel=1e-12)
    # a root without parameters of its own has no collective at all
    empty = predict_fsdp(W, 2, LINK, unit_bytes=[0, 2 * MIB], overlap=False)
    assert empty.step_s == pytest.approx(compute + 2 * ag[1] + rs[1] + norm, rel=1e-12)
    kept = predict_fsdp(W, 2, LINK, unit_bytes=[0, 2 * MIB], overlap=False, reshard=False)
    assert kept.step_s == pytest.approx(compute + ag[1] + rs[1] + norm, rel=1e-12)
    assert predict_fsdp(W, 1, LINK, unit_bytes=units).step_s == pytest.approx(W.local_s())


def test_a_mixed_precision_fsdp_gathers_the_parameters_in_the_low_dtype_and_reduce_scatters_float32():
    # bf16 over float32 parameters (gather_scale 0.5): the root (1 MiB) and a unit (2 MiB), 2 ranks, no
    # overlap: all-gathers of half the bytes (the root's once, the unit's twice), reduce-scatters of all of them
    units = [MIB, 2 * MIB]
    p = predict_fsdp(W, 2, LINK, unit_bytes=units, overlap=False, gather_scale=0.5)
    compute = W.forward_s + W.backward_s + W.optimizer_s / 2
    ag = [ring_allgather_s(b / 2, 2, LINK) for b in units]
    rs = [ring_reduce_scatter_s(b, 2, LINK) for b in units]
    assert p.step_s == pytest.approx(compute + ag[0] + 2 * ag[1] + sum(rs) + ring_allreduce_s(4, 2, LINK), rel=1e-12)
    assert p.step_s < predict_fsdp(W, 2, LINK, unit_bytes=units, overlap=False).step_s
    # overlapped (a GPU's streams): the same collectives, fewer bytes, never slower
    assert (predict_fsdp(W, 8, LINK, unit_bytes=units, gather_scale=0.5).step_s
            <= predict_fsdp(W, 8, LINK, unit_bytes=units).step_s)
    # this machine's measured paths (timed under the same policy) keep their 2-rank price; beyond 2 ranks the
    # ring model's difference of the all-gathers is of the gathered bytes: at 4 ranks, per gather of b bytes,
    # (3 - 1) alpha + (3/4 - 1/2) b/2 beta
    rows = [[MIB, 1e-3, 3e-3, 2e-3], [2 * MIB, 2e-3, 6e-3, 4e-3]]
    at4 = fsdp_paths_s(units, 4, True, unit_paths(rows), LINK, LINK, gather_scale=0.5)
    at2 = fsdp_paths_s(units, 2, True, unit_paths(rows), LINK, LINK, gather_scale=0.5)
    assert at2 == pytest.approx(1e-3 + 2e-3 + 2e-3 + 6e-3)
    d_ag = [2 * LINK.alpha_s + 0.25 * b / 2 * LINK.beta_s_per_byte for b in units]
    d_rs = [2 * LINK.alpha_s + 0.25 * b * LINK.beta_s_per_byte for b in units]
    assert at4 - at2 == pytest.approx(d_ag[0] + 2 * d_ag[1] + sum(d_rs), rel=1e-9)


def test_fsdps_gathers_move_the_mixed_precision_policys_bytes_per_stored_byte():
    from types import SimpleNamespace

    from paratrain.bench.strategy_model import fsdp_gather_scale

    def cfg(precision, dtype="float32"):
        return SimpleNamespace(train=SimpleNamespace(precision=precision, dtype=dtype))
    assert fsdp_gather_scale(cfg("fp32")) == 1.0 and fsdp_gather_scale(cfg("fp32", "float64")) == 1.0
    assert fsdp_gather_scale(cfg("bf16")) == 0.5 and fsdp_gather_scale(cfg("fp16")) == 0.5
    assert fsdp_gather_scale(cfg("bf16", "float64")) == 0.25
    assert fsdp_gather_scale(cfg("bf16", "bfloat16")) == 1.0  # stored low already: nothing to cast


def test_the_ranks_wait_the_measured_meeting_after_each_units_forward_and_backward():
    # one unit with parameters ([0, 2 MiB]): 2 stretches of compute (its forward, its backward) of
    # (3 + 5) / 2 = 4 ms each; the meeting after 4 ms costs 0.5 + 0.1 x 4 = 0.9 ms, less the alpha (0.1 ms) the
    # collectives already pay: 2 x 0.8 ms
    units = [0, 2 * MIB]
    base = predict_fsdp(W, 2, LINK, unit_bytes=units, overlap=False)
    got = predict_fsdp(W, 2, LINK, unit_bytes=units, overlap=False, meeting_s=lambda c: 5e-4 + 0.1 * c)
    norm_wait = 5e-4 - ring_allreduce_s(4, 2, LINK)  # the norm's all-reduce after the backward: a meeting
    assert got.step_s == pytest.approx(base.step_s + 2 * 8e-4 + norm_wait, rel=1e-9)
    # two units with parameters: 4 stretches of 2 ms, 0.7 - 0.1 ms each
    two = [MIB, 2 * MIB]
    assert (predict_fsdp(W, 2, LINK, unit_bytes=two, overlap=False, meeting_s=lambda c: 5e-4 + 0.1 * c).step_s
            - predict_fsdp(W, 2, LINK, unit_bytes=two, overlap=False).step_s) == pytest.approx(4 * 6e-4 + norm_wait,
                                                                                             rel=1e-9)
    # a meeting faster than the link's alpha adds nothing
    assert predict_fsdp(W, 2, LINK, unit_bytes=units, overlap=False, meeting_s=lambda c: 1e-6).step_s == base.step_s
    # ZeRO-1's all-gather of the updated rows follows the optimizer's share (1 ms): 0.5 + 0.1 ms
    z = predict_zero1(W, 2, LINK, overlap=False, meeting_s=lambda c: 5e-4 + 0.1 * c)
    z0 = predict_zero1(W, 2, LINK, overlap=False)
    assert z.step_s - z0.step_s == pytest.approx(6e-4 - LINK.alpha_s, rel=1e-9)


def test_fsdp_on_this_machine_adds_each_units_measured_collectives_and_the_ring_difference_beyond_two():
    # measured at 2 ranks: a unit of 1 MiB costs 1 ms forward, 3 ms backward resharded, 2 ms kept; 2 MiB: twice that
    rows = [[MIB, 1e-3, 3e-3, 2e-3], [2 * MIB, 2e-3, 6e-3, 4e-3]]
    path = unit_paths(rows)
    assert path(1.5 * MIB) == pytest.approx((1.5e-3, 4.5e-3, 3e-3))
    assert path(4 * MIB) == pytest.approx((4e-3, 12e-3, 8e-3))  # proportional beyond the largest
    # the root (1 MiB, kept) and a unit (2 MiB, resharded), 2 ranks: as measured
    assert fsdp_paths_s([MIB, 2 * MIB], 2, True, path, LINK, LINK) == pytest.approx((1e-3 + 2e-3) + (2e-3 + 6e-3))
    assert fsdp_paths_s([MIB, 2 * MIB], 2, False, path, LINK, LINK) == pytest.approx((1e-3 + 2e-3) + (2e-3 + 4e-3))
    # 4 ranks: each collective also costs the ring's difference between 4 and 2 ranks
    d_ag = ring_allgather_s(2 * MIB, 4, LINK) - ring_allgather_s(2 * MIB, 2, LINK)
    d_rs = ring_reduce_scatter_s(2 * MIB, 4, LINK) - ring_reduce_scatter_s(2 * MIB, 2, LINK)
    assert d_ag > 0 and fsdp_paths_s([0, 2 * MIB], 4, True, path, LINK, LINK) == pytest.approx(
        2e-3 + 6e-3 + 2 * d_ag + d_rs)
    assert fsdp_paths_s([MIB, 2 * MIB], 1, True, path, LINK, LINK) == 0.0  # one rank: no collective
    # without path_meeting_s (a caller that does not say which processes the paths were measured
    # between): compute + the units' paths + 4 waits (2 units) + the norm's all-reduce, a meeting
    compute = W.forward_s + W.backward_s + W.optimizer_s / 2
    p = predict_fsdp(W, 2, LINK, unit_bytes=[MIB, 2 * MIB], overlap=False, unit_path_s=path,
                     meeting_s=lambda c: 3e-4)
    norm = 3e-4  # the meeting of no compute, more than the ring's 2 alpha (0.2 ms)
    assert ring_allreduce_s(4, 2, LINK) < norm
    assert p.step_s == pytest.approx(compute + (1e-3 + 2e-3) + (2e-3 + 6e-3) + 4 * 2e-4 + norm, rel=1e-12)


def test_measured_unit_paths_hold_the_wait_after_no_compute_so_each_stretch_adds_its_meeting_beyond_that():
    """With the units measured between 2 processes (``unit_path_s``), whose means hold the waits of 2
    ranks reaching each collective from almost no compute, a wait per stretch of c seconds of compute
    is what the n processes' meeting after c costs beyond the 2 processes' after none
    (``path_meeting_s(0)``); without the paths (the ring model), the meeting less the all-gather's alpha."""
    rows = [[MIB, 1e-3, 3e-3, 2e-3], [2 * MIB, 2e-3, 6e-3, 4e-3]]
    path = unit_paths(rows)
    two = lambda c: 5e-4 + 0.1 * c  # noqa: E731 (2 processes: 0.9 ms after 4 ms of compute)
    four = lambda c: 2e-3 + 0.2 * c  # noqa: E731 (4 processes on 2 cores: 2.8 ms after 4 ms)
    lay = dict(unit_bytes=[0, 2 * MIB], overlap=False, unit_path_s=path)  # one unit: 2 stretches of 4 ms
    compute = W.forward_s + W.backward_s + W.optimizer_s / 2
    norm = 5e-4  # the norm's all-reduce: the meeting of no compute (more than the ring's 0.2 ms)
    at2 = predict_fsdp(W, 2, LINK, meeting_s=two, path_meeting_s=two, **lay)
    # 2 waits of 0.9 ms (after 4 ms of compute) less 0.5 ms (after none)
    assert at2.step_s == pytest.approx(compute + (2e-3 + 6e-3) + 2 * 4e-4 + norm, rel=1e-12)
    # 4 processes: the measured paths at 2, the ring's difference from 2 to 4, and 2 waits of 2.8 - 0.5 ms
    d_ag = ring_allgather_s(2 * MIB, 4, LINK) - ring_allgather_s(2 * MIB, 2, LINK)
    d_rs = ring_reduce_scatter_s(2 * MIB, 4, LINK) - ring_reduce_scatter_s(2 * MIB, 2, LINK)
    at4 = predict_fsdp(W, 4, LINK, meeting_s=four, path_meeting_s=two, **lay)
    compute4 = W.forward_s + W.backward_s + W.optimizer_s / 4
    assert at4.step_s == pytest.approx(compute4 + (2e-3 + 6e-3) + 2 * d_ag + d_rs + 2 * 2.3e-3 + 2e-3, rel=1e-9)
    # a meeting table below the paths' one adds nothing (never a negative wait)
    assert predict_fsdp(W, 2, LINK, meeting_s=lambda c: 1e-4, path_meeting_s=two, **lay).step_s == pytest.approx(
        compute + 8e-3 + max(1e-4, ring_allreduce_s(4, 2, LINK)), rel=1e-12)
    # without path_meeting_s (an older caller), the wait is the meeting less the all-gather's alpha
    old = predict_fsdp(W, 2, LINK, meeting_s=two, **lay)
    assert old.step_s - at2.step_s == pytest.approx(2 * (9e-4 - LINK.alpha_s) - 2 * 4e-4, rel=1e-9)
    # the ring model (overlap, no measured paths used) keeps the alpha too: the paths' table is not its
    ring = dict(unit_bytes=[0, 2 * MIB], overlap=True, meeting_s=two)
    assert predict_fsdp(W, 2, LINK, path_meeting_s=two, unit_path_s=path, **ring).step_s == pytest.approx(
        predict_fsdp(W, 2, LINK, **ring).step_s, rel=1e-12)


def test_the_plan_gives_fsdp_the_two_process_meeting_table_its_unit_paths_were_measured_with():
    """strategy_model.predict_model: ``inputs["path_meetings"]`` reaches predict_fsdp as
    ``path_meeting_s``; plan.predict_layout passes the profile's 2-process ``meetings`` there."""
    from types import SimpleNamespace

    from paratrain.bench.strategy_model import predict_model

    cfg = SimpleNamespace(dist=SimpleNamespace(reshard_after_forward=True, bucket_mb=25.0),
                          train=SimpleNamespace(clip=0.0))
    two, four = [[0.001, 0.001], [0.004, 0.002]], [[0.001, 0.004], [0.004, 0.009]]
    inputs = {"units": [0, 2 * MIB], "fsdp_units": [[MIB, 1e-3, 3e-3, 2e-3]], "meetings": two}
    plain = predict_model("sharded_parameters", W, 2, LINK, cfg, inputs, overlap=False)
    held = predict_model("sharded_parameters", W, 2, LINK, cfg, {**inputs, "path_meetings": two}, overlap=False)
    # 2 stretches of 4 ms: the meeting's 2 ms less the alpha (0.1 ms) each; the paths hold the meeting
    # after no compute (the table's first point, 1 ms), so 2 - 1 ms each is left
    assert plain.step_s - held.step_s == pytest.approx(2 * (2e-3 - LINK.alpha_s) - 2 * (2e-3 - 1e-3), rel=1e-9)
    above = predict_model("sharded_parameters", W, 4, LINK, cfg, {**inputs, "meetings": four, "path_meetings": two},
                          overlap=False)
    lone = predict_model("sharded_parameters", W, 4, LINK, cfg, {**inputs, "meetings": two, "path_meetings": two},
                         overlap=False)
    # 4 processes: 9 - 2 ms more per stretch, and the norm's meeting of no compute 4 - 1 ms more
    assert above.step_s - lone.step_s == pytest.approx(2 * 7e-3 + 3e-3, rel=1e-9)


def test_the_meeting_microbenchmark_times_a_collective_reached_from_compute_in_two_processes(monkeypatch):
    from paratrain.bench import microbench_meetings
    from paratrain.bench.microbench_meetings import measured_meetings

    points = measured_meetings((1e-4, 2e-3), timeout_s=90)
    assert [c for c, _ in points] == pytest.approx([1e-4, 2e-3])
    assert all(math.isfinite(t) and 0 < t < 0.5 for _, t in points)  # both ranks met 30+ times and returned
    # more processes than cores: as many ranks (the plan's profile runs 4 on this machine: test_plan_cli)
    asked = []
    monkeypatch.setattr(microbench_meetings, "measure_allreduce",
                        lambda world, sizes, **kw: asked.append((world, list(sizes), kw["op"])) or
                        [(us, 1e-3) for us in sizes])
    assert measured_meetings((1e-3,), processes=4) == [[pytest.approx(1e-3), 1e-3]]
    assert asked == [(4, [1000], "meeting")]


def test_n_above_the_cores_prices_fsdps_meetings_with_the_oversubscribed_measurement():
    """plan_inputs.meetings: two processes' table up to the cores; at 4 the table of 4 processes on 2
    cores; above the cores each point on the line in n through the two tables (n = 3 halfway, n = 8
    extrapolated, never below 0); a 4-process table on other compute points is taken as it is; a
    profile without it (more cores, or older) keeps two processes' for every n; on one core, n = 2
    is two processes' own measurement."""
    from paratrain.bench.plan_inputs import meetings

    two, four = [[0.001, 0.001], [0.004, 0.002]], [[0.001, 0.004], [0.004, 0.009]]
    prof = {"cores": 2, "meetings": two, "meetings_oversubscribed": {"processes": 4, "points": four}}
    assert [meetings(prof, n) for n in (1, 2, 4)] == [two, two, four]
    assert meetings(prof, 3) == [[0.001, pytest.approx(0.0025)], [0.004, pytest.approx(0.0055)]]
    # 8 processes: 3 times the rise from 2 to 4 above two processes' seconds
    assert meetings(prof, 8) == [[0.001, pytest.approx(0.010)], [0.004, pytest.approx(0.023)]]
    falling = {**prof, "meetings_oversubscribed": {"processes": 4, "points": [[0.001, 0.0], [0.004, 0.001]]}}
    assert meetings(falling, 8) == [[0.001, 0.0], [0.004, 0.0]]  # 0.001 - 3 x 0.001 and 0.002 - 3 x 0.001
    other = [[0.002, 0.004], [0.008, 0.009]]
    assert meetings({**prof, "meetings_oversubscribed": {"processes": 4, "points": other}}, 3) == other
    assert meetings({**prof, "cores": 4}, 4) == two
    assert meetings({"cores": 2, "meetings": two}, 4) == two
    assert meetings({"cores": 2}, 4) is None
    assert [meetings({**prof, "cores": 1}, n) for n in (2, 4)] == [two, four]
    # fsdp's step at n = 4: each unit's forward and backward end in a wait of the 4-process table
    lay = dict(unit_bytes=[MIB, 2 * MIB], overlap=False)
    slow = predict_fsdp(W, 4, LINK, meeting_s=meeting_seconds(four), **lay).step_s
    fast = predict_fsdp(W, 4, LINK, meeting_s=meeting_seconds(two), **lay).step_s
    assert slow > fast


def test_the_fsdp_unit_microbenchmark_measures_each_unit_size_once_between_two_processes():
    from paratrain.bench.microbench_sharded import measured_fsdp_units

    assert measured_fsdp_units([0]) == []
    rows = measured_fsdp_units([0, 4096, 65536, 4096], repeats=20, timeout_s=150)
    assert [r[0] for r in rows] == [4096, 65536]  # distinct sizes > 0, smallest first
    assert all(len(r) == 4 and all(math.isfinite(v) and 0 <= v < 1 for v in r[1:]) for r in rows)
    # FSDP2's hooks, copies and collectives take time beyond the same module without FSDP2: the
    # forward's all-gather, and the backward's second all-gather and reduce-scatter (resharded) or
    # reduce-scatter alone (kept)
    assert all(r[1] > 1e-5 and r[2] > 1e-5 and r[3] > 1e-5 for r in rows)


def test_the_fsdp_unit_microbenchmark_gives_each_unit_size_the_shapes_and_dtypes_of_its_first_unit(monkeypatch):
    import torch

    from paratrain.bench import microbench
    from paratrain.bench.microbench_sharded import measured_fsdp_units

    seen = []

    def fake(world, specs, **kw):
        seen.append((world, specs, kw["op"]))
        return [(spec, [1e-3, 2e-3, 3e-3]) for spec in specs]

    monkeypatch.setattr(microbench, "measure_allreduce", fake)
    half = [torch.zeros(512, dtype=torch.bfloat16) for _ in range(4)]  # 4096 bytes in four bf16 tensors
    units = [[], [torch.zeros(32, 32)], half, [torch.zeros(8192, dtype=torch.bfloat16)]]
    rows = measured_fsdp_units([0, 4096, 4096, 16384], parameters=units)
    assert rows == [[4096.0, 1e-3, 2e-3, 3e-3], [16384.0, 1e-3, 2e-3, 3e-3]]
    # the first unit of 4096 bytes (one 32 x 32 tensor) stands for the second (four bf16 tensors)
    assert seen == [(2, [{"bytes": 4096, "shapes": [[32, 32]], "dtypes": ["float32"]},
                         {"bytes": 16384, "shapes": [[8192]], "dtypes": ["bfloat16"]}], "fsdp_unit")]
    # parameters that are not the units' (other bytes, or another count) are refused
    with pytest.raises(ValueError, match="same order"):
        measured_fsdp_units([0, 4096, 16384], parameters=units[:2] + units[3:4][::-1] + [[]])
    with pytest.raises(ValueError, match="same order"):
        measured_fsdp_units([0, 4096], parameters=units)


def test_the_fsdp_unit_microbenchmarks_module_has_the_units_parameters_and_almost_no_compute():
    import torch

    from paratrain.bench.microbench_sharded import fsdp_unit_module

    unit = fsdp_unit_module({"shapes": [[16, 1, 3, 3], [16], [16]], "dtypes": ["bfloat16"] * 3})
    assert [(tuple(p.shape), p.dtype) for p in unit.parameters()] == [
        ((16, 1, 3, 3), torch.bfloat16), ((16,), torch.bfloat16), ((16,), torch.bfloat16)]
    with torch.no_grad():
        for p in unit.parameters():
            p.fill_(0.5)
    x = torch.ones(1, requires_grad=True)
    y = unit(x)
    y.sum().backward()
    assert y.item() == 1.5 and all(p.grad is not None for p in unit.parameters())  # each in the graph
    assert [(tuple(p.shape), p.dtype) for p in fsdp_unit_module(4096).parameters()] == [((1024,), torch.float32)]
    assert [tuple(p.shape) for p in fsdp_unit_module({"shapes": [[3, 2]]}).parameters()] == [(3, 2)]


def test_the_fsdp_unit_microbenchmark_times_a_unit_of_several_parameters_between_two_processes():
    from paratrain.bench.microbench import measure_allreduce

    spec = {"shapes": [[16, 1, 3, 3], [16], [16]], "dtypes": ["bfloat16"] * 3}  # FSDP2: one dtype a unit
    ((got, (fwd, again, kept)),) = measure_allreduce(2, [spec], repeats=20, warmup=2, timeout_s=150, op="fsdp_unit")
    assert got == spec and all(1e-5 < v < 1 for v in (fwd, again, kept))


def test_the_sharded_norm_microbenchmark_prices_the_dtensor_dispatch_of_fsdps_guard(monkeypatch):
    import time

    import torch
    import torch.distributed as dist
    from torch import nn

    from paratrain.bench.microbench_sharded import measured_sharded_norm

    params = [nn.Parameter(torch.randn(8, 4)), nn.Parameter(torch.randn(4)), nn.Parameter(torch.tensor(1.0))]
    threads, had_group = torch.get_num_threads(), dist.is_initialized()
    plain = measured_sharded_norm(params, threads=1, repeats=5, warmup=1)
    assert 0.0 <= plain < 0.01
    real = nn.utils.get_total_norm

    def slow_on_dtensors(tensors, *a, **kw):  # 10 ms more when the gradients are DTensors
        if hasattr(tensors[0], "placements"):
            time.sleep(0.01)
        return real(tensors, *a, **kw)
    monkeypatch.setattr(nn.utils, "get_total_norm", slow_on_dtensors)
    assert 0.009 <= measured_sharded_norm(params, threads=1, repeats=5, warmup=1) < 0.05
    assert dist.is_initialized() == had_group and torch.get_num_threads() == threads


def test_fsdp_memory_keeps_the_roots_gathered_parameters_from_the_forward_to_the_backward():
    from paratrain.bench.plan_memory import MemoryInputs, memory_per_device
    from paratrain.bench.strategy_model import SHARDED_PARAMETERS

    m = MemoryInputs(params=100.0, optimizer=100.0, activations=1000.0, largest_unit=10.0, root_unit=40.0)
    # the forward's end at 2 ranks: shards of P and O (50 + 50), A, and the root's 40 bytes gathered
    assert memory_per_device(SHARDED_PARAMETERS, 2, m)["total"] == pytest.approx(50 + 50 + 1000 + 40 + 2 * 10)
    no_root = MemoryInputs(params=100.0, optimizer=100.0, activations=1000.0, largest_unit=10.0)
    assert memory_per_device(SHARDED_PARAMETERS, 2, no_root)["total"] == pytest.approx(50 + 50 + 1000 + 2 * 10)
    assert memory_per_device(SHARDED_PARAMETERS, 1, m)["total"] == pytest.approx(100 + 100 + 1000 + 2 * 10)
    # a bf16 recipe (gather_scale 0.5): the root gathered in bf16 (20), the last unit's bf16 gradient (5) and
    # its float32 copy for the reduce-scatter (10); autocast's casts (C = 30) are not made under FSDP
    low = MemoryInputs(params=100.0, optimizer=100.0, activations=1000.0, largest_unit=10.0, root_unit=40.0,
                       gather_scale=0.5, autocast_copies=30.0)
    assert memory_per_device(SHARDED_PARAMETERS, 2, low)["total"] == pytest.approx(50 + 50 + 1000 + 20 + 15)


def test_fsdp_without_resharding_after_the_forward_keeps_every_unit_gathered_until_its_backward():
    """ZeRO-2 (``reshard_after_forward`` off): every unit stays gathered from its forward to its backward, so
    the forward's end holds all of P gathered where FSDP2 holds the root's alone, and the backward's start
    adds the last unit's gradient only (it is still gathered). By hand, as the test above. Measured on
    ptb_small at N = 2 (MemTracker): 68.97 MiB resharded, 86.72 not; predicted 68.91 and 86.66."""
    from paratrain.bench.plan_memory import MemoryInputs, memory_per_device
    from paratrain.bench.strategy_model import SHARDED_PARAMETERS

    m = MemoryInputs(params=100.0, optimizer=100.0, activations=1000.0, largest_unit=10.0, root_unit=40.0)
    kept = memory_per_device(SHARDED_PARAMETERS, 2, m, reshard_after_forward=False)
    # the backward's start: shards (50 + 50), A, all 100 bytes gathered and the last unit's gradient (10)
    assert kept["total"] == pytest.approx(50 + 50 + 1000 + 100 + 10)
    assert memory_per_device(SHARDED_PARAMETERS, 2, m)["total"] == pytest.approx(50 + 50 + 1000 + 40 + 2 * 10)
    # the forward's end with the loss's temporaries (T = 30) above: shards, A, T and all of P gathered
    hot = MemoryInputs(params=100.0, optimizer=100.0, activations=1000.0, largest_unit=10.0, root_unit=40.0,
                       temporaries=30.0)
    assert memory_per_device(SHARDED_PARAMETERS, 2, hot, reshard_after_forward=False)["total"] == pytest.approx(
        50 + 50 + 1000 + 30 + 100)
    # bf16 (gather_scale 0.5): every unit gathered in bf16 (50) and the last unit's gradient copied (10)
    low = MemoryInputs(params=100.0, optimizer=100.0, activations=1000.0, largest_unit=10.0, root_unit=40.0,
                       gather_scale=0.5)
    assert memory_per_device(SHARDED_PARAMETERS, 2, low, reshard_after_forward=False)["total"] == pytest.approx(
        50 + 50 + 1000 + 50 + 10)
    # no other strategy reads the key
    from paratrain.bench.strategy_model import RING
    assert memory_per_device(RING, 2, m, reshard_after_forward=False) == memory_per_device(RING, 2, m)


def test_the_plan_prices_zero2s_memory_above_fsdps_from_a_profile():
    """ptb_small's shipped profile (version 44) at N = 2 on this machine: fsdp 68.91 MiB, fsdp without
    resharding 86.66 MiB (all 17.75 MiB of parameters gathered, its root unit holding none), as measured
    (68.97 and 86.72)."""
    import json
    from pathlib import Path

    from paratrain.bench import plan as pl
    from paratrain.bench.costmodel import Link
    from paratrain.config import load

    root = Path(__file__).resolve().parents[2]
    prof = json.loads((root / "benchmarks/results/plan-xeon/ptb_small-v44/profile.json").read_text())
    link = Link(name="measured", **prof["links"]["all_reduce"])
    cfg = load(str(root / "configs" / "ptb_small.toml"))
    got = {label: pl.predict_layout(pl.Layout("fsdp", 2, over, label), prof, cfg, link, on_this_machine=True,
                                    global_batch=None)["memory"]["total"] / 2 ** 20
           for label, over in (("fsdp", {}), ("zero2", {"reshard_after_forward": False}))}
    assert got["fsdp"] == pytest.approx(68.91, abs=0.01) and got["zero2"] == pytest.approx(86.66, abs=0.01)
    assert got["zero2"] - got["fsdp"] == pytest.approx(prof["param_total_bytes"] / 2 ** 20, rel=1e-9)


def test_zero1_on_this_machine_is_allreduce_plus_its_measured_step_moved_from_two_ranks_to_n():
    """predict_zero1 with ``step_path_s`` (ZeRO-1's optimizer step measured against allreduce's between
    2 processes): at n = 2 the step is allreduce's plus the path, nothing else; at n = 4 on time-shared
    cores (compute_scale 2) the path is kept (not scaled: it was measured to take as long at 4
    processes on 2 cores, its waits aside) and moved by the terms that depend on n: the
    optimizer's arithmetic on 1/4 instead of 1/2, the all-gather's ring time at 4 less at 2, the copies
    at 4 less at 2, and the 4 processes' meeting beyond the 2 processes' (hand-computed below)."""
    from paratrain.bench.costmodel import predict

    path = 7e-3
    two = lambda c: 5e-4 + 0.1 * c  # noqa: E731
    four = lambda c: 2e-3 + 0.2 * c  # noqa: E731
    copy = lambda b: 1e-5 if b < MIB else 5e-5  # noqa: E731
    kw = dict(bucket_mb=25.0, overlap=False, copy_s=copy, step_path_s=path, path_meeting_s=two)
    at2 = predict_zero1(W, 2, LINK, meeting_s=two, **kw)
    allreduce2 = predict(W, 2, LINK, algorithm="ring", bucket_mb=25.0, overlap=False)
    assert at2.step_s == pytest.approx(allreduce2.step_s + 7e-3, rel=1e-12)
    assert at2.compute_s == pytest.approx(0.003 + 0.005 + 0.002 / 2, rel=1e-12)
    at4 = predict_zero1(W, 4, LINK, meeting_s=four, compute_scale=2.0, **kw)
    allreduce4 = predict(W, 4, LINK, algorithm="ring", bucket_mb=25.0, overlap=False, compute_scale=2.0)
    # allreduce's whole step at scale 2 (4 ms) becomes a quarter of the rows (1 ms), and the path's own
    # arithmetic (half the rows less the whole at scale 1: 1 - 2 ms) is given back: -3 + 1 = -2 ms
    optimizer = (0.002 * 2 / 4 - 0.002 * 2) - (0.002 / 2 - 0.002)
    gather = 2e-4 + (3 / 4 - 1 / 2) * 2 * MIB * 1e-9  # 2 alphas and a quarter of 2 MiB more
    copies = (1e-5 + 5e-5) - 2 * 5e-5  # 0.5 MiB in and 1.5 MiB out, against 1 MiB each way
    wait = (2e-3 + 0.2 * 1e-3) - (5e-4 + 0.1 * 1e-3)  # after the optimizer's 1 ms (0.002 x 2 / 4)
    assert at4.step_s == pytest.approx(allreduce4.step_s + 7e-3 + optimizer + gather + copies + wait, rel=1e-12)
    assert at4.compute_s == pytest.approx(2 * (0.003 + 0.005) + 0.002 * 2 / 4, rel=1e-12)
    # the ring model where the collectives overlap compute (another machine): the path is not used
    assert predict_zero1(W, 2, LINK, step_path_s=path).step_s == pytest.approx(predict_zero1(W, 2, LINK).step_s)
    assert predict_zero1(W, 1, LINK, **kw).step_s == pytest.approx(W.local_s())  # one rank: the single step


def test_a_measured_zero1_step_replaces_the_one_process_dispatch_and_is_zero1s_optimizer_part():
    """plan_model.step_parts: with ``zero1_step_s`` the one-process DTensor dispatch
    (``sharded_optimizer_s``) is not added again for zero1 (fsdp still pays it), and zero1's optimizer
    part is everything its step adds to allreduce's without allreduce's optimizer; compute and
    exposed communication are allreduce's (the measured parts: the optimizer's span holds the
    all-gather). Where collectives overlap compute, the measurement is not used. (That
    plan.predict_layout passes the profile's ``zero1_step_s``: tests/e2e/test_plan_cli.py.)"""
    from types import SimpleNamespace

    from paratrain.bench.plan_model import Layout, step_parts
    from paratrain.bench.strategy_model import RING, SHARDED_OPTIMIZER, SHARDED_PARAMETERS
    from paratrain.config import Config

    cls = lambda m: SimpleNamespace(cost_model=m, synchronous=True)  # noqa: E731
    cfg = Config()
    inputs = {"units": [0, MIB, MIB], "sharded_optimizer_s": 3e-3, "sharded_norm_s": 0.0}
    lay = Layout("x", 2, {"bucket_mb": 25.0})
    ring = step_parts(cls(RING), lay, W, LINK, cfg, inputs, overlap=False)
    z = step_parts(cls(SHARDED_OPTIMIZER), lay, W, LINK, cfg, {**inputs, "zero1_step_s": 7e-3}, overlap=False)
    assert z["step_s"] == pytest.approx(ring["step_s"] + 7e-3, rel=1e-12)  # no 3 ms dispatch on top
    assert z["optimizer_s"] == pytest.approx(0.002 + 7e-3, rel=1e-12)
    assert z["compute_s"] == pytest.approx(ring["compute_s"]) and z["comm_s"] == pytest.approx(ring["comm_s"])
    old = step_parts(cls(SHARDED_OPTIMIZER), lay, W, LINK, cfg, inputs, overlap=False)  # a profile without it
    assert old["optimizer_s"] == pytest.approx(0.002 / 2 + 3e-3, rel=1e-12)
    f0, f1 = [step_parts(cls(SHARDED_PARAMETERS), lay, W, LINK, cfg, {**inputs, "zero1_step_s": z1}, overlap=False)
              for z1 in (None, 7e-3)]
    assert f0 == f1  # fsdp's price does not read zero1's measurement
    # where collectives overlap compute (not this machine's CPU) the path is not used: the dispatch stays
    o0, o1 = [step_parts(cls(SHARDED_OPTIMIZER), lay, W, LINK, cfg, {**inputs, "zero1_step_s": z1}, overlap=True)
              for z1 in (None, 7e-3)]
    assert o0 == o1 and o0["optimizer_s"] == pytest.approx(0.002 / 2 + 3e-3, rel=1e-12)


def test_the_zero1_step_microbenchmark_times_the_real_strategys_step_against_allreduces(monkeypatch):
    """time_sharded_step of zero1 (the default) in this process on a one-rank group: a
    ``Zero1._gather_rows`` made 10 ms slower is measured (the real strategy's step is what is
    timed), and the group, the threads and the global random generator are left as they were. Then
    between 2 processes for digits_cnn's parameter shapes with training's SGD: the DTensor steps cost
    more than the plain one (finite, positive, under a second), with nothing and with digits_cnn's
    model between the steps."""
    import time

    import torch
    import torch.distributed as dist

    from paratrain.bench.microbench_sharded import measured_sharded_step, optimizer_spec, time_sharded_step
    from paratrain.strategies.zero1 import Zero1

    shapes = [[10], [10, 64], [64], [64, 32, 3, 3], [16, 1, 3, 3]]
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    sgd = torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=5e-4)
    spec = {**optimizer_spec(sgd), "shapes": shapes}
    assert spec["optimizer"] == "torch.optim.sgd:SGD" and spec["defaults"]["momentum"] == 0.9
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        gather = Zero1._gather_rows
        monkeypatch.setattr(Zero1, "_gather_rows", lambda self: (time.sleep(0.01), gather(self)))
        threads, rng = torch.get_num_threads(), torch.get_rng_state()
        assert 0.009 <= time_sharded_step({**spec, "threads": 1}, repeats=20, warmup=1) < 0.1
        assert dist.is_initialized() and dist.get_world_size() == 1
        assert torch.get_num_threads() == threads and torch.equal(torch.get_rng_state(), rng)
    finally:
        dist.destroy_process_group()
    monkeypatch.undo()
    got = measured_sharded_step("zero1", params, sgd, timeout_s=150)
    assert math.isfinite(got) and 0 < got < 1
    # each process builds digits_cnn's model and batch as its rank and runs them before each step
    from paratrain.config import load

    recipe = {"config": load(DIGITS), "data_dir": None}
    got = measured_sharded_step("zero1", params, sgd, timeout_s=150, workload=recipe)
    assert math.isfinite(got) and 0 < got < 1


def test_the_rank_workload_runs_the_recipes_model_on_the_batch_of_that_rank(monkeypatch):
    """rank_workload builds the recipe's task as rank ``rank`` of ``world_size`` ranks (a replica's
    share of the global batch), once per process, recipe and rank; each call runs its model's forward
    and backward on that batch, its gradients set anew; the global random generator is left as it
    was, by the build and by each run (digits_cnn's dropout draws from it); None: nothing.
    check_workload refuses any other form before the ranks see it."""
    import torch

    from paratrain import runs
    from paratrain.bench import microbench_workload
    from paratrain.bench.microbench_workload import check_workload
    from paratrain.bench.microbench_workload import rank_workload as _rank_workload
    from paratrain.config import load
    from paratrain.tasks.digits_cnn import DigitsTask

    assert _rank_workload(None, 0, 2)() is None
    cfg = load(DIGITS)
    assert cfg.model_value("dropout") > 0
    monkeypatch.setattr(microbench_workload, "_WORKLOADS", {})
    built, seen = [], []
    build = runs.build_task
    monkeypatch.setattr(runs, "build_task", lambda *a, **kw: (built.append((a, kw)), build(*a, **kw))[1])
    loss = DigitsTask.loss

    def spy(self, model, micro_batch):
        got = loss(self, model, micro_batch)
        seen.append((len(micro_batch[1]), [p.grad for p in model.parameters()]))
        return got
    monkeypatch.setattr(DigitsTask, "loss", spy)
    rng = torch.get_rng_state()
    recipe = {"config": cfg, "data_dir": None}
    run = _rank_workload(recipe, 1, 2)
    assert built == [((cfg, None), {"rank": 1, "world_size": 2})]
    assert torch.equal(torch.get_rng_state(), rng)
    run()
    run()
    assert torch.equal(torch.get_rng_state(), rng)
    # rank 1's half of the global batch, its gradients set to None before each forward
    assert [n for n, _ in seen] == [cfg.train.batch_size // 2] * 2
    assert all(g is None for _, grads in seen for g in grads)
    assert _rank_workload(dict(recipe), 1, 2) is run and len(built) == 1  # the same recipe and rank: built once
    _rank_workload(recipe, 0, 2)
    assert len(built) == 2
    check_workload(None)
    check_workload(recipe)
    for bad in ({"config": "configs/digits_cnn.toml", "data_dir": None}, {"data_dir": None}, [cfg],
                {"config": cfg, "data_dir": 3}):
        with pytest.raises(ValueError, match="workload is None or"):
            check_workload(bad)


def test_the_sharded_step_microbenchmark_runs_the_model_before_every_step_of_both_kinds(monkeypatch):
    """time_sharded_step with a workload, on a one-rank group: every timed or untimed step of zero1
    and of allreduce follows exactly one run of the recipe's model (built by _rank_workload as this
    rank of the group) and then the barrier after which the clock starts: the model's time is outside
    each timed span."""
    import torch
    import torch.distributed as dist

    from paratrain.bench import microbench_sharded
    from paratrain.bench.microbench_sharded import optimizer_spec, time_sharded_step
    from paratrain.config import load

    events, asked = [], []

    def workload(recipe, rank, world):
        asked.append((recipe, rank, world))
        return lambda: events.append("model")
    monkeypatch.setattr(microbench_sharded, "_rank_workload", workload)
    step = torch.optim.SGD.step
    monkeypatch.setattr(torch.optim.SGD, "step",
                        lambda self, *a, **kw: (events.append("step"), step(self, *a, **kw))[1])
    recipe = {"config": load(DIGITS), "data_dir": None}
    shapes = [[10], [10, 64], [64, 32, 3, 3]]
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.randn(s)) for s in shapes], lr=0.05, momentum=0.9)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        barrier = dist.barrier
        monkeypatch.setattr(dist, "barrier", lambda *a, **kw: (events.append("barrier"), barrier(*a, **kw))[1])
        time_sharded_step({**optimizer_spec(sgd), "shapes": shapes, "workload": recipe}, repeats=20, warmup=1)
        monkeypatch.setattr(dist, "barrier", barrier)
    finally:
        dist.destroy_process_group()
    assert asked == [(recipe, 0, 1)]
    # warm-up 1 pair, 2 pairs to size the rounds, then at least 2 rounds of 10 of each kind
    triples = len(events) // 3
    assert events == ["model", "barrier", "step"] * triples and triples >= 2 * (1 + 2 + 20)


def test_the_fsdp_unit_microbenchmark_runs_the_model_before_every_pass(monkeypatch):
    """time_fsdp_unit with a workload, on a one-rank group: every pass (sharded, kept and without
    FSDP2) follows exactly one run of the recipe's model and then the barrier after which the clock
    starts, at least 10 timed passes of each kind. measured_fsdp_units hands the workload to every
    unit size's spec (a size given as bytes: one float32 tensor of them), and refuses one of another
    form before starting the ranks."""
    import torch
    import torch.distributed as dist

    from paratrain.bench import microbench, microbench_sharded
    from paratrain.bench.microbench_sharded import fsdp_unit_module, measured_fsdp_units, time_fsdp_unit
    from paratrain.config import load

    events, asked = [], []

    def workload(recipe, rank, world):
        asked.append((recipe, rank, world))
        return lambda: events.append("model")

    def unit_module(unit):
        module = fsdp_unit_module(unit)
        forward = module.forward
        module.forward = lambda x: (events.append("pass"), forward(x))[1]
        return module
    monkeypatch.setattr(microbench_sharded, "_rank_workload", workload)
    monkeypatch.setattr(microbench_sharded, "fsdp_unit_module", unit_module)
    recipe = {"config": load(DIGITS), "data_dir": "/data"}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        barrier = dist.barrier
        monkeypatch.setattr(dist, "barrier", lambda *a, **kw: (events.append("barrier"), barrier(*a, **kw))[1])
        got = time_fsdp_unit({"shapes": [[256]], "workload": recipe}, 200, 2)
        monkeypatch.setattr(dist, "barrier", barrier)
    finally:
        dist.destroy_process_group()
    assert asked == [(recipe, 0, 1)]
    passes = len(events) // 3
    assert events == ["model", "barrier", "pass"] * passes
    assert (5 + 2) + 3 * (10 + 2) <= passes <= (5 + 2) + 3 * (200 + 2)  # at most repeats timed passes a kind
    assert len(got) == 3 and all(0 <= t < 0.1 for t in got)

    seen = []
    monkeypatch.setattr(microbench, "measure_allreduce",
                        lambda world, specs, **kw: (seen.append(specs), [(s, [0.0] * 3) for s in specs])[1])
    measured_fsdp_units([4096, 0], workload=recipe)
    units = [[torch.zeros(8, 8)]]
    measured_fsdp_units([256], parameters=units, workload=recipe)
    measured_fsdp_units([256], parameters=units, param_dtype="bfloat16")  # a bf16 recipe's policy
    measured_fsdp_units([4096], param_dtype="float16")
    assert seen == [[{"shapes": [[1024]], "workload": recipe}],
                    [{"bytes": 256, "shapes": [[8, 8]], "dtypes": ["float32"], "workload": recipe}],
                    [{"bytes": 256, "shapes": [[8, 8]], "dtypes": ["float32"], "param_dtype": "bfloat16"}],
                    [{"shapes": [[1024]], "param_dtype": "float16"}]]
    with pytest.raises(ValueError, match="workload is None or"):
        measured_fsdp_units([256], workload={"config": "a recipe", "data_dir": None})
    assert len(seen) == 4


def test_the_fsdp_unit_microbenchmark_shards_under_fsdps_mixed_precision_policy(monkeypatch):
    """A unit with ``param_dtype`` is sharded as ``fsdp`` shards a bf16 recipe's (its unit and its root
    under MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32, output_dtype=float32)): in
    the forward of every FSDP2 pass the unit's parameters are bfloat16, as gathered; the module without
    FSDP2 and every pass without the policy, float32. On a one-rank gloo group."""
    import torch.distributed as dist

    from paratrain.bench import microbench_sharded
    from paratrain.bench.microbench_sharded import fsdp_unit_module, time_fsdp_unit

    seen = []

    def unit_module(unit):
        module = fsdp_unit_module(unit)
        forward = module.forward

        def spy(x):
            seen.append({str(w.dtype).removeprefix("torch.") for w in module.weights})
            return forward(x)
        module.forward = spy
        return module
    monkeypatch.setattr(microbench_sharded, "fsdp_unit_module", unit_module)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        time_fsdp_unit({"shapes": [[64], [8, 8]], "param_dtype": "bfloat16"}, 20, 1)
        low = list(seen)
        seen.clear()
        time_fsdp_unit({"shapes": [[64], [8, 8]]}, 20, 1)
    finally:
        dist.destroy_process_group()
    # the passes: sharded (sizing, then timed), kept, then the module without FSDP2 (float32, as stored)
    plain = low.index({"float32"})
    assert low[:plain] == [{"bfloat16"}] * plain and low[plain:] == [{"float32"}] * (len(low) - plain)
    assert plain >= 2 * (len(low) - plain) > 0
    assert seen and seen == [{"float32"}] * len(seen)
