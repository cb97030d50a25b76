"""How strategy ``pipeline`` cuts a model and feeds a task (strategies/stages.py, TaskBase's
defaults): an nn.Sequential's children in consecutive groups that share its parameters and compute
what it computes, the stage plan's counts, the one-line refusals, and micro-batches of tensors cut
by rows."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import paratrain as pt
from paratrain.errors import UsageError
from paratrain.strategies.stages import cut_stages, even_blocks, task_hooks


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


@pytest.mark.parametrize("split, sizes", [("", [3, 2]), ("1,4", [1, 4]), ("4,1", [4, 1])])
def test_a_sequential_is_cut_into_consecutive_groups_that_compute_the_whole(split, sizes):
    model = mlp()
    stages = cut_stages(model, 2, split)
    assert [len(s) for s in stages] == sizes
    assert {id(p) for s in stages for p in s.parameters()} == {id(p) for p in model.parameters()}
    x = torch.randn(3, 4)
    assert torch.equal(stages[1](stages[0](x)), model(x))


def test_even_blocks_give_the_remainder_to_the_first_stages():
    assert even_blocks(5, 2) == [3, 2] and even_blocks(7, 3) == [3, 2, 2] and even_blocks(2, 3) == [1, 1, 0]


@pytest.mark.parametrize("model, stages, split, words", [
    (mlp(), 2, "2,2", "add up to 5"),
    (mlp(), 2, "5,0", "counts >= 1"),
    (mlp(), 6, "", "counts >= 1"),
    (nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.Linear(2, 2)), 2, "", "a model with BatchNorm"),
    (nn.Linear(2, 2), 2, "", "not an nn.Sequential"),
    (mlp(), 2, "1;4", "whole numbers"),
])
def test_what_cannot_be_cut_is_a_usage_error_that_says_why(model, stages, split, words):
    with pytest.raises(UsageError, match=words):
        cut_stages(model, stages, split)


class Rows(pt.TaskBase):
    pass


def test_taskbase_feeds_the_inputs_and_cuts_every_tensor_by_rows():
    feed, chunk = task_hooks(Rows())
    x, y = torch.arange(12.).view(6, 2), torch.arange(6)
    assert feed((x, y)) is x and feed(x) is x
    got = chunk((x, y, "tag"), 2, 5)
    assert isinstance(got, tuple) and torch.equal(got[0], x[2:5]) and torch.equal(got[1], y[2:5]) and got[2] == "tag"
    assert isinstance(chunk([x, y], 0, 1), list) and torch.equal(chunk(x, 1, 2), x[1:2])
    with pytest.raises(UsageError, match="pipeline_input"):
        feed({"x": x})


def test_a_task_with_another_batch_dimension_needs_its_own_hooks():
    class TimeMajor(pt.TaskBase):
        batch_dim = 1

    with pytest.raises(UsageError, match="batch_dim 1"):
        task_hooks(TimeMajor())

    class Own(TimeMajor):
        def pipeline_input(self, mb):
            return mb.t()

        def pipeline_chunk(self, mb, lo, hi):
            return mb[:, lo:hi]

    feed, chunk = task_hooks(Own())
    assert feed(torch.zeros(3, 5)).shape == (5, 3)
