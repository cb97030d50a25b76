"""``paratrain verify``: passes for every synchronous strategy, fails with the right diagnosis on
deliberately broken variants."""
from __future__ import annotations

import pytest

from .test_cli import TINY, paratrain

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("strategy, extra", [("replicate", ()), ("ps-sync", ("--num-ps", "1")), ("fsdp", ()),
                                             ("fsdp", ("--set", "dist.reshard_after_forward=false")), ("zero1", ())])
def test_verify_passes_for_synchronous_strategies(tmp_path, tiny_data, strategy, extra):
    (tmp_path / "tiny.toml").write_text(TINY)
    r = paratrain("verify", "tiny.toml", "--strategy", strategy, "--nproc", "2", "--steps", "3", *extra,
                  "--data-dir", tiny_data, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"[verify] OK: {strategy} x 2 equals single" in r.stdout
    assert "rnn.weight_ih_l0" in r.stdout  # the per-parameter table


def test_verify_with_dropout_compares_at_p0_and_checks_the_ranks_dropout_seeds(tmp_path, tiny_data):
    """allreduce passes; what verify does with a configured dropout (verify.py): the comparison runs
    with the dropout modules at p = 0 (with masks drawn, 2 ranks' halves could not equal one device's
    batch), while each step is still seeded as configured, and the ranks' RNG states before every step
    are compared: equal ones are the same-dropout bug (test_verify_names_the_cause_of_a_broken_variant).
    A correct run passes."""
    (tmp_path / "tiny.toml").write_text(TINY)
    r = paratrain("verify", "tiny.toml", "--strategy", "allreduce", "--nproc", "2", "--steps", "3",
                  "--set", "model.dropout=0.5", "--data-dir", tiny_data, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "dropout modules at p = 0" in r.stdout.splitlines()[0]
    assert "[verify] OK: allreduce x 2 equals single" in r.stdout and "MISMATCH" not in r.stderr
    assert "rnn.weight_ih_l0" in r.stdout  # the per-parameter table


SUM_LOSS = ("sum-loss", "the loss is summed over the 2 replicas instead of averaged")
OVERLAP = ("overlap-shards", "shards overlap: all 2 ranks computed the same local")
SAME_DROPOUT = ("same-dropout", "dropout RNG identical across ranks")


# Each injected bug on each of these strategies would be 9 runs of 3 processes; the bug is injected
# the same way whatever the strategy (verify._record), and what differs by strategy is how verify
# records it (a replica's gradients, fsdp's shards gathered, zero1's rows). So each strategy meets one
# bug and each bug one of them (a Latin square); the pipeline below meets every bug.
@pytest.mark.parametrize("strategy, bug, cause", [("allreduce", *OVERLAP), ("fsdp", *SUM_LOSS),
                                                  ("zero1", *SAME_DROPOUT)])
def test_verify_names_the_cause_of_a_broken_variant(tmp_path, tiny_data, bug, cause, strategy):
    (tmp_path / "tiny.toml").write_text(TINY)
    r = paratrain("verify", "tiny.toml", "--strategy", strategy, "--nproc", "2", "--inject-bug", bug,
                  "--set", "model.dropout=0.2", "--data-dir", tiny_data, cwd=tmp_path, timeout=300)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[verify] MISMATCH" in r.stderr and cause in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("bug, cause", [("", ""), SUM_LOSS, OVERLAP, SAME_DROPOUT])
def test_verify_of_pipeline_two_replicas_of_two_stages(tmp_path, tiny_data, bug, cause):
    """``--nproc 2`` replicas of the 2-stage gpt: 4 processes; a correct run equals single, and each
    injected bug is named (the merged gradients are the union of the stages'). Clipping off: a
    gradient twice too large clipped to the same norm would hide the summed loss."""
    from .test_pipeline_cli import GPT

    (tmp_path / "gpt.toml").write_text(GPT)
    r = paratrain("verify", "gpt.toml", "--strategy", "pipeline", "--nproc", "2", "--steps", "3",
                  *(("--inject-bug", bug) if bug else ()), "--set", "train.clip=0", "--set", "model.dropout=0.2",
                  "--data-dir", tiny_data, cwd=tmp_path, timeout=300)
    if not bug:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert "[verify] OK: pipeline x 2 equals single" in r.stdout and "blocks.1.mlp.fc.weight" in r.stdout
        return
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[verify] MISMATCH" in r.stderr and cause in r.stderr, r.stderr[-2000:]
