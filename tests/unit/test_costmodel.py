"""Alpha-beta cost model (pure, exact against hand-computed values) and one slow run of the
collective micro-benchmark.

The made-up link uses powers of two (alpha 1 s, beta 0.5 s/byte, gamma 0.25 s/byte) so that the
hand-computed times are exact in floating point.
"""
from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from paratrain.bench.costmodel import (MIB, PRESETS, Link, Workload, fit_alpha_beta, make_buckets,
                                       overlapped_step_s, pick_bucket, predict, predict_curve, relative_error,
                                       ring_allreduce_bytes, ring_allreduce_s, scaling, tree_allreduce_s)
from paratrain.bench.costmodel_ps import ps_bytes, ps_step_s
from paratrain.errors import UsageError

TOY = Link(name="toy", alpha_s=1.0, beta_s_per_byte=0.5, gamma_s_per_byte=0.25)


@pytest.mark.parametrize("n, expected", [(1, 0.0), (2, 1000.0), (4, 1500.0), (8, 1750.0)])
def test_ring_bytes(n, expected):
    assert ring_allreduce_bytes(1000, n) == expected


@pytest.mark.parametrize("n, expected", [
    (1, 0.0),
    (2, 2 * 1.0 + 1 * 8 * 0.5 + 0.5 * 8 * 0.25),     # 2 + 4 + 1 = 7
    (4, 6 * 1.0 + 1.5 * 8 * 0.5 + 0.75 * 8 * 0.25),  # 6 + 6 + 1.5 = 13.5
])
def test_ring_time_by_hand(n, expected):
    assert ring_allreduce_s(8, n, TOY) == expected


@pytest.mark.parametrize("n, expected", [
    (1, 0.0),
    (2, 2 * 1 * (1 + 8 * 0.5) + 1 * 8 * 0.25),  # depth 1: 10 + 2 = 12
    (4, 2 * 2 * (1 + 8 * 0.5) + 2 * 8 * 0.25),  # depth 2: 20 + 4 = 24
    (5, 2 * 3 * (1 + 8 * 0.5) + 3 * 8 * 0.25),  # depth ceil(log2 5) = 3: 30 + 6 = 36
])
def test_tree_time_by_hand(n, expected):
    assert tree_allreduce_s(8, n, TOY) == expected


def test_ps_bytes():
    assert ps_bytes(8, workers=4, shards=2) == {"worker_sent": 8.0, "worker_received": 8.0,
                                                "server_received": 16.0, "server_sent": 16.0}


def test_ps_time_server_bound():
    # server phase: 4 messages handled in turn, 4*1 + 16*0.5 = 12 > worker phase 2*1 + 8*0.5 = 6;
    # reduce 16*0.25 = 4
    assert ps_step_s(8, 4, 2, TOY) == 2 * 12 + 4


def test_ps_time_server_handles_its_workers_messages_in_turn():
    # bandwidth-free: 8 workers' fixed costs at one server, one after another: 2 x 8 alpha
    free = Link(name="latency", alpha_s=1.0, beta_s_per_byte=0.0, gamma_s_per_byte=0.0)
    assert ps_step_s(8, 8, 1, free) == 2 * 8
    assert ps_step_s(8, 8, 4, free) == 2 * 8  # every server hears from every worker; a worker sends 4: tie


def test_ps_time_on_one_host_moves_the_copies_of_the_servers_messages_side_by_side():
    """TOY: alpha 1, beta 0.5, gamma 0.25. 4 workers, 2 shards: the server receives 16 bytes (8 s of
    beta in turn). On 2 cores (streams 2) with 3/4 of beta copies: 8 (1/4 + 3/4 / 2) = 5 s; server
    phase 4 + 5 = 9 > worker phase 6; reduce 4."""
    assert ps_step_s(8, 4, 2, TOY, streams=2, copy_fraction=0.75) == 2 * 9 + 4
    assert ps_step_s(8, 4, 2, TOY, streams=2, copy_fraction=0.0) == ps_step_s(8, 4, 2, TOY) == 2 * 12 + 4
    # all copies, more streams than workers: each of the 4 workers' messages side by side: 4 + 2 = 6 = worker phase
    assert ps_step_s(8, 4, 2, TOY, streams=16, copy_fraction=1.0) == 2 * 6 + 4
    # one worker: nothing beside its message (the single round trip the exchange's link was fitted to)
    assert ps_step_s(8, 1, 1, TOY, streams=2, copy_fraction=1.0) == ps_step_s(8, 1, 1, TOY)
    with pytest.raises(ValueError):
        ps_step_s(8, 4, 2, TOY, streams=0)
    with pytest.raises(ValueError):
        ps_step_s(8, 4, 2, TOY, copy_fraction=1.5)


@given(st.integers(1, 64), st.integers(1, 8), st.integers(1, 16), st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_ps_time_never_grows_with_more_streams_or_more_copies(workers, shards, streams, fraction, more):
    """Property: messages that can move side by side, or more of whose cost can, never predict a
    slower exchange."""
    base = ps_step_s(1e6, workers, shards, TOY)
    wide = ps_step_s(1e6, workers, shards, TOY, streams=streams, copy_fraction=fraction)
    wider = ps_step_s(1e6, workers, shards, TOY, streams=streams + 1, copy_fraction=fraction)
    copier = ps_step_s(1e6, workers, shards, TOY, streams=streams, copy_fraction=max(fraction, more))
    assert wider <= wide * (1 + 1e-12) and wide <= base * (1 + 1e-12) and copier <= wide * (1 + 1e-12)


def test_ps_time_worker_bound():
    # one worker, 4 shards: server phase 1*1 + 2*0.5 = 2 < worker phase 4*1 + 8*0.5 = 8; reduce 2*0.25
    assert ps_step_s(8, 1, 4, TOY) == 2 * 8 + 0.5


@pytest.mark.parametrize("params, cap, expected", [
    ([3, 3, 3, 3], 5, [6, 6]),
    ([2, 3, 4], 5, [5, 4]),       # closes exactly at the cap
    ([10, 1, 1], 5, [10, 2]),     # a parameter larger than the cap is never split
    ([5, 5], 5, [5, 5]),
    ([1, 2, 3], 100, [6]),
    ([], 5, []),
])
def test_make_buckets(params, cap, expected):
    assert make_buckets(params, cap) == expected


def test_make_buckets_rejects_zero_cap():
    with pytest.raises(UsageError, match="bucket size 0"):
        make_buckets([1], 0)


def _step(buckets, comm):
    return overlapped_step_s(forward_s=1.0, backward_s=4.0, other_s=0.5, bucket_bytes=buckets, comm_s=comm)


def test_overlap_full():
    # ready at 1, 2, 3, 4; each all-reduce 0.125 s ends before the next is ready: only the last is exposed
    assert _step([1, 1, 1, 1], lambda b: 0.125 * b) == (5.625, 0.125)


def test_overlap_none_with_one_bucket():
    # one bucket is ready when backward ends: all of its 0.5 s is exposed
    assert _step([4], lambda b: 0.125 * b) == (6.0, 0.5)


def test_overlap_comm_bound():
    # 2 s per bucket: 1-3, 3-5, 5-7, 7-9; backward ends at 4, so 5 s exposed
    assert _step([1, 1, 1, 1], lambda b: 2.0 * b) == (10.5, 5.0)


def test_overlap_uneven_buckets():
    # ready at 3 and 4; 1.5 s (3 - 4.5) then 0.5 s (4.5 - 5)
    assert _step([3, 1], lambda b: 0.5 * b) == (6.5, 1.0)


def test_overlap_no_buckets():
    assert _step([], lambda b: 1.0) == (5.5, 0.0)


@given(buckets=st.lists(st.integers(1, 10**9), max_size=30),
       per_msg=st.floats(0, 1), per_byte=st.floats(0, 1e-6), backward=st.floats(0, 10))
def test_overlap_bounds(buckets, per_msg, per_byte, backward):
    comm = lambda b: per_msg + per_byte * b  # noqa: E731
    step, exposed = overlapped_step_s(forward_s=0.5, backward_s=backward, other_s=0.25, bucket_bytes=buckets,
                                      comm_s=comm)
    total_comm = sum(comm(b) for b in buckets)
    assert 0.0 <= exposed <= total_comm * (1 + 1e-12) + 1e-12
    assert step >= 0.5 + backward + 0.25
    assert step == pytest.approx(0.75 + backward + exposed, rel=1e-12)


@given(params=st.lists(st.integers(0, 10**6), max_size=50), cap=st.integers(1, 10**6))
def test_buckets_keep_bytes_and_fill(params, cap):
    buckets = make_buckets(params, cap)
    assert sum(buckets) == sum(params)
    assert all(b >= cap for b in buckets[:-1])
    assert all(b < cap + max(params) for b in buckets)


# one replica: 1 + 2 + 0.25 + 0.75 = 4 s per step, 8 gradients of 1 MiB
W = Workload(forward_s=1.0, backward_s=2.0, data_s=0.25, optimizer_s=0.75, param_bytes=(MIB,) * 8,
             tokens_per_step=1000)
# alpha 2^-7 s, 2^27 bytes/s: a ring all-reduce of 2 MiB among 2 ranks is 2^-6 + 2^-6 = 2^-5 s
DYADIC = Link(name="dyadic", alpha_s=2.0 ** -7, beta_s_per_byte=2.0 ** -27, gamma_s_per_byte=0.0)


@pytest.mark.parametrize("algorithm", ["ring", "tree", "ps"])
def test_predict_one_device(algorithm):
    p = predict(W, 1, PRESETS["eth25"], algorithm=algorithm, bucket_mb=25)
    assert (p.step_s, p.compute_s, p.exposed_comm_s, p.words_per_s, p.speedup, p.efficiency) == (
        4.0, 4.0, 0.0, 250.0, 1.0, 1.0)


def test_predict_ring_by_hand():
    # buckets of 2 MiB ready at 0.5, 1, 1.5, 2 s of backward; each all-reduce 2^-5 s: only the last exposed
    p = predict(W, 2, DYADIC, bucket_mb=2)
    step = 4.0 + 2.0 ** -5
    assert (p.step_s, p.compute_s, p.exposed_comm_s, p.bucket_mb, p.algorithm) == (step, 4.0, 2.0 ** -5, 2.0, "ring")
    assert p.words_per_s == 2000 / step
    assert p.speedup == pytest.approx(8 / step, rel=1e-15)
    assert p.efficiency == pytest.approx(4 / step, rel=1e-15)


def test_predict_ps_by_hand():
    # 8 MiB = 2^23 bytes, 2 workers, 1 server: server phase 2 x 2^-7 (two messages in turn) + 2^24 * 2^-27
    p = predict(W, 2, DYADIC, algorithm="ps", num_ps=1)
    assert p.step_s == 4.0 + 2 * (2 * 2.0 ** -7 + 2.0 ** -3)
    assert p.bucket_mb == 0.0


def test_predict_compute_scale_against_unscaled_baseline():
    p = predict(W, 1, DYADIC, bucket_mb=2, compute_scale=2.0)
    assert (p.step_s, p.compute_s, p.speedup, p.efficiency) == (8.0, 8.0, 0.5, 0.5)


def test_efficiency_falls_with_n():
    big = Workload(forward_s=0.05, backward_s=0.1, data_s=0.0, optimizer_s=0.01,
                   param_bytes=(4 * MIB,) * 100, tokens_per_step=700)
    curve = predict_curve(big, PRESETS["eth25"], [1, 2, 4, 8, 16])
    eff = [p.efficiency for p in curve]
    assert eff[0] == 1.0
    assert all(a > b for a, b in zip(eff, eff[1:])), eff


def test_predict_rejects_unknown_algorithm():
    with pytest.raises(UsageError, match="'butterfly'.*ring, tree, ps"):
        predict(W, 2, DYADIC, algorithm="butterfly")


def test_link_rejects_negative():
    with pytest.raises(UsageError, match="alpha_s = -1"):
        Link(name="bad", alpha_s=-1.0, beta_s_per_byte=0.0, gamma_s_per_byte=0.0)


MANY_SMALL = Workload(forward_s=0.1, backward_s=0.2, data_s=0.0, optimizer_s=0.0,
                      param_bytes=(256 * 1024,) * 400, tokens_per_step=100)  # 100 MiB


def test_pick_bucket_small_without_latency():
    free = Link(name="no-alpha", alpha_s=0.0, beta_s_per_byte=1e-9, gamma_s_per_byte=0.0)
    assert pick_bucket(MANY_SMALL, 4, free) == 1.0


def test_pick_bucket_large_with_latency():
    slow = Link(name="big-alpha", alpha_s=0.1, beta_s_per_byte=1e-9, gamma_s_per_byte=0.0)
    assert pick_bucket(MANY_SMALL, 4, slow) == 100.0


def test_pick_bucket_tie_goes_to_larger():
    one_param = Workload(forward_s=0.1, backward_s=0.2, data_s=0.0, optimizer_s=0.0, param_bytes=(200 * MIB,),
                         tokens_per_step=100)
    assert pick_bucket(one_param, 4, PRESETS["ib400"]) == 100.0
    assert predict(one_param, 4, PRESETS["ib400"]).bucket_mb == 100.0


SIZES = [4 ** k for k in range(1, 14)]


@pytest.mark.parametrize("n", [2, 4])
def test_fit_exact_without_noise(n):
    alpha, beta, gamma = 50e-6, 1e-9, 1e-10
    times = [2 * (n - 1) * alpha + (2 * (n - 1) / n * beta + (n - 1) / n * gamma) * x for x in SIZES]
    a, b = fit_alpha_beta(SIZES, times, n, gamma)
    assert a == pytest.approx(alpha, rel=1e-9)
    assert b == pytest.approx(beta, rel=1e-9)


def test_fit_within_5_percent_with_3_percent_noise():
    rng = random.Random(1234)
    alpha, beta = 100e-6, 1e-9
    times = [(2 * alpha + beta * x) * (1 + rng.gauss(0, 0.03)) for x in SIZES]
    a, b = fit_alpha_beta(SIZES, times, 2)
    assert a == pytest.approx(alpha, rel=0.05)
    assert b == pytest.approx(beta, rel=0.05)


def test_fit_clamps_negative_alpha():
    # free fit: 2 alpha = -1, beta = 2; with alpha = 0 the relative-error fit of beta is 15/13
    a, b = fit_alpha_beta([1, 2], [1, 3], 2)
    assert a == 0.0
    assert b == pytest.approx(15 / 13, rel=1e-12)


def test_fit_needs_two_sizes():
    with pytest.raises(UsageError, match="distinct sizes"):
        fit_alpha_beta([4, 4], [1e-3, 1e-3], 2)


def test_scaling():
    assert scaling({1: 100.0, 2: 180.0, 4: 320.0}, 100.0) == {
        1: {"speedup": 1.0, "efficiency": 1.0}, 2: {"speedup": 1.8, "efficiency": 0.9},
        4: {"speedup": 3.2, "efficiency": 0.8}}


def test_relative_error():
    assert relative_error(150.0, 100.0) == 0.5
    assert relative_error(75.0, 100.0) == -0.25
    with pytest.raises(UsageError):
        relative_error(1.0, 0.0)


@pytest.mark.slow
def test_measured_link_on_this_machine():
    from paratrain.bench.microbench import measured_link

    link = measured_link(2, sizes_bytes=(4, 4096, 256 * 1024, 4 * MIB, 16 * MIB), repeats=5, warmup=1,
                         timeout_s=60, gamma_bytes=4 * MIB)
    assert link.name == "measured"
    assert link.alpha_s > 0 and link.beta_s_per_byte > 0 and link.gamma_s_per_byte > 0
    assert 10e6 < 1 / link.beta_s_per_byte < 1e12  # bytes/s: 10 MB/s .. 1 TB/s


@pytest.mark.slow
def test_measure_allreduce_deadline_kills_ranks():
    """Ranks still running at the deadline are killed and named. Their work, seven all-reduces of
    256 MiB (about 0.35 s each on the 2-vCPU VM), lasts over ten times the 0.2 s deadline: a 4-byte
    all-reduce had finished inside it on an idle machine (the forkserver starts ranks in milliseconds)."""
    from paratrain.bench.microbench import measure_allreduce

    with pytest.raises(RuntimeError, match="still running after timeout_s = 0.2 s"):
        measure_allreduce(2, (256 * 2 ** 20,), repeats=5, warmup=2, timeout_s=0.2)


@pytest.mark.parametrize("ratio", [0.5, 0.0625])
def test_a_compressed_payload_shrinks_the_exposed_all_reduce_by_its_ratio(ratio):
    """A communication hook's payload ratio scales every bucket's all-reduce bytes: with no latency
    and no overlap (backward 0), the exposed communication is exactly ratio x the uncompressed one;
    buckets are still cut from the gradient bytes (the bucket size picked is the same)."""
    import dataclasses

    link = Link(name="bw", alpha_s=0.0, beta_s_per_byte=1e-9, gamma_s_per_byte=0.0)
    w = Workload(forward_s=0.01, backward_s=0.0, data_s=0.0, optimizer_s=0.0,
                 param_bytes=(4 * MIB, 8 * MIB, 2 * MIB), tokens_per_step=100)
    plain = predict(w, 4, link, bucket_mb=5)
    packed = predict(dataclasses.replace(w, payload_ratio=ratio), 4, link, bucket_mb=5)
    assert plain.exposed_comm_s == pytest.approx(2 * 3 / 4 * 14 * MIB * 1e-9, rel=1e-12)
    assert packed.exposed_comm_s == pytest.approx(ratio * plain.exposed_comm_s, rel=1e-12)
    assert predict(dataclasses.replace(w, payload_ratio=ratio), 1, link).step_s == predict(w, 1, link).step_s
    with pytest.raises(UsageError, match="payload_ratio"):
        dataclasses.replace(w, payload_ratio=1.5)
