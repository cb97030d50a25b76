"""Sharding arithmetic: the union over ranks and micro-batches is exactly the single-process batch."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paratrain.data.batching import (BPTTTrainStream, SentenceTrainStream, batchify, bptt_eval_batches,
                                     sentence_eval_batches, shard_range)
from paratrain.data.corpus import Split


def make_split(lengths: list[int]) -> Split:
    ids, starts = [], [0]
    v = 1
    for n in lengths:
        ids += list(range(v, v + n - 1)) + [0]  # id 0 is <eos>
        v += n - 1
        starts.append(len(ids))
    return Split(torch.tensor(ids), torch.tensor(starts))


@given(n=st.integers(0, 200), w=st.integers(1, 16))
def test_shard_range_partitions(n, w):
    spans = [shard_range(n, w, r) for r in range(w)]
    assert spans[0][0] == 0 and spans[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert max(b - a for a, b in spans) - min(b - a for a, b in spans) <= 1


@settings(max_examples=40, deadline=None)
@given(w=st.sampled_from([1, 2, 4]), k=st.sampled_from([1, 2]), T=st.integers(1, 7), extra=st.integers(0, 50))
def test_bptt_union_equals_single_batch(w, k, T, extra):
    B = 8
    split = Split(torch.arange(B * (3 * T + 2) + extra), torch.tensor([0, B * (3 * T + 2) + extra]))
    ref = BPTTTrainStream(split, B, T, 0, 1, 1)
    shards = [BPTTTrainStream(split, B, T, r, w, k) for r in range(w)]
    assert all(s.steps_per_epoch == ref.steps_per_epoch for s in shards)
    for step_ref, *steps in zip(ref.epoch(1), *(s.epoch(1) for s in shards)):
        cols_in = torch.cat([mb.inputs for sb in steps for mb in sb.micro], dim=1)
        cols_tg = torch.cat([mb.targets for sb in steps for mb in sb.micro], dim=1)
        assert torch.equal(cols_in, step_ref.micro[0].inputs)
        assert torch.equal(cols_tg, step_ref.micro[0].targets)
        assert all(sb.global_tokens == B * T for sb in steps)


def test_bptt_targets_are_next_tokens():
    split = Split(torch.arange(100), torch.tensor([0, 100]))
    data = batchify(split.ids, 4)  # (25, 4): stream b is 25b .. 25b+24
    assert data[:, 1].tolist() == list(range(25, 50))
    sb = next(BPTTTrainStream(split, 4, 5, 0, 1).epoch(1))
    assert torch.equal(sb.micro[0].targets, sb.micro[0].inputs + 1)


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(2, 9), min_size=16, max_size=60), w=st.sampled_from([1, 2, 4]),
       k=st.sampled_from([1, 2]), epoch=st.integers(1, 3))
def test_sentence_union_equals_single_batch(lengths, w, k, epoch):
    split = make_split(lengths)
    B = 8
    ref = SentenceTrainStream(split, B, 0, 1, 1, seed=5)
    shards = [SentenceTrainStream(split, B, r, w, k, seed=5) for r in range(w)]
    for step_ref, *steps in zip(ref.epoch(epoch), *(s.epoch(epoch) for s in shards)):
        want = sorted(tuple(step_ref.micro[0].targets[:, j][step_ref.micro[0].mask[:, j]].tolist()) for j in range(B))
        got = sorted(tuple(mb.targets[:, j][mb.mask[:, j]].tolist()) for sb in steps for mb in sb.micro
                     for j in range(mb.targets.size(1)))
        assert got == want
        assert {sb.global_tokens for sb in steps} == {step_ref.global_tokens} == {step_ref.micro[0].num_tokens}


def test_sentence_order_reshuffles_per_epoch_same_on_all_ranks():
    split = make_split([3] * 40)
    a, b = SentenceTrainStream(split, 8, 0, 2, seed=1), SentenceTrainStream(split, 8, 1, 2, seed=1)
    assert torch.equal(a.order(1), b.order(1))
    assert not torch.equal(a.order(1), a.order(2))


def test_sentence_padding_and_start_symbol():
    split = make_split([3, 5])
    mb = next(SentenceTrainStream(split, 2, 0, 1).epoch(1)).micro[0]
    assert mb.inputs.shape == (5, 2)
    assert (mb.inputs[0] == 0).all()  # <eos> as start symbol
    assert torch.equal(mb.inputs[1:][mb.mask[:-1]], mb.targets[:-1][mb.mask[:-1]])
    assert mb.num_tokens == 8


@settings(max_examples=30, deadline=None)
@given(n=st.integers(3, 120), B=st.integers(1, 12), T=st.integers(1, 9), w=st.integers(1, 5))
def test_bptt_eval_covers_every_prediction_once(n, B, T, w):
    split = Split(torch.arange(n), torch.tensor([0, n]))
    pairs = []
    for r in range(w):
        for mb in bptt_eval_batches(split, B, T, r, w):
            m = torch.ones_like(mb.inputs, dtype=torch.bool) if mb.mask is None else mb.mask
            assert mb.num_tokens == int(m.sum())
            pairs += list(zip(mb.inputs[m].tolist(), mb.targets[m].tolist()))
    assert sorted(pairs) == [(i, i + 1) for i in range(n - 1)]


def test_sentence_eval_covers_every_line_once():
    split = make_split([2, 3, 4, 5, 6, 7, 8])
    tokens = sum(mb.num_tokens for r in range(3) for mb in sentence_eval_batches(split, 2, r, 3))
    assert tokens == split.ids.numel()
