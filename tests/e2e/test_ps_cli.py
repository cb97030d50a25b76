"""Parameter-server strategies through the CLI: servers in the same torchrun job, worker failures."""
from __future__ import annotations

import pytest

from .test_cli import TINY, final_model, paratrain, records

DELAYS = "delay:rank=0:ms=60,delay:rank=1:ms=60,delay:rank=2:ms=60"  # steps long enough to overlap


@pytest.fixture()
def tiny(tmp_path, tiny_data):
    (tmp_path / "tiny.toml").write_text(TINY)
    return tmp_path, tiny_data


def test_ps_async_survives_a_dead_worker(tiny):
    tmp, data = tiny
    res = paratrain("train", "tiny.toml", "--strategy", "ps-async", "--nproc", 3, "--num-ps", 1, "--run-dir", "run",
                    "--data-dir", data, "--set", "train.batch_size=6", "--set", "train.max_steps=60",
                    "--set", "train.timeout_s=2", "--set", "train.log_every=5",
                    "--fault", "kill:rank=2:step=5", "--fault", DELAYS, cwd=tmp)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "worker 2 died (signal 9)" in res.stderr
    summary = [r for r in records(tmp / "run") if r["kind"] == "summary"][-1]
    assert summary["updates"] >= 3 * 60  # the two survivors carried the run to its W x max_steps updates
    assert summary["dead_workers"] == 1 and summary["test_ppl"] > 1


def test_ps_sync_dead_worker_ends_the_run_naming_it(tiny):
    tmp, data = tiny
    res = paratrain("train", "tiny.toml", "--strategy", "ps-sync", "--nproc", 2, "--num-ps", 2, "--run-dir", "run",
                    "--data-dir", data, "--set", "train.max_steps=40", "--set", "train.timeout_s=20",
                    "--fault", "kill:rank=1:step=5", cwd=tmp)
    assert res.returncode == 1
    assert "paratrain: rank 1 failed first: killed by signal SIGKILL at step 5 (before the step)" in res.stderr


def test_ps_sync_with_backup_worker_survives_a_dead_worker(tiny):
    tmp, data = tiny
    res = paratrain("train", "tiny.toml", "--strategy", "ps-sync", "--nproc", 3, "--num-ps", 1, "--backup-workers", 1,
                    "--run-dir", "run", "--data-dir", data, "--set", "train.batch_size=6",
                    "--set", "train.max_steps=30", "--set", "train.timeout_s=3",
                    "--fault", "kill:rank=2:step=5", "--fault", DELAYS, cwd=tmp)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "worker 2 died" in res.stderr
    summary = [r for r in records(tmp / "run") if r["kind"] == "summary"][-1]
    assert summary["updates"] == 30  # the servers made every update; rank 0 may have had a gradient dropped
    assert 25 <= summary["steps"] <= 30


def test_ps_sync_drops_the_whole_version_of_a_non_finite_gradient(tiny):
    """A NaN gradient on one worker: the servers apply no part of that step (not (W-1)/W of it), so
    the run equals allreduce with the same fault, where the step is skipped whole; every worker
    counts the step as skipped."""
    tmp, data = tiny
    fault = ("--fault", "nan:rank=1:step=5", "--set", "train.max_steps=10")
    ps = paratrain("train", "tiny.toml", "--strategy", "ps-sync", "--nproc", 2, "--num-ps", 2, "--run-dir", "psnan",
                   "--data-dir", data, *fault, cwd=tmp)
    ar = paratrain("train", "tiny.toml", "--strategy", "allreduce", "--nproc", 2, "--run-dir", "arnan",
                   "--data-dir", data, *fault, cwd=tmp)
    assert ps.returncode == 0 and ar.returncode == 0, ps.stderr[-2000:] + ar.stderr[-2000:]
    recs = records(tmp / "psnan")
    (rec,) = [r for r in recs if r["kind"] == "nonfinite"]
    assert rec["step"] == 5 and rec["ranks"] == [1]
    a, b = final_model(tmp / "psnan"), final_model(tmp / "arnan")
    worst = max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)).item() for k in b)
    assert worst < 1e-10, worst


def test_ps_async_applies_exactly_w_times_max_steps_updates(tiny):
    tmp, data = tiny
    res = paratrain("train", "tiny.toml", "--strategy", "ps-async", "--nproc", 2, "--num-ps", 2, "--run-dir", "run",
                    "--data-dir", data, "--set", "train.max_steps=30", "--fault", DELAYS.rsplit(",", 1)[0], cwd=tmp)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = [r for r in records(tmp / "run") if r["kind"] == "summary"][-1]
    assert summary["updates"] == 2 * 30, summary  # W x max_steps: no in-flight push applied past the end


def test_a_killed_parameter_server_is_one_line_naming_it(tiny):
    import os
    import signal
    import subprocess
    import sys

    import psutil

    from paratrain.train import checkpoint

    from .test_processes import wait_for_checkpoints

    tmp, data = tiny
    run = tmp / "pskill"
    p = subprocess.Popen([sys.executable, "-m", "paratrain.cli", "train", "tiny.toml", "--strategy", "ps-sync",
                          "--nproc", "2", "--num-ps", "1", "--run-dir", str(run), "--data-dir", str(data),
                          "--set", "train.epochs=1000", "--set", "train.checkpoint_every=5"], cwd=tmp,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_for_checkpoints(run, 1, p)
        server = [c for c in psutil.Process(p.pid).children(recursive=True)
                  if "paratrain.worker" in " ".join(c.cmdline()) and c.environ().get("RANK") == "2"]
        assert len(server) == 1
        server[0].kill()
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 1
    said = [ln[ln.index("paratrain:"):] for ln in err.replace("\r", "\n").splitlines() if "paratrain:" in ln]
    assert "Traceback" not in err and "eof" not in err, err[-3000:]
    # whoever notices first says it: the launcher (the server's process died) or rank 0 (its RPC to the
    # server failed) -- on a busy machine either can come first; the server is named either way, once
    gone = [ln for ln in said if "parameter server 0 (rank 2, shard 0" in ln]
    killed = [ln for ln in said if ln == "paratrain: rank 2 failed first: killed by signal SIGKILL"]
    assert len(gone) <= 1 and (killed or gone), err[-3000:]
    assert checkpoint.load(checkpoint.latest(run))["step"] > 0
