"""Towers draw their own random numbers: distinct between towers, reproducible, and independent
of which tower thread runs first (CPU towers share one default generator without this)."""
from __future__ import annotations

import threading
import time

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.strategies.towers import CPUTowers, TowerRandom, current_tower, run_threads, tower_seeds


class Probe(nn.Module):
    """Per tower: a dropout mask, the inter-layer dropout of a 2-layer LSTM, and a random draw,
    each after a tower-specific delay, so a shared generator hands them out in schedule order."""

    def __init__(self, delays: tuple[float, float]) -> None:
        super().__init__()
        self.delays = delays
        torch.manual_seed(0)
        self.lstm = nn.LSTM(8, 8, num_layers=2, dropout=0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, 8) -> (B, 8 + 8 + 8)
        d = self.delays[current_tower()]
        time.sleep(d)
        mask = F.dropout(x, 0.5, True)
        time.sleep(d)
        rnn = self.lstm(x.unsqueeze(0))[0][0]
        time.sleep(d)
        noise = torch.rand_like(x)
        return torch.cat([mask, rnn, noise], 1)


def towers_output(delays: tuple[float, float], seed: int = 3) -> torch.Tensor:
    towers = CPUTowers(Probe(delays), 2, batch_dim=0, threads=2)
    torch.default_generator.manual_seed(seed)
    with torch.no_grad():
        return towers(torch.ones(4, 8))  # rows 0-1: tower 0, rows 2-3: tower 1


def test_tower_masks_do_not_depend_on_thread_schedule():
    first_tower_0, first_tower_1 = towers_output((0.0, 0.05)), towers_output((0.05, 0.0))
    assert torch.equal(first_tower_0, first_tower_1)


def test_towers_draw_different_masks_and_reproduce_them():
    out = towers_output((0.0, 0.0))
    assert not torch.equal(out[:2, :8], out[2:, :8])  # dropout masks
    assert not torch.equal(out[:2, 8:16], out[2:, 8:16])  # the LSTM's own inter-layer dropout
    assert not torch.equal(out[:2, 16:], out[2:, 16:])  # torch.rand_like
    assert torch.equal(out, towers_output((0.0, 0.0)))
    assert not torch.equal(out, towers_output((0.0, 0.0), seed=4))  # the next step's seed


def test_a_shared_generator_would_depend_on_the_schedule():
    """The control: the same probe in tower threads without per-tower generators, the towers made to
    run one after the other in a given order (an event, not a delay: on a loaded machine a delay does
    not order threads)."""
    def run(order):
        probe, first_done = Probe((0.0, 0.0)), threading.Event()

        def tower(t):
            def call():
                if t != order[0]:
                    assert first_done.wait(60)
                out = probe(torch.ones(2, 8))
                if t == order[0]:
                    first_done.set()
                return out
            return call

        torch.default_generator.manual_seed(3)
        with torch.no_grad():
            return run_threads([tower(0), tower(1)])

    a, b = run((0, 1)), run((1, 0))
    # the tower that runs first gets the same draws: the dropout mask and torch.rand_like exactly, and the
    # LSTM's inter-layer mask (its output to rounding: oneDNN's LSTM without AVX-512 differs by ~1e-8
    # between threads; the other mask moves it by 3e-2)
    for first, again in ((a[0], b[1]), (a[1], b[0])):
        assert torch.equal(first[:, :8], again[:, :8]) and torch.equal(first[:, 16:], again[:, 16:])
        assert torch.allclose(first[:, 8:16], again[:, 8:16], rtol=0, atol=1e-6)
    assert not torch.equal(a[0][:, :8], b[0][:, :8]) and not torch.equal(a[0][:, 16:], b[0][:, 16:])
    assert (a[0][:, 8:16] - b[0][:, 8:16]).abs().max() > 1e-3  # the LSTM's mask depends on the schedule too


def test_tower_random_leaves_other_calls_and_eval_dropout_alone():
    g = torch.Generator().manual_seed(1)
    x = torch.ones(1000)
    torch.default_generator.manual_seed(5)
    expected = torch.rand(3)
    torch.default_generator.manual_seed(5)
    with TowerRandom(g):
        assert torch.equal(F.dropout(x, 0.5, training=False), x)
        assert torch.equal(F.dropout(x, 0.0, training=True), x)
        y = F.dropout(x, 0.5, True)
    assert torch.equal(torch.rand(3), expected)  # the default generator was not drawn from
    assert torch.equal(y, _masked(x, torch.Generator().manual_seed(1)))


def _masked(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    return x * torch.empty_like(x).bernoulli_(0.5, generator=g) / 0.5


def test_tower_seeds_differ_and_follow_the_default_generator():
    torch.default_generator.manual_seed(9)
    a = tower_seeds(4)
    torch.default_generator.manual_seed(9)
    assert tower_seeds(4) == a and len(set(a)) == 4


def test_towers_forward_uses_a_share_of_the_threads_and_gives_them_back_to_the_loss():
    seen = {}

    class Threads(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen[current_tower()] = torch.get_num_threads()
            return x * 2

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        out = CPUTowers(Threads(), 2, 0, threads=4)(torch.ones(4, 3))
        assert seen == {0: 2, 1: 2}  # each tower's forward: threads // towers
        assert torch.get_num_threads() == 4  # tower 0 ran in this thread; the loss and backward get every thread
        assert torch.equal(out, torch.full((4, 3), 2.0))
    finally:
        torch.set_num_threads(before)
