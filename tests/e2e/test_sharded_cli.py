"""The sharded strategies as a user runs them: ``paratrain train --strategy fsdp|zero1`` writes DCP
checkpoints from every rank, a worker killed at step 50 of 120 restarts (``--max-restarts 1``) and
the run ends bitwise equal to an uninterrupted one, and ``paratrain export`` turns the newest DCP
folder into a plain ``.pt`` whose ``model`` is that run's."""
from __future__ import annotations

import pytest
import torch

from paratrain.strategies.sharded import read_whole
from paratrain.train.checkpoint import latest

from .test_cli import TINY, paratrain
from .test_reliability import records

pytestmark = pytest.mark.slow
COMMON = ("--set", "train.max_steps=120", "--set", "model.dropout=0.2")


@pytest.mark.parametrize("strategy", ["fsdp", "zero1"])
def test_killed_worker_restarts_and_ends_bitwise_equal(tmp_path, tiny_data, strategy):
    (tmp_path / "tiny.toml").write_text(TINY)
    a = paratrain("train", "tiny.toml", "--data-dir", tiny_data, "--run-dir", "plain", "--strategy", strategy,
                  *COMMON, cwd=tmp_path, timeout=300)
    assert a.returncode == 0, a.stderr[-2000:]
    b = paratrain("train", "tiny.toml", "--data-dir", tiny_data, "--run-dir", "killed", "--strategy", strategy,
                  *COMMON, "--fault", "kill:rank=1:step=50", "--max-restarts", "1", cwd=tmp_path, timeout=300)
    assert b.returncode == 0, b.stderr[-3000:]
    assert "restart 1 of 1: resuming from step 48 (checkpoint-00000048.dcp)" in b.stdout + b.stderr
    resumed = records(tmp_path / "killed", "resume")
    assert len(resumed) == 1 and resumed[0]["step"] == 48
    plain, killed = (read_whole(latest(tmp_path / d))["model"] for d in ("plain", "killed"))
    assert latest(tmp_path / "killed").name == "checkpoint-00000120.dcp"
    assert all(torch.equal(plain[k], killed[k]) for k in plain), "restarted run differs from the uninterrupted one"

    out = tmp_path / "model.pt"
    e = paratrain("export", tmp_path / "killed", out, cwd=tmp_path)
    assert e.returncode == 0, e.stderr
    exported = torch.load(out, weights_only=True)
    assert exported["step"] == 120 and exported["model"].keys() == plain.keys()
    assert all(torch.equal(plain[k], exported["model"][k]) for k in plain)
    again = paratrain("export", tmp_path / "killed", out, cwd=tmp_path)
    assert again.returncode == 2 and "exists" in again.stderr and "Traceback" not in again.stderr


def test_resume_of_a_fsdp_run_under_allreduce_passes_over_a_damaged_folder(tmp_path, tiny_data):
    """``--resume`` of a run dir of DCP folders under another strategy; a newest folder that lost a
    shard file is passed over with one warning, and the run resumes from the one before."""
    (tmp_path / "tiny.toml").write_text(TINY)
    a = paratrain("train", "tiny.toml", "--data-dir", tiny_data, "--run-dir", "run", "--strategy", "fsdp",
                  "--set", "train.max_steps=12", cwd=tmp_path, timeout=300)
    assert a.returncode == 0, a.stderr[-2000:]
    (tmp_path / "run" / "checkpoint-00000012.dcp" / "__1_0.distcp").unlink()
    b = paratrain("train", "tiny.toml", "--data-dir", tiny_data, "--resume", "run", "--strategy", "allreduce",
                  "--set", "train.max_steps=16", cwd=tmp_path, timeout=300)
    assert b.returncode == 0, b.stderr[-3000:]
    out = b.stdout + b.stderr
    assert "checkpoint-00000012.dcp" in out and "lacks __1_0.distcp" in out, out[-2000:]
    assert "resumed from checkpoint-00000008.dcp" in out and "Traceback" not in out
    assert (tmp_path / "run" / "checkpoint-00000016.pt").is_file()


def test_fsdp_in_bf16_trains_and_evaluates(tmp_path, tiny_data):
    """Under bf16 FSDP2 gathers bf16 shards and each unit returns float32: evaluation (outside the
    training forward) must run under the same autocast, or a float32 activation meets a bf16 weight."""
    from .test_pipeline_cli import GPT

    (tmp_path / "gpt.toml").write_text(GPT)
    r = paratrain("train", "gpt.toml", "--data-dir", tiny_data, "--run-dir", "bf16", "--strategy", "fsdp",
                  "--set", "train.precision=bf16", "--set", "train.max_steps=6", cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = records(tmp_path / "bf16", "summary")[-1]
    assert 1 < summary["valid_ppl"] < 45 and 1 < summary["test_ppl"] < 45  # 40 words: near-uniform after 6 steps
