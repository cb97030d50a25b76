"""The cost model of fsdp, zero1 and pipeline (bench/costmodel_sharded.py, bench/costmodel_pipeline.py),
against hand computation."""
from __future__ import annotations

import pytest

from paratrain.bench.costmodel import MIB, Link, Workload, predict, ring_allreduce_s
from paratrain.bench.costmodel_pipeline import bubble_fraction, predict_pipeline
from paratrain.bench.costmodel_sharded import (fsdp_copies_s, fsdp_phases_s, predict_fsdp, predict_zero1,
                                               ring_allgather_s, ring_reduce_scatter_s)
from paratrain.errors import UsageError

LINK = Link(name="t", alpha_s=1e-5, beta_s_per_byte=1e-9, gamma_s_per_byte=2e-10)
FREE = Link(name="free", alpha_s=0.0, beta_s_per_byte=0.0, gamma_s_per_byte=0.0)
W = Workload(forward_s=0.1, backward_s=0.2, data_s=0.01, optimizer_s=0.04, param_bytes=(8 * MIB, 8 * MIB),
             tokens_per_step=1000)


@pytest.mark.parametrize("n", [2, 3, 8])
def test_reduce_scatter_then_all_gather_is_the_ring_all_reduce(n):
    nbytes = 10 * MIB
    assert ring_allgather_s(nbytes, n, LINK) == pytest.approx((n - 1) * 1e-5 + (n - 1) / n * nbytes * 1e-9)
    assert ring_reduce_scatter_s(nbytes, n, LINK) + ring_allgather_s(nbytes, n, LINK) == \
        pytest.approx(ring_allreduce_s(nbytes, n, LINK), rel=1e-12)
    assert ring_allgather_s(nbytes, 1, LINK) == ring_reduce_scatter_s(nbytes, 1, LINK) == 0.0


def test_fsdp_phase_compute_bound_exposes_only_the_first_gather():
    # units of 1, 1, 2 bytes; compute 4 s split 1, 1, 2; gathers 0.5 s each fit inside the compute
    assert fsdp_phases_s(4.0, [1, 1, 2], [0.5, 0.5, 0.5]) == pytest.approx(0.5 + 4.0)


def test_fsdp_phase_communication_bound_is_the_gathers_plus_the_last_compute():
    # gathers of 3 s each dominate: unit i computes right after its gather; the last unit's 2 s follow
    assert fsdp_phases_s(4.0, [1, 1, 2], [3.0, 3.0, 3.0]) == pytest.approx(9.0 + 2.0)


def test_fsdp_backward_reduce_scatters_queue_behind_prefetched_gathers():
    # two units of equal size, compute 1 s each; backward: AG0 (0.5) | C0 [0.5, 1.5], AG1 issued at 0.5 -> 1.0,
    # RS0 issued at 1.5 -> 2.0 | C1 [1.5, 2.5], RS1 at 2.5 -> 3.0
    assert fsdp_phases_s(2.0, [1, 1], [0.5, 0.5], [0.5, 0.5]) == pytest.approx(3.0)
    # without resharding (no gathers): C0 [0, 1], RS0 [1, 1.5], C1 [1, 2], RS1 [2, 2.5]
    assert fsdp_phases_s(2.0, [1, 1], [], [0.5, 0.5]) == pytest.approx(2.5)


def test_fsdp_and_zero1_on_one_rank_are_the_single_step():
    assert predict_fsdp(W, 1, LINK, unit_bytes=[8 * MIB, 8 * MIB]).step_s == pytest.approx(W.local_s())
    assert predict_zero1(W, 1, LINK).step_s == pytest.approx(W.local_s())


def test_zero1_is_allreduce_with_a_sharded_optimizer_plus_the_parameter_all_gather():
    z = predict_zero1(W, 4, LINK, bucket_mb=25)
    ddp = predict(W, 4, LINK, bucket_mb=25)
    assert z.step_s == pytest.approx(ddp.step_s - W.optimizer_s * 3 / 4 + ring_allgather_s(16 * MIB, 4, LINK))


def test_zero1_copies_its_rows_in_and_the_others_rows_out():
    def copy(nbytes):
        return 1e-5 + 2.5e-10 * nbytes
    # 16 MiB of parameters over 4 ranks: 4 MiB of its own rows into the send buffer, 12 MiB of the others' out
    base = predict_zero1(W, 4, LINK, bucket_mb=25)
    copied = predict_zero1(W, 4, LINK, bucket_mb=25, copy_s=copy)
    assert copied.step_s - base.step_s == pytest.approx(2e-5 + 16 * MIB * 2.5e-10)
    assert predict_zero1(W, 1, LINK, copy_s=copy).step_s == pytest.approx(W.local_s())  # one rank gathers nothing


def test_fsdp_on_a_free_link_saves_the_optimizer_share():
    p = predict_fsdp(W, 4, FREE, unit_bytes=[8 * MIB, 8 * MIB])
    assert p.step_s == pytest.approx(W.forward_s + W.backward_s + W.data_s + W.optimizer_s / 4)


def test_fsdp_copies_around_each_collective_add_to_an_unoverlapped_step():
    def copy(nbytes):
        return 1e-5 + 2.5e-10 * nbytes
    # per collective of an 8 MiB unit over 4 ranks: copies of 2 MiB and 8 MiB = 2 x 1e-5 + 10 MiB x 2.5e-10 s
    per = 2e-5 + 10 * MIB * 2.5e-10
    assert fsdp_copies_s(8 * MIB, 4, copy) == pytest.approx(per)
    assert fsdp_copies_s(8 * MIB, 1, copy) == 0.0 and fsdp_copies_s(8 * MIB, 4, None) == 0.0
    units = [8 * MIB, 8 * MIB]
    base = predict_fsdp(W, 4, LINK, unit_bytes=units, overlap=False)
    # the root and a unit: all-gathers in the forward, the unit's again in the backward (resharded; FSDP2
    # keeps the root's gathered), one reduce-scatter each: 5 collectives
    copied = predict_fsdp(W, 4, LINK, unit_bytes=units, overlap=False, copy_s=copy)
    assert copied.step_s - base.step_s == pytest.approx(5 * per)
    kept = predict_fsdp(W, 4, LINK, unit_bytes=units, overlap=False, copy_s=copy, reshard=False)
    kept_base = predict_fsdp(W, 4, LINK, unit_bytes=units, overlap=False, reshard=False)
    assert kept.step_s - kept_base.step_s == pytest.approx(2 * 2 * per)


@pytest.mark.parametrize("stages, m", [(2, 4), (4, 4), (2, 16)])
def test_pipeline_on_a_free_link_is_the_bubble_formula(stages, m):
    p = predict_pipeline(W, 1, stages, m, FREE, activation_bytes=1e6)
    compute = (W.forward_s + W.backward_s) / stages
    assert p.step_s == pytest.approx(compute / (1 - bubble_fraction(stages, m)) + W.data_s + W.optimizer_s / stages)
    assert bubble_fraction(stages, m) == pytest.approx((stages - 1) / (m + stages - 1))


def test_an_unequal_pipeline_is_paced_by_its_slowest_stage():
    # stage times per micro-batch: 0.25 T / 4 and 0.75 T / 4; the first micro-batch passes both,
    # the other 3 come one slowest-stage time apart
    t = W.forward_s + W.backward_s
    p = predict_pipeline(W, 1, 2, 4, FREE, activation_bytes=1e6, stage_fractions=[1, 3])
    assert p.step_s == pytest.approx(t / 4 + 3 * 0.75 * t / 4 + W.data_s + W.optimizer_s / 2)
    even = predict_pipeline(W, 1, 2, 4, FREE, activation_bytes=1e6, stage_fractions=[0.5, 0.5])
    assert even.step_s == pytest.approx(predict_pipeline(W, 1, 2, 4, FREE, activation_bytes=1e6).step_s)
    with pytest.raises(UsageError):
        predict_pipeline(W, 1, 2, 4, FREE, activation_bytes=1e6, stage_fractions=[1.0])


def test_processes_above_the_cores_fill_the_pipelines_bubble_with_other_stages_work():
    """compute_scale s = processes x threads / cores > 1: the schedule is the larger of the critical
    path on cores of their own and each core's share of every process' work, s x M x mean stage
    time (both lower bounds of any schedule); s = 1 is the critical path. gpt_wt2's pipeline on the 2-vCPU VM: its second
    stage holds about 95% of the work, so at 2 x 2 on 2 cores its first stages' bubble is the
    heavy stages' turn: 2.2 s a step measured, 3.7 s predicted as s x the critical path."""
    from paratrain.bench.costmodel_pipeline import pipeline_schedule_s

    t = W.forward_s + W.backward_s
    # equal stages, M = 4: critical path 5 t / 8; 4 processes on 2 cores (s = 2): 2 x 4 x t / 8 = t
    assert pipeline_schedule_s([t / 8, t / 8], 4) == pytest.approx(5 * t / 8)
    assert pipeline_schedule_s([t / 8, t / 8], 4, 2.0) == pytest.approx(t)
    # 5% and 95% of t: critical path t (0.05 + 0.95) / 4 + 3 x 0.95 t / 4 = 0.9625 t; work 2 x t / 2 = t
    lop = [0.05 * t / 4, 0.95 * t / 4]
    assert pipeline_schedule_s(lop, 4) == pytest.approx(0.9625 * t)
    assert pipeline_schedule_s(lop, 4, 2.0) == pytest.approx(t)
    assert pipeline_schedule_s(lop, 4, 1.5) == pytest.approx(0.9625 * t)  # the critical path is still longer
    # the step: the schedule, then data and the largest stage's optimizer, s times as long
    p = predict_pipeline(W, 2, 2, 4, FREE, activation_bytes=0, stage_fractions=[0.05, 0.95], compute_scale=2.0)
    assert p.step_s == pytest.approx(t + 2 * (W.data_s + W.optimizer_s / 2))
    # the old model, s x the critical path: 1.925 t; the bubble's idle core now runs the other stages
    assert p.step_s < 2 * 0.9625 * t + 2 * (W.data_s + W.optimizer_s / 2)


def test_the_largest_stage_paces_the_optimizer_and_the_replicas_all_reduce():
    # a tied embedding of 12 MiB in both stages of a 16 MiB model: stages of 14 and 14 MiB
    stages = [14 * MIB, 14 * MIB]
    free = predict_pipeline(W, 2, 2, 4, FREE, activation_bytes=0, stage_param_bytes=stages)
    t = W.forward_s + W.backward_s
    assert free.step_s == pytest.approx(5 * t / 8 + W.data_s + W.optimizer_s * 14 / 16)
    slow = predict_pipeline(W, 2, 2, 4, LINK, activation_bytes=0, stage_param_bytes=stages)
    assert slow.step_s - free.step_s == pytest.approx(2 * 1e-5 + ring_allreduce_s(14 * MIB, 2, LINK), rel=1e-12)
    # micro-batches measured 1.2x slower than the whole batch stretch every stage's time
    slower = predict_pipeline(W, 1, 2, 4, FREE, activation_bytes=0, microbatch_factor=1.2)
    assert slower.step_s == pytest.approx(1.2 * 5 * t / 8 + W.data_s + W.optimizer_s / 2)


def test_pipeline_adds_fill_and_drain_transfers_and_the_replicas_all_reduce():
    free = predict_pipeline(W, 2, 2, 4, FREE, activation_bytes=4e6)
    slow = predict_pipeline(W, 2, 2, 4, LINK, activation_bytes=4e6, shared_bytes=2e6)
    p2p = 2 * (1e-5 + 1e6 * 1e-9)
    expected = p2p + ring_allreduce_s(2e6, 2, LINK) + ring_allreduce_s(8 * MIB, 2, LINK)
    assert slow.step_s - free.step_s == pytest.approx(expected, rel=1e-12)
    assert slow.n == 4 and slow.words_per_s == pytest.approx(2 * W.tokens_per_step / slow.step_s)


def test_every_formula_fills_the_optimizers_part_of_its_step():
    """``Prediction.optimizer_s``, by hand (W: O = 0.04 s; scale 1.5): ring and towers step the whole
    optimizer; zero1 and fsdp 1/n of it; a pipeline its largest stage's share (12 of 16 MiB); ZeRO-1's
    measured step (this machine's CPU) all it adds to allreduce's without allreduce's optimizer, and
    FSDP2's 1/n plus :func:`fsdp_step_path_s` (the path less its 2 processes' arithmetic)."""
    from paratrain.bench.costmodel_sharded import fsdp_step_path_s
    from paratrain.bench.costmodel_towers import predict_towers

    s, O = 1.5, W.optimizer_s
    assert predict(W, 4, LINK, bucket_mb=25, compute_scale=s).optimizer_s == pytest.approx(O * s, rel=1e-12)
    assert predict_towers(W, 4, LINK, output_bytes=1e3, compute_scale=s).optimizer_s == pytest.approx(O * s)
    assert predict_zero1(W, 4, LINK, compute_scale=s).optimizer_s == pytest.approx(O * s / 4, rel=1e-12)
    assert predict_fsdp(W, 4, LINK, unit_bytes=[0, 8 * MIB, 8 * MIB], compute_scale=s).optimizer_s == \
        pytest.approx(O * s / 4, rel=1e-12)
    assert predict_fsdp(W, 1, LINK, unit_bytes=[0, 8 * MIB, 8 * MIB], compute_scale=s).optimizer_s == \
        pytest.approx(O * s, rel=1e-12)
    pipe = predict_pipeline(W, 1, 2, 4, LINK, activation_bytes=1e3, stage_param_bytes=[4 * MIB, 12 * MIB],
                            compute_scale=s)
    assert pipe.optimizer_s == pytest.approx(O * 0.75 * s, rel=1e-12)
    # ZeRO-1's measured path of 7 ms: the step is allreduce's + 7 ms + O (1/2 - 1/2) at n = 2 (no copies given)
    z = predict_zero1(W, 2, LINK, overlap=False, step_path_s=7e-3)
    ring = predict(W, 2, LINK, bucket_mb=25.0, overlap=False)
    assert z.step_s == pytest.approx(ring.step_s + 7e-3, rel=1e-12)
    assert z.optimizer_s == pytest.approx(O + 7e-3, rel=1e-12)  # everything it adds to allreduce's without O
    # a path that saves more than O (1 - 1/n): the optimizer's part is still its 1/n share
    assert predict_zero1(W, 2, LINK, overlap=False, step_path_s=-0.03).optimizer_s == pytest.approx(O / 2)
    f = predict_fsdp(W, 4, LINK, unit_bytes=[0, 8 * MIB, 8 * MIB], overlap=False, step_path_s=3e-3)
    assert fsdp_step_path_s(W, 4, LINK, 3e-3) == pytest.approx(3e-3 + O / 2 + ring_allreduce_s(4, 4, LINK)
                                                               - ring_allreduce_s(4, 2, LINK), rel=1e-12)
    assert f.optimizer_s == pytest.approx(O / 4 + fsdp_step_path_s(W, 4, LINK, 3e-3), rel=1e-12)


def test_the_dtensor_dispatch_is_compute_of_the_sharded_optimizers_step_unless_a_measured_step_holds_it():
    """``dispatch_s`` (the DTensors' per-operation dispatch, measured in one process) adds, times the
    scale, to ZeRO-1's and FSDP's step, compute and optimizer part at n > 1; not at n = 1 (plain
    tensors), and not beside a measured sharded step on this machine's CPU (which holds it)."""
    s, d = 1.5, 2e-3
    for n in (2, 4):
        for f in (lambda **k: predict_zero1(W, n, LINK, compute_scale=s, **k),
                  lambda **k: predict_fsdp(W, n, LINK, unit_bytes=[0, 8 * MIB, 8 * MIB], compute_scale=s, **k)):
            a, b = f(), f(dispatch_s=d)
            assert (b.step_s - a.step_s, b.compute_s - a.compute_s, b.optimizer_s - a.optimizer_s) == \
                pytest.approx((d * s,) * 3, rel=1e-9)
    assert predict_zero1(W, 1, LINK, dispatch_s=d).step_s == pytest.approx(W.local_s())
    assert predict_fsdp(W, 1, LINK, unit_bytes=[8 * MIB], dispatch_s=d).step_s == pytest.approx(W.local_s())
    assert predict_zero1(W, 2, LINK, overlap=False, step_path_s=7e-3, dispatch_s=d) == \
        predict_zero1(W, 2, LINK, overlap=False, step_path_s=7e-3)
    assert predict_fsdp(W, 2, LINK, unit_bytes=[8 * MIB], overlap=False, step_path_s=3e-3, dispatch_s=d) == \
        predict_fsdp(W, 2, LINK, unit_bytes=[8 * MIB], overlap=False, step_path_s=3e-3)
