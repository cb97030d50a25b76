"""``paratrain verify``: passes for every synchronous strategy, fails with the right diagnosis on
deliberately broken variants."""
from __future__ import annotations

import pytest

from .test_cli import TINY, paratrain

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("strategy, extra", [("allreduce", ("--set", "model.dropout=0.2")), ("replicate", ()),
                                             ("ps-sync", ("--num-ps", "1"))])
def test_verify_passes_for_synchronous_strategies(tmp_path, tiny_data, strategy, extra):
    (tmp_path / "tiny.toml").write_text(TINY)
    r = paratrain("verify", "tiny.toml", "--strategy", strategy, "--nproc", "2", "--steps", "3", *extra,
                  "--data-dir", tiny_data, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"[verify] OK: {strategy} x 2 equals single" in r.stdout
    assert "rnn.weight_ih_l0" in r.stdout  # the per-parameter table


@pytest.mark.parametrize("bug, cause", [("sum-loss", "the loss is summed over the 2 replicas instead of averaged"),
                                        ("overlap-shards", "shards overlap: all 2 ranks computed the same local"),
                                        ("same-dropout", "dropout RNG identical across ranks")])
def test_verify_names_the_cause_of_a_broken_variant(tmp_path, tiny_data, bug, cause):
    (tmp_path / "tiny.toml").write_text(TINY)
    r = paratrain("verify", "tiny.toml", "--strategy", "allreduce", "--nproc", "2", "--inject-bug", bug,
                  "--set", "model.dropout=0.2", "--data-dir", tiny_data, cwd=tmp_path, timeout=300)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[verify] MISMATCH" in r.stderr and cause in r.stderr, r.stderr[-2000:]
