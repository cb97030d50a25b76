"""``pt.shard`` arithmetic (no processes): for every kind of data, the W ranks' parts of each step
are exactly the single-process batch of that step (no sample twice, none lost)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset

from paratrain.data.sharding import ShardedDataset, ShardedIterable, ShardedLoader, shard, shard_tensor


@given(streams=st.integers(1, 24), length=st.integers(1, 9), world=st.integers(1, 6))
@settings(max_examples=60, deadline=None)
def test_tensor_shards_are_contiguous_column_blocks_covering_every_stream(streams, length, world):
    data = torch.arange(streams * length).view(length, streams)  # (L, B): B parallel streams
    if streams % world:
        with pytest.raises(ValueError, match=f"does not split evenly over world_size {world}"):
            shard_tensor(data, 0, world)
        parts = [shard_tensor(data, r, world, allow_uneven=True) for r in range(world)]
    else:
        parts = [shard_tensor(data, r, world) for r in range(world)]
        assert {p.size(1) for p in parts} == {streams // world}
    assert torch.equal(torch.cat(parts, dim=1), data)  # contiguous blocks, in rank order: the union is everything
    assert all(p.is_contiguous() for p in parts)  # like the tensor it replaces: part[i:j].view(-1) works


def test_tensor_needs_the_dimension_it_shards():
    with pytest.raises(ValueError, match="has no dimension 1"):
        shard(torch.arange(10), 0, 2)
    assert torch.equal(shard(torch.arange(10), 1, 2, dim=0), torch.arange(5, 10))


def _dataset(n: int = 37) -> TensorDataset:
    return TensorDataset(torch.arange(n), torch.arange(n) * 10)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("shuffle", [True, False])
def test_sharded_loader_steps_add_up_to_the_one_process_steps(world, shuffle):
    batch = 6
    loaders = [ShardedLoader(DataLoader(_dataset(), batch_size=batch, shuffle=shuffle, drop_last=True), r, world,
                             seed=4) for r in range(world)]
    one = ShardedLoader(DataLoader(_dataset(), batch_size=batch, shuffle=shuffle, drop_last=True), 0, 1, seed=4)
    for _epoch in range(3):  # every new iteration is a new epoch, the same on every rank
        ref = [set(x.tolist()) for x, _ in one]
        per_rank = [[x for x, _ in ld] for ld in loaders]
        assert all(len(p) == len(ref) for p in per_rank)
        for i, want in enumerate(ref):
            got = [set(p[i].tolist()) for p in per_rank]
            assert all(len(g) == batch // world for g in got)
            assert set().union(*got) == want and sum(len(g) for g in got) == batch
    orders = [[x.tolist() for x, _ in one] for _ in range(2)]
    assert (orders[0] != orders[1]) == shuffle  # set_epoch is called for you at every new iteration


def test_sharded_loader_refuses_a_global_batch_that_does_not_split():
    with pytest.raises(ValueError,
                       match="batch_size \\(the global batch\\) of 7 does not split evenly over world_size 2"):
        ShardedLoader(DataLoader(_dataset(), batch_size=7), 0, 2)
    assert ShardedLoader(DataLoader(_dataset(), batch_size=7), 1, 2, allow_uneven=True).batch_size == 4


def test_sharded_dataset_union_per_epoch_and_set_epoch():
    n, world = 37, 3
    parts = [ShardedDataset(_dataset(n), r, world, seed=1) for r in range(world)]
    for epoch in range(2):
        for p in parts:
            p.set_epoch(epoch)
        items = [[int(p[i][0]) for i in range(len(p))] for p in parts]
        assert len({len(x) for x in items}) == 1 and len(items[0]) == n // world
        flat = [v for x in items for v in x]
        assert len(flat) == len(set(flat)) == n - n % world  # no sample twice; only the tail that cannot fill W ranks
    before = [int(parts[0][i][0]) for i in range(len(parts[0]))]
    parts[0].set_epoch(5)
    assert [int(parts[0][i][0]) for i in range(len(parts[0]))] != before  # another epoch, another order


def test_iterable_of_global_batches_gives_each_rank_its_block():
    batches = [(torch.arange(8) + 8 * i, {"w": torch.ones(8, 2) * i}) for i in range(3)]
    parts = [list(ShardedIterable(batches, r, 2)) for r in range(2)]
    for i, (x, d) in enumerate(batches):
        assert torch.equal(torch.cat([parts[0][i][0], parts[1][i][0]]), x)
        assert parts[1][i][1]["w"].shape == (4, 2)


def test_shard_refuses_what_it_cannot_split():
    with pytest.raises(TypeError, match="takes a tensor, a DataLoader, a map-style dataset or an iterable"):
        shard(42, 0, 2)
