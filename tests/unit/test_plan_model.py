"""``paratrain plan``'s formulas against hand-computed cases, and their properties: more bandwidth
never predicts a slower step; more shards never predict more memory per device."""
from __future__ import annotations

import copy
import json
import math
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paratrain.bench.costmodel import Link, Workload
from paratrain.bench.mfu import PEAK_TFLOPS, count_flops, mfu, table_peak
from paratrain.bench.plan_memory import MemoryInputs, memory_per_device
from paratrain.bench.plan_model import Layout, step_parts
from paratrain.bench.plan_ps import ps_async_rate
from paratrain.bench.straggler import expected_max_normal, straggle_s
from paratrain.config import Config
from paratrain.errors import UsageError
from paratrain.bench.strategy_model import PS, RING, SHARDED_OPTIMIZER, SHARDED_PARAMETERS, STAGES, TOWERS

M = MemoryInputs(params=100, optimizer=200, activations=50, temporaries=10, largest_unit=40)


def test_memory_of_one_device_is_the_larger_phase():
    # forward end: P + O + A + T = 100 + 200 + 50 + 10 = 360; optimizer step: P + G + O = 400
    assert memory_per_device(RING, 1, M)["total"] == 400


def test_memory_of_all_reduce_keeps_the_gradient_buckets():
    # forward end: P + G (DDP's buckets) + O + A + T = 460 > optimizer step 400
    m = memory_per_device(RING, 2, M)
    assert (m["params"], m["grads"], m["optimizer"], m["total"]) == (100, 100, 200, 460)


def test_memory_of_zero1_shards_the_optimizer_and_gathers_the_parameters():
    # n = 4: O/4 = 50; forward end 100 + 100 + 50 + 60 = 310; optimizer step 100 + 100 + 50 + 100 * 1.25 = 375
    m = memory_per_device(SHARDED_OPTIMIZER, 4, M)
    assert (m["optimizer"], m["total"]) == (50, 375)


def test_memory_of_fsdp_shards_everything_but_a_gathered_unit_and_its_gradient():
    # n = 4: P/4 = 25, O/4 = 50; forward end 25 + 50 + 50 + 10 = 135; optimizer step 25 + 25 + 50 = 100;
    # backward start 25 + 50 + 50 + 2 x 40 = 205; with T = 90 and U = 10 the forward end (215) is the peak
    m = memory_per_device(SHARDED_PARAMETERS, 4, M)
    assert (m["params"], m["grads"], m["optimizer"], m["activations"], m["total"]) == (25, 25, 50, 50, 205)
    assert memory_per_device(SHARDED_PARAMETERS, 4, MemoryInputs(params=100, optimizer=200, activations=50,
                                                                 temporaries=90, largest_unit=10))["total"] == 215


def test_memory_of_a_pipeline_stage_counts_its_micro_batches_in_flight():
    big = MemoryInputs(params=100, optimizer=200, activations=500, temporaries=40)
    kw = dict(stages=2, microbatches=4, stage_shares=[0.6, 0.4], stage_params=[60, 50])
    # 1F1B, stage 0: min(S - 0, M) = 2 of 4 micro-batches: A 500 x 0.6 x 2/4 = 150, P 60, O 200 x 60/100 = 120,
    # and its gradient G 60 (held from the first backward on, before the third forward): 390; stage 1: one
    # micro-batch (50) and one micro-batch's loss (40 / 4 = 10), P 50, G 50, O 100: 260 -> stage 0
    m = memory_per_device(STAGES, 2, big, schedule="1f1b", **kw)
    assert (m["total"], m["stage"]) == (390, 0)
    # GPipe: all 4 in flight everywhere before any backward, without gradients: stage 0 60 + 120 + 300 = 480
    # (after the first backward: 60 + 60 + 120 + 225 = 465); stage 1 50 + 100 + 200 + 40 = 390
    assert memory_per_device(STAGES, 2, big, schedule="gpipe", **kw)["total"] == 480
    # each stage keeps its outputs until the micro-batch's backward: 1F1B stage 1 (the model's output, 400 for the
    # batch) adds one micro-batch's 100: 360; stage 0 (the boundary's 80) adds 2 x 20: 430 -> stage 0
    kept = memory_per_device(STAGES, 2, big, schedule="1f1b", stage_outputs=[80, 400], **kw)
    assert (kept["total"], kept["stage"], kept["activations"]) == (430, 0, 190)
    out = memory_per_device(STAGES, 2, big, schedule="1f1b", stage_outputs=[0, 800], **kw)
    assert (out["total"], out["stage"]) == (460, 1)  # 50 + 50 + 100 + 50 + 200 + 10


def test_a_pipeline_stage_shares_the_activations_by_saved_bytes_and_holds_its_data_shard_whole():
    """The activations besides the data set's storage D split by what each stage's forward saves
    (``stage_saved``, not the compute's shares); D (a language model's corpus shard, which every
    stage's view of the batch keeps) is held whole by every stage of a replica, not per micro-batch."""
    lm = MemoryInputs(params=100, optimizer=200, activations=500, temporaries=40, data_bytes=40)
    kw = dict(stages=2, microbatches=4, stage_shares=[0.6, 0.4], stage_params=[60, 50], stage_saved=[10, 90])
    # A - D = 460; stage 1: 460 x 0.9 / 4 + 40 = 143.5, + P 50 + G 50 + O 100 + T/M 10 = 353.5; stage 0:
    # 460 x 0.1 x 2/4 + 40 = 63, + 60 + 60 + 120 = 303
    m = memory_per_device(STAGES, 2, lm, schedule="1f1b", **kw)
    assert (m["total"], m["stage"], m["activations"]) == (pytest.approx(353.5), 1, pytest.approx(143.5))
    # half the batch per replica: A - D and T halve, D (the replica's corpus shard) does not:
    # 230 x 0.9 / 4 + 40 + 50 + 50 + 100 + 5 = 296.75
    half = memory_per_device(STAGES, 2, lm, schedule="1f1b", batch_ratio=0.5, **kw)
    assert (half["total"], half["stage"]) == (pytest.approx(296.75), 1)
    # 2 replicas of 2 stages (n = 4): each replica's stages hold half the corpus: 103.5 + 20 + 210 = 333.5
    assert memory_per_device(STAGES, 4, lm, schedule="1f1b", **kw)["total"] == pytest.approx(333.5)
    # gpt_wt2's last of 2 stages, M = 4 (profile v43, MiB): A 327.0 of which D 15.93, outputs (logits) 260.0,
    # T 520.0, P_1 17.01, O_1 34.03, saved shares [25.03, 286.05]: MemTracker measured 351.24 on rank 1
    gpt = MemoryInputs(params=17.79, optimizer=35.59, activations=327.0, temporaries=519.97, data_bytes=15.93)
    got = memory_per_device(STAGES, 2, gpt, stages=2, microbatches=4, stage_params=[17.04, 17.01],
                            stage_saved=[25.03, 286.05], stage_outputs=[1.0, 260.0])
    assert got["stage"] == 1
    assert got["total"] == pytest.approx(351.24, rel=0.01)


def test_a_process_holds_its_shard_of_the_data_set_its_batch_views_whatever_its_batch():
    """D (``data_bytes``, part of A): the data set's storage a language model's batch is a view of,
    whole at one process; n processes hold D / n each, towers (one process) D, in every phase."""
    m = MemoryInputs(params=100, optimizer=200, activations=50, temporaries=10, data_bytes=20)
    # one device: the optimizer step P + G + O + D = 420 above the forward's end 100 + 200 + 50 + 10 = 360
    assert memory_per_device(RING, 1, m)["total"] == 420
    # n = 2: P + G (buckets) + O + (A - D) + D / 2 + T = 100 + 100 + 200 + 30 + 10 + 10 = 450; the batch halved,
    # A - D and T halve, D / 2 does not: 100 + 100 + 200 + 15 + 10 + 5 = 430
    assert memory_per_device(RING, 2, m)["total"] == 450
    assert memory_per_device(RING, 2, m, batch_ratio=0.5)["total"] == 430
    # CPU towers, n = 2, one process: every tower's A - D (60) and the one corpus (20)
    assert memory_per_device(TOWERS, 2, m, shared_cores=True)["activations"] == 80
    # gpt_wt2 (MiB; v42's terms, D measured at v43): allreduce at N = 2, 17.79 x 2 + 35.59 + (327.0 - 15.93)
    # + 15.93 / 2 + 519.97 = 910.2, MemTracker 910.2 (918.1 with D scaled as the batch)
    gpt = MemoryInputs(params=17.79, optimizer=35.59, activations=327.0, temporaries=519.97, data_bytes=15.93)
    assert memory_per_device(RING, 2, gpt)["total"] == pytest.approx(910.2, abs=0.05)
    # checkpointing: D stays in the kept bytes (it is no block's) and is not scaled. A 100 with D 20, blocks
    # saving (30, 40), inputs (5, 5): kept 100 - 70 + 10 = 40. At n = 2 and half the batch, the forward's
    # end: P 10 + G 10 + (40 - 20) x 0.5 + 20 / 2 + T 1 x 0.5 = 40.5; the largest block's recompute: its
    # 40 x 0.5 back, with min(T, 40) x 0.5 of gradients and the loss's T gone: 10 + 10 + 10 + 20 + 10 + 0.5
    ck = MemoryInputs(params=10, optimizer=0, activations=100, temporaries=1, blocks_saved=(30, 40),
                      blocks_input=(5, 5), data_bytes=20)
    assert memory_per_device(RING, 2, ck, checkpointing=True, batch_ratio=0.5)["total"] == pytest.approx(60.5)


def test_a_pipeline_stage_with_every_micro_batch_in_flight_holds_its_gradient_after_the_first_backward():
    # GPipe, M = 2: before the first backward 2 micro-batches (10 each) without G: 60 + 120 + 20 = 200; after it
    # one micro-batch with G: 60 + 60 + 120 + 10 = 250 (above the optimizer step's 2 x 60 + 120 = 240)
    small = MemoryInputs(params=120, optimizer=240, activations=40)
    got = memory_per_device(STAGES, 2, small, stages=2, microbatches=2, stage_params=[60, 60], schedule="gpipe")
    assert got["total"] == 250


def test_memory_of_a_parameter_server_worker_and_server():
    # worker: no optimizer state: forward end 100 + 60 = 160, step 100 + 100 = 200; server, synchronous:
    # (P + 4 received gradients + the mean's buffer + the answer's copy + O) / K = (700 + 200) / 2
    m = memory_per_device(PS, 4, M, num_ps=2)
    assert (m["total"], m["server"]) == (200, 450)
    # asynchronous: one update's gradient and the answer's copy: (300 + 200) / 2
    assert memory_per_device(PS, 4, M, num_ps=2, synchronous_buckets=False)["server"] == 250
    # the busiest server of 2 holding 0.9 of the bytes (a dominant tensor): (700 + 200) x 0.9, not half
    assert memory_per_device(PS, 4, M, num_ps=2, server_share=0.9)["server"] == pytest.approx(810)


def test_checkpointing_keeps_block_inputs_and_one_block():
    m = MemoryInputs(params=0, optimizer=0, activations=100, blocks_saved=(30, 40), blocks_input=(5, 5))
    assert m.checkpointed_activations() == 100 - 70 + 10 + 40
    assert memory_per_device(RING, 1, m, checkpointing=True)["activations"] == 80


def test_checkpointings_peak_is_the_forwards_end_with_the_loss_or_a_blocks_recompute_without_it():
    """Two moments (Chen et al. 2016's recompute, in backward order): at the forward's end the blocks
    keep their inputs and the loss's temporaries T are live; while the largest block is recomputed the
    loss's are gone and its backward's gradients (at most its saved bytes, at most T) are live.
    ptb_small's one block (the LSTM, 10.7 MiB saved, 0.3 MiB input) under a 30.5 MiB loss: the
    forward's end, 17.75 + (33.06 - 10.71 + 0.31) + 30.52 = 70.9 MiB (MemTracker: 71.3), not the 81.6
    MiB of the largest block on top of it. digits_cnn's whole model in blocks (its convolutions 2.39
    MiB): the recompute, 0.18 + 0.05 + 2.39 + 0.5 = 3.13 MiB (MemTracker: 3.06)."""
    ptb = MemoryInputs(params=17.75, optimizer=0.0, activations=33.06, temporaries=30.52, blocks_saved=(10.71,),
                       blocks_input=(0.31,))
    one = memory_per_device(RING, 1, ptb, checkpointing=True)
    assert one["total"] == pytest.approx(17.75 + 33.06 - 10.71 + 0.31 + 30.52)
    assert (one["activations"], one["temporaries"]) == (pytest.approx(33.06 - 10.71 + 0.31), pytest.approx(30.52))
    # a small loss: the recompute is the peak (the largest block back, with min(T, its bytes) of gradients)
    small = MemoryInputs(params=10, optimizer=0, activations=100, temporaries=5, blocks_saved=(30, 40),
                         blocks_input=(5, 5))
    assert memory_per_device(RING, 1, small, checkpointing=True)["total"] == 10 + 100 - 70 + 10 + 40 + 5
    digits = MemoryInputs(params=0.0927, optimizer=0.0918, activations=2.4265, temporaries=0.5,
                          blocks_saved=(2.392, 0.016, 0.016), blocks_input=(0.016, 0.016, 0.016))
    got = memory_per_device(RING, 1, digits, checkpointing=True)["total"]
    assert got == pytest.approx(0.0927 + 0.0918 + 2.4265 - 2.424 + 0.048 + 2.392 + 0.5)
    assert got == pytest.approx(3.06, rel=0.03)
    # at half the batch both moments scale alike; without blocks, checkpointing changes nothing
    half = memory_per_device(RING, 1, ptb, checkpointing=True, batch_ratio=0.5)
    assert half["total"] == pytest.approx(17.75 + (33.06 - 10.71 + 0.31 + 30.52) / 2)
    bare = MemoryInputs(params=10, optimizer=0, activations=100, temporaries=5)
    assert memory_per_device(RING, 1, bare, checkpointing=True) == memory_per_device(RING, 1, bare)


def test_cpu_towers_hold_every_towers_kept_bytes_and_one_blocks_recompute_at_a_time():
    """CPU towers (one memory) under checkpointing: the one backward thread recomputes one tower's
    block at a time, so a recompute moment holds n towers' kept bytes and one block's saved bytes and
    gradients (n = 2), not n of each. A = 100, one block saving 70 from a 10-byte input, T = 40, P = 10,
    O = 20, n = 2: the forward's end 10 + 20 + 2 x 40 + 2 x 40 = 190; a recompute 10 + 20 + (2 x 40 +
    70) + min(40, 70) = 220 (n-fold it would be 10 + 20 + 2 x 110 + 2 x 40 = 330)."""
    m = MemoryInputs(params=10, optimizer=20, activations=100, temporaries=40, blocks_saved=(70,), blocks_input=(10,))
    towers = memory_per_device(TOWERS, 2, m, checkpointing=True, shared_cores=True)
    assert (towers["total"], towers["activations"], towers["temporaries"]) == (220, 150, 40)
    # n = 3: tower 0's graph first, then towers 1 and 2 together (their nodes share autograd's per-thread
    # sequence numbers): two blocks' activations at once, one's gradients, 10 + 20 + (3 x 40 + 2 x 70) + 40 =
    # 330 (n-fold: 480). digits_cnn measured 3.18, 5.58, 7.97 MiB at n = 2, 3, 4 (its 2.39 MiB block once
    # more a tower)
    three = memory_per_device(TOWERS, 3, m, checkpointing=True, shared_cores=True)
    assert (three["total"], three["activations"], three["temporaries"]) == (330, 260, 40)
    digits = MemoryInputs(params=0.0927, optimizer=0.0918, activations=2.4265, temporaries=0.5,
                          blocks_saved=(2.392, 0.016, 0.016), blocks_input=(0.016, 0.016, 0.016))
    got = [memory_per_device(TOWERS, n, digits, checkpointing=True, shared_cores=True)["total"] for n in (2, 3, 4)]
    assert got == [pytest.approx(x, rel=0.02) for x in (3.18, 5.58, 7.97)]  # 3.18, 5.57, 8.06
    # GPU towers (a memory each): device 0 holds one tower's, as one device does, with the loss over both
    gpu = memory_per_device(TOWERS, 2, m, checkpointing=True)
    assert gpu["total"] == max(10 + 20 + 40 + 2 * 40, 10 + 20 + 40 + 70 + 40)


def test_activations_scale_with_the_per_replica_batch():
    assert memory_per_device(RING, 2, M, batch_ratio=0.5)["activations"] == 25


def test_autocasts_casts_of_the_weights_stay_whole_at_any_batch_and_follow_each_strategys_replicas():
    """C (autocast's casts of the weights, kept for the backward) does not scale with the batch per
    replica: a process' whole C (all-reduce, a PS worker, checkpointing too); each CPU tower thread's
    own; a stage's share P_s / P; none under FSDP (its parameters gathered in the low dtype)."""
    m = MemoryInputs(params=100, optimizer=200, activations=160, temporaries=10, autocast_copies=30,
                     blocks_saved=(20, 40), blocks_input=(5, 5))
    # all-reduce at n = 2, half the batch a replica: P + G_kept + O + A/2 + C + T/2 = 100 + 100 + 200 + 80 + 30 + 5
    ring = memory_per_device(RING, 2, m, batch_ratio=0.5)
    assert (ring["activations"], ring["autocast_copies"], ring["total"]) == (80, 30, 515)
    assert memory_per_device(RING, 1, m)["total"] == 100 + 200 + 160 + 30 + 10
    # checkpointed: C whole (autocast's cache holds it to the forward's end) at both moments; the forward's
    # end (A = 160 - 60 + 10 = 110, with T) is below a block's recompute (A = 110 + 40 = 150, its backward's
    # min(T, 40) = 10)
    assert memory_per_device(RING, 1, m, checkpointing=True)["total"] == 100 + 200 + 150 + 30 + 10
    # where the blocks make 10 and 15 of C: autocast's cache frees them at the forward's end (30 - 25 = 5
    # left), a recompute makes the largest block's again (5 + 15)
    inside = MemoryInputs(params=100, optimizer=200, activations=160, temporaries=10, autocast_copies=30,
                          blocks_saved=(20, 40), blocks_input=(5, 5), blocks_copies=(10, 15))
    ckpt = memory_per_device(RING, 1, inside, checkpointing=True)
    assert (ckpt["total"], ckpt["autocast_copies"]) == (100 + 200 + 150 + 20 + 10, 20)
    assert memory_per_device(RING, 1, inside)["total"] == 100 + 200 + 160 + 30 + 10  # not checkpointed: all of C
    # FSDP at 2: P/2 + O/2 + A/2 + T/2, no casts
    fsdp = memory_per_device(SHARDED_PARAMETERS, 2, m, batch_ratio=0.5)
    assert (fsdp["autocast_copies"], fsdp["total"]) == (0, 50 + 100 + 80 + 5)
    # a PS worker: P + A + C + T (no optimizer state, no buckets)
    assert memory_per_device(PS, 2, m)["total"] == 100 + 160 + 30 + 10
    # towers: CPU virtual devices hold every tower's activations and casts (and the loss over both outputs)
    assert memory_per_device(TOWERS, 2, m, shared_cores=True)["total"] == 100 + 200 + 320 + 60 + 20
    assert memory_per_device(TOWERS, 2, m)["total"] == 100 + 200 + 160 + 30 + 20
    # 2 stages of 60 and 40 parameter bytes, one micro-batch: stage 0 holds 60/100 of C (18)
    stage = memory_per_device(STAGES, 2, m, stages=2, stage_params=[60, 40])
    assert (stage["stage"], stage["autocast_copies"], stage["total"]) == (0, 18, 60 + 120 + 80 + 18)
    # fp32 (no casts): nothing added
    assert memory_per_device(RING, 2, M, batch_ratio=0.5)["autocast_copies"] == 0


W = Workload(forward_s=0.1, backward_s=0.2, data_s=0.0, optimizer_s=0.05, param_bytes=(4_000_000,) * 10,
             tokens_per_step=1000)


def test_ps_async_rate_is_the_workers_or_the_servers_bound():
    link = Link(name="x", alpha_s=0.0, beta_s_per_byte=1e-9, gamma_s_per_byte=0.0)
    # worker: 0.35 s local + push 0.04 + pull 0.04 (40 MB at 1 GB/s, K = 1) = 0.43 s; 4 workers: 9.30 updates/s;
    # server: 40 MB x 2 x 1e-9 = 0.08 s per update: 12.5 updates/s -> the workers bound
    rate, step = ps_async_rate(W, 4, 1, link)
    assert step == pytest.approx(0.43) and rate == pytest.approx(4 / 0.43)
    rate16, _ = ps_async_rate(W, 16, 1, link)  # 16 workers would send 37 updates/s: the server's 12.5 bound
    assert rate16 == pytest.approx(12.5)


def test_ps_async_rate_adds_the_servers_update_to_both_bounds():
    link = Link(name="x", alpha_s=0.0, beta_s_per_byte=1e-9, gamma_s_per_byte=0.0)
    # worker: 0.43 s as above + 0.01 s that its push waits for the update = 0.44; 4 workers: 9.09 updates/s;
    # server: 0.08 + 0.01 = 0.09 s per update: 11.1 updates/s
    rate, step = ps_async_rate(W, 4, 1, link, update_s=0.01)
    assert step == pytest.approx(0.44) and rate == pytest.approx(4 / 0.44)
    rate16, _ = ps_async_rate(W, 16, 1, link, update_s=0.01)
    assert rate16 == pytest.approx(1 / 0.09)


def test_the_parameter_servers_formula_by_hand():
    """predict_ps: synchronous, local + push + pull + update, the workers stepping no optimizer;
    asynchronous, n replicas at the rate of ps_async_rate (the workers' or the servers' bound)."""
    from paratrain.bench.plan_ps import predict_ps

    link = Link(name="x", alpha_s=0.0, beta_s_per_byte=1e-9, gamma_s_per_byte=0.0)
    # 4 workers, 2 servers: a server's phase 4 x 20 MB at 1 GB/s = 0.08 s (a worker's 40 MB: 0.04), twice,
    # then the update: 0.3 + 0.16 + 0.01 = 0.47 s, all of it past the local 0.3 s exposed
    p = predict_ps(W, 4, 2, link, update_s=0.01)
    assert p.step_s == pytest.approx(0.47) and p.optimizer_s == 0.0 and p.compute_s == pytest.approx(0.3)
    assert p.exposed_comm_s == pytest.approx(0.17) and p.words_per_s == pytest.approx(4 * 1000 / 0.47)
    one = predict_ps(W, 1, 1, link, update_s=0.01)  # one device steps its own optimizer, no messages
    assert one.step_s == pytest.approx(0.35) and one.optimizer_s == pytest.approx(0.05) and one.speedup == 1.0
    # asynchronous, 4 workers, compute twice as slow: 0.6 + 0.08 (push and pull of 40 MB) + 0.02 waiting = 0.7 s;
    # 5.7 updates/s under the server's 12.5: each of the 4 replicas steps every 0.7 s
    a = predict_ps(W, 4, 1, link, synchronous=False, wait_s=0.02, compute_scale=2.0)
    assert a.step_s == pytest.approx(0.7) and a.words_per_s == pytest.approx(4 * 1000 / 0.7)
    assert a.optimizer_s == 0.0 and a.compute_s == pytest.approx(0.6)
    # 16 workers would send 22.9 updates/s: the server's 12.5 bound, 16 / 12.5 = 1.28 s a replica's step
    assert predict_ps(W, 16, 1, link, synchronous=False, wait_s=0.02, compute_scale=2.0).step_s == pytest.approx(1.28)
    with pytest.raises(UsageError, match="servers"):
        predict_ps(W, 4, 0, link)


def test_a_parameter_server_workers_guard_by_hand():
    """predict_ps's guard_s (a worker's norm and clip around its exchange, plan_ps.loop_guard): before
    the push in both modes, the prediction's optimizer part; none at n = 1 (one device steps its own
    optimizer). loop_guard: each PS strategy's own measurement in the loop's job, at n >= 2 on this
    machine; None elsewhere. A synchronous worker's stolen_s (plan_ps.loop_stolen) adds to its compute."""
    from paratrain.bench.plan_ps import loop_guard, predict_ps

    link = Link(name="x", alpha_s=0.0, beta_s_per_byte=1e-9, gamma_s_per_byte=0.0)
    # synchronous, 4 workers, 2 servers: 0.3 local + 0.004 guard + 0.16 exchange + 0.01 update = 0.474 s
    p = predict_ps(W, 4, 2, link, update_s=0.01, guard_s=0.004)
    assert p.step_s == pytest.approx(0.474) and p.optimizer_s == pytest.approx(0.004)
    assert p.compute_s == pytest.approx(0.304) and p.exposed_comm_s == pytest.approx(0.17)
    # and 0.02 s of compute lost beside the server's process: 0.494 s, of it 0.324 s compute
    q = predict_ps(W, 4, 2, link, update_s=0.01, guard_s=0.004, stolen_s=0.02)
    assert q.step_s == pytest.approx(0.494) and q.compute_s == pytest.approx(0.324)
    assert predict_ps(W, 1, 1, link, stolen_s=0.02).step_s == pytest.approx(0.35)  # one device: no server
    one = predict_ps(W, 1, 1, link, update_s=0.01, guard_s=0.004)  # one device: its own optimizer, no guard term
    assert one.step_s == pytest.approx(0.35) and one.optimizer_s == pytest.approx(0.05)
    # asynchronous, 4 workers, compute twice as slow: 0.6 + 0.004 + 0.08 + 0.02 = 0.704 s a worker's step
    a = predict_ps(W, 4, 1, link, synchronous=False, wait_s=0.02, compute_scale=2.0, guard_s=0.004)
    assert a.step_s == pytest.approx(0.704) and a.optimizer_s == pytest.approx(0.004)
    assert a.compute_s == pytest.approx(0.604)
    prof = {"loop_ps_guard_s": {"ps-async": 6e-4, "ps-sync": 4e-4}}
    assert [loop_guard(prof, n, "ps-async") for n in (1, 2, 4)] == [None, 6e-4, 6e-4]
    assert loop_guard(prof, 2, "ps-sync") == 4e-4 and loop_guard(prof, 2, "allreduce") is None
    assert loop_guard({}, 2, "ps-sync") is None and loop_guard({"loop_ps_guard_s": {}}, 2, "ps-async") is None


def test_sync_overhead_by_hand():
    """What processes that meet every step add: sync BN + the buffer broadcast + the wait for the last
    rank (here the measured meeting after 0.3 s of compute, 5.333 ms, less alpha); towers their own
    sync BN; a pipeline and an asynchronous PS nothing; one device nothing."""
    from paratrain.bench.strategy_model import sync_overhead_s

    link = Link(name="x", alpha_s=1e-5, beta_s_per_byte=1e-9, gamma_s_per_byte=0.0)
    inputs = {"sync_batchnorm_s": 0.003, "buffer_broadcast_s": 0.001, "tower_sync_batchnorm_s": 0.002,
              "meetings": [[0.1, 0.004], [0.4, 0.006]]}
    wait = 0.004 + 0.002 * (0.3 - 0.1) / (0.4 - 0.1) - 1e-5

    def terms(model, **kw):
        return sync_overhead_s(model, 2, W, link, inputs, **{"overlap": False, **kw})

    assert terms(RING) == pytest.approx(0.004 + wait) and terms(PS) == pytest.approx(0.004 + wait)
    assert terms(SHARDED_OPTIMIZER) == pytest.approx(0.004 + wait)
    assert terms(None) == pytest.approx(0.004 + wait)  # no cost model: DDP's all-reduce
    assert terms(PS, backup_workers=1) == pytest.approx(0.004)  # the servers do not wait for the last worker
    assert terms(SHARDED_PARAMETERS) == pytest.approx(0.004)  # its units' meetings are in its formula
    assert terms(RING, overlap=True) == pytest.approx(0.004)  # a cluster: the straggle alone (spread 0 here)
    sd = Workload(**{**W.__dict__, "local_sd_s": 0.01})
    assert sync_overhead_s(RING, 4, sd, link, inputs) == pytest.approx(0.004 + 0.01 * expected_max_normal(4))
    assert terms(TOWERS) == 0.002 and terms(STAGES) == 0.0 and terms(PS, synchronous=False) == 0.0
    assert sync_overhead_s(RING, 1, W, link, inputs, overlap=False) == 0.0


def test_every_plan_layout_pays_its_sync_overhead_once():
    """Sync BatchNorm, DDP's buffer broadcast and a spread of the one-device step, added to the inputs,
    raise each plan layout's step and exposed communication by exactly sync_overhead_s: all three
    for the processes that meet every step (all-reduce, ZeRO-1, FSDP, a synchronous PS), the towers'
    own sync BN for towers, nothing for a pipeline or an asynchronous PS; once, with or without
    overlap."""
    link = Link(name="x", alpha_s=1e-5, beta_s_per_byte=1e-9, gamma_s_per_byte=1e-11)
    terms = {"sync_batchnorm_s": 0.003, "buffer_broadcast_s": 0.001, "tower_sync_batchnorm_s": 0.002}
    spread = Workload(**{**W.__dict__, "local_sd_s": 0.01})
    meets = 0.004 + 0.01 * expected_max_normal(4)  # sync BN + broadcast + the straggle of 4 ranks
    expected = {RING: meets, SHARDED_OPTIMIZER: meets, SHARDED_PARAMETERS: meets, TOWERS: 0.002, STAGES: 0.0}
    for cls, overrides in LAYOUTS:
        extra = expected.get(cls.cost_model, meets if cls.synchronous else 0.0)
        for overlap in (False, True):
            lay = Layout("x", 4, dict(overrides))
            base = step_parts(cls, lay, W, link, Config(), INPUTS, overlap=overlap)
            got = step_parts(cls, lay, spread, link, Config(), {**INPUTS, **terms}, overlap=overlap)
            assert got["step_s"] - base["step_s"] == pytest.approx(extra, abs=1e-12), (cls.cost_model, overlap)
            assert got["comm_s"] - base["comm_s"] == pytest.approx(extra, abs=1e-12), (cls.cost_model, overlap)
            assert got["units_per_s"] == pytest.approx(base["units_per_s"] * base["step_s"] / got["step_s"])


def test_predict_model_prices_a_parameter_server_with_its_servers_update_and_rpc_link():
    """predict_model's PS: dist.num_ps servers, the measured update (ps_update_s) and links["rpc"] (the
    servers' messages) in place of the collectives' link, synchronous or not; by hand."""
    from paratrain.bench.plan_model import replace_dist
    from paratrain.bench.plan_ps import predict_ps
    from paratrain.bench.strategy_model import predict_model

    rpc = Link(name="rpc", alpha_s=0.0, beta_s_per_byte=1e-9, gamma_s_per_byte=0.0)
    slow = Link(name="ring", alpha_s=0.0, beta_s_per_byte=1e-6, gamma_s_per_byte=0.0)
    d = replace_dist(Config(), num_ps=2)
    inputs = {"ps_update_s": {"sync_1": 0.006, "sync_2": 0.008, "async": 0.0025}}
    # 4 workers, 2 servers over rpc: 0.3 + 0.16 (as by hand above) + the update, (0.006 + 3 x 0.002) / 2
    p = predict_model(PS, W, 4, slow, d, inputs, links={"rpc": rpc})
    assert p.step_s == pytest.approx(0.466) and p.optimizer_s == 0.0
    # asynchronous, compute twice as slow: 0.6 + 2 x max(20 MB, 40 MB at 1 GB/s) + 0.0025 / 2 = 0.68125 s a
    # worker, 5.9 updates/s, under each server's 1 / (20 MB x 2 ns + 0.00125 s) = 24.2
    a = predict_model(PS, W, 4, slow, d, inputs, links={"rpc": rpc}, synchronous=False, compute_scale=2.0)
    assert a.step_s == pytest.approx(0.68125) and a.words_per_s == pytest.approx(4 * 1000 / 0.68125)
    # a synchronous step at compute_scale 2: 0.6 + 0.16 (2 workers, 1 server: its 2 x 40 MB at 1 GB/s, twice) + 0.01
    assert predict_ps(W, 2, 1, rpc, update_s=0.01, compute_scale=2.0).step_s == pytest.approx(0.77)


def test_the_busiest_server_holds_whole_parameters_by_hand():
    """ps_largest_shard_bytes: paratrain's sharding (whole parameters, largest first to the emptiest
    server), so a dominant tensor sets the busiest server's bytes whatever K; ps_update_s takes that
    server's share of the bytes (None: 1/k)."""
    from paratrain.bench.costmodel_ps import ps_largest_shard_bytes
    from paratrain.bench.plan_ps import ps_update_s

    assert ps_largest_shard_bytes([900, 50, 50], 2) == 900  # 900 | 50 + 50
    assert ps_largest_shard_bytes([40, 30, 20, 10], 2) == 50  # 40 + 10 | 30 + 20
    assert ps_largest_shard_bytes([40, 30, 20, 10], 3) == 40  # 40 | 30 | 20 + 10
    assert ps_largest_shard_bytes([5], 3) == 5 and ps_largest_shard_bytes([4_000_000] * 10, 2) == 20_000_000
    with pytest.raises(UsageError, match="shards"):
        ps_largest_shard_bytes([5], 0)
    measured = {"sync_1": 0.02, "sync_2": 0.03, "async": 0.01}
    assert ps_update_s(measured, 4, 2, True, share=0.9) == pytest.approx((0.02 + 3 * 0.01) * 0.9)
    assert ps_update_s(measured, 4, 2, True) == pytest.approx((0.02 + 3 * 0.01) / 2)
    assert ps_update_s(measured, 4, 2, False, share=0.9) == pytest.approx(0.009)


def test_a_dominant_parameter_paces_every_exchange_through_its_server_by_hand():
    """predict_model's PS with one parameter of 36 of 40 MB: two servers hold 36 and 4 MB, so the busiest
    one's 36 MB, not 20, sets the exchange, its update (0.9 of the measured) and the asynchronous
    servers' bound; an even split would price 2 servers like 0.47 s (test above)."""
    from paratrain.bench.plan_model import replace_dist
    from paratrain.bench.strategy_model import predict_model

    wd = Workload(forward_s=0.1, backward_s=0.2, data_s=0.0, optimizer_s=0.05, param_bytes=(2e6, 36e6, 2e6),
                  tokens_per_step=1000)
    rpc = Link(name="rpc", alpha_s=0.0, beta_s_per_byte=1e-9, gamma_s_per_byte=0.0)
    d = replace_dist(Config(), num_ps=2)
    inputs = {"ps_update_s": {"sync_1": 0.006, "sync_2": 0.008, "async": 0.0025}}
    # 4 workers: the busiest server's phase 4 x 36 MB at 1 GB/s = 0.144 s (a worker's 40 MB: 0.04), twice,
    # + its update (0.006 + 3 x 0.002) x 0.9: 0.3 + 0.288 + 0.0108
    p = predict_model(PS, wd, 4, rpc, d, inputs, links={"rpc": rpc})
    assert p.step_s == pytest.approx(0.5988)
    # one server: 0.3 + 2 x 4 x 40 MB + 0.012 = 0.632; the second server saves 5%, not the even split's 25%
    one = predict_model(PS, wd, 4, rpc, replace_dist(Config(), num_ps=1), inputs, links={"rpc": rpc})
    assert one.step_s == pytest.approx(0.632)
    # asynchronous, compute twice as slow: a worker 0.6 + 2 x max(36, 40 MB) + 0.0025 x 0.9 = 0.68225 s; the
    # busiest server 36 MB x 2 ns + 0.00225 = 0.07425 s an update, 13.5/s: 16 workers (23.5/s) wait for it
    a = predict_model(PS, wd, 4, rpc, d, inputs, links={"rpc": rpc}, synchronous=False, compute_scale=2.0)
    assert a.step_s == pytest.approx(0.68225)
    a16 = predict_model(PS, wd, 16, rpc, d, inputs, links={"rpc": rpc}, synchronous=False, compute_scale=2.0)
    assert a16.step_s == pytest.approx(16 * 0.07425)
    # paratrain predict --algorithm ps (workers step their own optimizer): 0.35 + 0.288, not the even split's 0.51
    from paratrain.bench.costmodel import predict

    assert predict(wd, 4, rpc, algorithm="ps", num_ps=2).step_s == pytest.approx(0.35 + 0.288)


def test_ps_message_link_reproduces_the_measured_exchange():
    from paratrain.bench.plan_ps import ps_message_link

    echo = Link(name="rpc", alpha_s=1e-4, beta_s_per_byte=2e-10, gamma_s_per_byte=0.0)
    # 40 MB each way; the exchange took 0.1 s of which the update 0.01: beta = (0.1 - 0.01 - 2e-4) / 80 MB
    link = ps_message_link(echo, 0.1, 0.01, 40e6)
    assert link.alpha_s == 1e-4 and link.beta_s_per_byte == pytest.approx(0.0898 / 80e6)
    # one worker, one server: its step is its local time plus the measured exchange, exactly
    _, step = ps_async_rate(W, 1, 1, link, update_s=0.01)
    assert step == pytest.approx(W.local_s() + 0.1)
    # two servers: the worker still sends and receives every byte, with one latency per server
    _, two = ps_async_rate(W, 1, 2, link, update_s=0.005)
    assert two == pytest.approx(W.local_s() + 2 * (2e-4 + 40e6 * link.beta_s_per_byte) + 0.005)
    # an exchange faster than its update and latencies (noise) is a free link, never a negative one
    assert ps_message_link(echo, 0.005, 0.01, 40e6).beta_s_per_byte == 0.0
    with pytest.raises(UsageError, match="bytes > 0"):
        ps_message_link(echo, 0.1, 0.01, 0)


def test_ps_update_seconds_are_linear_in_the_workers_and_split_over_the_servers():
    from paratrain.bench.plan_ps import ps_update_s

    got = {"sync_1": 0.006, "sync_2": 0.008, "async": 0.0025}
    assert ps_update_s(got, 2, 1) == pytest.approx(0.008)
    assert ps_update_s(got, 4, 1) == pytest.approx(0.012)  # 0.006 + 3 x 0.002: one more gradient added each
    assert ps_update_s(got, 4, 2) == pytest.approx(0.006)  # each server updates half the bytes
    assert ps_update_s(got, 4, 2, synchronous=False) == pytest.approx(0.00125)
    assert ps_update_s(None, 4, 2) == 0.0
    # a second gradient measured cheaper than one (noise) never makes more workers cheaper
    assert ps_update_s({"sync_1": 0.008, "sync_2": 0.007, "async": 0.0}, 16, 1) == pytest.approx(0.008)


def test_ps_sync_step_pays_the_servers_update_after_the_messages():
    link = Link(name="x", alpha_s=1e-5, beta_s_per_byte=1e-9, gamma_s_per_byte=0.0)
    measured = {**INPUTS, "ps_update_s": {"sync_1": 0.006, "sync_2": 0.008, "async": 0.0025}}
    cls, _ = LAYOUTS[5]
    for n, k, update in ((2, 1, 0.008), (4, 2, 0.006)):
        a, b = [step_parts(cls, Layout("x", n, {"num_ps": k}), W, link, Config(), x) for x in (INPUTS, measured)]
        assert b["step_s"] == pytest.approx(a["step_s"] + update, abs=1e-15)
        assert b["comm_s"] == pytest.approx(a["comm_s"] + update, abs=1e-15)  # the workers wait for it
    a, b = [step_parts(cls, Layout("x", 1, {"num_ps": 1}), W, link, Config(), x) for x in (INPUTS, measured)]
    assert a == b  # one worker steps on its own optimizer


def test_the_ps_update_microbenchmark_prices_the_servers_step(monkeypatch):
    """What a server's update costs is what it measures: with the server's optimizer step made 20 ms
    slower (a sleep, which a busy machine does not shorten), every kind of update takes 20 ms more
    (a few ms without it, for these 4 MB); the process' intra-op threads are as before."""
    import time

    import torch

    from paratrain.bench.microbench_rpc import measured_ps_update
    from paratrain.ps.server import ShardServer

    params = [torch.nn.Parameter(torch.randn(1000, 1000)), torch.nn.Parameter(torch.randn(1000))]
    optimizer = torch.optim.SGD(params, lr=0.5)
    threads = torch.get_num_threads()
    plain = measured_ps_update(params, optimizer, 1.0, repeats=5, warmup=1)
    assert set(plain) == {"sync_1", "sync_2", "async"} and all(0 < v < 0.5 for v in plain.values())
    step = ShardServer._step

    def slow(self, lr):
        time.sleep(0.02)
        return step(self, lr)

    monkeypatch.setattr(ShardServer, "_step", slow)
    slowed = measured_ps_update(params, optimizer, 1.0, repeats=5, warmup=1)
    assert all(0.02 <= v < 0.5 for v in slowed.values())
    assert torch.get_num_threads() == threads


class SlowSGD(torch.optim.SGD):
    """SGD whose step sleeps 300 ms first (importable: the round trip's server process builds it)."""

    def step(self, closure=None):
        time.sleep(0.3)
        return super().step(closure)


def test_the_ps_round_trip_microbenchmark_times_the_servers_update():
    """What a worker's exchange with a server costs is what it measures, between two processes: with
    the server's optimizer step 300 ms slower (a sleep, which a busy machine does not shorten), the
    round trip takes about 300 ms more than a plain SGD's (a few ms for these 4 MB each way; on a busy
    machine a median of 5 moved by up to 60 ms: with a 100 ms sleep the CI of 2026-12-01 measured 63 ms
    plain and 117 ms slowed, hence the longer sleep and a margin of 100 ms)."""
    from paratrain.bench.microbench_rpc import measured_ps_round_trip

    params = [torch.nn.Parameter(torch.randn(1000, 1000)), torch.nn.Parameter(torch.randn(1000))]
    plain = measured_ps_round_trip(params, torch.optim.SGD(params, lr=0.5), repeats=5, warmup=1)
    slowed = measured_ps_round_trip(params, SlowSGD(params, lr=0.5), repeats=5, warmup=1)
    assert 0 < plain < 0.5 and slowed >= 0.3
    assert slowed - plain >= 0.2  # the sleep, less the medians' noise on a busy machine


class BrokenSGD(torch.optim.SGD):
    """SGD whose step fails (importable: the round trip's server process builds it)."""

    def step(self, closure=None):
        raise ValueError("the server's optimizer broke")


def test_the_ps_round_trip_microbenchmark_reports_a_failure_at_once():
    """A server whose update fails ends the measurement with the worker's error, and the server is
    stopped at once instead of waiting out the timeout in rpc.shutdown."""
    from paratrain.bench.microbench_rpc import measured_ps_round_trip

    params = [torch.nn.Parameter(torch.randn(100, 10))]
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 0 failed .*the server's optimizer broke"):
        measured_ps_round_trip(params, BrokenSGD(params, lr=0.5), repeats=2, warmup=0, timeout_s=240)
    assert time.monotonic() - t0 < 120  # half the timeout: start-up of two processes and one push


def test_ps_sync_mean_reuses_its_buffers_and_equals_the_plain_mean():
    """The synchronous server averages into buffers it keeps from step to step (no fresh tensor per
    step), bitwise equal to clone / add / divide, and never into a worker's gradient."""
    import torch

    from paratrain.ps.server import ShardServer

    server = ShardServer(0, 3, "sync", timeout_s=60.0)
    server.init([torch.zeros(5, 3), torch.zeros(7)], torch.optim.SGD, {"lr": 1.0})
    buffers = None
    for step in range(3):
        grads = [[torch.randn(5, 3), torch.randn(7)] for _ in range(3)]
        kept = [[g.clone() for g in gs] for gs in grads]
        before = [p.detach().clone() for p in server.params]
        futs = [server.push(w, server.version, grads[w], 1.0, 0.0) for w in range(3)]
        torch.futures.wait_all(futs)
        for i in range(2):
            mean = (kept[0][i].clone() + kept[1][i] + kept[2][i]) / 3
            assert torch.equal(server.params[i].detach(), before[i] - mean)
            assert all(torch.equal(grads[w][i], kept[w][i]) for w in range(3))
        ptrs = [b.data_ptr() for b in server._sums]
        assert buffers is None or ptrs == buffers
        assert not server._sum_busy  # free for the next step, which therefore averages into them
        buffers = ptrs


def test_towers_broadcast_gather_and_reduce_through_device_0_or_share_the_cores():
    from paratrain.bench.costmodel_towers import predict_towers

    link = Link(name="x", alpha_s=1e-5, beta_s_per_byte=1e-9, gamma_s_per_byte=1e-10)
    p = predict_towers(W, 4, link, output_bytes=1e6)
    # compute 0.35 s; broadcast 3 alpha + 40 MB beta = 0.04003; outputs there and back 2 x 3 x (alpha + 1e6 beta)
    # = 0.00606; reduce 3 alpha + 40 MB (beta + gamma) = 0.04403
    assert p.step_s == pytest.approx(0.35 + 0.04003 + 0.00606 + 0.04403)
    shared = predict_towers(W, 4, link, output_bytes=1e6, shared_cores=True)
    assert shared.step_s == pytest.approx(4 * 0.3 + 0.05) and shared.exposed_comm_s == 0
    # on shared cores the join of 4 outputs of 1 MB is a memory copy of 4 MB: 1e-5 + 4e6 x 2.5e-10 s = 0.00101 s
    joined = predict_towers(W, 4, link, output_bytes=1e6, shared_cores=True, copy_s=lambda b: 1e-5 + 2.5e-10 * b)
    assert joined.step_s == pytest.approx(4 * 0.3 + 0.05 + 0.00101)
    assert joined.exposed_comm_s == pytest.approx(0.00101)
    one = predict_towers(W, 1, link, output_bytes=1e6, shared_cores=True, copy_s=lambda b: 1.0)
    assert one.exposed_comm_s == 0  # one tower joins nothing
    # the forwards side by side as measured (0.25 s for the 4), the backward 4 x 0.2 s in the caller's thread
    side = predict_towers(W, 4, link, output_bytes=1e6, shared_cores=True, forward_side_by_side_s=0.25)
    assert side.step_s == pytest.approx(0.25 + 4 * 0.2 + 0.05)
    apart = predict_towers(W, 4, link, output_bytes=1e6, forward_side_by_side_s=0.25)  # own devices: ignored
    assert apart.step_s == pytest.approx(p.step_s)
    # the forward measured with the join in it (profile version 26): the copy is not added again
    copy = {"output_bytes": 1e6, "shared_cores": True, "copy_s": lambda b: 1e-5 + 2.5e-10 * b}
    measured = predict_towers(W, 4, link, forward_side_by_side_s=0.25, joined=True, **copy)
    assert measured.step_s == pytest.approx(0.25 + 4 * 0.2 + 0.05) and measured.exposed_comm_s == 0
    alone = predict_towers(W, 4, link, forward_side_by_side_s=0.25, **copy)  # an older profile: forwards alone
    assert alone.step_s == pytest.approx(0.25 + 4 * 0.2 + 0.05 + 0.00101)
    unmeasured = predict_towers(W, 4, link, joined=True, **copy)  # no measured forward: the join is priced
    assert unmeasured.step_s == pytest.approx(4 * 0.3 + 0.05 + 0.00101)


def test_towers_forward_side_by_side_is_the_concurrent_one_thread_forward_times_n_over_cores():
    from paratrain.bench.plan import towers_forward_s

    prof = {"workloads": {"2": {"forward_s": 0.02}, "1": {"forward_s": 0.03, "concurrent": 2}}}
    assert towers_forward_s(prof, 2) == pytest.approx(0.03)  # 2 towers of 1 thread on 2 cores: as measured
    assert towers_forward_s(prof, 4) == pytest.approx(0.06)  # 4 towers on 2 cores: two rounds
    assert towers_forward_s(prof, 2, ratio=0.5) == pytest.approx(0.015)  # half the batch per tower
    assert towers_forward_s(prof, 1) is None  # fewer towers than cores: each has several threads, not measured
    assert towers_forward_s({"workloads": {"2": {"forward_s": 0.02}}}, 2) is None  # one core: not measured


def test_towers_forward_side_by_side_is_the_threads_measurement_where_the_profile_has_it():
    from paratrain.bench.plan import towers_forward_s

    prof = {"workloads": {"2": {"forward_s": 0.02}, "1": {"forward_s": 0.03, "concurrent": 2}},
            "towers_forward_threads": {"towers": 2, "seconds": 0.04}}
    assert towers_forward_s(prof, 2) == pytest.approx(0.04)  # the threads' 40 ms, not the processes' 30
    assert towers_forward_s(prof, 4) == pytest.approx(0.08)  # 4 towers on 2 cores: two rounds
    assert towers_forward_s(prof, 2, ratio=0.5) == pytest.approx(0.02)
    assert towers_forward_s(prof, 1) is None


def _sleepy(forward_s: float, seen: list | None = None):
    """A model whose forward sleeps ``forward_s`` (noting thread, threads, replica and batch in
    ``seen``) and whose backward sleeps 30 ms per call: a sleep, which a busy machine does not shorten."""
    import threading
    import time

    import torch

    class SlowBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            time.sleep(0.03)
            return grad

    class Sleepy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)

        def forward(self, x):
            if seen is not None:
                seen.append((threading.get_ident(), torch.get_num_threads(), id(self), x.shape[1]))
            time.sleep(forward_s)
            return SlowBackward.apply(self.lin(x))

    return Sleepy()


def test_the_towers_microbenchmark_times_cpu_towers_forward_with_the_join_and_their_backward_after_a_full_step():
    """Three towers whose forwards each sleep 50 ms and whose backward sleeps 30 ms once per tower (a
    sleep, which a busy machine does not shorten): the timed loss runs through CPUTowers, so each tower
    gets its third of the batch in its own thread, with its share of the intra-op threads, on its own
    replica, side by side (about 50 ms, not 150 in a row), and the loss sees the joined outputs of the
    whole batch; the one backward runs through the three towers' graphs in the caller (3 x 30 ms);
    every step before them has the process' threads, and so does the caller after; the gradients are
    left as None, as the loop's zero_grad leaves them."""
    import torch

    from paratrain.bench.microbench_towers import measured_towers_forward

    seen, steps, joined = [], [], []
    model = _sleepy(0.05, seen)
    x = torch.randn(4, 6, 3)  # batch dimension 1, as the LSTM's (T, B) inputs

    def loss_of(engine):
        y = engine(x)
        joined.append(tuple(y.shape))
        return y.sum()

    threads = torch.get_num_threads()
    got = measured_towers_forward(model, loss_of, lambda: steps.append(torch.get_num_threads()), 3, 1,
                                  repeats=3, warmup=1)
    assert 0.05 <= got["seconds"] < 0.1 and 0.09 <= got["backward_seconds"] < 0.15 and got["repeats"] == 3
    assert "sync_batchnorm_s" not in got and all(p.grad is None for p in model.parameters())
    assert steps == [threads] * 4 and torch.get_num_threads() == threads
    assert joined == [(4, 6, 3)] * 4  # the loss on the joined outputs
    assert {b for *_, b in seen} == {2}  # each tower its third of the batch
    assert {n for _, n, _, _ in seen} == {max(1, threads // 3)}
    assert len({m for _, _, m, _ in seen}) == 3 and id(model) in {m for _, _, m, _ in seen}
    assert len({t for t, *_ in seen[:3]}) == 3


def test_the_towers_microbenchmark_times_the_synchronised_towers_in_turn_and_keeps_the_difference():
    """The plain towers (forward 20 ms, backward 3 x 30 ms) and the synchronised ones (forward 60 ms,
    the same backward), each after its own training step, in turn: the difference is their forward's
    40 ms; the plain model's forward and backward are still what is kept; and the timed steps go on
    past ``repeats`` until they last ``least_s``."""
    import torch

    from paratrain.bench.microbench_towers import measured_towers_forward
    from paratrain.strategies.towers import TowerGroup

    steps = []
    plain, synced = _sleepy(0.02), _sleepy(0.06)
    got = measured_towers_forward(plain, lambda engine: engine(torch.randn(6, 3)).sum(), lambda: steps.append(1), 3,
                                  0, repeats=2, warmup=1, least_s=1.0, synced=(synced, TowerGroup(3)))
    assert 0.02 <= got["seconds"] < 0.05 and 0.09 <= got["backward_seconds"] < 0.15
    assert 0.03 <= got["sync_batchnorm_s"] < 0.07
    # each round: both, each after a step; past 2 repeats until the timed steps (110 + 150 ms a round) last 1 s
    assert 3 <= got["repeats"] <= 6 and len(steps) == 2 * (got["repeats"] + 1)
    assert all(p.grad is None for m in (plain, synced) for p in m.parameters())


def test_latency_bandwidth_fit_is_exact_on_noise_free_messages():
    from paratrain.bench.microbench import fit_latency_bandwidth

    sizes = [4 ** k for k in range(1, 12)]
    alpha, beta = fit_latency_bandwidth(sizes, [3e-5 + 2e-10 * s for s in sizes])
    assert alpha == pytest.approx(3e-5) and beta == pytest.approx(2e-10)


def test_mfu_is_achieved_over_peak():
    assert mfu(1e12, 0.5, 4, 1e12) == pytest.approx(0.5)
    assert math.isnan(mfu(math.nan, 0.5, 4, 1e12))


def test_cpu_peak_is_the_fastest_product_kernel(monkeypatch, tmp_path):
    """A kernel slower than another (float16 ``torch.mm`` on a CPU without float16 arithmetic) does
    not set the peak: the fastest of :data:`PRODUCTS` does."""
    import time

    import torch

    from paratrain.bench import mfu as m

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))

    def slow(a, b):
        time.sleep(0.05)  # at least 50 ms for 2 x 64^3 FLOPs: at most 10.5 MFLOP/s
        return a @ b

    monkeypatch.setattr(m, "PRODUCTS", {"slow": slow, "fast": torch.mm})
    fast = m.measured_cpu_peak(torch.float32, size=64, seconds=0.05)
    monkeypatch.setattr(m, "PRODUCTS", {"slow": slow})
    slowest = m.measured_cpu_peak(torch.float32, size=64, seconds=0.05)
    assert slowest <= 2 * 64 ** 3 / 0.05 < fast


def test_a_cached_cpu_peak_below_a_runs_achieved_rate_is_measured_again(monkeypatch, tmp_path):
    """A peak cached while the cores were shared (too low) is measured again when a run achieves
    more; the cache keeps the best value; a peak still below the achieved rate gives no MFU."""
    import json
    import time

    import torch

    from paratrain.bench import mfu as m

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(m, "PRODUCTS", {"mm": torch.mm})
    key = f"{m._cpu_name()}|threads={torch.get_num_threads()}|torch.float32|1024|mm"
    m._cache_path().parent.mkdir(parents=True)
    m._cache_path().write_text(json.dumps({key: 1e6}))  # 1 MFLOP/s: measured on a busy machine
    assert m.peak_flops(torch.device("cpu"), "float32")[0] == 1e6  # no run to contradict it: the cache
    peak, source = m.peak_flops(torch.device("cpu"), "float32", achieved=2e6)
    assert peak > 1e8 and source.startswith("measured: float32")  # any CPU multiplies faster than that
    assert json.loads(m._cache_path().read_text())[key] == peak  # the better value replaced the cached one

    def slow(a, b):
        time.sleep(0.05)
        return a @ b

    monkeypatch.setattr(m, "PRODUCTS", {"mm": slow})  # the same key, a worse measurement
    m.measured_cpu_peak(torch.float32, seconds=0.01, fresh=True)
    assert json.loads(m._cache_path().read_text())[key] == peak  # never replaces the better one
    nan, why = m.peak_flops(torch.device("cpu"), "float32", achieved=1e20)
    assert math.isnan(nan) and "no MFU" in why and "below this run's" in why


def test_flops_of_a_linear_layer_forward_and_backward():
    import torch

    layer = torch.nn.Linear(8, 16, bias=False)
    x = torch.randn(5, 8)
    _, flops = count_flops(lambda: layer(x).sum().backward())
    assert flops == 2 * 5 * 8 * 16 * 2  # forward, and the weight's gradient (x needs none)


def test_flops_of_a_cpu_lstm_count_both_products_of_every_step():
    import torch

    lstm = torch.nn.LSTM(8, 16, num_layers=2)
    x = torch.randn(5, 3, 8)  # T = 5 steps, B = 3 sequences
    _, flops = count_flops(lambda: lstm(x)[0].sum().backward())
    forward = 2 * 5 * 3 * (64 * 8 + 64 * 16) + 2 * 5 * 3 * (64 * 16 + 64 * 16)  # 4 gates x 16 = 64 rows
    assert flops == 3 * forward


def test_flops_of_a_cudnn_lstm_by_hand():
    """The GPU's fused LSTM (aten._cudnn_rnn) as its shapes reach the counter: 2 layers of 4 gates x
    16 units, input 8, T = 5 steps of B = 3 sequences; weights with biases (4 tensors a layer)."""
    from paratrain.bench.mfu import _cudnn_rnn_backward_flop, _cudnn_rnn_flop

    weight = [(64, 8), (64, 16), (64,), (64,), (64, 16), (64, 16), (64,), (64,)]
    forward = 2 * 5 * 3 * (64 * 8 + 64 * 16) + 2 * 5 * 3 * (64 * 16 + 64 * 16)
    assert _cudnn_rnn_flop((5, 3, 8), weight, 4) == forward
    assert _cudnn_rnn_flop((3, 5, 8), weight, 4, batch_first=True) == forward
    assert _cudnn_rnn_flop((15, 8), weight, 4) == forward  # packed: 15 steps in all
    no_bias = [w for w in weight if len(w) == 2]
    assert _cudnn_rnn_flop((5, 3, 8), no_bias, 2) == forward
    assert _cudnn_rnn_backward_flop((5, 3, 8), weight, 4) == 2 * forward


def test_flops_of_a_cudnn_lstm_with_a_projection_and_as_the_counter_calls_it():
    """proj_size = 4: w_hh is 4H x P and each layer adds w_hr (P x H), nn.LSTM's own flat weights; the
    counter's registry (torch's shape wrapper) hands the formula the weight list as shapes."""
    from paratrain.bench.mfu import _counter, _cudnn_rnn_flop

    lstm = torch.nn.LSTM(8, 16, num_layers=2, proj_size=4)
    weight = [tuple(w.shape) for w in lstm._flat_weights]  # per layer w_ih, w_hh, b_ih, b_hh, w_hr
    forward = 2 * 5 * 3 * (64 * 8 + 64 * 4 + 4 * 16) + 2 * 5 * 3 * (64 * 4 + 64 * 4 + 4 * 16)
    assert _cudnn_rnn_flop((5, 3, 8), weight, 5) == forward
    no_bias = [tuple(w.shape) for w in torch.nn.LSTM(8, 16, proj_size=4, bias=False)._flat_weights]
    assert _cudnn_rnn_flop((5, 3, 8), no_bias, 3) == 2 * 5 * 3 * (64 * 8 + 64 * 4 + 4 * 16)
    aten = torch.ops.aten
    registry = _counter().flop_registry
    x, h = torch.zeros(5, 3, 8), torch.zeros(2, 3, 4)
    flops = registry[aten._cudnn_rnn](x, list(lstm._flat_weights), 5, None, h, h, 2, 16, 4, 2, False, 0.0, True,
                                      False, [], None, out_val=None)
    assert flops == forward  # the arguments as aten._cudnn_rnn receives them (mode 2: LSTM)
    assert aten._cudnn_rnn_backward in registry


def test_peak_table_picks_the_most_specific_device():
    assert table_peak("NVIDIA H100 PCIe", "bfloat16") == 756.0e12
    assert table_peak("NVIDIA H100 80GB HBM3", "bfloat16") == 989.4e12
    assert table_peak("NVIDIA A100-SXM4-80GB", "float32") == 19.5e12
    assert table_peak("Some GPU", "float32") is None and PEAK_TFLOPS


class _Cls:  # a registry entry's attributes that step_parts reads
    def __init__(self, model, synchronous=True):
        self.cost_model, self.synchronous, self.name = model, synchronous, "x"



INPUTS = {"units": [4_000_000] * 10, "output_bytes": 1e6,
          "stage_profiles": {"2": {"activation_bytes": 1e6, "shared_bytes": 0.0, "stage_param_bytes": [2e7, 2e7],
                                   "stage_fractions": [0.5, 0.5], "microbatch_factor": 1.1}}}
LAYOUTS = [(_Cls(RING), {}), (_Cls(SHARDED_OPTIMIZER), {}), (_Cls(SHARDED_PARAMETERS), {}), (_Cls(TOWERS), {}),
           (_Cls(STAGES), {"pipeline_stages": 2, "microbatches": 4}), (_Cls(PS), {"num_ps": 2}),
           (_Cls(PS, synchronous=False), {"num_ps": 2})]


@settings(max_examples=40, deadline=None)
@given(n=st.sampled_from([2, 4, 8, 16]), beta=st.floats(1e-12, 1e-8), faster=st.floats(1.0, 100.0),
       alpha=st.floats(0, 1e-4), which=st.integers(0, len(LAYOUTS) - 1))
def test_more_bandwidth_never_predicts_a_slower_step(n, beta, faster, alpha, which):
    cls, overrides = LAYOUTS[which]
    slow = Link(name="slow", alpha_s=alpha, beta_s_per_byte=beta, gamma_s_per_byte=1e-11)
    fast = Link(name="fast", alpha_s=alpha, beta_s_per_byte=beta / faster, gamma_s_per_byte=1e-11)
    a = step_parts(cls, Layout("x", n, dict(overrides)), W, slow, Config(), INPUTS)
    b = step_parts(cls, Layout("x", n, dict(overrides)), W, fast, Config(), INPUTS)
    assert b["step_s"] <= a["step_s"] * (1 + 1e-12)
    assert b["units_per_s"] >= a["units_per_s"] * (1 - 1e-12)


@settings(max_examples=60, deadline=None)
@given(params=st.floats(1, 1e10), optimizer=st.floats(0, 2e10), acts=st.floats(0, 1e10), temps=st.floats(0, 1e9),
       unit=st.floats(0, 1), n=st.integers(2, 512), more=st.integers(1, 8),
       model=st.sampled_from([SHARDED_OPTIMIZER, SHARDED_PARAMETERS]))
def test_more_shards_never_predict_more_memory_per_device(params, optimizer, acts, temps, unit, n, more, model):
    m = MemoryInputs(params=params, optimizer=optimizer, activations=acts, temporaries=temps,
                     largest_unit=unit * params)
    fewer, more_shards = memory_per_device(model, n, m), memory_per_device(model, n * (more + 1), m)
    assert more_shards["total"] <= fewer["total"] * (1 + 1e-12)


def test_a_layout_the_recipe_refuses_is_named_with_the_strategys_reason():
    from pathlib import Path

    from paratrain.bench.plan import refusal

    recipe = str(Path(__file__).resolve().parents[2] / "configs" / "digits_cnn.toml")  # sync BatchNorm
    said = refusal(recipe, None, [], Layout("ps-async", 4, {"num_ps": 2}))
    assert said and "sync_batchnorm needs workers that step together; ps-async" in said
    assert refusal(recipe, None, [], Layout("ps-sync", 4, {"num_ps": 2})) is None
    assert refusal(recipe, None, [], Layout("replicate", 2, {})) is None


def test_a_row_over_several_machines_is_the_command_each_machine_runs():
    """A row priced on machines of ``per_node`` devices (a flat ib400: 1; nvlink+ib400: --devices-per-node)
    spans ceil(N / per_node) machines: its command is the one each runs, with --nnodes, --nproc a machine's
    share, and the shell's $NODE_RANK and $NODE0 for --node-rank and the rendezvous (README, "Several
    machines"); on one machine, or per_node None (one machine of any size), --nproc N as before. Towers
    name their devices (they are never over several machines: infeasible there)."""
    from paratrain.bench.plan import command_line, machines_of

    row = {"strategy": "zero1", "n": 64, "overrides": {"bucket_mb": 10}, "checkpointing": False,
           "per_replica_batch": 20, "replicas": 64}
    assert command_line(row, "c.toml", [], 20, per_node=8) == (
        "paratrain train c.toml --strategy zero1 --nnodes 8 --nproc 8 --set dist.bucket_mb=10 --set "
        "train.batch_size=1280 --node-rank $NODE_RANK --rdzv-endpoint $NODE0:29400")
    two = {**row, "n": 2, "replicas": 2}
    assert command_line(two, "c.toml", [], 20, per_node=1).startswith(
        "paratrain train c.toml --strategy zero1 --nnodes 2 --nproc 1 ")
    for per_node in (None, 8):
        assert command_line({**row, "n": 8, "replicas": 8}, "c.toml", [], 20, per_node=per_node) == (
            "paratrain train c.toml --strategy zero1 --nproc 8 --set dist.bucket_mb=10 --set train.batch_size=160")
    assert command_line(row, "c.toml", [], 20) == command_line(row, "c.toml", [], 20, per_node=None)
    assert "--nnodes" not in command_line(row, "c.toml", [], 20)
    towers = {**row, "strategy": "replicate", "n": 2, "replicas": 2, "overrides": {}}
    assert command_line(towers, "c.toml", [], 20, "cuda", per_node=1) == (
        "paratrain train c.toml --strategy replicate --devices cuda:0,cuda:1 --set train.batch_size=40")
    assert [machines_of(n, 8) for n in (1, 8, 9, 64)] == [1, 1, 2, 8] and machines_of(64, None) == 1


def test_a_row_the_launcher_cannot_start_over_several_machines_as_priced_is_refused():
    """Every machine starts the same --nproc workers and dist.num_ps servers: N = 12 on machines of 8 (priced
    8 + 4) cannot start, nor K = 1 server over 2 machines; K = 2 over 2 is one a machine in the command. One
    machine, towers and a flat preset's single devices (N a multiple of 1) are no concern."""
    from paratrain.bench.plan import command_line, launch_refusal

    def row(strategy, n, **over):
        return {"strategy": strategy, "n": n, "overrides": over, "checkpointing": False, "per_replica_batch": 20,
                "replicas": n}

    assert launch_refusal(row("allreduce", 12), 8) == ("N = 12 fills 2 machines of 8 devices unevenly; paratrain "
                                                       "starts the same --nproc on every machine: give N a multiple "
                                                       "of 8")
    assert launch_refusal(row("ps-sync", 16, num_ps=1), 8).startswith("1 parameter server(s) do not split over 2")
    assert launch_refusal(row("ps-sync", 16, num_ps=2), 8) == ""
    assert "--nnodes 2 --nproc 8 --set dist.num_ps=1 " in command_line(row("ps-sync", 16, num_ps=2), "c", [], 20,
                                                                        per_node=8)
    assert "--nproc 8 --set dist.num_ps=2 " in command_line(row("ps-sync", 8, num_ps=2), "c", [], 20, per_node=8)
    for r, per_node in ((row("allreduce", 8), 8), (row("allreduce", 12), None), (row("allreduce", 64), 1),
                        (row("replicate", 12), 8)):
        assert launch_refusal(r, per_node) == "", (r, per_node)


def test_the_plan_bounds_this_machines_rows_by_the_hosts_memory_end_to_end(monkeypatch, tmp_path, capsys, real_data):
    """paratrain plan on this machine's measured links, from ptb_small's shipped profile, with the host's
    memory taken as 1 GB: the rows whose processes need more are infeasible with that reason (the 4-process
    rows, 4 x 0.07 GB, fit; the 64 towers, 3.8 GB, do not), and the recommendation is one that fits."""
    import argparse
    import json
    import platform
    import types
    from pathlib import Path

    import psutil

    from paratrain.bench.plan import add_plan_parser
    from paratrain.bench.plan_report import cmd_plan

    root = Path(__file__).resolve().parents[2]
    profile = root / "benchmarks/results/plan-xeon/ptb_small-v44/profile.json"
    monkeypatch.setattr(platform, "node", lambda: json.loads(profile.read_text())["host"])  # profiled here
    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(total=1e9))
    sub = argparse.ArgumentParser().add_subparsers()
    add_plan_parser(sub)
    args = sub.choices["plan"].parse_args([str(root / "configs/ptb_small.toml"), "--profile", str(profile),
                                           "--nproc", "1,4,64", "--out", str(tmp_path / "p"),
                                           "--data-dir", str(real_data)])
    assert cmd_plan(args) == 0
    plan = json.loads((tmp_path / "p" / "plan.json").read_text())
    assert plan["host_memory_bytes"] == 1e9
    over = [r for r in plan["rows"] if "of this host's 1.0 GB of memory" in r["reason"]]
    assert over and all(not r["feasible"] for r in over)
    assert {r["n"] for r in over} == {64} and any(r["strategy"] == "replicate" for r in over)
    assert all(r["feasible"] for r in plan["rows"] if r["n"] == 4 and r["strategy"] == "allreduce")
    assert plan["recommended"]["n"] < 64
    # a profile made before a process' own memory was measured: the tensors alone, and the header says so
    assert plan["host_process_bytes"] is None and plan["host_shared_bytes"] is None
    said = capsys.readouterr().out
    assert ("this host's 1.0 GB hold every process of a row, counting their tensors only: the profile has not "
            "measured a process' own (--reprofile does)") in said
    # nor the towers' step in the training loop: its CPU towers are priced from the in-process timing, and it says so
    assert plan["cpu_towers_step"] == {"source": "the profile's process", "n_at_least": 2}
    clause = "; CPU towers (N >= 2) priced from their forward and backward timed in the profile's process"
    assert clause in said
    # with the towers' step in the loop: priced from it (the row at N = 4: its parts twice, the optimizer once)
    looped = {"towers": 2, "data_s": 0.001, "forward_s": 0.05, "backward_s": 0.08, "optimizer_s": 0.006}
    (tmp_path / "v.json").write_text(json.dumps({**json.loads(profile.read_text()), "loop_towers": looped}))
    args.profile, args.out = tmp_path / "v.json", tmp_path / "q"
    assert cmd_plan(args) == 0
    plan = json.loads((tmp_path / "q" / "plan.json").read_text())
    assert plan["cpu_towers_step"] == {"source": "the training loop", "n_at_least": 2}
    assert clause not in capsys.readouterr().out
    four = next(r for r in plan["rows"] if r["strategy"] == "replicate" and r["n"] == 4 and not r["checkpointing"])
    assert four["step_s"] == pytest.approx(2 * (0.001 + 0.05 + 0.08) + 0.006)  # ptb_small: no BatchNorm


def test_on_this_machines_cpu_a_rows_processes_share_the_hosts_memory(monkeypatch):
    """Planned on this machine's measured links, a CPU's rows run here: N processes hold N peaks (a
    parameter server's K servers the busiest's each; towers, one process, their own) in the host's
    memory, each process its own memory beyond its tensors too and the shared pages once, and a row
    over it is infeasible with what it needs (ptb_small's 1024 CPU towers: 60.7 GB of the 2-vCPU VM's
    25.3 were once recommended). A preset's devices, a GPU's profile or a profile from another host
    have no such bound."""
    import platform

    import psutil

    from paratrain.bench.plan_feasible import HostMemory, host_demand, host_memory
    from paratrain.bench.plan_feasible import infeasible as _infeasible

    row = {"strategy": "allreduce", "n": 4, "overrides": {}, "memory": {"total": 3e9}}
    ps = {"strategy": "ps-sync", "n": 4, "overrides": {"num_ps": 2}, "memory": {"total": 1e9, "server": 2e9}}
    towers = {"strategy": "replicate", "n": 64, "overrides": {}, "memory": {"total": 30e9}}
    assert host_demand(row) == 12e9 and host_demand(ps) == 4e9 + 4e9 and host_demand(towers) == 30e9
    own = HostMemory(total=100e9, process=0.5e9, shared=0.2e9)
    # 4 processes and their launcher, the libraries once
    assert host_demand(row, own) == pytest.approx(4 * 3.5e9 + 0.5e9 + 0.2e9)
    assert host_demand(ps, own) == pytest.approx(4 * 1.5e9 + 2 * 2.5e9 + 0.5e9 + 0.2e9)  # 4 workers, 2 servers
    one = {**row, "n": 1}
    assert host_demand(one, own) == pytest.approx(3.5e9 + 0.2e9)  # one process: no launcher
    assert host_demand(towers, own) == pytest.approx(30.7e9)  # one process
    assert _infeasible(row, None, None, HostMemory(10e9)) == (
        "its processes need 12.0 GB of this host's 10.0 GB of memory; use fewer devices")
    assert _infeasible(row, None, None, HostMemory(12e9)) == "" == _infeasible(row, None, None, None)
    assert _infeasible(row, None, None, HostMemory(12e9, process=0.1e9)).startswith("its processes need 12.5 GB")
    assert _infeasible(towers, None, None, HostMemory(25e9)).startswith("its processes need 30.0 GB")
    here = {"device": "cpu", "host": platform.node()}
    total = float(psutil.virtual_memory().total)
    assert host_memory(here, None) == HostMemory(total) == host_memory({"device": "cpu"}, None)
    # a process' own: the one-device run's private memory at its end (the default threads': the most) less the
    # profile's tracked peak of a step; the shared pages as measured
    measured = {**here, "memory_measured": {"peak_bytes": 100e6},
                "workloads": {"1": {"host_private_bytes": 1e9, "host_shared_bytes": 1e9},
                              "2": {"host_private_bytes": 900e6, "host_shared_bytes": 300e6}}}
    assert host_memory(measured, None) == HostMemory(total, process=800e6, shared=300e6, measured=True)
    measured["memory_measured"]["peak_bytes"] = 2e9  # never below nothing
    assert host_memory(measured, None) == HostMemory(total, process=0.0, shared=300e6, measured=True)
    assert host_memory(here, object()) is None  # a preset
    assert host_memory({**here, "device": "cuda:0"}, None) is None
    assert host_memory({**here, "host": platform.node() + "-other"}, None) is None


def test_a_pipelines_check_splits_the_global_batch_the_layout_trains():
    """gpt_wt2 (train.batch_size 32): under weak scaling 32 replicas of 2 stages train 32 x 32 rows, which
    split into 32 replicas x 4 micro-batches; checked against the recipe's 32 rows instead, the plan used to
    refuse the layout. A --global-batch of 36 does not split into 2 replicas x 4 micro-batches: refused, as
    paratrain train refuses it."""
    from pathlib import Path

    from paratrain.bench.plan import layout_batch, refusal

    recipe = str(Path(__file__).resolve().parents[2] / "configs" / "gpt_wt2.toml")
    wide = Layout("pipeline", 64, {"pipeline_stages": 2, "microbatches": 4, "pipeline_schedule": "1f1b"},
                  "pipeline 32x2")
    assert layout_batch(wide, 32) == 1024 and layout_batch(wide, 32, 2048) == 2048
    assert refusal(recipe, None, [], wide, layout_batch(wide, 32)) is None
    assert "global batch 32 does not split into 32 replica(s) x 4 micro-batches" in refusal(recipe, None, [], wide)
    two = Layout("pipeline", 4, {"pipeline_stages": 2, "microbatches": 4, "pipeline_schedule": "1f1b"}, "pipeline 2x2")
    assert "global batch 36 does not split into 2 replica(s) x 4 micro-batches" in refusal(recipe, None, [], two, 36)
    assert refusal(recipe, None, [], two, 40) is None
    assert layout_batch(Layout("allreduce", 8), 64) == 512 and layout_batch(Layout("single", 1), 64) == 64


def test_a_global_batch_the_training_split_cannot_fill_is_found_in_a_few_builds(monkeypatch):
    """digits_cnn's training split holds 1197 images: its task refuses a global batch of 2048 or 4096 (as
    paratrain train does), and the plan marks those rows infeasible with the task's reason. It builds the
    task for the largest batch and bisects for the smallest that fails: 3 builds for 5 batches here, 1 where
    the largest fits. An epoch of no step is refused too."""
    import types
    from pathlib import Path

    import paratrain.runs as runs
    from paratrain.bench.plan_feasible import data_refusals
    from paratrain.config import load

    cfg = load(str(Path(__file__).resolve().parents[2] / "configs" / "digits_cnn.toml"))
    built, build = [], runs.build_task
    monkeypatch.setattr(runs, "build_task", lambda c, d, **kw: (built.append(c.train.batch_size), build(c, d, **kw))[1])
    got = data_refusals(cfg, None, {64, 512, 1024, 2048, 4096})
    assert set(got) == {2048, 4096} and built == [4096, 1024, 2048]
    assert got[2048] == ("the training split has 1197 images, fewer than one global batch of 2048; use a smaller "
                         "train.batch_size")
    assert got[4096].startswith("the training split has 1197 images, fewer than one global batch of 4096")
    built.clear()
    assert data_refusals(cfg, None, {64, 512, 1024}) == {} and built == [1024]
    assert data_refusals(cfg, None, set()) == {}
    monkeypatch.setattr(runs, "build_task", lambda c, d, **kw: types.SimpleNamespace(
        steps_per_epoch=lambda: 100 // c.train.batch_size))
    assert data_refusals(cfg, None, {50, 100, 200, 400}) == {
        200: "an epoch of the training split holds no step of global batch 200; use fewer devices or a smaller "
             "--global-batch",
        400: "an epoch of the training split holds no step of global batch 400; use fewer devices or a smaller "
             "--global-batch"}
    # a batch above the smallest that fails, not built itself, says so
    assert data_refusals(cfg, None, {50, 200, 300, 400})[300] == (
        "a global batch of 300, over 200, which the task refuses: an epoch of the training split holds no step of "
        "global batch 200; use fewer devices or a smaller --global-batch")


def test_sync_batchnorm_adds_its_seconds_to_allreduce_zero1_fsdp_and_ps_sync_and_none_to_towers_or_ps_async():
    link = Link(name="x", alpha_s=1e-5, beta_s_per_byte=1e-9, gamma_s_per_byte=1e-11)
    synced = {**INPUTS, "sync_batchnorm_s": 0.02}
    for cls, overrides in LAYOUTS[:3] + LAYOUTS[5:6]:  # all-reduce, zero1, fsdp, ps-sync
        a = step_parts(cls, Layout("x", 2, dict(overrides)), W, link, Config(), INPUTS)
        b = step_parts(cls, Layout("x", 2, dict(overrides)), W, link, Config(), synced)
        assert b["step_s"] == pytest.approx(a["step_s"] + 0.02, abs=1e-15)
        assert b["comm_s"] == pytest.approx(a["comm_s"] + 0.02, abs=1e-15)  # blocking collectives: exposed
        assert b["units_per_s"] == pytest.approx(a["units_per_s"] * a["step_s"] / (a["step_s"] + 0.02))
    for cls, overrides in LAYOUTS[3:4] + LAYOUTS[6:]:  # towers sync in their process; ps-async refuses the key
        a, b = [step_parts(cls, Layout("x", 2, dict(overrides)), W, link, Config(), x) for x in (INPUTS, synced)]
        assert a == b
    towers, _ = LAYOUTS[3]  # they pay their threads' meetings instead
    a, b = [step_parts(towers, Layout("x", 2, {}), W, link, Config(), x)
            for x in (INPUTS, {**INPUTS, "tower_sync_batchnorm_s": 0.004})]
    assert b["step_s"] == pytest.approx(a["step_s"] + 0.004, abs=1e-15)
    assert b["comm_s"] == pytest.approx(a["comm_s"] + 0.004, abs=1e-15)
    for cls, overrides in LAYOUTS[:3] + LAYOUTS[5:]:  # processes do not
        a, b = [step_parts(cls, Layout("x", 2, dict(overrides)), W, link, Config(), x)
                for x in (INPUTS, {**INPUTS, "tower_sync_batchnorm_s": 0.004})]
        assert a == b


def test_expected_maximum_of_normals_matches_the_order_statistics_tables():
    # E[max of 2] = 1/sqrt(pi) exactly; 3: 3/(2 sqrt(pi)); 4, 8, 10, 100, 1000: Harter's (1961) tables
    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), abs=1e-9)
    assert expected_max_normal(3) == pytest.approx(1.5 / math.sqrt(math.pi), abs=1e-9)
    assert expected_max_normal(4) == pytest.approx(1.029375, abs=1e-6)
    assert expected_max_normal(8) == pytest.approx(1.423600, abs=1e-6)
    assert expected_max_normal(10) == pytest.approx(1.538753, abs=1e-6)
    assert expected_max_normal(100) == pytest.approx(2.507594, abs=1e-6)
    assert expected_max_normal(1000) == pytest.approx(3.241436, abs=1e-6)
    assert expected_max_normal(1) == 0.0
    with pytest.raises(ValueError):
        expected_max_normal(0)


def test_expected_maximum_of_normals_is_the_mean_of_the_largest_draw():
    import random

    rng = random.Random(0)
    draws = [max(rng.gauss(0, 1) for _ in range(4)) for _ in range(200_000)]
    assert sum(draws) / len(draws) == pytest.approx(expected_max_normal(4), abs=0.01)


def test_a_pipelines_step_parts_above_the_cores_add_up_to_the_cost_models_step():
    """step_parts of a 2-stage pipeline, stages of 5% and 95% of the work (gpt_wt2's), M = 4, on a
    free link. At compute scale 2 (4 processes on 2 cores) the schedule is each core's share of the
    work, 2 x 0.3 s / 2 = 0.3 s (the critical path, 0.28875 s, is shorter): compute 0.3 s, no bubble,
    the largest stage's optimizer 2 x 0.05 / 2. At 1.5 the critical path is longer: compute
    1.5 x 0.15, and the rest of it bubble. The parts add up to predict_pipeline's step."""
    from paratrain.bench.costmodel_pipeline import predict_pipeline

    free = Link(name="free", alpha_s=0.0, beta_s_per_byte=0.0, gamma_s_per_byte=0.0)
    inputs = {**INPUTS, "stage_profiles": {"2": {**INPUTS["stage_profiles"]["2"], "stage_fractions": [0.05, 0.95],
                                                 "microbatch_factor": 1.0}}}
    lay = Layout("x", 4, {"pipeline_stages": 2, "microbatches": 4})
    for s, compute, bubble in ((2.0, 0.3, 0.0), (1.5, 0.225, 0.28875 - 0.225)):
        parts = step_parts(_Cls(STAGES), lay, W, free, Config(), inputs, compute_scale=s)
        assert parts["compute_s"] == pytest.approx(compute) and parts["bubble_s"] == pytest.approx(bubble, abs=1e-12)
        assert parts["optimizer_s"] == pytest.approx(s * 0.05 / 2)
        whole = predict_pipeline(W, 2, 2, 4, free, activation_bytes=1e6, stage_fractions=[0.05, 0.95],
                                 stage_param_bytes=[2e7, 2e7], compute_scale=s)
        assert parts["step_s"] == pytest.approx(whole.step_s)
        together = parts["compute_s"] + parts["bubble_s"] + parts["optimizer_s"] + parts["comm_s"]
        assert together == pytest.approx(whole.step_s)
        assert parts["comm_s"] == pytest.approx(0.0, abs=1e-12)


def test_ranks_that_meet_every_step_wait_for_the_slowest_and_towers_pipelines_and_ps_async_do_not():
    link = Link(name="x", alpha_s=1e-5, beta_s_per_byte=1e-9, gamma_s_per_byte=1e-11)
    spread = Workload(**{**W.__dict__, "local_sd_s": 0.01})
    assert straggle_s(4, 0.01) == pytest.approx(0.01 * 1.029375, abs=1e-8)
    assert straggle_s(1, 0.01) == 0.0 and straggle_s(4, 0.0) == 0.0
    for n in (2, 4):
        for cls, overrides in LAYOUTS[:3] + LAYOUTS[5:6]:  # all-reduce, zero1, fsdp, ps-sync
            a = step_parts(cls, Layout("x", n, dict(overrides)), W, link, Config(), INPUTS)
            b = step_parts(cls, Layout("x", n, dict(overrides)), spread, link, Config(), INPUTS)
            assert b["step_s"] == pytest.approx(a["step_s"] + 0.01 * expected_max_normal(n), abs=1e-15)
            assert b["comm_s"] == pytest.approx(a["comm_s"] + 0.01 * expected_max_normal(n), abs=1e-15)
            # time-shared cores stretch the spread with the compute
            c = step_parts(cls, Layout("x", n, dict(overrides)), spread, link, Config(), INPUTS, compute_scale=2.0)
            d = step_parts(cls, Layout("x", n, dict(overrides)), W, link, Config(), INPUTS, compute_scale=2.0)
            assert c["step_s"] == pytest.approx(d["step_s"] + 0.02 * expected_max_normal(n), abs=1e-15)
        for cls, overrides in LAYOUTS[3:5] + LAYOUTS[6:]:  # towers, pipeline, ps-async
            a, b = [step_parts(cls, Layout("x", n, dict(overrides)), x, link, Config(), INPUTS) for x in (W, spread)]
            assert a == b


def test_on_shared_cores_ddp_and_a_synchronous_ps_wait_the_measured_meeting_after_the_steps_compute():
    """This machine's CPU (no overlap) with the profile's meeting table: all-reduce, ZeRO-1 (the same
    DDP) and a synchronous PS wait max(straggle, meeting(forward + backward + data) - alpha) once a
    step; FSDP (its units' meetings are in its formula), towers, pipelines and an asynchronous PS do
    not; with overlap (a cluster) or without the table, the straggle alone."""
    from paratrain.bench.costmodel_sharded import meeting_seconds, predict_fsdp, predict_zero1

    link = Link(name="x", alpha_s=1e-5, beta_s_per_byte=1e-9, gamma_s_per_byte=1e-11)
    table = {**INPUTS, "meetings": [[0.1, 0.004], [0.4, 0.006]]}  # (compute s, s): 0.3 s of compute -> 5.333 ms
    wait = 0.004 + 0.002 * (0.3 - 0.1) / (0.4 - 0.1) - 1e-5
    meeting = meeting_seconds(table["meetings"])
    for cls, overrides in LAYOUTS[:2] + LAYOUTS[5:6]:  # all-reduce, zero1, ps-sync
        got = step_parts(cls, Layout("x", 2, dict(overrides)), W, link, Config(), table, overlap=False)
        if cls.cost_model == SHARDED_OPTIMIZER:  # its own formula reads the table too (the all-gather's meeting)
            alone = predict_zero1(W, 2, link, bucket_mb=Config().dist.bucket_mb, overlap=False,
                                  meeting_s=meeting).step_s
        else:
            alone = step_parts(cls, Layout("x", 2, dict(overrides)), W, link, Config(), INPUTS, overlap=False)["step_s"]
        assert got["step_s"] == pytest.approx(alone + wait, abs=1e-12), cls.cost_model
        # a spread whose straggle is larger wins: 0.01 s x 0.564 at n = 2
        spread = Workload(**{**W.__dict__, "local_sd_s": 0.01})
        s1 = step_parts(cls, Layout("x", 2, dict(overrides)), spread, link, Config(), table, overlap=False)
        assert s1["step_s"] == pytest.approx(got["step_s"] - wait + 0.01 * expected_max_normal(2), abs=1e-12)
        # a cluster overlaps and does not share the cores: the straggle alone (here 0)
        on = step_parts(cls, Layout("x", 2, dict(overrides)), W, link, Config(), table)
        if cls.cost_model != SHARDED_OPTIMIZER:
            assert on == step_parts(cls, Layout("x", 2, dict(overrides)), W, link, Config(), INPUTS)
    ps_sync, _ = LAYOUTS[5]  # backup workers: the servers do not wait for the last worker
    a, b = [step_parts(ps_sync, Layout("x", 2, {"num_ps": 2, "backup_workers": 1}), W, link, Config(), x,
                       overlap=False) for x in (INPUTS, table)]
    assert a == b
    for cls, overrides in LAYOUTS[2:5] + LAYOUTS[6:]:  # fsdp, towers, pipeline, ps-async
        if cls.cost_model == SHARDED_PARAMETERS:
            got = step_parts(cls, Layout("x", 2, dict(overrides)), W, link, Config(), table, overlap=False)
            alone = predict_fsdp(W, 2, link, unit_bytes=INPUTS["units"], reshard=Config().dist.reshard_after_forward,
                                 overlap=False, meeting_s=meeting).step_s
            assert got["step_s"] == pytest.approx(alone, abs=1e-12)
            continue
        a, b = [step_parts(cls, Layout("x", 2, dict(overrides)), W, link, Config(), x, overlap=False)
                for x in (INPUTS, table)]
        assert a == b, cls.cost_model


def test_zero1_and_fsdp_pay_the_dtensor_optimizers_dispatch_and_the_others_do_not():
    link = Link(name="x", alpha_s=1e-5, beta_s_per_byte=1e-9, gamma_s_per_byte=1e-11)
    priced = {**INPUTS, "sharded_optimizer_s": 0.003}
    for cls, overrides in LAYOUTS[1:3]:  # zero1, fsdp
        a, b = [step_parts(cls, Layout("x", 2, dict(overrides)), W, link, Config(), x) for x in (INPUTS, priced)]
        assert b["step_s"] == pytest.approx(a["step_s"] + 0.003, abs=1e-15)
        assert b["optimizer_s"] == pytest.approx(a["optimizer_s"] + 0.003, abs=1e-15)
        assert b["comm_s"] == pytest.approx(a["comm_s"], abs=1e-15)
        c, d = [step_parts(cls, Layout("x", 2, dict(overrides)), W, link, Config(), x, compute_scale=2.0)
                for x in (INPUTS, priced)]
        assert d["step_s"] == pytest.approx(c["step_s"] + 0.006, abs=1e-15)  # time-shared cores
    for cls, overrides in LAYOUTS[:1] + LAYOUTS[3:]:
        a, b = [step_parts(cls, Layout("x", 2, dict(overrides)), W, link, Config(), x) for x in (INPUTS, priced)]
        assert a == b


class _SlowOnDTensors(torch.optim.SGD):
    """SGD that sleeps 20 ms a step when its parameters are DTensors."""

    def step(self, closure=None):
        from torch.distributed.tensor import DTensor

        if isinstance(self.param_groups[0]["params"][0].data, DTensor):
            time.sleep(0.02)
        return super().step(closure)


def test_the_sharded_optimizer_microbenchmark_prices_what_dtensor_shards_add_to_the_step():
    import torch.distributed as dist

    from paratrain.bench.microbench_sharded import measured_sharded_optimizer

    params = [torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(4)),
              torch.nn.Parameter(torch.tensor(1.0))]
    threads, had_group = torch.get_num_threads(), dist.is_initialized()
    got = measured_sharded_optimizer(params, _SlowOnDTensors(params, lr=0.1, momentum=0.9), threads=1,
                                     repeats=5, warmup=1)
    assert 0.018 <= got < 0.1
    assert dist.is_initialized() == had_group  # a one-rank group it made is gone again
    assert torch.get_num_threads() == threads
    plain = measured_sharded_optimizer(params, torch.optim.SGD(params, lr=0.1), repeats=5, warmup=1)
    assert 0.0 <= plain < 0.018


def test_the_plans_workload_carries_the_measured_spread_scaled_by_the_root_of_the_batch():
    from paratrain.bench.plan import workload

    step = {"data_s": 0.001, "forward_s": 0.01, "backward_s": 0.02, "optimizer_s": 0.003}
    prof = {"workloads": {"2": {**step, "local_sd_s": 0.002}, "1": {**step, "local_sd_s": 0.005, "concurrent": 2}},
            "param_bytes": [4, 8], "tokens_per_step": 64.0}
    assert workload(prof, 1).local_sd_s == pytest.approx(0.005)
    assert workload(prof, None, ratio=0.5).local_sd_s == pytest.approx(0.002 * math.sqrt(0.5))
    del prof["workloads"]["2"]["local_sd_s"]  # a profile without it: no straggling priced
    assert workload(prof, 2).local_sd_s == 0.0


def test_ddps_buffer_broadcast_is_measured_here_or_a_binomial_tree_on_a_cluster_and_only_where_ddp_sends_them():
    from pathlib import Path

    from paratrain.bench.costmodel import PRESETS
    from paratrain.bench.plan import buffer_broadcast_s
    from paratrain.config import load
    from paratrain.strategies import STRATEGIES

    recipe = str(Path(__file__).resolve().parents[2] / "configs" / "digits_cnn.toml")
    cfg = load(recipe, ["model.sync_batchnorm=false"])  # DDP then sends rank 0's BatchNorm statistics
    ddp, zero1 = STRATEGIES["allreduce"], STRATEGIES["zero1"]
    prof = {"batchnorm_inputs": [[64, 16, 8, 8]], "buffer_bytes": 920, "loop_buffer_broadcast_s": {"allreduce": 0.0017}}
    ib = PRESETS["ib400"]  # alpha 14 us, 50 GB/s: 920 bytes take 18.4 ns; NCCL's base of a collective 8.4 us
    hop, base = 14e-6 + 920 / 50e9, 8.4e-6
    assert buffer_broadcast_s(prof, cfg, ddp, 2, ib, on_this_machine=False) == pytest.approx(base + hop)
    assert buffer_broadcast_s(prof, cfg, ddp, 8, ib, on_this_machine=False) == pytest.approx(
        base + 3 * hop)  # log2 8 hops
    assert buffer_broadcast_s(prof, cfg, zero1, 5, ib, on_this_machine=False) == pytest.approx(
        base + 3 * hop)  # ceil
    here = Link(name="gloo", alpha_s=1.5e-4, beta_s_per_byte=1e-9, gamma_s_per_byte=0.0)
    assert buffer_broadcast_s(prof, cfg, ddp, 2, here, on_this_machine=True) == 0.0017  # the loop's measurement
    assert buffer_broadcast_s(prof, cfg, ddp, 4, here, on_this_machine=True) == pytest.approx(
        0.0017 + 1.5e-4 + 920e-9)  # plus the tree's second hop
    unmeasured = {k: v for k, v in prof.items() if k != "loop_buffer_broadcast_s"}
    assert buffer_broadcast_s(unmeasured, cfg, ddp, 2, here, on_this_machine=True) == pytest.approx(1.5e-4 + 920e-9)
    # nothing where DDP sends nothing: one process, sync BatchNorm (paratrain turns it off), the key off,
    # no buffers, and strategies without DDP's key
    assert buffer_broadcast_s(prof, cfg, ddp, 1, ib, on_this_machine=False) == 0.0
    assert buffer_broadcast_s(prof, load(recipe, []), ddp, 2, ib, on_this_machine=False) == 0.0
    no_key = load(recipe, ["model.sync_batchnorm=false", "dist.broadcast_buffers=false"])
    assert buffer_broadcast_s(prof, no_key, ddp, 2, ib, on_this_machine=False) == 0.0
    assert buffer_broadcast_s({**prof, "buffer_bytes": 0}, cfg, ddp, 2, ib, on_this_machine=False) == 0.0
    for name in ("fsdp", "ps-sync", "replicate", "pipeline"):
        assert buffer_broadcast_s(prof, cfg, STRATEGIES[name], 2, ib, on_this_machine=False) == 0.0, name
    # sync BatchNorm turns it off whatever the buffers are (the strategy makes its statistics group)
    assert buffer_broadcast_s({**prof, "batchnorm_inputs": []}, load(recipe, []), ddp, 2, ib,
                              on_this_machine=False) == 0.0
    # the plan adds it to the step of the processes that meet, as exposed communication
    a = step_parts(ddp, Layout("allreduce", 2, {}), W, ib, Config(), INPUTS)
    b = step_parts(ddp, Layout("allreduce", 2, {}), W, ib, Config(), {**INPUTS, "buffer_broadcast_s": 0.0017})
    assert (b["step_s"], b["comm_s"]) == pytest.approx((a["step_s"] + 0.0017, a["comm_s"] + 0.0017), abs=1e-15)


def test_tower_sync_batchnorm_seconds_are_the_two_tower_measurement_times_n_minus_one_here_only():
    from pathlib import Path

    from paratrain.bench.plan import tower_sync_batchnorm_s
    from paratrain.config import load

    recipe = str(Path(__file__).resolve().parents[2] / "configs" / "digits_cnn.toml")
    cfg, off = load(recipe, []), load(recipe, ["model.sync_batchnorm=false"])
    prof = {"batchnorm_inputs": [[64, 16, 8, 8]], "tower_sync_batchnorm_s": 0.003}
    assert tower_sync_batchnorm_s(prof, cfg, 2, on_this_machine=True) == 0.003
    assert tower_sync_batchnorm_s(prof, cfg, 4, on_this_machine=True) == pytest.approx(0.009)
    assert tower_sync_batchnorm_s(prof, cfg, 1, on_this_machine=True) == 0.0
    assert tower_sync_batchnorm_s(prof, cfg, 2, on_this_machine=False) == 0.0
    assert tower_sync_batchnorm_s(prof, off, 2, on_this_machine=True) == 0.0
    assert tower_sync_batchnorm_s({"batchnorm_inputs": []}, cfg, 2, on_this_machine=True) == 0.0
    # the training loop's own two-tower term, where the profile has it, before the micro-benchmark's
    loop = {**prof, "loop_sync_batchnorm_s": {"allreduce": 0.0335, "replicate": 0.012}}
    assert tower_sync_batchnorm_s(loop, cfg, 2, on_this_machine=True) == 0.012
    assert tower_sync_batchnorm_s(loop, cfg, 3, on_this_machine=True) == pytest.approx(0.024)
    assert tower_sync_batchnorm_s(loop, cfg, 2, on_this_machine=False) == 0.0
    # since version 36 the towers' own steps, plain and synchronised in turn, at m = 4 towers (4 cores):
    # before the loop's; x (n - 1) / (m - 1): 2 towers meet a third as often per tower pair, 7 towers twice
    steps = {**loop, "towers_forward_threads": {"towers": 4, "seconds": 0.02, "sync_batchnorm_s": 0.009}}
    assert tower_sync_batchnorm_s(steps, cfg, 4, on_this_machine=True) == pytest.approx(0.009)
    assert tower_sync_batchnorm_s(steps, cfg, 2, on_this_machine=True) == pytest.approx(0.003)
    assert tower_sync_batchnorm_s(steps, cfg, 7, on_this_machine=True) == pytest.approx(0.018)
    assert tower_sync_batchnorm_s(steps, off, 4, on_this_machine=True) == 0.0


def test_the_towers_backward_is_the_measured_one_times_n_over_cores_and_replaces_n_backwards():
    from paratrain.bench.costmodel import Link
    from paratrain.bench.costmodel_towers import predict_towers
    from paratrain.bench.plan import towers_backward_s

    prof = {"towers_forward_threads": {"towers": 2, "joined": True, "seconds": 0.04, "backward_seconds": 0.03}}
    assert towers_backward_s(prof, 2) == pytest.approx(0.03)
    assert towers_backward_s(prof, 4) == pytest.approx(0.06)  # 4 towers on 2 cores: twice the graphs
    assert towers_backward_s(prof, 2, ratio=0.5) == pytest.approx(0.015)  # half the batch per tower
    assert towers_backward_s(prof, 1) is None  # fewer towers than cores: not measured
    older = {"towers_forward_threads": {"towers": 2, "joined": True, "seconds": 0.04}}  # version 35 and before
    assert towers_backward_s(older, 2) is None and towers_backward_s({}, 2) is None
    w = Workload(forward_s=0.02, backward_s=0.01, data_s=0.001, optimizer_s=0.002, param_bytes=(1000,),
                 tokens_per_step=100.0)
    link = Link(name="t", alpha_s=1e-5, beta_s_per_byte=1e-9, gamma_s_per_byte=0.0)
    measured = predict_towers(w, 2, link, output_bytes=0.0, shared_cores=True, forward_side_by_side_s=0.04,
                              joined=True, backward_measured_s=0.03)
    assert measured.step_s == pytest.approx(0.04 + 0.03 + 0.001 + 0.002)  # not 0.04 + 2 x 0.01 + ...
    unmeasured = predict_towers(w, 2, link, output_bytes=0.0, shared_cores=True, forward_side_by_side_s=0.04,
                                joined=True)
    assert unmeasured.step_s == pytest.approx(0.04 + 2 * 0.01 + 0.001 + 0.002)
    apart = predict_towers(w, 2, link, output_bytes=0.0, backward_measured_s=0.03)  # own devices: ignored
    assert apart.compute_s == pytest.approx(0.02 + 0.01 + 0.001 + 0.002)


def test_the_tower_microbenchmark_prices_the_threads_meeting_in_synchronised_batchnorm(monkeypatch):
    """What the towers' meetings cost is what it measures: with every meeting made 20 ms slower (a
    sleep, which a busy machine does not shorten), 2 layers x 2 meetings add about 80 ms a step
    (62-82 ms measured with one core kept busy, 39-57 with both: a delayed tower's compute overlaps the
    other's sleep; a quarter of it is asked, far above the 0-0.1 ms without the sleeps); the process'
    intra-op threads are as before when it ends."""
    import time

    import torch

    from paratrain.bench.microbench_towers import measured_tower_sync_batchnorm
    from paratrain.strategies.towers import TowerGroup

    exchange = TowerGroup.exchange

    def slow(self, index, value):
        time.sleep(0.02)
        return exchange(self, index, value)

    monkeypatch.setattr(TowerGroup, "exchange", slow)
    threads = torch.get_num_threads()
    got = measured_tower_sync_batchnorm([[32, 8, 8, 8], [32, 16, 4, 4]], repeats=9, warmup=1, compute_s=2e-4)
    assert 0.02 < got < 0.5
    assert torch.get_num_threads() == threads
    assert measured_tower_sync_batchnorm([], repeats=3) == 0.0


def test_sync_batchnorm_seconds_measured_here_or_three_ring_all_reduces_per_layer_on_a_cluster():
    from pathlib import Path
    from types import SimpleNamespace

    from paratrain.bench.plan import sync_batchnorm_s
    from paratrain.config import load

    recipe = str(Path(__file__).resolve().parents[2] / "configs" / "digits_cnn.toml")  # sync BatchNorm on
    cfg, off = load(recipe, []), load(recipe, ["model.sync_batchnorm=false"])
    table = SimpleNamespace(model_value=lambda key, default=None: {"sync_batchnorm": True}.get(key, default),
                            train=SimpleNamespace(dtype="float32"))
    prof = {"batchnorm_inputs": [[64, 16, 8, 8], [64, 31, 4, 4]], "sync_batchnorm_s": 0.0123}
    link = Link(name="x", alpha_s=1e-5, beta_s_per_byte=1e-9, gamma_s_per_byte=0.0)
    assert sync_batchnorm_s(prof, cfg, 2, link, on_this_machine=True) == 0.0123
    # a ring all-reduce of b bytes at n: 2 (n-1) alpha + 2 (n-1)/n b beta; a layer's three: the forward's
    # (C + 1) x 4 and C x 4 bytes, the backward's 2 C x 4: 68, 64, 128 and 128, 124, 248 bytes
    ring = {n: sum(2 * (n - 1) * 1e-5 + 2 * (n - 1) / n * b * 1e-9 for b in (68, 64, 128, 128, 124, 248))
            for n in (2, 4)}
    assert sync_batchnorm_s(prof, cfg, 4, link, on_this_machine=False) == pytest.approx(ring[4])
    assert sync_batchnorm_s(prof, table, 4, link, on_this_machine=False) == pytest.approx(ring[4])  # a [model] table
    # a float64 recipe's statistics are float64: 8 bytes a number
    ring64 = sum(2 * 3 * 1e-5 + 2 * 3 / 4 * b * 2e-9 for b in (68, 64, 128, 128, 124, 248))
    assert sync_batchnorm_s(prof, load(recipe, ["train.dtype=\"float64\""]), 4, link, False) == pytest.approx(ring64)
    # checkpointing's recompute on a cluster: the forward's two rings again (C + 1 and C numbers)
    from paratrain.bench.plan_inputs import sync_batchnorm_recompute_s
    forward = sum(2 * 3 * 1e-5 + 2 * 3 / 4 * b * 1e-9 for b in (68, 64, 128, 124))
    assert sync_batchnorm_recompute_s(prof, cfg, 4, link, on_this_machine=False) == pytest.approx(forward)
    # here, beyond the 2 processes measured: what the ring adds
    assert sync_batchnorm_s(prof, cfg, 4, link, on_this_machine=True) == pytest.approx(0.0123 + ring[4] - ring[2])
    assert sync_batchnorm_s(prof, cfg, 1, link, on_this_machine=True) == 0.0  # one process: nothing to sync
    assert sync_batchnorm_s(prof, off, 2, link, on_this_machine=True) == 0.0
    assert sync_batchnorm_s({"batchnorm_inputs": []}, cfg, 2, link, on_this_machine=True) == 0.0
    # the training loop's own allreduce term, where the profile has it, before the layers' micro-benchmark
    loop = {**prof, "loop_sync_batchnorm_s": {"allreduce": 0.0335, "replicate": 0.012}}
    assert sync_batchnorm_s(loop, cfg, 2, link, on_this_machine=True) == 0.0335
    assert sync_batchnorm_s(loop, cfg, 4, link, on_this_machine=True) == pytest.approx(0.0335 + ring[4] - ring[2])
    assert sync_batchnorm_s(loop, cfg, 4, link, on_this_machine=False) == pytest.approx(ring[4])  # a cluster
    # more processes than cores, measured at 4 on 2 cores (digits_cnn on the 2-vCPU VM: 29 and 85 ms): the
    # straight line through 2 and 4 processes, beyond 4 extrapolated; not on a cluster, not within the cores
    over = {**loop, "cores": 2, "loop_sync_batchnorm_oversubscribed": {"processes": 4, "seconds": 0.085}}
    assert sync_batchnorm_s(over, cfg, 2, link, on_this_machine=True) == 0.0335
    assert sync_batchnorm_s(over, cfg, 3, link, on_this_machine=True) == pytest.approx(0.0335 + (0.085 - 0.0335) / 2)
    assert sync_batchnorm_s(over, cfg, 4, link, on_this_machine=True) == pytest.approx(0.085)
    assert sync_batchnorm_s(over, cfg, 8, link, on_this_machine=True) == pytest.approx(0.0335 + 3 * (0.085 - 0.0335))
    assert sync_batchnorm_s(over, cfg, 4, link, on_this_machine=False) == pytest.approx(ring[4])
    assert sync_batchnorm_s({**over, "cores": 4}, cfg, 4, link, on_this_machine=True) == pytest.approx(
        0.0335 + ring[4] - ring[2])  # 4 processes on 4 cores: not oversubscribed
    noisy = {**over, "loop_sync_batchnorm_oversubscribed": {"processes": 4, "seconds": 0.0}}
    assert sync_batchnorm_s(noisy, cfg, 8, link, on_this_machine=True) == 0.0  # a falling line stops at 0


def test_the_profile_finds_every_batchnorm_input_and_the_microbenchmark_runs_their_sync_on_two_processes():
    import torch
    from torch import nn

    from paratrain.bench.microbench_meetings import measured_sync_batchnorm
    from paratrain.bench.profile import _batchnorm_inputs

    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(64, 5),
                          nn.BatchNorm1d(5))
    x = torch.randn(6, 1, 4, 4)
    shapes = _batchnorm_inputs(model, lambda xs: model(xs[0]).sum(), lambda: [x])
    assert shapes == [[6, 4, 4, 4], [6, 5]]
    assert not model[1]._forward_pre_hooks  # the hooks are gone
    assert measured_sync_batchnorm([]) == 0.0
    got = measured_sync_batchnorm(shapes, repeats=3, warmup=1)  # two gloo processes, paratrain's SyncBatchNorm
    assert isinstance(got, float) and math.isfinite(got)  # ran to the end on both ranks (it raises otherwise)


def test_memory_copies_are_timed_at_each_requested_size_and_priced_between_them():
    from paratrain.bench import microbench
    from paratrain.bench.costmodel_sharded import copy_seconds

    seen = []
    real_cat = microbench.torch.cat

    def cat(pieces):
        seen.append(sum(p.numel() * p.element_size() for p in pieces))
        return real_cat(pieces)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(microbench.torch, "cat", cat)
        points = microbench.measure_copies([2 ** 20, 4096, 0, 4096], repeats=2, warmup=1)
    assert seen == [4096] * 3 + [2 ** 20] * 3  # each size once, smallest first, 3 joins of two float32 halves
    assert [b for b, _ in points] == [4096, 2 ** 20] and all(t >= 0 for _, t in points)
    # priced from (bytes, seconds) points: the smallest's time below it, linear between, per byte beyond
    copy = copy_seconds([[1000, 1e-5], [11000, 2e-5], [111000, 1.2e-3]])
    assert copy(10) == 1e-5 and copy(0) == 0.0
    assert copy(6000) == pytest.approx(1.5e-5) and copy(61000) == pytest.approx(2e-5 + 0.5 * 1.18e-3)
    assert copy(222000) == pytest.approx(2.4e-3)
    with pytest.raises(UsageError):
        copy_seconds([])


def test_predicts_sync_batchnorm_helpers_add_exposed_comm_pick_the_paying_strategies_and_read_digits_shapes():
    from pathlib import Path

    pytest.importorskip("sklearn")  # the digits data set
    from paratrain.bench.costmodel import with_extra_step_s
    from paratrain.bench.costmodel import Prediction
    from paratrain.bench.strategy_model import pays_sync_batchnorm
    from paratrain.bench.profile import batchnorm_inputs_of
    from paratrain.config import load
    from paratrain.runs import build_task
    from paratrain.strategies import STRATEGIES

    # step 10 ms (8 compute + 2 comm), 4000 words/s, speedup 1.6 at N = 2; +5 ms of sync: x 10/15
    p = Prediction(n=2, step_s=0.010, compute_s=0.008, exposed_comm_s=0.002, words_per_s=4000.0, speedup=1.6,
                   efficiency=0.8, bucket_mb=25.0, algorithm="ring", optimizer_s=0.001)
    q = with_extra_step_s(p, 0.005)
    assert (q.step_s, q.compute_s, q.exposed_comm_s) == pytest.approx((0.015, 0.008, 0.007))
    assert (q.words_per_s, q.speedup, q.efficiency) == pytest.approx((4000 * 2 / 3, 1.6 * 2 / 3, 0.8 * 2 / 3))
    assert with_extra_step_s(p, 0.0) is p
    paying = {"single", "allreduce", "zero1", "fsdp", "ps-sync"}  # single: modelled as a ring of one (no term at N = 1)
    assert {s for s, c in STRATEGIES.items() if pays_sync_batchnorm(c)} == paying
    recipe = str(Path(__file__).resolve().parents[2] / "configs" / "digits_cnn.toml")
    cfg = load(recipe, ["train.batch_size=8"])
    shapes = batchnorm_inputs_of(build_task(cfg, None, world_size=1), cfg)  # the whole batch of 8 on one replica
    assert shapes == [[8, 16, 8, 8], [8, 32, 8, 8], [8, 64, 4, 4]]  # digits_cnn's three BatchNorm2d layers


def test_parameter_servers_take_threads_but_not_compute_time_of_the_cores():
    from paratrain.bench.validate import layout_cpu_share

    # 2 workers + 1 server on 2 cores: the launcher gives each of the 3 processes max(1, 2 // 3) = 1 thread;
    # the 2 workers compute at once on the 2 cores: no time sharing (the server sleeps until gradients come)
    assert layout_cpu_share(2, 1, 2) == (1, 1.0)
    assert layout_cpu_share(4, 2, 2) == (1, 2.0)  # 4 one-thread workers on 2 cores: each computes half the time
    assert layout_cpu_share(2, 0, 8) == (4, 1.0)  # all-reduce: 8 // 2 threads each, 2 x 4 = 8 cores
    assert layout_cpu_share(2, 2, 8) == (2, 1.0)  # 4 processes share 8 cores: 2 threads, the 2 workers use 4
    assert layout_cpu_share(4, 0, 2, in_process=True) == (2, 1.0)  # towers: one process, every core


@pytest.mark.parametrize("steps", [6, 20, 30, 100])
def test_validation_runs_track_memory_on_a_warm_up_step_after_the_first(steps):
    from paratrain.bench.plan_validate import run_overrides

    warmup, sets = run_overrides(steps)
    got = dict(s.split("=") for s in sets)
    track, log_every = int(got["train.track_memory_step"]), int(got["train.log_every"])
    assert int(got["train.timing_warmup_steps"]) == warmup and warmup < steps
    # timed intervals are those that start at or after the warm-up; the tracked step (1-based) ends before
    assert 2 <= track <= warmup and (track - 1) // log_every * log_every < warmup


def test_runs_of_short_steps_are_long_enough_to_time():
    from paratrain.bench.plan_profile import run_steps

    # a third is warm-up: 2 s timed at 5 ms a step needs 1.5 x 2 / 0.005 = 600 steps
    assert run_steps(30, 0.005) == 600
    assert run_steps(30, 0.5) == 30  # long steps: the least steps already time 10 s
    assert run_steps(30, 1e-6) == 2000 and run_steps(30, 0.0) == 30  # capped; no estimate: the least
    assert run_steps(30, 0.005, timed_s=0.05) == 30 and run_steps(30, 0.005, timed_s=0) == 30


def test_pipeline_stages_output_the_boundary_then_the_model_output_scaled_with_the_batch():
    from paratrain.bench.plan import stage_outputs

    prof = {"output_bytes": 1000.0, "strategy_inputs": {"stage_profiles": {"4": {"activation_bytes": 30.0}}}}
    assert stage_outputs(prof, 4, ratio=2.0) == [60.0, 60.0, 60.0, 2000.0]
    assert stage_outputs(prof, 2) is None  # no profile for 2 stages: a model that does not cut so


def _row(label, units, mib, n=2, feasible=True, synchronous=True):
    return {"label": label, "units_per_s": units, "n": n, "feasible": feasible, "synchronous": synchronous,
            "memory": {"total": mib * 2 ** 20}}


def test_the_recommendation_of_predictions_within_a_tie_is_the_one_with_the_least_memory():
    from paratrain.bench.plan import TIE, rank

    assert TIE == 0.01
    rows = [_row("allreduce", 1000.0, 918), _row("zero1", 999.5, 900), _row("pipeline", 991.0, 324),
            _row("fsdp", 980.0, 100), _row("ps-async", 2000.0, 50, synchronous=False),
            _row("towers", 5000.0, 10, feasible=False)]
    # within 1% of 1000 words/s: allreduce, zero1, pipeline (991 >= 990); fsdp (2% slower) is not, however small
    assert [r["label"] for r in rank(rows, "words_per_s")] == [
        "pipeline", "allreduce", "zero1", "fsdp", "ps-async", "towers"]
    # a clear winner stays first whatever its memory
    rows[0]["units_per_s"] = 1020.0
    assert rank(rows, "words_per_s")[0]["label"] == "allreduce"
    # equal memory within the tie: the faster
    tied = [_row("a", 1000.0, 10), _row("b", 999.0, 10)]
    assert rank(list(reversed(tied)), "words_per_s")[0]["label"] == "a"
    # a plateau: 16 devices no faster than 8 is not recommended for its smaller shards
    plateau = [_row("fsdp", 1000.0, 100, n=8), _row("fsdp", 999.0, 50, n=16)]
    assert rank(plateau, "words_per_s")[0]["n"] == 8


def test_within_a_tie_the_recommendation_trains_on_exact_gradients_rather_than_compressed_ones():
    from paratrain.bench.plan import rank

    def row(label, units, n=2, hook=None, mib=918):
        return {**_row(label, units, mib, n=n), "overrides": {"comm_hook": hook} if hook else {"bucket_mb": 100.0}}

    # gpt_wt2 on the 2-vCPU VM: the bf16 hook predicted 0.1% faster at the same memory: a tie, allreduce
    rows = [row("allreduce + bf16 hook", 1929.8, hook="bf16"), row("allreduce", 1927.4),
            row("zero1 + powersgd hook", 1929.0, hook="powersgd", mib=900)]
    assert rank(rows, "words_per_s")[0]["label"] == "allreduce"
    # "none" (or no value) is no hook
    from paratrain.bench.plan_rank import compresses

    assert not compresses({"comm_hook": None}) and not compresses(None) and compresses({"comm_hook": "powersgd"})
    assert rank([row("a + hook", 1000.0, hook="fp16"), row("a", 999.0, hook="none")], "words_per_s")[0]["label"] == "a"
    # a hook faster beyond the tie is recommended
    rows[0]["units_per_s"] = 1960.0
    assert rank(rows, "words_per_s")[0]["label"] == "allreduce + bf16 hook"
    # fewer processes come first: a compressed layout on 2 devices before an exact one on 4 in a tie
    assert rank([row("exact", 1000.0, n=4), row("hooked", 999.0, hook="bf16")], "words_per_s")[0]["n"] == 2


def test_the_recommendation_skips_faster_asynchronous_and_infeasible_rows_and_is_none_without_a_synchronous_fit():
    from paratrain.bench.plan import rank, recommendation

    rows = [_row("towers", 5000.0, 10, feasible=False), _row("ps-async", 2000.0, 50, synchronous=False),
            _row("fsdp", 900.0, 100), _row("allreduce", 1000.0, 918)]
    assert recommendation(rank(rows, "words_per_s"))["label"] == "allreduce"
    assert recommendation(rows)["label"] == "fsdp"  # the first of the order it is given, as rank leaves it
    assert recommendation(rank(rows[:2], "words_per_s")) is None  # only an infeasible and an async row


def test_the_plan_names_the_layouts_its_measured_errors_cannot_tell_from_the_recommendation():
    """plan.close_calls and the report's line: digits_cnn without sync BN on 2026-11-27 (v23), towers
    predicted 1.3% above allreduce and 2.9% above ps-sync, with step errors of 10.5%, 10.8% and 12.7%
    (measured: allreduce and ps-sync 18% faster than towers). A row's band v (1 +- e) must reach the
    recommendation's v_best (1 - e_best); rows without a measured error, extrapolated, infeasible,
    unpriced or asynchronous are never named; the cost objective compares per device."""
    from paratrain.bench.plan import close_calls
    from paratrain.bench.plan_report import markdown

    def row(label, units, err, n=2, **kw):
        return {**_row(label, units, 3, n=n, **{k: kw.pop(k) for k in ("feasible", "synchronous") if k in kw}),
                "measured_error": err, "extrapolated": kw.get("extrapolated", False)}

    towers, allreduce, ps = row("towers", 1000.0, 0.105), row("allreduce", 987.0, 0.108), row("ps-sync", 971.0, 0.127)
    far = row("fsdp", 581.0, 0.035)  # 581 x 1.035 = 601 < 1000 x 0.895 = 895
    # the recommendation's floor: 1000 x 0.895 = 895; a band of 25% reaches it from 717 (896.25), not from 715
    edge, below = row("zero1", 717.0, 0.25), row("zero1b", 715.0, 0.25)
    unknown = row("pipeline", 999.0, None)
    unpriced = {**row("allreduce + fp16 hook", 990.0, 0.108), "unpriced": "fp16 hook on CPUs: ..."}
    beyond = row("allreduce", 1990.0, 0.1, n=4, extrapolated=True)
    others = [row("ps-async", 1500.0, 0.15, synchronous=False), row("big", 999.0, 0.1, feasible=False)]
    rows = [towers, allreduce, ps, far, edge, below, unknown, unpriced, beyond, *others]
    assert [r["label"] for r in close_calls(rows, towers, "words_per_s")] == ["allreduce", "ps-sync", "zero1"]
    assert close_calls(rows, unknown, "words_per_s") == [] and close_calls(rows, None, "words_per_s") == []
    # the extrapolated N = 4 row is named once measured there (1990 words/s, the fastest, is named first)
    beyond["extrapolated"] = False
    assert [(r["label"], r["n"]) for r in close_calls(rows, towers, "words_per_s")][0] == ("allreduce", 4)
    # cost, per device: the floor is 500 x 0.895 = 447.5; 1990 / 4 = 497.5 reaches it, 1600 / 4 x 1.1 = 440 not
    assert ("allreduce", 4) in [(r["label"], r["n"]) for r in close_calls(rows, towers, "cost")]
    beyond["units_per_s"] = 1600.0
    assert all(r["n"] == 2 for r in close_calls(rows, towers, "cost"))
    assert ("allreduce", 4) in [(r["label"], r["n"]) for r in close_calls(rows, towers, "words_per_s")]
    result = {"config": "c.toml", "date": "d", "unit": "samples", "rows": [towers, allreduce, ps],
              "interconnect": "measured", "link": {"alpha_s": 1e-5, "beta_s_per_byte": 1e-9},
              "device_memory_bytes": None, "objective": "words_per_s", "global_batch": None, "refused": {},
              "profile": {"device": "cpu", "cores": 2, "tokens_per_step": 64, "flops_per_unit": 1e6,
                          "peak_flops_source": "measured"},
              "close_calls": [{"label": "allreduce", "n": 2}, {"label": "ps-sync", "n": 2}]}
    for r in result["rows"]:
        r.update(staleness=0, reason="", step_s=0.01, compute_s=0.01, comm_s=0.0, bubble_s=0.0, optimizer_s=0.0,
                 speedup=1.0, efficiency=0.5, mfu=0.1, command="paratrain train c.toml")
    result["recommended"] = towers
    text = markdown(result)
    line = next(x for x in text.splitlines() if x.startswith("Too close to call"))
    assert "allreduce at N = 2 (987 samples/s, -1.3%, error 11%)" in line
    assert "ps-sync at N = 2 (971 samples/s, -2.9%, error 13%)" in line and "error of 10%" in line
    assert "Too close to call" not in markdown({**result, "close_calls": []})


def test_a_plan_row_carries_its_strategys_measured_error_at_its_own_n(tmp_path):
    """plan.read_validation and row_error: ptb_small's replicate (towers) on 2026-11-27 measured -3.0% at N = 2 and
    -20.1% at N = 4 (oversubscribed): the N = 2 row carries 3.0%, the N = 4 row 20.1%, an N not
    measured (8) the largest, 20.1%; a layout's K or hook shares its strategy's N; unvalidated, or no run
    that gave a step time: None."""
    import json

    from paratrain.bench.plan import read_validation, row_error

    rows = [{"strategy": "replicate", "n": 2, "step_error": -0.030, "memory_error": 0.05},
            {"strategy": "replicate", "n": 4, "step_error": -0.201, "memory_error": 0.1},
            {"strategy": "ps-sync", "n": 2, "step_error": 0.04, "memory_error": 0.0},
            {"strategy": "ps-sync", "n": 2, "step_error": -0.06, "memory_error": 0.0},  # K = 2
            {"strategy": "fsdp", "n": 2, "step_error": float("nan"), "memory_error": 0.0}]
    (tmp_path / "validation.json").write_text(json.dumps({"rows": rows}))
    checked = read_validation(tmp_path)
    assert row_error(checked, "replicate", 2) == pytest.approx(0.030)
    assert row_error(checked, "replicate", 4) == row_error(checked, "replicate", 8) == pytest.approx(0.201)
    assert row_error(checked, "ps-sync", 2) == pytest.approx(0.06) and checked["ps-sync"]["max_n"] == 2
    assert row_error(checked, "fsdp", 2) is None and row_error(checked, "zero1", 2) is None  # no step time, none
    assert checked["fsdp"]["max_n"] == 0 and checked["replicate"]["max_n"] == 4  # a failed run measures no N
    assert read_validation(tmp_path / "nothing") == {}


def test_a_checkpointed_row_carries_its_checkpointed_runs_error_and_a_plain_row_its_plain_runs(tmp_path):
    """plan.read_validation keeps a strategy's checkpointed runs apart: digits_cnn's allreduce on
    2026-11-29 measured +5.0% plain and +16.7% checkpointed at N = 2. The plain row carries 5.0% (the
    recompute's error is not its own), the checkpointed row 16.7%. fsdp validated plain only: its
    checkpointed row carries the plain 8.0% and is extrapolated (its recompute was not measured), as
    does zero1's, whose checkpointed run failed; allreduce's checkpointed row at 2 is not."""
    import json

    from paratrain.bench.plan import extrapolated, read_validation, row_error

    rows = [{"strategy": "allreduce", "n": 2, "step_error": 0.05, "memory_error": 0.01},
            {"strategy": "allreduce", "n": 2, "step_error": 0.167, "memory_error": 0.08, "checkpointing": True},
            {"strategy": "fsdp", "n": 2, "step_error": -0.08, "memory_error": 0.02},
            {"strategy": "zero1", "n": 2, "step_error": 0.07, "memory_error": 0.02},
            {"strategy": "zero1", "n": 2, "step_error": float("nan"), "memory_error": 0.0, "checkpointing": True}]
    (tmp_path / "validation.json").write_text(json.dumps({"rows": rows}))
    checked = read_validation(tmp_path)
    assert row_error(checked, "allreduce", 2) == pytest.approx(0.05)
    assert checked["allreduce"]["memory_error"] == pytest.approx(0.01)
    assert row_error(checked, "allreduce", 2, checkpointing=True) == pytest.approx(0.167)
    assert row_error(checked, "fsdp", 2, checkpointing=True) == pytest.approx(0.08)
    assert not extrapolated(checked, "allreduce", 2, False, checkpointing=True)
    assert extrapolated(checked, "allreduce", 4, False, checkpointing=True)
    assert extrapolated(checked, "fsdp", 2, False, checkpointing=True) and not extrapolated(checked, "fsdp", 2, False)
    # zero1's checkpointed run failed (no step time): its plain runs' error, extrapolated
    assert row_error(checked, "zero1", 2, checkpointing=True) == pytest.approx(0.07)
    assert extrapolated(checked, "zero1", 2, False, checkpointing=True)


def test_a_plan_row_is_extrapolated_beyond_the_measured_n_and_off_the_measured_link_above_one_device(tmp_path):
    """plan.extrapolated: a validation of single at N = 1 and allreduce at N = 1, 2 (a failed fsdp run
    at 2). On the measured link: allreduce at 2 is measured, at 4 extrapolated; single at 1 measured;
    fsdp (no step time) and zero1 (not validated) extrapolated. On a preset (``--interconnect ib400``)
    every row above one device is extrapolated (its link was not measured), and the one-device row is
    not: no link prices it."""
    import json

    from paratrain.bench.plan import extrapolated, read_validation

    rows = [{"strategy": "single", "n": 1, "step_error": 0.10, "memory_error": 0.0},
            {"strategy": "allreduce", "n": 1, "step_error": 0.02, "memory_error": 0.0},
            {"strategy": "allreduce", "n": 2, "step_error": 0.05, "memory_error": 0.0},
            {"strategy": "fsdp", "n": 2, "step_error": float("nan"), "memory_error": 0.0}]
    (tmp_path / "validation.json").write_text(json.dumps({"rows": rows}))
    checked = read_validation(tmp_path)
    measured_link = {(s, n): extrapolated(checked, s, n, preset=False)
                     for s, n in (("single", 1), ("allreduce", 1), ("allreduce", 2), ("allreduce", 4),
                                  ("fsdp", 2), ("zero1", 2))}
    assert measured_link == {("single", 1): False, ("allreduce", 1): False, ("allreduce", 2): False,
                             ("allreduce", 4): True, ("fsdp", 2): True, ("zero1", 2): True}
    assert not extrapolated(checked, "single", 1, preset=True) and not extrapolated(checked, "allreduce", 1, True)
    assert extrapolated(checked, "allreduce", 2, preset=True) and extrapolated(checked, "zero1", 1, preset=True)


def test_the_validation_runs_the_layout_the_plan_ranks_first_at_two(monkeypatch):
    """plan_validate.plan_first is the plan's rank at N = 2 (the fastest synchronous layout, of a tie the
    least memory; an asynchronous one never), and validation_runs adds it to each strategy's plain layout where
    it is another (a hook here), once."""
    from paratrain.bench import plan as pl
    from paratrain.bench import plan_validate as pv

    lays = [pl.Layout("allreduce", 2, {}, "allreduce"), pl.Layout("allreduce", 2, {"comm_hook": "bf16"},
                                                                   "allreduce + bf16 hook"),
            pl.Layout("ps-async", 2, {"num_ps": 1}, "ps-async K=1")]
    rate = {"allreduce": 1000.0, "allreduce + bf16 hook": 1040.0, "ps-async K=1": 2000.0}
    monkeypatch.setattr(pl, "layouts", lambda n, prof, cfg: [pl.Layout(x.strategy, n, x.overrides, x.label)
                                                             for x in lays] if n == 2 else [])
    monkeypatch.setattr(pl, "refusal", lambda *a: None)
    monkeypatch.setattr(pl, "predict_layout", lambda lay, *a, **k: {
        "label": lay.label, "n": lay.n, "units_per_s": rate[lay.label], "synchronous": lay.strategy != "ps-async",
        "memory": {"total": 1.0}, "strategy": lay.strategy, "overrides": lay.overrides})
    first = pv.plan_first({"batch_size": 8}, None, None, 2, "c.toml", None, [])
    assert first.label == "allreduce + bf16 hook"  # the asynchronous one is faster and never recommended
    runs = pv.validation_runs({"batch_size": 8}, None, [1, 2], "c.toml", None, [], first)
    assert [(lay.label, n) for lay, n in runs] == [("allreduce", 2), ("ps-async K=1", 2), ("allreduce + bf16 hook", 2)]
    rate["allreduce"] = 1100.0  # the plain layout first: run once
    first = pv.plan_first({"batch_size": 8}, None, None, 2, "c.toml", None, [])
    runs = pv.validation_runs({"batch_size": 8}, None, [2], "c.toml", None, [], first)
    assert [(lay.label, n) for lay, n in runs] == [("allreduce", 2), ("ps-async K=1", 2)]
    # N = 2 not validated: not added
    assert pv.validation_runs({"batch_size": 8}, None, [1], "c.toml", None, [], first) == []


def test_the_validation_scores_the_recommendation_the_plan_makes():
    from paratrain.bench.plan_validate import _choice

    def row(label, predicted, mib, measured, step_error=float("nan")):
        return {"label": label, "n": 2, "synchronous": True, "ok": True, "predicted_units_per_s": predicted,
                "predicted_memory_bytes": mib * 2 ** 20, "measured_units_per_s": measured, "step_error": step_error}

    # gpt_wt2 on 2026-11-24: allreduce and zero1 predicted 0.07% apart; zero1 keeps less memory
    got = _choice([row("allreduce", 1000.0, 918, 880.0), row("zero1", 999.3, 900, 1000.0),
                   row("towers", 900.0, 1747, 800.0)])
    assert got == {"recommended": "zero1", "measured_fastest": "zero1", "shortfall": 0.0, "close_calls": [],
                   "first_not_run": None, "runoff": None, "judged_shortfall": 0.0}
    # the plan's own first layout at N = 2, where it was run, is the recommendation scored
    first = _choice([row("allreduce", 1000.0, 918, 880.0), row("zero1", 999.3, 900, 1000.0)], "allreduce")
    assert first["recommended"] == "allreduce" and first["shortfall"] == pytest.approx(0.12)
    assert first["first_not_run"] is None
    # a validation run before the plan's first layout was (or whose run gave no step time) says so
    old = _choice([row("allreduce", 1000.0, 918, 880.0), row("zero1", 999.3, 900, 1000.0)], "zero1 + bf16 hook")
    assert old["recommended"] == "zero1" and old["first_not_run"] == "zero1 + bf16 hook"
    got = _choice([row("allreduce", 1000.0, 918, 880.0), row("zero1", 980.0, 900, 1000.0)])
    assert got["recommended"] == "allreduce" and got["shortfall"] == pytest.approx(0.12)
    # of a tie, exact gradients before a compression hook at the same memory (gpt_wt2, 2026-11-28)
    hooked = {**row("allreduce + bf16 hook", 1929.8, 918, 1766.0), "overrides": {"comm_hook": "bf16"}}
    got = _choice([hooked, {**row("allreduce", 1927.4, 918, 1901.0), "overrides": {"bucket_mb": 100.0}}])
    assert got["recommended"] == "allreduce" and got["measured_fastest"] == "allreduce"
    # digits_cnn without sync BN on 2026-11-27: towers recommended by 1.3% and 2.9%, with step errors
    # (predicted / measured step - 1) of -10.5%, +10.8%, +12.7%: measured rates v (1 + e) = 895, 1094,
    # 1094; fsdp's band (581 x 1.035 = 601) is far below towers' 895: not named
    got = _choice([row("towers", 1000.0, 6, 895.0, -0.105), row("allreduce", 987.0, 3.2, 1093.6, 0.108),
                   row("ps-sync", 971.0, 3.0, 1094.3, 0.127), row("fsdp", 581.0, 3.0, 560.7, -0.035)])
    assert got["recommended"] == "towers" and got["measured_fastest"] == "ps-sync"
    assert got["close_calls"] == ["allreduce", "ps-sync"]
    from paratrain.bench.plan_validate import markdown

    text = markdown({"config": "c", "rows": [], "choice": got})
    assert ("Too close to call at N = 2 by these step errors (a layout whose predicted rate, raised by its own "
            "measured error, reaches the recommendation's, lowered by its own): allreduce, ps-sync.") in text


def test_a_run_off_pairs_the_two_layouts_back_to_back_in_alternating_order_and_judges_on_the_median_ratio():
    """ptb_small on 2026-11-28: the bf16 hook's two runs in the rounds were 139.8 and 186.8 ms, so the
    round-robin's "fastest" was the moment its first run had. Here a machine slows 10% with every
    run, and b's rate is a's times 1.02 at the same moment: a pair run a b favours a, b a favours
    b, so the order alternates."""
    from paratrain.bench.plan_validate import _choice, markdown, run_off

    calls, speed = [], [1.0]

    def run(i, k):
        calls.append((i, k))
        speed[0] /= 1.1
        return {"units_per_s": 1000.0 * speed[0] * (1.02 if i == 1 else 1.0)}

    ro = run_off(run, 0, 1, 3, ("allreduce", "allreduce + bf16 hook"))
    assert calls == [(0, 0), (1, 1), (1, 2), (0, 3), (0, 4), (1, 5)]  # a b, b a, a b; each run's k its own
    assert ro["first"] == ["allreduce", "allreduce + bf16 hook", "allreduce"]
    assert ro["ratios"] == pytest.approx([1.1 / 1.02, 1 / (1.1 * 1.02), 1.1 / 1.02])
    assert ro["shortfall"] == pytest.approx(1 - 1.1 / 1.02)  # the median of 3: a pair where a ran first
    # an even count's median is the mean of the middle two: one pair each way
    calls.clear()
    ro = run_off(run, 0, 1, 2, ("allreduce", "allreduce + bf16 hook"))
    assert ro["shortfall"] == pytest.approx(1 - (1.1 / 1.02 + 1 / (1.1 * 1.02)) / 2)
    # a failed run gives no ratio for its pair; none at all: NaN
    failed = run_off(lambda i, k: {"units_per_s": float("nan")} if k == 1 else {"units_per_s": 100.0}, 0, 1, 2,
                     ("a", "b"))
    assert failed["ratios"] == [1.0] and failed["shortfall"] == 0.0
    assert math.isnan(run_off(lambda i, k: {}, 0, 1, 1, ("a", "b"))["shortfall"])

    def row(label, predicted, measured):
        return {"label": label, "n": 2, "synchronous": True, "ok": True, "predicted_units_per_s": predicted,
                "predicted_memory_bytes": 2 ** 20, "measured_units_per_s": measured, "step_error": 0.0}

    rows = [row("allreduce", 1000.0, 880.0), row("allreduce + bf16 hook", 990.0, 1000.0)]
    ro = {"recommended": "allreduce", "measured_fastest": "allreduce + bf16 hook", "rates": [[990.0, 1000.0]],
          "first": ["allreduce"], "ratios": [0.99], "shortfall": 0.01}
    got = _choice(rows, None, ro)
    assert got["shortfall"] == pytest.approx(0.12) and got["judged_shortfall"] == pytest.approx(0.01)
    assert got["runoff"] == ro
    text = markdown({"config": "c", "rows": [], "choice": got})
    assert ("Run-off: the two ran again in 1 pair(s) back to back, the order alternating (allreduce first in pairs "
            "1); their rates per s, the recommendation's / the fastest's: 990.0 / 1000.0; the median ratio 0.990: "
            "the recommendation is 1.0% slower than allreduce + bf16 hook.") in text
    # a run-off whose pairs gave no ratio: the rounds' shortfall is judged, and the report says so
    empty = {**ro, "rates": [[float("nan"), 1000.0]], "ratios": [], "shortfall": float("nan")}
    none = _choice(rows, None, empty)
    assert none["judged_shortfall"] == pytest.approx(0.12)
    text = markdown({"config": "c", "rows": [], "choice": none})
    assert "no pair gave two rates, so the 5% target is judged on the rounds' shortfall above." in text
    assert "The 5% target is judged on this" not in text
    # a rescore that recommends another layout keeps the run-off out of its score
    other = _choice([row("allreduce", 980.0, 880.0), row("allreduce + bf16 hook", 1000.0, 1000.0)], None, ro)
    assert other["runoff"] is None and other["judged_shortfall"] == 0.0


def test_loop_sync_batchnorm_is_each_strategys_two_replica_step_with_the_key_on_minus_off(monkeypatch, capsys):
    """profile_runs.loop_sync_batchnorm with the runs stubbed: the commands (each strategy at 2
    replicas, the global batch, the key on and off) and the arithmetic (median on - median off of rank
    0's data + forward + backward, at least 0)."""
    from pathlib import Path
    from types import SimpleNamespace

    from paratrain.bench import report, runner, sweep, validate
    from paratrain.bench.profile_runs import loop_sync_batchnorm

    recipe = str(Path(__file__).resolve().parents[2] / "configs" / "digits_cnn.toml")
    # compute seconds by (strategy, key on), one per round: medians 0.044 / 0.010 and 0.031 / 0.017
    compute = {("allreduce", True): [0.044, 0.046, 0.040], ("allreduce", False): [0.010, 0.011, 0.009],
               ("replicate", True): [0.031, 0.030, 0.035], ("replicate", False): [0.017, 0.016, 0.020]}
    commands = []

    def run_cmd(cmd, log, timeout_s, env):
        commands.append(cmd)
        return 0, None

    def variant(cmd):  # (strategy, key on; None: off with DDP's buffer broadcast on)
        strategy = cmd[cmd.index("--strategy") + 1]
        on = "model.sync_batchnorm=true" in cmd
        sends = strategy == "allreduce" and not on and "dist.broadcast_buffers=false" not in cmd
        return strategy, (None if sends else on)

    def workload(rec, ranks, units):
        key = variant(rec["cmd"])
        got = compute[key][sum(1 for c in commands[:rec["i"] + 1] if variant(c) == key) - 1]
        return SimpleNamespace(data_s=0.001, forward_s=got / 2 - 0.0005, backward_s=got / 2 - 0.0005)

    monkeypatch.setattr(runner, "run_cmd", run_cmd)
    monkeypatch.setattr(sweep, "read_outcome", lambda plan, rc, run_dir: len(commands) - 1)
    monkeypatch.setattr(report, "run_record", lambda i: {"ok": True, "units_per_step": 64, "cmd": commands[i], "i": i})
    monkeypatch.setattr(validate, "workload_from_record", workload)
    got = loop_sync_batchnorm(recipe, None, (), None, 64, 12, repeats=3)
    assert got == pytest.approx({"allreduce": 0.034, "replicate": 0.014})
    assert len(commands) == 12  # 3 rounds x 2 strategies x on, off
    for cmd in commands:
        assert "train.batch_size=128" in cmd and "train.max_steps=12" in cmd  # 64 a replica, as the plan's rows
        assert ("model.sync_batchnorm=true" in cmd) != ("model.sync_batchnorm=false" in cmd)
    replicate = [c for c in commands if c[c.index("--strategy") + 1] == "replicate"]
    assert all('dist.devices="cpu:0,cpu:1"' in c for c in replicate)  # two towers
    assert all("dist.nproc=2" in c for c in commands if c not in replicate)  # two processes
    # DDP's key-off runs leave out its per-forward buffer broadcast, as its key-on runs do; towers have none
    for c in commands:
        off = "model.sync_batchnorm=false" in c and c not in replicate
        assert ("dist.broadcast_buffers=false" in c) == off, c
    # a key that costs nothing measured below zero: 0, not a negative term
    compute[("replicate", True)] = [0.015, 0.015, 0.015]
    commands.clear()
    assert loop_sync_batchnorm(recipe, None, (), None, 64, 12, repeats=3)["replicate"] == 0.0
    # a strategy whose run fails is left out with a line (the plan falls back to the micro-benchmark)
    monkeypatch.setattr(report, "run_record", lambda i: {"ok": "replicate" not in commands[i], "units_per_step": 64,
                                                          "cmd": commands[i], "i": i})
    commands.clear()
    got = loop_sync_batchnorm(recipe, None, (), None, 64, 12, repeats=1)
    assert set(got) == {"allreduce"}
    assert "replicate left out (its run with the key on failed" in capsys.readouterr().out
    # 4 replicas (more than the cores): each with the recipe's batch too
    commands.clear()
    got = loop_sync_batchnorm(recipe, None, (), None, 64, 12, strategies=("allreduce",), replicas=4)
    assert set(got) == {"allreduce"} and len(commands) == 2
    assert all("dist.nproc=4" in c and "train.batch_size=256" in c for c in commands), commands
    # a batch that 5 micro-batches cannot split: nothing runs, both left out
    commands.clear()
    assert loop_sync_batchnorm(recipe, None, (), None, 12, 12, accumulation=5) == {} and not commands
    assert "a batch of 12 per replica does not split into 5 micro-batches" in capsys.readouterr().out


def test_sync_batchnorm_micro_benchmarks_run_only_for_what_the_loop_did_not_measure(monkeypatch):
    """profile_runs.sync_batchnorm_fallbacks with the micro-benchmarks stubbed: the loop's measurement of
    both strategies leaves nothing to time; a strategy it left out (a failed run) or no loop at all
    times the layers apart, with each layer's share of the step's compute, and tells the
    progress bar each one it runs; no BatchNorm
    inputs, no links or no towers' forwards: nothing for what needs them; a GPU's profile: not the
    processes' (its plan never reads them)."""
    from paratrain.bench import microbench_meetings, microbench_towers
    from paratrain.bench.profile_runs import sync_batchnorm_fallbacks, sync_batchnorm_strategies

    calls = []
    monkeypatch.setattr(microbench_meetings, "measured_sync_batchnorm",
                        lambda shapes, compute_s, repeats: calls.append(("processes", compute_s)) or 0.025)
    monkeypatch.setattr(microbench_towers, "measured_tower_sync_batchnorm",
                        lambda shapes, repeats, compute_s: calls.append(("towers", compute_s)) or 0.006)
    processes, towers = sync_batchnorm_strategies()
    shapes = [[64, 16, 8, 8], [64, 32, 8, 8]]

    def profile(**extra):
        return {"batchnorm_inputs": shapes, "links": {}, "default_threads": 2,
                "workloads_in_process": {"2": {"forward_s": 0.004, "backward_s": 0.006}},
                "towers_forward_threads": {"towers": 2, "seconds": 0.010}, **extra}

    prof = profile()
    sync_batchnorm_fallbacks(prof, {processes: 0.031, towers: 0.012})
    assert not calls and "sync_batchnorm_s" not in prof and "tower_sync_batchnorm_s" not in prof
    sync_batchnorm_fallbacks(prof, {processes: 0.031})  # the towers' run failed
    assert calls == [("towers", pytest.approx(0.005))] and prof["tower_sync_batchnorm_s"] == 0.006
    calls.clear()
    prof, told = profile(), []
    sync_batchnorm_fallbacks(prof, {}, told.append)  # no loop (a GPU): both, each layer after its share of compute
    assert calls == [("processes", (pytest.approx(0.002), pytest.approx(0.003))), ("towers", pytest.approx(0.005))]
    assert told == ["sync BatchNorm micro-benchmark: 2 processes", "sync BatchNorm micro-benchmark: CPU towers"]
    assert prof["sync_batchnorm_s"] == 0.025 and prof["tower_sync_batchnorm_s"] == 0.006
    calls.clear()
    for bare in (profile(batchnorm_inputs=[]), {k: v for k, v in profile().items() if k != "links"}):
        sync_batchnorm_fallbacks(bare, {})
    few_cores = {k: v for k, v in profile().items() if k != "towers_forward_threads"}  # no towers' forward
    sync_batchnorm_fallbacks(few_cores, {})
    assert calls == [("processes", (pytest.approx(0.002), pytest.approx(0.003)))]
    calls.clear()
    steps = profile(towers_forward_threads={"towers": 2, "seconds": 0.010, "sync_batchnorm_s": 0.004})
    sync_batchnorm_fallbacks(steps, {processes: 0.031})  # the towers' steps timed synchronised: no layers alone
    assert not calls and "tower_sync_batchnorm_s" not in steps
    gpu = {**profile(), "device": "cuda"}  # a GPU's profile plans its measured link at N = 1 alone: unread
    del gpu["towers_forward_threads"]
    sync_batchnorm_fallbacks(gpu, {})
    assert not calls and "sync_batchnorm_s" not in gpu


def _stub_profile(keys):
    """A stand-in for profile.profile_model that writes ``keys()`` into its ``out`` (its phases unrecorded)."""
    def profile_model(task, cfg, progress, towers_task, data_dir, out, phase):
        out.update(keys())
        return out
    return profile_model


@pytest.mark.parametrize("cores", [2, 4])
def test_the_profile_measures_sync_batchnorm_in_the_loop_at_4_processes_only_on_fewer_cores(monkeypatch, tmp_path,
                                                                                           cores):
    """plan_profile.load_profile with the measurements stubbed (a BatchNorm recipe on a CPU): the loop's sync
    BatchNorm at 2 replicas for both strategies; on fewer than 4 cores the processes' again at 4, with
    half the steps (its step is about 4 / 2 times as long), kept as loop_sync_batchnorm_oversubscribed;
    not when the 2-replica run of the processes' strategy failed (a line needs both ends); then the
    layers' micro-benchmarks for what the loop left out."""
    import argparse
    from pathlib import Path

    from paratrain.bench import plan_profile, profile, profile_runs, profile_runs_ps, profile_runs_towers
    from paratrain.config import load

    recipe = str(Path(__file__).resolve().parents[2] / "configs" / "digits_cnn.toml")
    cfg = load(recipe, [])
    processes, towers = profile_runs.sync_batchnorm_strategies()
    loops, fallbacks = [], []

    def loop_sync_batchnorm(config, task, overrides, data_dir, batch, steps, strategies=None, repeats=1,
                            accumulation=1, replicas=2):
        loops.append((replicas, steps, strategies))
        measured = {processes: 0.03, towers: 0.01} if replicas == 2 else {processes: 0.085}
        return {k: v for k, v in measured.items() if k not in failing}

    in_process = {}  # the towers' steps timed in the profile's process (version 36)
    monkeypatch.setattr(profile, "profile_model", _stub_profile(lambda: {
        "device": "cpu", "cores": cores, "default_threads": 2, "batchnorm_inputs": [[64, 16, 8, 8]],
        "buffer_bytes": 920, "workloads_in_process": {"2": {"data_s": 0.0, "forward_s": 0.004, "backward_s": 0.004,
                                       "optimizer_s": 0.002}}, **in_process}))
    monkeypatch.setattr(profile_runs, "sync_batchnorm_fallbacks",
                        lambda prof, loop, progress: fallbacks.append(dict(loop)))
    monkeypatch.setattr(profile_runs, "loop_workload_rounds", lambda *a, **k: {})
    one_rank = {"allreduce": {"step_s": 0.0004, "compute_s": 0.0003, "optimizer_s": 0.0}}
    monkeypatch.setattr(profile_runs, "loop_one_rank_overheads", lambda *a, **k: one_rank)  # a CPU's too (presets)
    monkeypatch.setattr(profile_runs_ps, "loop_ps", lambda *a, **k: ({}, {}))
    monkeypatch.setattr(profile_runs, "loop_sync_batchnorm", loop_sync_batchnorm)
    monkeypatch.setattr(profile_runs_towers, "loop_towers", lambda *a, **k: None)  # (its run failed: no key)
    monkeypatch.setattr("paratrain.env.available_cores", lambda: cores)
    args = argparse.Namespace(reprofile=True, profile_steps=6, timed_seconds=2.0, profile_repeats=2, config=recipe,
                              task=None, overrides=[], data_dir=None)
    failing = ()
    prof, cached = plan_profile.load_profile(args, cfg, None, tmp_path / "a")
    steps = plan_profile.run_steps(6, 0.01, 2.0)  # 300 at a 10 ms step
    assert not cached and prof["loop_sync_batchnorm_s"] == {processes: 0.03, towers: 0.01}
    assert prof["loop_one_rank_s"] == one_rank
    assert "loop_buffer_broadcast_s" not in prof  # sync BatchNorm: DDP sends no buffers
    both = (processes, towers)
    if cores < 4:
        assert loops == [(2, steps, both), (4, plan_profile.run_steps(6, 0.02, 2.0), (processes,))]
        assert prof["loop_sync_batchnorm_oversubscribed"] == {"processes": 4, "seconds": 0.085}
    else:
        assert loops == [(2, steps, both)] and "loop_sync_batchnorm_oversubscribed" not in prof
    assert fallbacks == [{processes: 0.03, towers: 0.01}]
    loops.clear(), fallbacks.clear()
    failing = (processes,)  # its 2-replica run failed: no 4-replica run, the micro-benchmark for it
    prof, _ = plan_profile.load_profile(args, cfg, None, tmp_path / "b")
    assert loops == [(2, steps, both)] and "loop_sync_batchnorm_oversubscribed" not in prof
    assert fallbacks == [{towers: 0.01}]
    loops.clear(), fallbacks.clear()
    failing = ()  # the towers' steps plain and synchronised were timed in the profile's process: the processes' pair
    in_process["towers_forward_threads"] = {"towers": cores, "seconds": 0.01, "sync_batchnorm_s": 0.002}
    prof, _ = plan_profile.load_profile(args, cfg, None, tmp_path / "c")
    assert loops[0] == (2, steps, (processes,)) and "loop_towers" not in prof


def test_loop_buffer_broadcast_is_ddps_two_replica_step_with_the_broadcast_minus_without(monkeypatch, capsys):
    """profile_runs.loop_buffer_broadcast with the runs stubbed: DDP at 2 replicas of the recipe's
    batch, sync BatchNorm off, dist.broadcast_buffers true and false side by side in each round; the
    median of rank 0's data + forward + backward with it less without, at least 0; a failed run: none."""
    from pathlib import Path
    from types import SimpleNamespace

    from paratrain.bench import report, runner, sweep, validate
    from paratrain.bench.profile_runs import loop_buffer_broadcast

    recipe = str(Path(__file__).resolve().parents[2] / "configs" / "digits_cnn.toml")
    compute = {True: [0.0061, 0.0058, 0.0065], False: [0.0041, 0.0040, 0.0044]}  # medians 6.1 and 4.1 ms
    commands, ok = [], [True]

    def sends(cmd):
        assert ("dist.broadcast_buffers=true" in cmd) != ("dist.broadcast_buffers=false" in cmd)
        return "dist.broadcast_buffers=true" in cmd

    def run_cmd(cmd, log, timeout_s, env):
        commands.append(cmd)
        return 0, None

    def workload(rec, ranks, units):
        key = sends(rec["cmd"])
        got = compute[key][sum(1 for c in commands[:rec["i"] + 1] if sends(c) == key) - 1]
        return SimpleNamespace(data_s=0.0, forward_s=got / 2, backward_s=got / 2)

    monkeypatch.setattr(runner, "run_cmd", run_cmd)
    monkeypatch.setattr(sweep, "read_outcome", lambda plan, rc, run_dir: len(commands) - 1)
    monkeypatch.setattr(report, "run_record", lambda i: {"ok": ok[0], "units_per_step": 64, "cmd": commands[i], "i": i})
    monkeypatch.setattr(validate, "workload_from_record", workload)
    assert loop_buffer_broadcast(recipe, None, (), None, 64, 12, repeats=3) == pytest.approx({"allreduce": 0.002})
    assert len(commands) == 6  # 3 rounds x with, without
    for cmd in commands:
        assert cmd[cmd.index("--strategy") + 1] == "allreduce" and "dist.nproc=2" in cmd
        assert "model.sync_batchnorm=false" in cmd and "train.batch_size=128" in cmd and "train.max_steps=12" in cmd
    assert [sends(c) for c in commands[:2]] == [True, False]  # side by side in each round
    compute[True] = [0.0039, 0.0039, 0.0039]  # no dearer with it: 0, not a negative term
    commands.clear()
    assert loop_buffer_broadcast(recipe, None, (), None, 64, 12, repeats=3) == {"allreduce": 0.0}
    ok[0] = False  # a failed run: left out with a line (the plan prices the tree)
    commands.clear()
    assert loop_buffer_broadcast(recipe, None, (), None, 64, 12) == {}
    assert "DDP's buffer broadcast in the loop: allreduce left out (its run with the broadcast failed" in \
        capsys.readouterr().out


@pytest.mark.parametrize("sets, cores, measured", [
    (["model.sync_batchnorm=false"], 2, True),
    (["model.sync_batchnorm=false", "dist.broadcast_buffers=false"], 2, False),  # DDP sends none
    (["model.sync_batchnorm=false"], 1, False),  # one core: the loop is not the step of two processes
])
def test_the_profile_measures_ddps_buffer_broadcast_where_the_recipe_keeps_it(monkeypatch, tmp_path, sets, cores,
                                                                             measured):
    import argparse
    from pathlib import Path

    from paratrain.bench import plan_profile, profile, profile_runs, profile_runs_ps
    from paratrain.config import load

    recipe = str(Path(__file__).resolve().parents[2] / "configs" / "digits_cnn.toml")
    calls = []
    monkeypatch.setattr(profile, "profile_model", _stub_profile(lambda: {
        "device": "cpu", "cores": cores, "default_threads": cores, "batchnorm_inputs": [], "buffer_bytes": 920,
        "workloads_in_process": {str(cores): {"data_s": 0.0, "forward_s": 0.002, "backward_s": 0.002,
                                              "optimizer_s": 0.0005}}}))
    monkeypatch.setattr(profile_runs, "loop_workload_rounds", lambda *a, **k: {})
    one_rank = {"allreduce": {"step_s": 0.0004, "compute_s": 0.0003, "optimizer_s": 0.0}}
    monkeypatch.setattr(profile_runs, "loop_one_rank_overheads", lambda *a, **k: one_rank)  # a CPU's too (presets)
    monkeypatch.setattr(profile_runs_ps, "loop_ps", lambda *a, **k: ({"ps-async": 0.003}, {"ps-async": 6e-4}))
    monkeypatch.setattr(profile_runs, "sync_batchnorm_fallbacks", lambda prof, loop, progress: None)
    monkeypatch.setattr(profile_runs, "loop_sync_batchnorm", lambda *a, **k: pytest.fail("no sync BatchNorm here"))
    monkeypatch.setattr(profile_runs, "loop_buffer_broadcast",
                        lambda *a, **k: calls.append((a, k)) or {"allreduce": 0.0017})
    args = argparse.Namespace(reprofile=True, profile_steps=6, timed_seconds=2.0, profile_repeats=3, config=recipe,
                              task=None, overrides=sets, data_dir=None)
    prof, _ = plan_profile.load_profile(args, load(recipe, sets), None, tmp_path)
    if measured:
        assert prof["loop_buffer_broadcast_s"] == {"allreduce": 0.0017}
        (a, k), = calls
        assert a == (recipe, None, tuple(sets), None, 64, plan_profile.run_steps(6, 0.0045, 2.0))
        assert k == {"repeats": 3, "accumulation": 1}
    else:
        assert "loop_buffer_broadcast_s" not in prof and not calls
    # a PS worker's compute and its guard in the loop: on a CPU of several cores (its workers share them)
    assert prof.get("loop_ps_stolen_s") == ({"ps-async": 0.003} if cores > 1 else None)
    assert prof.get("loop_ps_guard_s") == ({"ps-async": 6e-4} if cores > 1 else None)


def test_the_one_device_step_is_the_median_round_each_rounds_step_kept_in_order():
    """median_rounds: per thread count the round whose step (data + forward + backward + optimizer)
    is the median, the lower middle of an even count; every round's step in the order they ran."""
    from paratrain.bench.profile_runs import median_rounds

    def parts(step_ms, concurrent=None):  # a step of step_ms: 0.1 data, 0.4 optimizer, the rest 50/50
        f = (step_ms - 0.5) / 2 / 1000
        return {"data_s": 1e-4, "forward_s": f, "backward_s": f, "optimizer_s": 4e-4, "local_sd_s": 1e-4,
                **({"concurrent": concurrent} if concurrent else {})}

    got = median_rounds({"2": [parts(3.0), parts(3.2), parts(2.4), parts(2.5)], "1": [parts(3.5, 2), parts(3.7, 2)],
                         "4": [parts(2.0)]})
    # 2 threads: 3.0, 3.2, 2.4, 2.5 ms sort to 2.4, 2.5, 3.0, 3.2: the lower middle is the 2.5 ms round
    assert got["2"]["forward_s"] == pytest.approx(0.001) and got["2"]["rounds_step_s"] == pytest.approx(
        [0.0030, 0.0032, 0.0024, 0.0025])
    assert got["1"]["forward_s"] == pytest.approx(0.0015) and got["1"]["concurrent"] == 2  # 3.5 of 3.5, 3.7
    assert got["4"] == parts(2.0)  # one round: no rounds to list
    odd = median_rounds({"2": [parts(2.9), parts(2.2), parts(2.6)]})["2"]
    assert odd["forward_s"] == pytest.approx(0.00105)  # 2.6 ms: the middle of three


@pytest.mark.parametrize("device, cores", [("cpu", 2), ("cpu", 1), ("cuda", 2)])
def test_a_cpu_profile_takes_its_one_device_step_over_rounds_spread_across_the_profile(monkeypatch, tmp_path, device,
                                                                                      cores):
    """plan_profile.load_profile with the measurements stubbed: on a CPU the default-thread one-device
    run goes --profile-repeats rounds first (with the one-thread runs side by side where there are
    several cores), then once more after the one-rank runs and once after the last of the loop's runs
    (the PS jobs; not where none ran, as on one core: it would follow the last round straight on):
    its step is the median of those rounds (the 2-vCPU EPYC VM's step moved 2.0-3.5 ms in spells
    longer than two back-to-back runs). A GPU's profile runs its rounds once, first."""
    import argparse
    from pathlib import Path

    from paratrain.bench import plan_profile, profile, profile_runs, profile_runs_ps, profile_runs_towers
    from paratrain.config import load

    recipe = str(Path(__file__).resolve().parents[2] / "configs" / "ptb_small.toml")
    cfg = load(recipe, [])
    events, draws = [], iter([[3.2, 3.0], [2.4], [2.5]])  # the step (ms) of each call's default-thread rounds

    def parts(step_ms):
        return {"data_s": 0.0, "forward_s": step_ms / 2000, "backward_s": step_ms / 2000, "optimizer_s": 0.0,
                "local_sd_s": 0.0}

    def rounds(config, task, overrides, data_dir, batch, steps, threads, concurrent=1, repeats=1):
        events.append(("rounds", threads, repeats))
        got = {str(cores): [parts(ms) for ms in next(draws)]}
        if 1 in threads:
            got["1"] = [{**parts(4.0), "concurrent": concurrent}] * repeats
        return got

    towers = cores if device == "cpu" and cores > 1 else 0  # CPU towers, one a core, timed in process
    monkeypatch.setattr(profile, "profile_model", _stub_profile(lambda: {
        "device": device, "cores": cores, "default_threads": cores, "batchnorm_inputs": [],
        "workloads_in_process": {str(cores): {"data_s": 0.0, "forward_s": 0.001, "backward_s": 0.001,
                                              "optimizer_s": 0.0}},
        **({"towers_forward_threads": {"towers": towers, "seconds": 0.002}} if towers else {})}))
    monkeypatch.setattr(profile_runs, "loop_workload_rounds", rounds)
    monkeypatch.setattr(profile_runs, "loop_one_rank_overheads", lambda *a, **k: events.append("one-rank") or {})
    looped = {"towers": towers, "data_s": 0.0, "forward_s": 0.002, "backward_s": 0.001, "optimizer_s": 0.0005}

    def loop_towers(config, task, overrides, data_dir, batch, steps, n, repeats=1, accumulation=1):
        events.append(("towers", n, steps, repeats))
        return looped
    monkeypatch.setattr(profile_runs_towers, "loop_towers", loop_towers)
    monkeypatch.setattr(profile_runs_ps, "loop_ps", lambda *a, **k: events.append("ps") or ({}, {}))
    monkeypatch.setattr(profile_runs, "sync_batchnorm_fallbacks", lambda prof, loop, progress: None)
    args = argparse.Namespace(reprofile=True, profile_steps=6, timed_seconds=2.0, profile_repeats=2, config=recipe,
                              task=None, overrides=[], data_dir=None)
    prof, _ = plan_profile.load_profile(args, cfg, None, tmp_path)
    first = ("rounds", (None, 1) if device == "cpu" and cores > 1 else (None,), 2)
    if device == "cpu":
        if cores > 1:  # the PS jobs' loop runs where the workers share several cores, then a last round
            # the towers' step in the loop after the one-rank runs: at the in-process guess of 2 ms, a step of
            # `cores` towers is priced cores x 2 ms, and run_steps gives the steps of that
            steps = plan_profile.run_steps(6, 0.002 * cores, 2.0)
            assert events == [first, "one-rank", ("towers", cores, steps, 2), ("rounds", (None,), 1), "ps",
                              ("rounds", (None,), 1)]
            assert prof["loop_towers"] == looped
            # 3.2, 3.0, 2.4, 2.5 ms: the lower middle of four is 2.5 ms, the last round
            assert prof["workloads"]["2"]["forward_s"] == pytest.approx(0.00125)
            assert prof["workloads"]["2"]["rounds_step_s"] == pytest.approx([0.0032, 0.0030, 0.0024, 0.0025])
        else:  # one core: no loop runs after the one-rank runs, so no last round; 3.2, 3.0, 2.4: 3.0 ms
            assert events == [first, "one-rank", ("rounds", (None,), 1)] and "loop_towers" not in prof
            assert prof["workloads"]["1"]["forward_s"] == pytest.approx(0.0015)
            assert prof["workloads"]["1"]["rounds_step_s"] == pytest.approx([0.0032, 0.0030, 0.0024])
        if cores > 1:  # the one-thread runs side by side: their own rounds, not drawn again
            assert prof["workloads"]["1"] == {**parts(4.0), "concurrent": cores, "rounds_step_s": [0.004, 0.004]}
    else:  # a GPU's: its first rounds alone (3.2, 3.0: the lower middle 3.0)
        assert events == [first, "one-rank"] and "loop_towers" not in prof  # no CPU towers
        assert prof["workloads"]["2"]["forward_s"] == pytest.approx(0.0015)


def test_a_profile_cut_short_resumes_at_the_phase_it_was_in(monkeypatch, tmp_path, capsys):
    """plan_profile.load_profile with the measurements stubbed (ptb_small on 2 CPU cores): an interrupt
    in the towers' loop runs leaves profile.partial.json with the phases before it (in process, the
    one-device rounds, the one-rank runs) and no profile.json; the next measurement of the same key
    measures only the towers and what follows, its later rounds joining the first sitting's in the
    median, says it resumed, writes the whole profile with both sittings and removes the partial file.
    A partial file of another key (another recipe) or of other settings (--profile-repeats) is measured
    from the start; a cached profile read beside a partial of its own key (not another's) says that
    --reprofile resumes it."""
    import argparse
    from pathlib import Path

    from paratrain.bench import plan_profile, profile, profile_runs, profile_runs_ps, profile_runs_towers
    from paratrain.bench.profile_cache import PARTIAL
    from paratrain.config import load

    recipe = str(Path(__file__).resolve().parents[2] / "configs" / "ptb_small.toml")
    cfg = load(recipe, [])
    # each call's default-thread rounds (ms)
    events, draws = [], iter([[3.2, 3.0], [2.4], [2.5], *[[9.0, 9.0], [9.0], [9.0]] * 2])

    def parts(step_ms):
        return {"data_s": 0.0, "forward_s": step_ms / 2000, "backward_s": step_ms / 2000, "optimizer_s": 0.0,
                "local_sd_s": 0.0}

    def rounds(config, task, overrides, data_dir, batch, steps, threads, concurrent=1, repeats=1):
        events.append("rounds")
        return {"2": [parts(ms) for ms in next(draws)]}

    def in_process(task, cfg, progress, towers_task, data_dir, out, phase):  # its three phases
        phase("in process", lambda: events.append("in process") or out.update(
            {"device": "cpu", "cores": 2, "default_threads": 1, "batchnorm_inputs": [],
             "workloads_in_process": {"1": {"data_s": 0.0, "forward_s": 0.001, "backward_s": 0.001,
                                            "optimizer_s": 0.0}}}))
        phase("links", lambda: events.append("links") or out.update({"links": {}}))
        phase("CPU towers' forward", lambda: events.append("towers in process") or out.update(
            {"towers_forward_threads": {"towers": 2, "seconds": 0.002}}))
        return out

    cut = [True]

    def loop_towers(*a, **k):
        events.append("towers")
        if cut and cut.pop():
            raise KeyboardInterrupt
        return {"towers": 2, "data_s": 0.0, "forward_s": 0.002, "backward_s": 0.001, "optimizer_s": 0.0}

    monkeypatch.setattr(profile, "profile_model", in_process)
    monkeypatch.setattr(profile_runs, "loop_workload_rounds", rounds)
    monkeypatch.setattr(profile_runs, "loop_one_rank_overheads", lambda *a, **k: events.append("one-rank") or {})
    monkeypatch.setattr(profile_runs_towers, "loop_towers", loop_towers)
    monkeypatch.setattr(profile_runs_ps, "loop_ps", lambda *a, **k: events.append("ps") or ({}, {}))
    monkeypatch.setattr(profile_runs, "sync_batchnorm_fallbacks", lambda prof, loop, progress: None)
    monkeypatch.setattr("paratrain.env.available_cores", lambda: 2)
    args = argparse.Namespace(reprofile=False, profile_steps=6, timed_seconds=2.0, profile_repeats=2, config=recipe,
                              task=None, overrides=[], data_dir=None)
    out = tmp_path / "p"
    with pytest.raises(KeyboardInterrupt):
        plan_profile.load_profile(args, cfg, None, out)
    assert events == ["in process", "links", "towers in process", "rounds", "one-rank", "towers"]
    assert not (out / "profile.json").exists()
    saved = json.loads((out / PARTIAL).read_text())
    assert saved["done"] == [*profile.PHASES, "one-device runs", "one-rank runs"] and len(saved["sittings"]) == 1
    assert saved["profile"]["workloads"]["2"]["rounds_step_s"] == pytest.approx([0.0032, 0.0030])
    assert not list(out.glob("*.tmp"))
    events.clear()
    capsys.readouterr()
    prof, cached = plan_profile.load_profile(args, cfg, None, out)
    assert not cached and events == ["towers", "rounds", "ps", "rounds"]
    assert "[plan] profile: resuming the one begun" in capsys.readouterr().out
    # the first sitting's rounds (3.2, 3.0) and this one's (2.4, 2.5): the lower middle of four, 2.5 ms
    assert prof["workloads"]["2"]["rounds_step_s"] == pytest.approx([0.0032, 0.0030, 0.0024, 0.0025])
    assert prof["workloads"]["2"]["forward_s"] == pytest.approx(0.00125)
    assert prof["loop_towers"]["towers"] == 2 and len(prof["sittings"]) == 2
    assert json.loads((out / "profile.json").read_text())["sittings"] == prof["sittings"]
    assert not (out / PARTIAL).exists()
    # a partial profile of another key is not resumed: everything is measured, and it is replaced
    events.clear()
    (out / PARTIAL).write_text(json.dumps({**saved, "key": "another recipe's"}))
    args.reprofile, cut[:] = True, [False]
    prof, _ = plan_profile.load_profile(args, cfg, None, out)
    assert events[:5] == ["in process", "links", "towers in process", "rounds", "one-rank"] and "sittings" not in prof
    assert not (out / PARTIAL).exists()
    # a --reprofile cut short beside a whole profile: a plain plan reads the whole one and says how to resume
    saved["key"] = json.loads((out / "profile.json").read_text())["key"]
    (out / PARTIAL).write_text(json.dumps(saved))
    args.reprofile = False
    capsys.readouterr()
    assert plan_profile.load_profile(args, cfg, None, out)[1]
    assert "holds the phases of a profile cut short: --reprofile resumes it" in capsys.readouterr().out
    # ... but not of another recipe's partial, which --reprofile would not resume
    (out / PARTIAL).write_text(json.dumps({**saved, "key": "another recipe's"}))
    assert plan_profile.load_profile(args, cfg, None, out)[1]
    assert "cut short" not in capsys.readouterr().out
    # a partial of this key measured under other settings (--profile-repeats 2, now 3) is measured from the start
    (out / PARTIAL).write_text(json.dumps(saved))
    events.clear()
    args.reprofile, args.profile_repeats = True, 3
    prof, _ = plan_profile.load_profile(args, cfg, None, out)
    assert events[:5] == ["in process", "links", "towers in process", "rounds", "one-rank"] and "sittings" not in prof
    assert ("holds a profile cut short under other settings (profile_repeats 2 there, 3 now): measuring from the start"
            in capsys.readouterr().out)
    assert not (out / PARTIAL).exists()


def test_profile_model_resumed_after_its_in_process_phase_steps_the_optimizer_before_the_towers(monkeypatch):
    """profile.profile_model resumed in a later sitting (its ``phase`` skips the in-process phase, done
    before; ``out`` holds that sitting's keys): it builds digits_cnn's model again and takes ``warmup``
    optimizer steps (3 here) before the CPU towers' forward, which times steps on the optimizer's state
    (the in-process phase stepped it in a first sitting); it keeps the earlier keys, measures none of
    the in-process ones again, and adds the towers'."""
    from pathlib import Path

    from paratrain.bench import microbench_towers, profile
    from paratrain.config import load
    from paratrain.runs import build_task
    from paratrain.train import optim

    recipe = str(Path(__file__).resolve().parents[2] / "configs" / "digits_cnn.toml")
    cfg = load(recipe, ["train.batch_size=8"])
    task = build_task(cfg, None, world_size=1)
    steps, seen = [0], {}
    build = optim.build_optimizer

    def counted(*a, **k):
        opt = build(*a, **k)
        opt.register_step_post_hook(lambda *_: steps.__setitem__(0, steps[0] + 1))
        return opt

    def towers_forward(task, model, device, one_step, towers_task, cores, batch, **k):
        seen.update(steps=steps[0], cores=cores, sync=k["sync_batchnorm"])
        return {"towers": cores, "seconds": 0.001}

    monkeypatch.setattr(optim, "build_optimizer", counted)
    monkeypatch.setattr(microbench_towers, "towers_forward", towers_forward)
    earlier = {"device": "cpu", "cores": 2, "batchnorm_inputs": [[8, 16, 8, 8]], "version": 1}
    ran = []

    def later_sitting(name, run):
        if name != profile.PHASES[0]:
            ran.append(name)
            run()

    out = profile.profile_model(task, cfg, warmup=3, steps=1, progress=lambda what: None, links=False,
                                towers_task=lambda batch: task, out=dict(earlier), phase=later_sitting)
    assert ran == [profile.PHASES[2]] and seen == {"steps": 3, "cores": 2, "sync": True}
    assert out == {**earlier, "towers_forward_threads": {"towers": 2, "seconds": 0.001}}


def test_the_reports_profile_rounds_are_the_default_thread_runs_in_ms():
    """profile_rounds_ms: the rounds of the profile's run at the most threads (the one-device row's
    prediction, plan_inputs.workload), in ms and in order; [] for a profile of one round or older."""
    from paratrain.bench.plan_validate import profile_rounds_ms

    prof = {"workloads": {"2": {"rounds_step_s": [0.0032, 0.0024]}, "1": {"rounds_step_s": [0.0035, 0.0037]}}}
    assert profile_rounds_ms(prof) == pytest.approx([3.2, 2.4])
    assert profile_rounds_ms({"workloads": {"2": {"forward_s": 0.001}}}) == []  # one round (or before version 38)
    assert profile_rounds_ms({}) == []


def test_validation_says_when_the_machine_itself_changed_speed_since_the_profile():
    """The one-device row's prediction is the profile's own run of it: a measured step 64% longer
    means the machine slowed (it did, on this VM: 8.1 ms profiled, 13.3 ms validated); within 10%
    the report says nothing."""
    from paratrain.bench.plan_validate import machine_drift, markdown

    def row(strategy, n, predicted, measured, ok=True):
        return {"strategy": strategy, "label": strategy, "n": n, "ok": ok, "predicted_step_ms": predicted,
                "measured_step_ms": measured, "step_error": measured and predicted / measured - 1,
                "predicted_memory_bytes": 2 ** 20, "measured_memory_bytes": 2 ** 20, "memory_error": 0.0}

    slow = [row("single", 1, 8.1, 13.3), row("allreduce", 2, 42.3, 52.9)]
    assert machine_drift(slow) == pytest.approx(13.3 / 8.1 - 1)
    assert "ran 64% slower here than the profile measured it" in markdown({"config": "c", "rows": slow})
    assert machine_drift([row("single", 1, 10.0, 8.5)]) == pytest.approx(-0.15)  # faster
    assert "15% faster" in markdown({"config": "c", "rows": [row("single", 1, 10.0, 8.5)]})
    quiet = [row("single", 1, 9.0, 9.2), row("allreduce", 2, 40.0, 50.0)]
    assert machine_drift(quiet) is None and "machine" not in markdown({"config": "c", "rows": quiet})
    assert machine_drift([row("allreduce", 2, 40.0, 50.0)]) is None  # no one-device row: nothing to say
    assert machine_drift([row("single", 1, 8.1, 13.3, ok=False)]) is None  # a failed run says nothing
    # the profile's own rounds of the one-device run (version 38), listed where there are several
    text = markdown({"config": "c", "rows": [row("single", 1, 3.0, 2.4)], "profile_rounds_ms": [3.2, 3.0, 2.4, 2.5]})
    assert "The profile's own runs of it took 3.2, 3.0, 2.4, 2.5 ms (the median round taken)." in text
    assert "own runs" not in markdown({"config": "c", "rows": [row("single", 1, 3.0, 2.4)], "profile_rounds_ms": [3.0]})
    assert "own runs" not in markdown({"config": "c", "rows": [row("single", 1, 2.5, 2.4)],  # no drift: not said
                                       "profile_rounds_ms": [3.2, 2.5]})


def test_validation_shows_each_layouts_runs_and_which_misses_lie_inside_their_own_spread():
    """validation.md: the fastest and slowest run of each layout and their spread; of the layouts at
    N <= 2 over the 15% step target with two or more runs, those whose prediction lies between their
    own runs are named; with one run each it says nothing of them
    (digits_cnn's ps-sync at 2 on the 2-vCPU VM: 50.3 ms predicted, runs of 38.5 and 52.9 ms)."""
    from paratrain.bench.plan_validate import between_runs, markdown

    def row(label, n, predicted, runs):
        measured = sorted(runs)[(len(runs) - 1) // 2]
        return {"strategy": label, "label": label, "n": n, "ok": True, "predicted_step_ms": predicted,
                "measured_step_ms": measured, "measured_step_ms_all": runs, "step_error": predicted / measured - 1,
                "predicted_memory_bytes": 2 ** 20, "measured_memory_bytes": 2 ** 20, "memory_error": 0.0}

    ps = row("ps-sync", 2, 50.3, [38.5, 52.9])
    zero1 = row("zero1", 2, 60.0, [41.2, 45.0])  # +45.6%, above both runs
    fine = row("fsdp", 2, 69.2, [66.6, 70.3])  # +3.9%: not over the target
    four = row("towers", 4, 72.1, [59.3, 78.7])  # +21.6% but N = 4: no target
    alone = row("allreduce", 2, 60.0, [40.0])  # one run: no spread to lie inside
    assert [between_runs(r) for r in (ps, zero1, fine, alone)] == [True, False, True, False]
    text = markdown({"config": "c", "rows": [ps, zero1, fine, four, alone]})
    assert "| 38.5-52.9 (37%) |" in text and "| 41.2-45.0 (9%) |" in text
    assert "| allreduce | 2 | 60.0 | 40.0 | +50.0% | - |" in text  # one run: no spread
    assert ("2 layout(s) at N <= 2 with two or more runs are over the 15% step target; for 1 of them the "
            "prediction lies between the layout's own fastest and slowest runs") in text  # not allreduce's one run
    assert "(ps-sync at 2)." in text
    assert ("1 layout(s) at N <= 2 with two or more runs are over the 15% step target; no prediction of theirs "
            "lies between") in markdown({"config": "c", "rows": [zero1, fine]})
    for rows in ([fine, four], [alone]):  # none over the target; one run each (the default --validate-repeats)
        assert "step target" not in markdown({"config": "c", "rows": rows})


def test_validation_scores_each_run_at_the_one_device_speed_of_its_own_round():
    """``step_error_same_speed``: the predicted slowdown from one device (predicted / the one-device
    prediction) against the median over rounds of (run r / the one-device run r). Hand-computed: one
    device predicted 4.0 ms, runs 5.0 and 4.0 (the machine 25% slower in round 0); allreduce predicted
    10.0, runs 12.0 and 9.0: ratios 2.4 and 2.25, median 2.325, predicted 2.5, error 2.5 / 2.325 - 1 =
    +7.53%, where its plain error (against 9.0 here, its faster run) moves with the machine's speed."""
    from paratrain.bench.plan_validate import markdown, same_speed_errors

    def row(strategy, n, predicted, runs, ok=True):
        return {"strategy": strategy, "label": strategy, "n": n, "ok": ok, "predicted_step_ms": predicted,
                "measured_step_ms": min(runs), "measured_step_ms_all": runs, "step_error": predicted / min(runs) - 1,
                "predicted_memory_bytes": 2 ** 20, "measured_memory_bytes": 2 ** 20, "memory_error": 0.0}

    one, ar = row("single", 1, 4.0, [5.0, 4.0]), row("allreduce", 2, 10.0, [12.0, 9.0])
    failed_round = row("zero1", 2, 11.0, [float("nan"), 10.0])  # round 0 failed: round 1 alone, 11 / 4 vs 10 / 4
    broken = row("fsdp", 2, 15.0, [20.0, 21.0], ok=False)
    rows = same_speed_errors([one, ar, failed_round, broken])
    assert ar["step_error_same_speed"] == pytest.approx(2.5 / 2.325 - 1)
    assert failed_round["step_error_same_speed"] == pytest.approx((11.0 / 4.0) / (10.0 / 4.0) - 1)
    assert math.isnan(one["step_error_same_speed"]) and math.isnan(broken["step_error_same_speed"])
    # a machine uniformly 30% slower in every run than profiled: the plain errors all move, these do not
    slow = same_speed_errors([row("single", 1, 4.0, [5.2, 5.2]), row("allreduce", 2, 10.0, [13.0, 13.0])])
    assert slow[1]["step_error_same_speed"] == pytest.approx(0.0, abs=1e-12)  # its plain error: 10 / 13 - 1
    # no one-device row (a validation without N = 1): nothing to pair with
    assert math.isnan(same_speed_errors([row("allreduce", 2, 10.0, [12.0])])[0]["step_error_same_speed"])
    text = markdown({"config": "c", "rows": rows})
    assert "| allreduce | 2 | 10.0 | 9.0 | +11.1% | 9.0-12.0 (33%) | +7.5% |" in text
    assert "| single | 1 | 4.0 | 4.0 | +0.0% | 4.0-5.0 (25%) | - |" in text
    assert "the step errors at N <= 2 are within 10.0% (the largest: zero1 at 2)" in text


def test_rescore_prices_each_validated_layout_with_the_dist_keys_it_ran_with(tmp_path):
    """``--rescore`` predicts a kept run with the bucket it ran with (``overrides``), not one picked
    anew; a row kept before runs recorded them ran the recipe's ``dist.bucket_mb``. gpt_wt2's v25
    profile (17.8 MiB of gradients, this machine: no overlap): 1 MiB buckets cost more alpha terms
    than the one bucket of 25 MiB (0.3 ms more)."""
    import json
    from pathlib import Path

    from paratrain import config as configuration
    from paratrain.bench import plan as pl
    from paratrain.bench.costmodel import Link
    from paratrain.bench.plan_validate import rescore

    root = Path(__file__).resolve().parents[2]
    prof = json.loads((root / "benchmarks/results/plan-xeon/gpt_wt2-v25/profile.json").read_text())
    cfg = configuration.load(root / "configs/gpt_wt2.toml")
    link = Link(name="measured", **prof["links"]["all_reduce"])

    def row(strategy, n, measured, **kept):
        return {"strategy": strategy, "label": strategy, "n": n, "ok": True, "measured_step_ms": measured,
                "measured_step_ms_all": [measured], "measured_memory_bytes": 2 ** 30,
                "measured_units_per_s": 1000.0 / measured, **kept}

    (tmp_path / "validation.json").write_text(json.dumps(
        {"config": "configs/gpt_wt2.toml", "rows": [row("single", 1, 580.0), row("allreduce", 2, 1100.0,
                                                     overrides={"bucket_mb": 1.0}), row("zero1", 2, 1120.0)]}))
    rescore(cfg, prof, tmp_path, "configs/gpt_wt2.toml")
    got = {r["strategy"]: r for r in json.loads((tmp_path / "validation.json").read_text())["rows"]}

    def predicted(strategy, bucket_mb):
        lay = pl.Layout(strategy, 2, {"bucket_mb": bucket_mb}, strategy)
        return 1000 * pl.predict_layout(lay, prof, cfg, link, on_this_machine=True, global_batch=None)["step_s"]

    assert got["allreduce"]["predicted_step_ms"] == pytest.approx(predicted("allreduce", 1.0), rel=1e-12)
    # more buckets, more alpha terms (the tied embedding, 17.0 of the 17.8 MB, is one bucket at any size)
    assert predicted("allreduce", 1.0) > predicted("allreduce", 100.0) * (1 + 1e-5)
    assert cfg.dist.bucket_mb == 25.0
    assert got["zero1"]["predicted_step_ms"] == pytest.approx(predicted("zero1", 25.0), rel=1e-12)


def test_checkpointing_runs_the_blocks_forward_again_in_the_backward():
    """Activation checkpointing's step (Chen et al. 2016): the backward gains the checkpointed blocks'
    forward, their share of the profile's in-process forward (the blocks' 24 ms of 150 ms: 0.16) times
    the workload's forward; CPU towers' one backward gains every tower's in turn; with sync BatchNorm
    each layer's forward meetings again; memory as before. gpt_wt2's v25 and digits_cnn's v40
    profiles on this machine's measured link."""
    import json
    from pathlib import Path

    from paratrain import config as configuration
    from paratrain.bench import plan as pl
    from paratrain.bench.costmodel import Link
    from paratrain.bench.plan_inputs import recompute_fraction, towers_backward_s, workload

    assert recompute_fraction({"blocks": [{"forward_s": 0.010}, {"forward_s": 0.014}], "default_threads": 2,
                               "workloads_in_process": {"2": {"forward_s": 0.150}}}) == pytest.approx(0.16)
    assert recompute_fraction({"blocks": [{"forward_s": 0.2}], "default_threads": 2,
                               "workloads_in_process": {"2": {"forward_s": 0.150}}}) == 1.0  # at most the forward
    assert recompute_fraction({"blocks": [], "default_threads": 2,
                               "workloads_in_process": {"2": {"forward_s": 0.150}}}) == 0.0

    root = Path(__file__).resolve().parents[2]
    prof = json.loads((root / "benchmarks/results/plan-xeon/gpt_wt2-v25/profile.json").read_text())
    cfg = configuration.load(root / "configs/gpt_wt2.toml")
    link = Link(name="measured", **prof["links"]["all_reduce"])
    f = recompute_fraction(prof)
    assert 0.05 < f < 0.5  # gpt_wt2: the decoder and its softmax outside the two blocks

    def both(lay):
        plain, ckpt = (pl.predict_layout(lay, prof, cfg, link, on_this_machine=True, global_batch=None,
                                         checkpointing=c) for c in (False, True))
        return plain, ckpt
    plain, ckpt = both(pl.Layout("single", 1, {}, "single"))
    w = workload(prof, None)  # one device: this process' threads
    assert ckpt["step_s"] - plain["step_s"] == pytest.approx(f * w.forward_s, rel=1e-9)
    assert ckpt["label"] == "single + checkpointing" and ckpt["checkpointing"]
    assert ckpt["memory"]["activations"] < plain["memory"]["activations"]
    # two processes, each at its share of the cores: the recompute at that share's forward, in the step
    plain2, ckpt2 = both(pl.Layout("allreduce", 2, {"bucket_mb": 25.0}, "allreduce"))
    w1 = workload(prof, 1)
    assert ckpt2["step_s"] - plain2["step_s"] == pytest.approx(f * w1.forward_s, rel=1e-6)
    # CPU towers: their measured backward gains n recomputes, in the backward's one thread (digits_cnn's v40
    # profile measured it; gpt_wt2's v25 did not)
    v40 = json.loads((root / "benchmarks/results/plan-amd/digits_cnn-amd-v40/profile.json").read_text())
    assert towers_backward_s(v40, 2) > 0 and towers_backward_s(v40, 2, 1.0, 0.5) == towers_backward_s(v40, 2) + 0.5
    assert towers_backward_s(prof, 2) is None and towers_backward_s(prof, 2, 1.0, 0.5) is None
    # sync BatchNorm (digits_cnn): each layer's two forward meetings again in the backward, after the
    # recomputed compute as in the forward: two thirds of the term, waits and all (5 meetings a layer of 3)
    from paratrain.bench.plan_inputs import sync_batchnorm_recompute_s, sync_batchnorm_s

    digits = json.loads((root / "benchmarks/results/plan-amd/digits_cnn-amd-v40/profile.json").read_text())
    dcfg = configuration.load(root / "configs/digits_cnn.toml")
    dlink = Link(name="measured", **digits["links"]["all_reduce"])
    again = sync_batchnorm_recompute_s(digits, dcfg, 2, dlink, True)
    assert again == pytest.approx(sync_batchnorm_s(digits, dcfg, 2, dlink, True) * 2 / 3, rel=1e-12) and again > 1e-3
    assert sync_batchnorm_recompute_s(digits, dcfg, 1, dlink, True) == 0.0
    assert sync_batchnorm_recompute_s(digits, configuration.load(root / "configs/digits_cnn.toml",
                                                                 ["model.sync_batchnorm=false"]), 2, dlink, True) == 0.0
    lay = pl.Layout("allreduce", 2, {"bucket_mb": 25.0}, "allreduce")
    plain, ckpt = (pl.predict_layout(lay, digits, dcfg, dlink, on_this_machine=True, global_batch=None,
                                     checkpointing=c) for c in (False, True))
    # the same as a profile whose measured backwards were longer by the recompute, plus those meetings
    # (the waits after each stretch of compute grow with the backward alike)
    longer = json.loads(json.dumps(digits))
    for w in longer["workloads"].values():
        w["backward_s"] += recompute_fraction(digits) * w["forward_s"]
    slower = pl.predict_layout(lay, longer, dcfg, dlink, on_this_machine=True, global_batch=None)
    assert ckpt["step_s"] == pytest.approx(slower["step_s"] + again, rel=1e-9)
    assert ckpt["step_s"] - plain["step_s"] > recompute_fraction(digits) * workload(digits, 1).forward_s + again


def test_the_profile_times_the_model_plain_and_a_checkpointed_copy_in_paired_rounds():
    """_checkpointing_cost: the model itself runs plain (each block's forward once a step) and a deep
    copy with every block checkpointed (its blocks' forward twice: once more in the backward), in
    turn; the model is left as it was; the fraction the plan reads is the measured forward and
    backward beyond plain over the plain forward, at least the blocks' share (from an older profile:
    that share)."""
    from paratrain.bench.plan_inputs import recompute_fraction
    from paratrain.bench.profile import _checkpointing_cost

    calls = []

    class Counted(torch.nn.Module):  # counts its forwards, the recompute's too (it calls forward itself)
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x):
            calls.append(type(self.inner).__name__)
            return self.inner(x)

    torch.manual_seed(0)
    model = torch.nn.Sequential(Counted(torch.nn.Linear(4, 8)), Counted(torch.nn.Tanh()),
                                Counted(torch.nn.Linear(8, 1)))
    x = torch.randn(16, 4)

    def loss_fn(batch, module=None):
        return (module or model)(batch).pow(2).mean()
    released = []
    loss_fn.release = released.append
    got = _checkpointing_cost(model, loss_fn, lambda: x, torch.device("cpu"), step_s=0.1, rounds=3)
    assert len(released) == 1 and released[0] is not model and "forward" in vars(released[0][0])  # the copy
    assert set(got) == {"plain_forward_s", "plain_backward_s", "checkpointed_forward_s", "checkpointed_backward_s"}
    assert all(v > 0 for v in got.values())
    # per round 2 steps (0.2 s / 0.1 s) of each, after a warm-up of each: the model's 3 blocks once a step,
    # the copy's twice (the forward, and again in the backward)
    steps = 1 + 3 * 2
    assert len(calls) == 3 * steps + 2 * 3 * steps
    assert all("forward" not in vars(block) for block in model)  # the model itself is not checkpointed
    assert _checkpointing_cost(torch.nn.Sequential(), loss_fn, lambda: x, torch.device("cpu"), 0.1) is None
    measured = {"checkpointing": {"plain_forward_s": 0.010, "plain_backward_s": 0.020,
                                  "checkpointed_forward_s": 0.011, "checkpointed_backward_s": 0.034},
                "blocks": [{"forward_s": 0.004}], "default_threads": 2,
                "workloads_in_process": {"2": {"forward_s": 0.01}}}
    assert recompute_fraction(measured) == pytest.approx((0.045 - 0.030) / 0.010)
    assert recompute_fraction({**measured, "checkpointing": None}) == pytest.approx(0.4)  # an older profile's
    # a measured difference below the blocks' own forward is noise: the recompute runs them once more (ptb_small
    # on the Xeon VM: the checkpointed copy 6.7 ms faster, its LSTM's forward a third of the forward's 46.4 ms)
    noisy = {**measured, "checkpointing": {"plain_forward_s": 0.0321, "plain_backward_s": 0.0603,
                                           "checkpointed_forward_s": 0.0277, "checkpointed_backward_s": 0.0580}}
    assert recompute_fraction(noisy) == pytest.approx(0.4)


def test_an_interrupted_validation_keeps_the_runs_it_measured_and_the_whole_validation_before_it(monkeypatch,
                                                                                                 tmp_path):
    """After each run the validation writes the rows so far to validation.partial.json and .md (a
    layout not run yet has no row; ``partial`` says how many runs of how many); an interrupt (here in
    the third run of four) leaves them, and the previous whole validation.json untouched; a validation
    that ends writes validation.json and removes the partial files."""
    import argparse
    import json
    import types

    import paratrain.bench.plan as pl
    import paratrain.bench.report as report
    import paratrain.bench.sweep as sweep
    from paratrain.bench import plan_validate as pv

    lays = [(pl.Layout("single", 1, {}, "single"), 1), (pl.Layout("allreduce", 2, {}, "allreduce"), 2)]
    monkeypatch.setattr(pv, "validation_runs", lambda *a, **k: list(lays))
    monkeypatch.setattr(pv, "plan_first", lambda *a, **k: lays[1][0])
    monkeypatch.setattr(pv, "side_by_side_ms", lambda prof: None)
    monkeypatch.setattr(pl, "predict_layout", lambda lay, *a, **k: {
        "step_s": 0.004 * lay.n, "compute_s": 0.003, "comm_s": 0.0, "bubble_s": 0.0, "optimizer_s": 0.001,
        "memory": {"total": 2 ** 20}, "units_per_s": 100.0, "synchronous": True, "overrides": {}})
    ran, seen = [], []

    def fake_sweep(spec, plans, folder, progress):
        ran.append(spec.strategies[0])
        part = tmp_path / "validation.partial.json"
        seen.append(json.loads(part.read_text()) if part.exists() else None)
        if len(ran) == stop_at:
            raise KeyboardInterrupt
        return [types.SimpleNamespace(ms=4.0 * plans[0].n + len(ran), summary={"tracked_peak_memory_mb": 1.0})]

    monkeypatch.setattr(sweep, "run_sweep", fake_sweep)
    monkeypatch.setattr(report, "run_record", lambda o: {"ok": True, "train_step_ms": o.ms, "units_per_s": 1e3 / o.ms,
                                                         "rank0_timing_ms": {}})
    args = argparse.Namespace(config="c.toml", task=None, overrides=[], validate_steps=6, timed_seconds=0.0,
                              validate_repeats=2, validate_runoff=0, validate_pace="run", data_dir=None)
    cfg = types.SimpleNamespace(train=types.SimpleNamespace(batch_size=8))
    prof = {"links": {"all_reduce": {"alpha_s": 1e-4, "beta_s_per_byte": 1e-9, "gamma_s_per_byte": 0.0}}, "cores": 2}
    (tmp_path / "validation.json").write_text('{"rows": [], "earlier": true}')
    stop_at = 3
    with pytest.raises(KeyboardInterrupt):
        pv.validate(args, cfg, None, prof, tmp_path, ([1, 2], (), []))
    # before run 1 nothing; before run 2 single's row alone (allreduce not run yet); before run 3 both
    assert seen[0] is None and [r["label"] for r in seen[1]["rows"]] == ["single"]
    assert seen[1]["partial"] == {"runs_done": 1, "runs": 4} and seen[2]["partial"] == {"runs_done": 2, "runs": 4}
    part = json.loads((tmp_path / "validation.partial.json").read_text())
    assert part == seen[2]  # the third run was interrupted: the file holds the two runs measured
    assert {r["label"]: r["measured_step_ms_all"] for r in part["rows"]} == {"single": [5.0], "allreduce": [10.0]}
    assert part["choice"]["recommended"] == "allreduce"
    assert "**Partial: 2 of 4 runs**" in (tmp_path / "validation.partial.md").read_text()
    assert json.loads((tmp_path / "validation.json").read_text()) == {"rows": [], "earlier": True}
    ran.clear()
    seen.clear()
    stop_at = 0  # never: the validation ends
    pv.validate(args, cfg, None, prof, tmp_path, ([1, 2], (), []))
    whole = json.loads((tmp_path / "validation.json").read_text())
    assert "partial" not in whole and [len(r["measured_step_ms_all"]) for r in whole["rows"]] == [2, 2]
    assert "Partial" not in (tmp_path / "validation.md").read_text()
    assert not list(tmp_path.glob("validation.partial.*")) and not list(tmp_path.glob(".*.tmp"))


def test_the_validation_with_activation_checkpointing_runs_each_layout_again_checkpointed(monkeypatch, tmp_path):
    """``--validate --activation-checkpointing``: each validated layout runs again with
    ``model.activation_checkpointing=true``, labelled ``+ checkpointing``, predicted with
    checkpointing; kept as such (``checkpointing``), and a rescore predicts it so again. None where
    the profile found no blocks, nor a layout the recipe refuses with the key."""
    import argparse
    import json
    import types

    import paratrain.bench.plan as pl
    import paratrain.bench.report as report
    import paratrain.bench.sweep as sweep
    from paratrain.bench import plan_validate as pv

    lays = [(pl.Layout("single", 1, {}, "single"), 1), (pl.Layout("allreduce", 2, {}, "allreduce"), 2)]
    refused = []
    monkeypatch.setattr(pl, "refusal", lambda config, task, sets, lay, batch: (
        refused.append((lay.label, sets, batch)), None)[1])
    assert pv.checkpointed_runs({"blocks": [], "batch_size": 8}, lays, "c.toml", None, ["a.b=1"]) == []
    got = pv.checkpointed_runs({"blocks": [{}], "batch_size": 8}, lays, "c.toml", None, ["a.b=1"])
    assert [(lay.strategy, lay.label, n) for lay, n in got] == [("single", "single + checkpointing", 1),
                                                               ("allreduce", "allreduce + checkpointing", 2)]
    # each checked at its run's global batch: the recipe's 8 a replica (weak scaling)
    assert refused == [(label, ["a.b=1", "model.activation_checkpointing=true"], batch)
                       for label, batch in (("single", 8), ("allreduce", 16))]
    monkeypatch.setattr(pl, "refusal", lambda config, task, sets, lay, batch: "no" if lay.strategy == "single"
                        else None)
    assert [lay.label for lay, _ in pv.checkpointed_runs({"blocks": [{}], "batch_size": 8}, lays, "c", None, [])] == [
        "allreduce + checkpointing"]

    monkeypatch.setattr(pl, "refusal", lambda *a: None)
    monkeypatch.setattr(pv, "validation_runs", lambda *a, **k: list(lays))
    monkeypatch.setattr(pv, "plan_first", lambda *a, **k: lays[1][0])
    monkeypatch.setattr(pv, "side_by_side_ms", lambda prof: None)
    predicted = []

    def predict(lay, *a, checkpointing=False, **k):
        predicted.append((lay.label, checkpointing))
        return {"step_s": 0.010 if checkpointing else 0.008, "compute_s": 0.006, "comm_s": 0.0, "bubble_s": 0.0,
                "optimizer_s": 0.001, "memory": {"total": 2 ** 20 if checkpointing else 2 ** 21},
                "units_per_s": 100.0, "synchronous": True, "overrides": {}}
    monkeypatch.setattr(pl, "predict_layout", predict)
    sets = []

    def fake_sweep(spec, plans, folder, progress):
        ckpt = "model.activation_checkpointing=true" in spec.overrides
        sets.append((spec.strategies[0], ckpt))
        # the checkpointed runs measured faster (noise): still not the plain recommendation's rival
        return [types.SimpleNamespace(ms=9.0 if ckpt else 10.0, summary={"tracked_peak_memory_mb": 1.0})]
    monkeypatch.setattr(sweep, "run_sweep", fake_sweep)
    monkeypatch.setattr(report, "run_record", lambda o: {"ok": True, "train_step_ms": o.ms, "units_per_s": 1e3 / o.ms,
                                                         "rank0_timing_ms": {}})
    args = argparse.Namespace(config="c.toml", task=None, overrides=[], validate_steps=6, timed_seconds=0.0,
                              validate_repeats=1, validate_runoff=0, validate_pace="run", data_dir=None,
                              activation_checkpointing=True)
    cfg = types.SimpleNamespace(train=types.SimpleNamespace(batch_size=8))
    prof = {"links": {"all_reduce": {"alpha_s": 1e-4, "beta_s_per_byte": 1e-9, "gamma_s_per_byte": 0.0}}, "cores": 2,
            "blocks": [{"forward_s": 0.001}], "batch_size": 8}
    pv.validate(args, cfg, None, prof, tmp_path, ([1, 2], (), []))
    assert sets == [("single", False), ("allreduce", False), ("single", True), ("allreduce", True)]
    assert predicted == [("single", False), ("allreduce", False), ("single + checkpointing", True),
                         ("allreduce + checkpointing", True)]
    rows = {r["label"]: r for r in json.loads((tmp_path / "validation.json").read_text())["rows"]}
    assert rows["allreduce + checkpointing"]["checkpointing"] is True and "checkpointing" not in rows["allreduce"]
    assert rows["allreduce + checkpointing"]["predicted_step_ms"] == pytest.approx(10.0)
    assert rows["allreduce"]["predicted_step_ms"] == pytest.approx(8.0)
    choice = json.loads((tmp_path / "validation.json").read_text())["choice"]
    assert choice["recommended"] == choice["measured_fastest"] == "allreduce"
    # a rescore finds the plain layout and predicts it checkpointed again
    monkeypatch.setattr(pl, "layouts", lambda n, prof, cfg: [lay for lay, m in lays if m == n])
    predicted.clear()
    pv.rescore(types.SimpleNamespace(dist=types.SimpleNamespace(bucket_mb=25.0)), prof, tmp_path, "c.toml")
    assert sorted(predicted) == sorted([("single", False), ("allreduce", False), ("single", True),
                                        ("allreduce", True)])


def test_validation_scores_n_gt_1_at_the_compute_speed_measured_again_in_each_round():
    """With the profile's one-thread runs side by side measured again before each round, an N > 1
    prediction's work on the cores (compute, optimizer, bubble) is scaled by that round's speed over
    the profile's; its communication is not. Hand-computed: the profile's side-by-side step 4.8 ms,
    the rounds' 5.76 and 5.28 (x1.2, x1.1); allreduce predicted 8.2 ms of which 5.0 compute + 0.5
    optimizer: round 0 8.2 + 0.2 x 5.5 = 9.3 against 9.0 (+3.33%), round 1 8.2 + 0.1 x 5.5 = 8.75
    against 10.0 (-12.5%): the median (the mean of the two) -4.58%. N = 1 keeps the one-device pairing."""
    from paratrain.bench.plan_validate import markdown, same_speed_errors, side_by_side_ms

    def row(strategy, n, predicted, runs, parts=None):
        return {"strategy": strategy, "label": strategy, "n": n, "ok": True, "predicted_step_ms": predicted,
                "measured_step_ms": min(runs), "measured_step_ms_all": runs, "step_error": predicted / min(runs) - 1,
                "predicted_memory_bytes": 2 ** 20, "measured_memory_bytes": 2 ** 20, "memory_error": 0.0,
                "predicted_ms": parts or {}}

    paced = {"profile_ms": 4.8, "rounds_ms": [5.76, 5.28]}
    one = row("single", 1, 4.0, [4.0, 4.0])
    ar = row("allreduce", 2, 8.2, [9.0, 10.0], {"compute": 5.0, "comm": 2.7, "bubble": 0.0, "optimizer": 0.5})
    same_speed_errors([one, ar], paced)
    assert ar["step_error_same_speed"] == pytest.approx(((9.3 / 9.0 - 1) + (8.75 / 10.0 - 1)) / 2, rel=1e-12)
    assert math.isnan(one["step_error_same_speed"])
    # without the rounds' measurement, the one-device pairing: (8.2 / 4.0) / median(9 / 4, 10 / 4) - 1
    same_speed_errors([one, ar])
    assert ar["step_error_same_speed"] == pytest.approx(2.05 / 2.375 - 1, rel=1e-12)
    text = markdown({"config": "c", "rows": same_speed_errors([one, ar], paced), "side_by_side": paced})
    assert "scaled by that round's one-thread one-device runs side by side" in text and "(5.8, 5.3 ms)" in text
    # the profile's side-by-side step: a CPU's one-thread runs, one per core; none on a GPU or without them
    w1 = {"data_s": 1e-4, "forward_s": 2.5e-3, "backward_s": 2.2e-3, "optimizer_s": 5e-4, "concurrent": 2}
    assert side_by_side_ms({"device": "cpu", "workloads": {"1": w1}}) == pytest.approx(5.3, rel=1e-12)
    assert side_by_side_ms({"device": "cuda:0", "workloads": {"1": w1}}) is None
    assert side_by_side_ms({"device": "cpu", "workloads": {"1": {**w1, "concurrent": 0}}}) is None


def test_validation_paced_per_run_scores_each_run_at_the_speed_measured_just_before_it():
    """``--validate-pace run``: a row's own side-by-side measurements (one before each of its runs)
    take the place of the rounds'. Hand-computed: the profile's side-by-side step 4.8 ms; allreduce's
    runs 9.0 and 10.0 ms, measured before them 4.8 (x1.0) and 6.0 ms (x1.25); predicted 8.2 ms of
    which 5.0 compute + 0.5 optimizer: run 0 8.2 against 9.0 (-8.89%), run 1 8.2 + 0.25 x 5.5 = 9.575
    against 10.0 (-4.25%): the median -6.57%. A row without its own (zero1 here) keeps the rounds'
    (x1.2, x1.1). The report names the per-run pacing and its range."""
    from paratrain.bench.plan_validate import markdown, same_speed_errors

    def row(strategy, n, predicted, runs, parts=None, own=None):
        r = {"strategy": strategy, "label": strategy, "n": n, "ok": True, "predicted_step_ms": predicted,
             "measured_step_ms": min(runs), "measured_step_ms_all": runs, "step_error": predicted / min(runs) - 1,
             "predicted_memory_bytes": 2 ** 20, "measured_memory_bytes": 2 ** 20, "memory_error": 0.0,
             "predicted_ms": parts or {}}
        return {**r, "side_by_side_ms_all": own} if own else r

    parts = {"compute": 5.0, "comm": 2.7, "bubble": 0.0, "optimizer": 0.5}
    one = row("single", 1, 4.0, [4.0, 4.0])
    ar = row("allreduce", 2, 8.2, [9.0, 10.0], parts, own=[4.8, 6.0])
    z1 = row("zero1", 2, 8.2, [9.0, 10.0], parts)
    paced = {"profile_ms": 4.8, "rounds_ms": [5.76, 5.28], "pace": "run"}
    same_speed_errors([one, ar, z1], paced)
    assert ar["step_error_same_speed"] == pytest.approx(((8.2 / 9.0 - 1) + (9.575 / 10.0 - 1)) / 2, rel=1e-12)
    assert z1["step_error_same_speed"] == pytest.approx(((9.3 / 9.0 - 1) + (8.75 / 10.0 - 1)) / 2, rel=1e-12)
    assert math.isnan(one["step_error_same_speed"])
    text = markdown({"config": "c", "rows": [one, ar], "side_by_side": {**paced, "rounds_ms": []}})
    assert "step error at the run's measured speed" in text and "just before each run" in text
    assert "measured again just before each of its runs (4.8-6.0 ms)" in text


@pytest.mark.parametrize("pace", ["round", "run", "run, no side-by-side runs"])
def test_validation_measures_the_machines_speed_before_each_round_or_each_multi_process_run(
        monkeypatch, tmp_path, pace):
    """plan_validate.validate's order, the runs and the side-by-side measurements stubbed (two N > 1
    layouts, two rounds, a one-pair run-off): with ``--validate-pace round`` one measurement before
    each round (``rounds_ms``); with ``run`` one just before each N > 1 run of the rounds, none before
    the one-device run, kept per row (``side_by_side_ms_all``), and each N > 1 error at the speed
    measured before its own run; none in the run-off (its pairs are judged by their ratio); a
    measurement that failed (NaN) leaves that run out; without the profile's side-by-side runs (a
    GPU's profile), none, and the one-device pairing."""
    import argparse
    import json
    import types

    import paratrain.bench.plan as pl
    import paratrain.bench.report as report
    import paratrain.bench.sweep as sweep
    from paratrain.bench import plan_validate as pv

    events, speeds = [], iter([4.8, 5.0, 6.0, float("nan")])
    lays = [(pl.Layout("single", 1, {}, "single"), 1), (pl.Layout("allreduce", 2, {}, "allreduce"), 2),
            (pl.Layout("zero1", 2, {}, "zero1"), 2)]
    monkeypatch.setattr(pv, "validation_runs", lambda *a, **k: lays)
    monkeypatch.setattr(pv, "plan_first", lambda *a, **k: lays[1][0])  # the recommendation: allreduce
    monkeypatch.setattr(pv, "side_by_side_ms", lambda prof: None if "no side-by-side" in pace else 4.8)

    def paced_now(*a):
        events.append("pace")
        return next(speeds)

    monkeypatch.setattr(pv, "_side_by_side_now", paced_now)
    parts = {"compute_s": 5e-3, "comm_s": 2.7e-3, "bubble_s": 0.0, "optimizer_s": 5e-4}
    predicted = {"single": (4.0e-3, {"compute_s": 3.5e-3, "comm_s": 0.0, "bubble_s": 0.0, "optimizer_s": 5e-4}),
                 "allreduce": (8.2e-3, parts), "zero1": (8.2e-3, parts)}
    monkeypatch.setattr(pl, "predict_layout", lambda lay, *a, **k: {
        "step_s": predicted[lay.strategy][0], **predicted[lay.strategy][1], "memory": {"total": 2 ** 20},
        "units_per_s": 100.0, "synchronous": True, "overrides": {}})
    # zero1 measured fastest: the run-off (one pair) runs allreduce and zero1 once more each
    measured = {"single": iter([4.0, 4.0]), "allreduce": iter([9.0, 10.0, 9.5]), "zero1": iter([8.0, 9.0, 8.1])}

    def fake_sweep(spec, plans, folder, progress):
        events.append(f"{spec.strategies[0]} N={plans[0].n}")
        ms = next(measured[spec.strategies[0]])
        return [types.SimpleNamespace(ms=ms, summary={"tracked_peak_memory_mb": 1.0})]

    monkeypatch.setattr(sweep, "run_sweep", fake_sweep)
    monkeypatch.setattr(report, "run_record", lambda o: {"ok": True, "train_step_ms": o.ms, "units_per_s": 1e3 / o.ms,
                                                         "rank0_timing_ms": {}})
    args = argparse.Namespace(config="c.toml", task=None, overrides=[], validate_steps=6, timed_seconds=0.0,
                              validate_repeats=2, validate_runoff=1, validate_pace=pace.split(",")[0], data_dir=None)
    cfg = types.SimpleNamespace(train=types.SimpleNamespace(batch_size=8))
    prof = {"links": {"all_reduce": {"alpha_s": 1e-4, "beta_s_per_byte": 1e-9, "gamma_s_per_byte": 0.0}}, "cores": 2}
    pv.validate(args, cfg, None, prof, tmp_path, ([1, 2], (), []))
    v = json.loads((tmp_path / "validation.json").read_text())
    ar, z1 = (next(r for r in v["rows"] if r["strategy"] == s) for s in ("allreduce", "zero1"))
    runoff = ["allreduce N=2", "zero1 N=2"]  # no measurement of the speed in the run-off
    assert v["choice"]["runoff"]["rates"] == [[pytest.approx(1e3 / 9.5), pytest.approx(1e3 / 8.1)]]

    def at(run_ms, speed_ms):  # one run's error at a measured speed: 5.5 ms of the 8.2 on the cores
        return (8.2 + (speed_ms / 4.8 - 1) * 5.5) / run_ms - 1

    if pace == "round":
        assert events == ["pace", "single N=1", "allreduce N=2", "zero1 N=2",
                          "pace", "single N=1", "allreduce N=2", "zero1 N=2", *runoff]
        assert v["side_by_side"]["rounds_ms"] == [4.8, 5.0] and "side_by_side_ms_all" not in ar
        assert ar["step_error_same_speed"] == pytest.approx((at(9.0, 4.8) + at(10.0, 5.0)) / 2, rel=1e-9)
        assert z1["step_error_same_speed"] == pytest.approx((at(8.0, 4.8) + at(9.0, 5.0)) / 2, rel=1e-9)
    elif pace == "run":
        assert events == ["single N=1", "pace", "allreduce N=2", "pace", "zero1 N=2",
                          "single N=1", "pace", "allreduce N=2", "pace", "zero1 N=2", *runoff]
        assert v["side_by_side"] == {"profile_ms": 4.8, "rounds_ms": [], "pace": "run"}
        assert ar["side_by_side_ms_all"] == [4.8, 6.0] and z1["side_by_side_ms_all"][0] == 5.0
        assert ar["step_error_same_speed"] == pytest.approx((at(9.0, 4.8) + at(10.0, 6.0)) / 2, rel=1e-9)
        # zero1's second measurement failed (NaN): its first run alone
        assert math.isnan(z1["side_by_side_ms_all"][1])
        assert z1["step_error_same_speed"] == pytest.approx(at(8.0, 5.0), rel=1e-9)
        assert "(4.8-6.0 ms)" in (tmp_path / "validation.md").read_text()
    else:  # nothing to measure the speed with: the one-device pairing, (8.2 / 4.0) / median(9 / 4, 10 / 4) - 1
        assert "pace" not in events and v["side_by_side"] is None
        assert ar["step_error_same_speed"] == pytest.approx(2.05 / 2.375 - 1, rel=1e-9)



def test_a_failed_measurement_of_the_machines_speed_is_nan_and_the_validation_goes_on(monkeypatch, capsys):
    """plan_validate._side_by_side_now: where one of the one-thread runs side by side fails
    (``loop_workloads`` raises UsageError), the measurement is NaN and says so in one line; a
    successful one is the runs' step in ms."""
    import argparse
    import types

    import paratrain.bench.profile_runs as profile_runs
    from paratrain.bench import plan_validate as pv

    args = argparse.Namespace(config="c.toml", task=None, overrides=[], data_dir=None, validate_steps=6,
                              timed_seconds=0.0)
    cfg = types.SimpleNamespace(train=types.SimpleNamespace(batch_size=8))
    prof = {"workloads": {"1": {"concurrent": 2}}}

    def failed(*a, **k):
        raise UsageError("the one-device run for the profile failed (exit 1): boom")

    monkeypatch.setattr(profile_runs, "loop_workloads", failed)
    assert math.isnan(pv._side_by_side_now(args, cfg, prof, 5.0))
    said = capsys.readouterr().out.strip().splitlines()
    assert len(said) == 1 and "left out" in said[0] and "boom" in said[0]
    parts = {"data_s": 1e-4, "forward_s": 2.5e-3, "backward_s": 2.2e-3, "optimizer_s": 5e-4}
    monkeypatch.setattr(profile_runs, "loop_workloads", lambda *a, **k: {"1": parts})
    assert pv._side_by_side_now(args, cfg, prof, 5.0) == pytest.approx(5.3, rel=1e-12)


def test_rescore_takes_each_error_at_the_measured_speed_against_the_new_profiles_side_by_side_step(tmp_path):
    """``--rescore`` after ``--reprofile``: the predictions are the new profile's, so the speeds
    measured in the runs are taken over the new profile's side-by-side step, not the stored one.
    ptb_small's validation paced per run (2026-11-28, profile 136.7 ms); a profile whose one-thread
    loop is twice as slow (273.4 ms) gives each run's factor s / 273.4."""
    import copy
    import json
    import shutil
    import statistics
    from pathlib import Path

    from paratrain import config as configuration
    from paratrain.bench.plan_validate import rescore, side_by_side_ms

    root = Path(__file__).resolve().parents[2]
    stored = root / "benchmarks/results/plan-amd/ptb_small-amd-v32-pace"
    shutil.copy(stored / "validation.json", tmp_path / "validation.json")
    prof = json.loads((stored / "profile.json").read_text())
    cfg = configuration.load(root / "configs/ptb_small.toml")
    slow = copy.deepcopy(prof)
    for k in ("data_s", "forward_s", "backward_s", "optimizer_s"):
        slow["workloads"]["1"][k] *= 2
    assert side_by_side_ms(slow) == pytest.approx(2 * side_by_side_ms(prof), rel=1e-12)
    rescore(cfg, slow, tmp_path, "configs/ptb_small.toml")
    v = json.loads((tmp_path / "validation.json").read_text())
    assert v["side_by_side"]["profile_ms"] == pytest.approx(side_by_side_ms(slow), rel=1e-12)
    ar = next(r for r in v["rows"] if r["label"] == "allreduce")
    on_cores = sum(ar["predicted_ms"][k] for k in ("compute", "optimizer", "bubble"))
    want = statistics.median((ar["predicted_step_ms"] + (s / side_by_side_ms(slow) - 1) * on_cores) / m - 1
                             for m, s in zip(ar["measured_step_ms_all"], ar["side_by_side_ms_all"]))
    assert ar["step_error_same_speed"] == pytest.approx(want, rel=1e-12)


class _ClockedStage(torch.nn.Module):
    """A stage whose forward + backward costs ``overhead + rows * per_row`` seconds of a fake clock,
    times the clock's speed; a whole batch through the first stage starts a new round and doubles
    it (a machine slowing down between rounds)."""

    def __init__(self, clock: dict, overhead: float, per_row: float, first: bool, whole_rows: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))
        self.clock, self.overhead, self.per_row = clock, overhead, per_row
        self.first, self.whole_rows = first, whole_rows

    def forward(self, h):
        rows = h.size(0)
        if self.first and rows == self.whole_rows:
            self.clock["speed"] *= 2
        self.clock["now"] += (self.overhead + rows * self.per_row) * self.clock["speed"]
        return h * self.w


def test_the_microbatch_factor_pairs_its_rounds_so_a_machine_that_slows_moves_both_alike(monkeypatch):
    from paratrain.bench.strategy_model import stage_profile

    clock = {"now": 0.0, "speed": 1.0}
    monkeypatch.setattr(time, "perf_counter", lambda: clock["now"])
    stages = [_ClockedStage(clock, 0.002, 0.001, True, 8), _ClockedStage(clock, 0.002, 0.003, False, 8)]
    got = stage_profile(stages, torch.ones(8, 3), microbatches=4)
    # whole: (0.002 + 8 * 0.001) + (0.002 + 8 * 0.003) = 0.036; 4 micro-batches of 2 rows:
    # 4 * ((0.002 + 0.002) + (0.002 + 0.006)) = 0.048; factor 0.048 / 0.036 at every round's speed
    assert got["microbatch_factor"] == pytest.approx(0.048 / 0.036)
    # one micro-batch: stage 0 0.004, stage 1 0.008 (no whole batch among them: one speed)
    assert got["stage_fractions"] == pytest.approx([1 / 3, 2 / 3])


def test_stage_saved_counts_what_each_stage_saves_but_the_batch_and_its_output():
    """Stage 0 (a Linear) saves its input, a view of the batch (the loop holds it whole, once: not
    counted); stage 1 (ReLU, Linear, the loss out ** 2) saves the ReLU's result (the Linear's input
    too: one storage) and its output, which the plan counts apart (``stage_outputs``): 3 rows x 8 x 4
    bytes a micro-batch, x 2 micro-batches = 192 bytes for the batch; the Linears' weights are
    parameters, not counted."""
    from paratrain.bench.profile_blocks import stage_saved

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    stages = [model[:1], model[1:]]
    store = torch.randn(100, 4)
    batch = (store[10:16], torch.zeros(6, dtype=torch.long))
    got = stage_saved(stages, model, batch, batch[0], 2, lambda out, lo, hi: (out ** 2).sum())
    assert got == {"stage_saved_bytes": [0.0, 192.0]}


def test_a_language_models_profile_counts_its_corpus_shard_apart(tiny_data):
    """gpt's batch is a view of the rank's batchified corpus: the embedding saves its indices, so the
    one-device profile's activations hold the whole corpus tensor (``data_bytes``); the stages' saved
    bytes do not count it (the plan holds it once a process); the last stage saves at least the
    loss's log-softmax, B x T x V float32 numbers for the batch (the logits' size)."""
    from paratrain.bench.profile import _model_and_batch, _stage_inputs
    from paratrain.bench.profile_blocks import _blocks_and_flops
    from paratrain.config import from_dict
    from paratrain.runs import build_task
    from paratrain.train.optim import build_optimizer

    from ..distributed.test_task_exactness import task_cfg

    cfg = from_dict(task_cfg("gpt", "float32", "single", 1, 1))  # batch 8 windows of bptt 8, d_model 16
    task = build_task(cfg, str(tiny_data), world_size=1)
    first = next(iter(task.train_steps(1, 0))).micro_batches[0]
    corpus = first.inputs.untyped_storage().nbytes()
    assert corpus > first.inputs.numel() * 8  # a view of the corpus shard, not a batch of its own
    got = _stage_inputs(task, cfg, None, torch.device("cpu"))["stage_profiles"]["2"]
    vocab = task.vocab_size
    assert got["stage_saved_bytes"][1] >= 8 * 8 * vocab * 4 and got["stage_saved_bytes"][0] > 0
    model, device, tokens, draw, loss_fn = _model_and_batch(task, cfg)
    w = {"forward_s": 1.0, "backward_s": 2.0}
    whole = _blocks_and_flops(model, build_optimizer(model.parameters(), cfg.train, 0.1), loss_fn, draw, device, w,
                              tokens)
    assert whole["data_bytes"] == corpus < whole["activation_bytes"]


@pytest.mark.parametrize("cores, threads", [(8, {0: 3, 2: 4, 4: 2}), (2, {0: 3, 2: 1, 4: 1}),
                                            (None, {0: 3, 2: 3, 4: 3})])
def test_a_cpus_stage_profiles_are_timed_at_a_stage_process_share_of_the_cores(monkeypatch, cores, threads):
    import paratrain.bench.strategy_model as sm
    from paratrain.bench.profile import _stage_inputs

    seen, before = {}, torch.get_num_threads()

    def inputs(task, layout, device=None):
        seen[layout.dist.pipeline_stages] = torch.get_num_threads()
        # the stages on the profile's device; fsdp's units (0 stages: bytes) counted on the CPU
        assert device == (torch.device("cpu") if layout.dist.pipeline_stages else None)
        if not layout.dist.pipeline_stages:
            return {"units": [1], "gather_scale": 1.0}
        return {"activation_bytes": 1.0, "shared_bytes": 0, "stage_param_bytes": [1, 1], "stage_fractions": [1, 1],
                "microbatch_factor": 1.0}

    monkeypatch.setattr(sm, "strategy_inputs", inputs)
    torch.set_num_threads(3)  # this process' threads: neither a share of 8 or 2 cores nor the machine's
    try:
        out = _stage_inputs(None, Config(), cores, torch.device("cpu"))
        # S stages run in S processes: cores // S threads each (at least 1); None (a GPU's): this process' 3
        assert seen == threads
        assert torch.get_num_threads() == 3
        assert sorted(out["stage_profiles"]) == ["2", "4"]

        def failing(task, layout, device=None):
            if layout.dist.pipeline_stages == 4:
                raise RuntimeError("stage 4 failed")
            return inputs(task, layout, device)

        monkeypatch.setattr(sm, "strategy_inputs", failing)
        with pytest.raises(RuntimeError, match="stage 4 failed"):
            _stage_inputs(None, Config(), cores, torch.device("cpu"))
        assert torch.get_num_threads() == 3  # restored after a failed measurement too
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("strategy, threads", [("pipeline", 4), ("zero1", 3)])
def test_predict_times_a_pipelines_stages_at_a_stage_process_share_of_the_cores(monkeypatch, strategy, threads):
    """``paratrain predict --strategy pipeline`` of 2 stages on 8 cores: its stages run in 2
    processes of 4 threads each, and are timed so (as ``paratrain plan`` times them); another
    strategy's inputs at this process' threads; the threads are given back."""
    import argparse

    import paratrain.bench.strategy_model as sm
    import paratrain.env as env
    from paratrain.bench.predict_command import _curve

    seen, before = [], torch.get_num_threads()

    def inputs(task, cfg, device=None):
        seen.append(torch.get_num_threads())
        assert device == torch.device("cpu")  # the recipe's
        return {"units": [1], "activation_bytes": 1.0, "shared_bytes": 0, "stage_param_bytes": [1, 1],
                "stage_fractions": [0.5, 0.5], "microbatch_factor": 1.0}

    monkeypatch.setattr(sm, "strategy_inputs", inputs)
    monkeypatch.setattr(env, "available_cores", lambda: 8)
    import dataclasses

    base = Config()
    cfg = dataclasses.replace(base, dist=dataclasses.replace(base.dist, pipeline_stages=2))
    args = argparse.Namespace(strategy=strategy, algorithm="ring", bucket_mb=25.0, num_ps=1, nproc="2")
    torch.set_num_threads(3)
    try:
        _curve(args, cfg, None, None, [2])
        assert seen == [threads] and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_profiles_links_run_each_micro_benchmark_once_at_its_layouts_share_of_the_cores(monkeypatch, device):
    """profile_links.profile_links with every micro-benchmark stubbed: which run, in what order, at how
    many threads, with which inputs, under which keys (8 cores: 3 processes get 2 threads, 2 get 4, 5 get 1)."""
    from types import SimpleNamespace

    from paratrain.bench import microbench, microbench_hooks, microbench_meetings, microbench_rpc, microbench_sharded
    from paratrain.bench.profile_links import profile_links

    calls = []

    workloads = []

    def stub(module, name, answer):
        def fake(*args, **kw):
            calls.append((name, kw.get("threads"), kw.get("workers"), kw.get("exchange_s"), kw.get("processes")))
            if "workload" in kw:
                workloads.append((name, kw.pop("workload"), kw.pop("timeout_s")))
            return answer(*args, **kw) if callable(answer) else answer
        monkeypatch.setattr(module, name, fake)

    stub(microbench, "measured_links", {"all_reduce": {}})
    stub(microbench_rpc, "measured_ps_update", {"async": 0.1})
    stub(microbench_rpc, "measured_ps_round_trip", 0.25)
    stub(microbench_sharded, "measured_sharded_optimizer", 0.01)
    stub(microbench_sharded, "measured_sharded_norm", 0.001)
    stub(microbench_rpc, "measured_ps_round_trips_loaded", {"points": []})
    stub(microbench, "measure_copies", lambda sizes: sizes)
    stub(microbench_meetings, "measured_meetings", [[0.001, 0.002]])
    policies = []
    stub(microbench_sharded, "measured_fsdp_units",
         lambda units, parameters, param_dtype: (policies.append(param_dtype),
                                                 (units, [[tuple(p.shape) for p in own] for own in parameters]))[1])
    stub(microbench_hooks, "measured_compress_hook", {"world_size": 2})
    stub(microbench_sharded, "measured_sharded_step", lambda strategy, params, opt, threads: strategy)
    model = torch.nn.Linear(2, 2)
    cfg = SimpleNamespace(train=SimpleNamespace(clip=0.5, precision="fp32"))
    prof = {"cores": 8, "output_bytes": 100, "strategy_inputs": {"units": [24]},  # a Linear(2, 2): the root alone
            "default_threads": 8, "workloads_in_process": {"8": {"forward_s": 0.25, "backward_s": 0.5}}}
    before = copy.deepcopy(prof)
    got = profile_links(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg, torch.device(device), prof, "/data")
    first = [("measured_links", None, None, None, None), ("measured_ps_update", 2, None, None, None),
             ("measured_ps_round_trip", 2, None, None, None), ("measured_sharded_optimizer", 4, None, None, None),
             ("measured_sharded_norm", 4, None, None, None)]
    if device == "cuda":  # a GPU's profile: the links only
        assert calls == first
        assert sorted(got) == ["links", "ps_round_trip_s", "ps_update_s", "sharded_norm_s", "sharded_optimizer_s"]
        return
    assert calls == first + [
        ("measured_ps_round_trips_loaded", 2, 2, 0.25, None), ("measured_ps_round_trips_loaded", 1, 4, 0.25, None),
        ("measure_copies", None, None, None, None), ("measured_meetings", None, None, None, None),
        ("measured_fsdp_units", None, None, None, None), ("measured_compress_hook", None, None, None, None),
        ("measured_sharded_step", 4, None, None, None), ("measured_sharded_step", 4, None, None, None)]
    # 8 cores: no oversubscribed meetings (4 processes fit); the copies: 4 KiB ... 256 MiB, two outputs,
    # each unit whole and halved
    assert "meetings_oversubscribed" not in got
    assert got["memory_copy"] == [4 ** k for k in range(6, 15, 2)] + [200, 24, 12]
    assert got["ps_round_trips_loaded"] == {"workers": 2, "points": []}
    assert got["ps_round_trips_loaded_4"] == {"workers": 4, "points": []}
    # FSDP2's units of the model's own parameters (a Linear: the root holds both)
    assert (got["fsdp_units"], got["zero1_step_s"], got["fsdp_step_s"]) == (([24], [[(2, 2), (2,)]]), "zero1", "fsdp")
    # each rank of the unit and step benchmarks runs the recipe's model before each pass or step: their
    # deadlines grow by 4 x 50 one-device steps (0.75 s at 8 threads) per unit size and per strategy,
    # scaled to a rank's half batch at its threads (the units: 1 thread, x4; the steps: 4 threads, x1)
    recipe = {"config": cfg, "data_dir": "/data"}
    assert workloads == [("measured_fsdp_units", recipe, 300 + 4 * 50 * 0.75 * 4),
                         ("measured_sharded_step", recipe, 450), ("measured_sharded_step", recipe, 450)]
    assert got["sharded_workload"] is True
    assert prof == before  # not changed
    # FSDP2's units under fsdp's MixedPrecisionPolicy: none in fp32; a bf16 recipe's gathered in bfloat16
    bf16 = SimpleNamespace(train=SimpleNamespace(clip=0.5, precision="bf16"))
    profile_links(model, torch.optim.SGD(model.parameters(), lr=0.1), bf16, torch.device(device), prof, "/data")
    assert policies == [None, "bfloat16"]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_mixed_precision_recipes_stages_are_profiled_under_its_autocast(tiny_data, monkeypatch, precision):
    """The pipeline runs its stages under the recipe's autocast, and so does the profile: stage 0's
    forward that measures ``activation_bytes``, and each stage's forward and loss that
    :func:`stage_profile` times, run under that autocast; their backward outside it (as
    torch.autocast advises). An fp32 recipe's under none. For gpt, what stage 0 sends stays 4 bytes
    an element: its residual stream is float32 (float32 + bfloat16 promotes to float32)."""
    import paratrain.strategies.stages as stages_module
    from paratrain.bench.profile import _stage_inputs
    from paratrain.config import from_dict
    from paratrain.runs import build_task

    from ..distributed.test_task_exactness import task_cfg

    real_cut = stages_module.cut_stages

    def inputs(prec: str, seen: list) -> dict:
        c = task_cfg("gpt", "float32", "single", 1, 1)
        cfg = from_dict({**c, "train": {**c["train"], "precision": prec}})

        def hook(module, args, out):
            seen.append(("forward", torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"),
                         torch.get_autocast_dtype("cpu")))
            if out.requires_grad:
                out.register_hook(lambda grad: seen.append(("backward", torch.is_autocast_enabled("cpu"))))

        def cut(*args, **kw):  # every stage strategy_inputs runs, from its first forward on
            got = real_cut(*args, **kw)
            for stage in got:
                stage.register_forward_hook(hook)
            return got

        monkeypatch.setattr(stages_module, "cut_stages", cut)
        got = _stage_inputs(build_task(cfg, str(tiny_data), world_size=1), cfg, None, torch.device("cpu"))
        return got["stage_profiles"]["2"]

    full_seen, low_seen = [], []
    full, low = inputs("fp32", full_seen), inputs(precision, low_seen)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    forwards = [s for s in low_seen if s[0] == "forward"]
    assert forwards[0][1] is False  # the first: stage 0's forward for activation_bytes, without grad
    assert len(forwards) > 2 and all(s[2] and s[3] == dtype for s in forwards)
    backwards = [s for s in low_seen if s[0] == "backward"]
    assert backwards and not any(s[1] for s in backwards)
    assert full_seen and not any(s[0] == "forward" and s[2] for s in full_seen)
    assert low["activation_bytes"] == full["activation_bytes"] > 0
    assert low["microbatch_factor"] > 0 and sum(low["stage_fractions"]) == pytest.approx(1.0)


def test_the_towers_sync_batchnorm_falls_back_to_the_loops_pair_when_the_model_cannot_be_copied(monkeypatch, capsys):
    """microbench_towers.towers_forward for a sync BatchNorm recipe whose model cannot be deep-copied:
    the plain towers are still timed, forward and backward, with no in-process term (the profile's
    loop pair then prices the towers' sync BatchNorm), and a line says so."""
    import copy
    from types import SimpleNamespace

    import torch

    from paratrain.bench.microbench_towers import towers_forward

    class Task:
        batch_dim = 0

        def train_steps(self, epoch, step):
            yield SimpleNamespace(micro_batches=[torch.randn(4, 3)], global_count=4)

        def loss(self, model, batch):
            return model(batch).sum(), {}

    def refuse(obj, memo=None):
        raise TypeError("cannot pickle '_thread.lock' object")

    monkeypatch.setattr(copy, "deepcopy", refuse)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    got = towers_forward(Task(), model, torch.device("cpu"), lambda: None, lambda batch: Task(), 2, 2,
                         sync_batchnorm=True, least_s=0.0)
    assert got["towers"] == 2 and got["seconds"] > 0 and got["backward_seconds"] > 0
    assert "sync_batchnorm_s" not in got
    assert "the model cannot be copied (cannot pickle" in capsys.readouterr().out


def test_the_sharded_micro_benchmarks_run_without_the_model_where_it_cannot_run_in_their_processes(
        monkeypatch, capsys):
    """profile_links where the recipe's model fails in the micro-benchmarks' processes (a RuntimeError
    from their ranks, as measure_allreduce raises it): FSDP2's units are timed again without it, and
    so are both sharded steps, with one line; the profile records ``sharded_workload`` False."""
    from types import SimpleNamespace

    from paratrain.bench import microbench, microbench_hooks, microbench_meetings, microbench_rpc, microbench_sharded
    from paratrain.bench.profile_links import profile_links

    calls = []

    def units(units, parameters, workload, timeout_s, param_dtype):
        calls.append(("units", workload is not None))
        if workload is not None:
            raise RuntimeError("all-reduce benchmark: rank 0 failed (exit 1): AssertionError: daemonic processes "
                               "are not allowed to have children")
        return [[24.0, 1e-3, 2e-3, 3e-3]]

    def step(name, params, opt, threads, workload, timeout_s):
        calls.append((name, workload is not None))
        return 1e-3
    for module, name, answer in ((microbench, "measured_links", {}), (microbench_rpc, "measured_ps_update", {}),
                                 (microbench_rpc, "measured_ps_round_trip", 0.25),
                                 (microbench_sharded, "measured_sharded_optimizer", 0.01),
                                 (microbench_sharded, "measured_sharded_norm", 0.001),
                                 (microbench_rpc, "measured_ps_round_trips_loaded", {"points": []}),
                                 (microbench, "measure_copies", []), (microbench_meetings, "measured_meetings", []),
                                 (microbench_hooks, "measured_compress_hook", {})):
        monkeypatch.setattr(module, name, lambda *a, answer=answer, **kw: answer)
    monkeypatch.setattr(microbench_sharded, "measured_fsdp_units", units)
    monkeypatch.setattr(microbench_sharded, "measured_sharded_step", step)
    model = torch.nn.Linear(2, 2)
    prof = {"cores": 8, "output_bytes": 100, "strategy_inputs": {"units": [24]}, "default_threads": 8,
            "workloads_in_process": {"8": {"forward_s": 0.25, "backward_s": 0.5}}}
    got = profile_links(model, torch.optim.SGD(model.parameters(), lr=0.1), SimpleNamespace(train=SimpleNamespace(
        clip=0.5, precision="fp32")), torch.device("cpu"), prof)
    assert calls == [("units", True), ("units", False), ("zero1", False), ("fsdp", False)]
    assert got["sharded_workload"] is False and got["fsdp_units"] == [[24.0, 1e-3, 2e-3, 3e-3]]
    out = capsys.readouterr().out
    assert out.count("[plan] the recipe's model could not run between the sharded micro-benchmarks' steps") == 1
    assert "daemonic processes" in out and "timed with nothing between them" in out


def test_the_towers_forward_of_a_mixed_precision_recipe_runs_under_its_autocast():
    """microbench_towers.towers_forward with ``precision`` bf16: the towers' forwards, each in its
    own thread, run under bf16 autocast, as training's ReplicaModule runs replicate's engine; fp32:
    under none."""
    from types import SimpleNamespace

    from paratrain.bench.microbench_towers import towers_forward

    seen = []

    class Model(torch.nn.Linear):
        def forward(self, x):
            seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
            return super().forward(x)

    class Task:
        batch_dim = 0

        def train_steps(self, epoch, step):
            yield SimpleNamespace(micro_batches=[torch.randn(4, 3)], global_count=4)

        def loss(self, model, batch):
            out = model(batch)
            assert out.dtype == torch.float32
            return out.sum(), {}

    for precision, want in (("bf16", (True, torch.bfloat16)), ("fp32", (False,))):
        seen.clear()
        got = towers_forward(Task(), Model(3, 3), torch.device("cpu"), lambda: None, lambda batch: Task(), 2, 2,
                             least_s=0.0, precision=precision)
        assert got["towers"] == 2 and len(seen) >= 2 and all(s[:len(want)] == want for s in seen)


def test_a_mixed_precision_recipe_whose_recurrent_layers_have_no_kernel_here_is_refused_before_profiling(
        tiny_data, monkeypatch):
    """A bf16 LSTM recipe on a CPU whose oneDNN has no bf16 LSTM kernel (rnn_runs_in False): the
    profile raises the one-line UsageError that training gives, naming the precision that runs here,
    before it times anything; an fp32 recipe is not checked."""
    from paratrain.bench.profile import _model_and_batch
    from paratrain.config import from_dict
    from paratrain.errors import UsageError
    from paratrain.runs import build_task
    from paratrain.strategies import precision

    from ..distributed.test_exactness import tiny_cfg

    asked = []
    monkeypatch.setattr(precision, "rnn_runs_in", lambda model, dtype: asked.append(dtype) and False)
    c = tiny_cfg("bptt", "float32", "single", 1, 1, "sgd")
    for prec in ("fp32", "bf16"):
        cfg = from_dict({**c, "train": {**c["train"], "precision": prec}})
        task = build_task(cfg, str(tiny_data), world_size=1)
        if prec == "fp32":
            _model_and_batch(task, cfg)
            assert asked == []
            continue
        with pytest.raises(UsageError, match=r'train.precision = "bf16": a recurrent layer of this model has no '
                                             r'bfloat16 kernel on this CPU \(found before profiling\); use '
                                             r'train.precision = "fp32"'):
            _model_and_batch(task, cfg)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_mixed_precision_recipes_whole_model_profile_runs_its_forward_under_autocast(tiny_data, precision):
    """Training runs the model's forward under the recipe's autocast and its loss on float32 outputs
    (strategies.wrapping.ReplicaModule), and so does the profile's step (_model_and_batch's loss,
    which the in-process steps, the blocks, the FLOPs and the memory use): every forward of the model
    under autocast of the recipe's dtype, its outputs float32 to the loss, the backward outside
    autocast; the model's other methods (the LSTM's init_hidden) reached through it. An fp32 recipe's
    under none. The saved activations differ: what autocast casts is kept in the low dtype."""
    from paratrain.bench.profile import _blocks_and_flops, _model_and_batch
    from paratrain.config import from_dict
    from paratrain.runs import build_task

    from ..distributed.test_task_exactness import task_cfg

    def profile(prec: str, seen: list) -> dict:
        c = task_cfg("gpt", "float32", "single", 1, 1)
        cfg = from_dict({**c, "train": {**c["train"], "precision": prec}})
        task = build_task(cfg, str(tiny_data), world_size=1)
        model, device, tokens, draw, loss_fn = _model_and_batch(task, cfg)

        def hook(module, args, out):
            seen.append(("forward", torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), out.dtype))
            out.register_hook(lambda grad: seen.append(("backward", torch.is_autocast_enabled("cpu"))))
        model.register_forward_hook(hook)
        loss = loss_fn(draw())
        assert loss.dtype == torch.float32
        loss.backward()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        w = {"forward_s": 1.0, "backward_s": 2.0}
        linear = {id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)}
        linear_elements.append(sum(linear.values()))  # each weight once: the tied lm_head is the embedding
        return _blocks_and_flops(model, opt, loss_fn, draw, device, w, tokens)

    full_seen, low_seen, linear_elements = [], [], []
    full, low = profile("fp32", full_seen), profile(precision, low_seen)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    # autocast's casts of the weights, apart from the activations: every Linear's weight once in the low
    # dtype (each Linear's input needs a gradient, so each keeps its weight's cast); none in fp32
    assert full["autocast_copy_bytes"] == 0 and all(b["autocast_copy_bytes"] == 0 for b in full["blocks"])
    assert low["autocast_copy_bytes"] == 2 * linear_elements[1] > 0
    assert sum(b["autocast_copy_bytes"] for b in low["blocks"]) < low["autocast_copy_bytes"]  # lm_head: no block
    forwards = [s for s in low_seen if s[0] == "forward"]
    assert len(forwards) >= 4 and all(s[1] and s[2] == dtype and s[3] == dtype for s in forwards)
    assert all(not s[1] for s in low_seen if s[0] == "backward") and any(s[0] == "backward" for s in low_seen)
    assert full_seen and not any(s[0] == "forward" and s[1] for s in full_seen)
    assert all(s[3] == torch.float32 for s in full_seen if s[0] == "forward")
    # the matmuls' low-precision copies of their inputs and weights are what the backward keeps
    assert low["activation_bytes"] != full["activation_bytes"] and low["output_bytes"] == full["output_bytes"] // 2
    assert low["flops_per_step"] == full["flops_per_step"]


def test_the_profile_tells_autocasts_casts_of_the_weights_from_the_activations():
    """Saved for the backward under bf16 autocast, per block, each storage once: a Linear whose input
    needs no gradient keeps its input's cast (32 bytes) but no weight; the ReLU keeps its output (32
    bytes, as large as the first weight's cast, and no cast: an activation); the second Linear keeps
    that output (already counted) and its weight's cast (4 x 3 x 2 = 24 bytes: autocast's copy). Where
    the input needs a gradient, the first weight's cast (4 x 4 x 2 bytes) is kept too. In fp32 the
    weights are the parameters themselves: no copies."""
    from paratrain.bench.profile import _BlockProbe, parameter_copy

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3))

    def probe(low: bool, grad: bool) -> tuple:
        p = _BlockProbe(model, list(model), torch.device("cpu"))
        x = torch.randn(4, 4, requires_grad=grad)
        try:
            with torch.autograd.graph.saved_tensors_hooks(p.pack, lambda t: t):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=low):
                    out = model(x)
                out.float().sum().backward()
        finally:
            p.close()
        return p.saved, p.copies, p.total_saved, p.total_copies
    assert probe(True, False) == ([32, 32, 0], [0, 0, 24], 64, 24)
    assert probe(True, True) == ([32, 32, 0], [32, 0, 24], 64, 56)
    assert probe(False, True) == ([64, 64, 0], [0, 0, 0], 128, 0)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    w = model[0].weight
    assert parameter_copy(w.to(torch.bfloat16).t(), params) and parameter_copy(w.double(), params)
    assert not parameter_copy(w.t(), params)  # a view without a cast shares the parameter's storage
    assert not parameter_copy(w.to(torch.bfloat16) * 2, params)  # computed from it: not a copy
    assert not parameter_copy((w.to(torch.bfloat16) * 2).t(), params)
    assert not parameter_copy(w.to(torch.bfloat16), set())  # not one of these parameters
    assert not parameter_copy(torch.ones(3), params)  # no history


def test_the_profiles_precision_wrapper_reaches_the_models_methods():
    """An LSTM LM's loss calls its model's ``init_hidden``: the profile's forward wrapper under bf16
    hands it (and every other attribute the wrapper lacks) to the model, whose parameters are its; a
    copy of it, as of a strategy's ReplicaModule (the same base), is the plain model."""
    import copy

    from paratrain.models.lstm_lm import LSTMLM
    from paratrain.strategies.wrapping import AutocastModule

    model = LSTMLM(20, 6, 5, num_layers=2)
    wrapped = AutocastModule(model, "cpu", torch.bfloat16)
    assert wrapped.module is model and list(wrapped.parameters()) == list(model.parameters())
    (h, c), (h0, c0) = wrapped.init_hidden(3), model.init_hidden(3)
    assert h.shape == h0.shape == c.shape == (2, 3, 5) and torch.equal(h, h0) and torch.equal(c, c0)
    twin = copy.deepcopy(wrapped)
    assert type(twin) is LSTMLM and twin is not model
    assert all(torch.equal(a, b) for a, b in zip(twin.parameters(), model.parameters()))
