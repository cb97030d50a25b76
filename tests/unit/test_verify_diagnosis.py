"""paratrain verify's comparison and diagnosis on synthetic gradients (no processes)."""
from __future__ import annotations

import pytest
import torch

from paratrain.verify import compare, diagnose, rel_diff

G = {"w": torch.tensor([1.0, -2.0, 3.0]), "b": torch.tensor([0.5])}


def rank(local, merged, replicas=2, bn=False):
    return {"local": [local], "merged": [merged] if merged is not None else [], "num_replicas": replicas,
            "batchnorm": bn, "params": {k: v.clone() for k, v in G.items()}}


def scaled(g, c):
    return {k: v * c for k, v in g.items()}


def test_rel_diff_and_compare():
    assert rel_diff(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0])) == 0.0
    assert rel_diff(torch.tensor([1.0, 2.2], dtype=torch.float64), torch.tensor([1.0, 2.0], dtype=torch.float64)) \
        == pytest.approx(0.1)
    single = rank(G, G, replicas=1)
    table = compare(rank(G, scaled(G, 2)), single)
    assert table["w"]["grad"] == 1.0 and table["w"]["param"] == 0.0


def test_diagnoses():
    single = {"merged": [G]}
    ok_locals = [scaled(G, 1.2), scaled(G, 0.8)]  # local gradients average to G
    # merged = sum of the local gradients instead of their mean
    assert "summed over the 2 ranks" in diagnose(single, [rank(lc, scaled(G, 2)) for lc in ok_locals], 1)
    # loss summed: every local gradient twice as large, merging right
    assert "summed over the 2 replicas instead of averaged" in diagnose(
        single, [rank(scaled(lc, 2), scaled(G, 2)) for lc in ok_locals], 1)
    assert "averaged twice" in diagnose(single, [rank(scaled(lc, 0.5), scaled(G, 0.5)) for lc in ok_locals], 1)
    assert "accumulation is not scaled by 1/4" in diagnose(
        single, [rank(scaled(lc, 4), scaled(G, 4)) for lc in ok_locals], 4)
    # every rank computed the same gradient: same samples everywhere
    same = [scaled(G, 1.3), scaled(G, 1.3)]
    assert "shards overlap" in diagnose(single, [rank(lc, scaled(G, 1.3)) for lc in same], 1)
    # shards that do not add up, non-uniformly
    odd = [{"w": torch.tensor([1.0, 0.0, 0.0]), "b": torch.tensor([0.5])}, {"w": torch.tensor([0.0, 1.0, 0.0]),
                                                                            "b": torch.tensor([0.1])}]
    assert "samples overlap or are dropped" in diagnose(single, [rank(lc, None) for lc in odd], 1)
    assert "BatchNorm" in diagnose(single, [rank(lc, None, bn=True) for lc in odd], 1)
