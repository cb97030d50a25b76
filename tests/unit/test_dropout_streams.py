"""Dropout random numbers: one stream per (seed, rank, tower, step), distinct and reproducible."""
from __future__ import annotations

import torch

from paratrain.train.loop import seed_step, stream_seed


def mask(seed: int) -> torch.Tensor:
    seed_step(seed, torch.device("cpu"))
    return torch.nn.functional.dropout(torch.ones(4096), p=0.5) > 0


def test_no_two_ranks_towers_or_steps_share_a_seed():
    seeds = [stream_seed(1234, r, s, t) for r in range(4) for t in range(2) for s in range(20_000)]
    assert len(set(seeds)) == len(seeds)
    assert all(0 <= x < 2**63 for x in seeds[:100])


def test_the_old_linear_formula_collision_is_gone():
    # seed*1_000_003 + rank*7919 + step gave rank 1 at step 0 the masks of rank 0 at step 7919
    assert not torch.equal(mask(stream_seed(0, 1, 0)), mask(stream_seed(0, 0, 7919)))


def test_masks_are_reproducible_and_differ_between_ranks():
    a, again = mask(stream_seed(7, 0, 42)), mask(stream_seed(7, 0, 42))
    assert torch.equal(a, again)  # a resumed run draws the same masks
    other_rank, other_tower = mask(stream_seed(7, 1, 42)), mask(stream_seed(7, 0, 42, tower=1))
    assert not torch.equal(a, other_rank) and not torch.equal(a, other_tower)
    assert 0.4 < a.float().mean() < 0.6
