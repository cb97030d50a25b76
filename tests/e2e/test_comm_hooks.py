"""Gradient compression as a user runs it: ``--set dist.comm_hook=fp16|bf16|powersgd`` under
``allreduce`` (and ``zero1``), the bytes per step the hook reports against an independent count from
the parameter shapes, PowerSGD's state surviving a killed worker bitwise, and the refusals."""
from __future__ import annotations

import pytest
import torch

from .test_cli import TINY, final_model, paratrain
from .test_reliability import records

pytestmark = pytest.mark.slow
RANK, START = 2, 6


def expected_bytes(model: dict, hook: str, element: int = 8) -> int:
    """One rank's all-reduce payload for one step, from the parameter shapes alone (the oracle):
    every element at ``element`` bytes (none), at 2 bytes (fp16/bf16), or PowerSGD's factors
    P (n x r) and Q (m x r) for each matrix where (n + m) r x 2 < n m (torch's default
    ``min_compression_rate`` = 2), the rest uncompressed."""
    if hook == "none":
        return sum(t.numel() for t in model.values()) * element
    if hook in ("fp16", "bf16"):
        return sum(t.numel() for t in model.values()) * 2
    total = 0
    for t in model.values():
        if t.dim() <= 1:
            total += t.numel()
            continue
        n, m = t.shape[0], t.numel() // t.shape[0]
        r = min(n, m, RANK)
        total += (n + m) * r if (n + m) * r * 2 < n * m else n * m
    return total * element


@pytest.mark.parametrize("hook", ["none", "fp16", "bf16", "powersgd"])
def test_bytes_per_step_are_what_the_hook_sends(tmp_path, tiny_data, hook):
    (tmp_path / "tiny.toml").write_text(TINY)
    r = paratrain("train", "tiny.toml", "--data-dir", tiny_data, "--run-dir", "run", "--set", "train.max_steps=12",
                  "--set", f"dist.comm_hook={hook}", "--set", f"dist.matrix_approximation_rank={RANK}",
                  "--set", f"dist.start_powerSGD_iter={START}", cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    model = final_model(tmp_path / "run")
    train = {rec["step"]: rec for rec in records(tmp_path / "run", "train")}
    assert train[12]["comm_bytes_per_step"] == expected_bytes(model, hook)
    if hook == "powersgd":  # the plain all-reduce steps before compression starts send everything
        assert train[4]["comm_bytes_per_step"] == expected_bytes(model, "none")
        assert expected_bytes(model, "powersgd") < expected_bytes(model, "none") / 3
    loss = train[12]["loss"]
    assert loss == loss and loss < 9.3  # finite and trained (ln 10000 = 9.21 is the uniform guess)


@pytest.mark.parametrize("bucket_mb", [25.0, 0.002])
def test_powersgd_state_survives_a_killed_worker_bitwise(tmp_path, tiny_data, bucket_mb):
    """Error feedback and warm-start memory are per rank and in every checkpoint: a run killed at step
    50 of 120 and restarted ends bitwise equal to an uninterrupted one (without the state it would not:
    the first step after resume would start PowerSGD afresh). The restarted process' buckets are laid
    out anew by DDP after its first backward (one bucket, or several of 2 KB), and the memory follows."""
    (tmp_path / "tiny.toml").write_text(TINY)
    common = ("--set", "train.max_steps=120", "--set", "model.dropout=0.2", "--set", "dist.comm_hook=powersgd",
              "--set", f"dist.bucket_mb={bucket_mb}",
              "--set", f"dist.start_powerSGD_iter={START}", "--set", f"dist.matrix_approximation_rank={RANK}")
    a = paratrain("train", "tiny.toml", "--data-dir", tiny_data, "--run-dir", "plain", *common, cwd=tmp_path,
                  timeout=300)
    assert a.returncode == 0, a.stderr[-2000:]
    b = paratrain("train", "tiny.toml", "--data-dir", tiny_data, "--run-dir", "killed", *common,
                  "--fault", "kill:rank=1:step=50", "--max-restarts", "1", cwd=tmp_path, timeout=300)
    assert b.returncode == 0, b.stderr[-3000:]
    assert "resuming from step 48" in b.stdout + b.stderr
    plain, killed = final_model(tmp_path / "plain"), final_model(tmp_path / "killed")
    assert all(torch.equal(plain[k], killed[k]) for k in plain), "restarted run differs from the uninterrupted one"
    saved = torch.load(sorted((tmp_path / "killed").glob("checkpoint-*.pt"))[-1], weights_only=True)["comm"]
    ranks = saved["powersgd"]
    assert len(ranks) == 2 and ranks[0]["iter"] == ranks[1]["iter"] == 120
    assert not all(torch.equal(ranks[0]["error"][b], ranks[1]["error"][b]) for b in ranks[0]["error"])


def test_zero1_takes_a_hook_and_fsdp_refuses_one(tmp_path, tiny_data):
    (tmp_path / "tiny.toml").write_text(TINY)
    z = paratrain("train", "tiny.toml", "--data-dir", tiny_data, "--run-dir", "z", "--strategy", "zero1",
                  "--set", "train.max_steps=4", "--set", "dist.comm_hook=fp16", cwd=tmp_path, timeout=300)
    assert z.returncode == 0, z.stderr[-2000:]
    assert records(tmp_path / "z", "train")[-1]["comm_bytes_per_step"] > 0
    for bad, words in ((("--strategy", "fsdp", "--set", "dist.comm_hook=fp16"), "dist.comm_hook"),
                       (("--set", "dist.comm_hook=int8"), "choose one of none, fp16, bf16, powersgd"),
                       (("--set", "dist.comm_hook=powersgd", "--set", "dist.start_powerSGD_iter=1"), "2 or more")):
        r = paratrain("train", "tiny.toml", "--data-dir", tiny_data, "--run-dir", "bad", *bad, cwd=tmp_path)
        assert r.returncode == 2 and words in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
        assert not (tmp_path / "bad").exists()
    v = paratrain("verify", "tiny.toml", "--data-dir", tiny_data, "--set", "dist.comm_hook=powersgd", cwd=tmp_path)
    assert v.returncode == 2 and "lossy" in v.stderr and len(v.stderr.strip().splitlines()) == 1, v.stderr
