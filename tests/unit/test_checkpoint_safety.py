"""Safe checkpoints: checksum sidecars, keep-K, a kill during a save, a crafted pickle."""
from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time

import pytest
import torch

from paratrain.errors import UsageError
from paratrain.train import checkpoint

WRITER = """
import sys, torch
from paratrain.train import checkpoint
run_dir = sys.argv[1]
step = 0
while True:
    step += 1
    checkpoint.save(run_dir, {"model": {"w": torch.full((4_000_000,), float(step))}}, step, keep=2)
    print(step, flush=True)
"""


def test_checksum_sidecar_is_written_and_checked(tmp_path):
    path = checkpoint.save(tmp_path, {"model": {"w": torch.arange(4.0)}}, 3)
    side = checkpoint.checksum_path(path)
    assert side.read_text().split()[0] == checkpoint.sha256_of(path)
    assert checkpoint.load(path)["model"]["w"].tolist() == [0, 1, 2, 3]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    path.write_bytes(bytes(data))
    with pytest.raises(UsageError, match="does not match its checksum"):
        checkpoint.load(path)


def test_keep_last_k_removes_sidecars_too(tmp_path):
    for step in range(1, 6):
        checkpoint.save(tmp_path, {"model": {"w": torch.zeros(1)}}, step, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint-00000004.pt", "checkpoint-00000004.pt.sha256",
        "checkpoint-00000005.pt", "checkpoint-00000005.pt.sha256"]


@pytest.mark.slow
def test_kill_during_save_leaves_a_loadable_checkpoint(tmp_path):
    """SIGKILL a process that saves 16 MB checkpoints back to back, at several moments; the newest
    checkpoint is always complete, matches its checksum and loads."""
    for attempt, delay in enumerate((0.9, 1.3, 1.7)):
        run_dir = tmp_path / f"r{attempt}"
        run_dir.mkdir()
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(run_dir)], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "1"  # at least one complete save
            time.sleep(delay)
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        newest = checkpoint.latest(run_dir)
        state = checkpoint.load(newest)
        assert state["model"]["w"][0].item() == state["step"] == int(newest.stem.split("-")[1])


class _Boom:
    def __reduce__(self):
        return (os.system, ("echo crafted > /dev/null",))


def test_crafted_pickle_is_refused(tmp_path):
    path = tmp_path / "checkpoint-00000001.pt"
    torch.save({"model": {}, "x": _Boom()}, path, pickle_protocol=pickle.DEFAULT_PROTOCOL)
    with pytest.raises(UsageError, match="cannot be loaded"):
        checkpoint.load(path)
