"""Run directories and resume as a user meets them: one run at a time holds a run dir, a finished
run is not trained again, a resume that would move the data position is refused, faults are not
written into a run dir, and a refused start writes nothing."""
from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from paratrain.train import checkpoint

from .test_cli import TINY, final_model, paratrain
from .test_processes import START_UP, wait_for_checkpoints

pytestmark = pytest.mark.slow


def snapshot(run_dir: Path) -> dict[str, str]:
    """Every file of a run dir with its content digest."""
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, tiny_data) -> Path:
    """TINY (allreduce, 2 workers) trained to its max_steps = 4 (a checkpoint at step 4): a finished
    run, and one to resume. Tests work on a copy (:func:`copy_of`)."""
    tmp = tmp_path_factory.mktemp("stopped")
    (tmp / "tiny.toml").write_text(TINY)
    r = paratrain("train", "tiny.toml", "--data-dir", tiny_data, "--run-dir", "run", "--set", "train.max_steps=4",
                  cwd=tmp)
    assert r.returncode == 0, r.stderr[-2000:]
    return tmp / "run"


def copy_of(stopped: Path, tmp_path: Path, name: str) -> Path:
    """``stopped`` copied to ``tmp_path / name``, with TINY's recipe beside it."""
    (tmp_path / "tiny.toml").write_text(TINY)
    return Path(shutil.copytree(stopped, tmp_path / name))


def test_a_second_run_on_a_held_run_dir_is_refused(tmp_path, tiny_data, stopped):
    run_dir = copy_of(stopped, tmp_path, "held")
    first = subprocess.Popen([sys.executable, "-m", "paratrain.cli", "train", "--resume", str(run_dir), "--data-dir",
                              str(tiny_data), "--set", "train.max_steps=0", "--set", "train.epochs=100000"],
                             cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_for_checkpoints(run_dir, 2, first)  # the first resume is training
        config_before = (run_dir / "config.toml").read_bytes()
        second = paratrain("train", "--resume", run_dir, "--data-dir", tiny_data, "--set", "train.lr=7.0",
                           cwd=tmp_path)
        assert second.returncode == 2, second.stderr[-2000:]
        assert second.stderr.strip().splitlines() == [
            f"paratrain: error: run dir {str(run_dir)!r} is in use by another paratrain run (pid {first.pid}); "
            f"wait for it to end, or use another --run-dir"]
        assert (run_dir / "config.toml").read_bytes() == config_before  # the first run's settings stand
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()


def test_resuming_a_finished_run_writes_nothing(tmp_path, tiny_data, stopped):
    copy_of(stopped, tmp_path, "done")
    before = snapshot(tmp_path / "done")
    again = paratrain("train", "--resume", "done", "--data-dir", tiny_data, "--set", "train.max_steps=4", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stdout.startswith("paratrain: run dir done is complete (step 4): valid_loss ")
    assert "test_ppl" in again.stdout
    assert snapshot(tmp_path / "done") == before


@pytest.mark.parametrize("change", ["train.batch_size=8", "data.bptt=7"])
def test_resume_that_would_move_the_data_position_is_refused(tmp_path, tiny_data, stopped, change):
    copy_of(stopped, tmp_path, "part")
    before = snapshot(tmp_path / "part")
    r = paratrain("train", "--resume", "part", "--data-dir", tiny_data, "--set", change, "--set",
                  "train.max_steps=8", cwd=tmp_path)
    assert r.returncode == 2
    key = change.split("=")[0]
    assert r.stderr.strip().splitlines() == [
        f"paratrain: error: --resume cannot change {key}: the checkpoint's data position is a batch index in the "
        f"old layout (data would be skipped or repeated); drop the override, or start a new run with --run-dir"]
    assert snapshot(tmp_path / "part") == before


def test_faults_are_never_written_and_do_not_fire_again_on_resume(tmp_path, tiny_data):
    (tmp_path / "tiny.toml").write_text(TINY)
    killed = paratrain("train", "tiny.toml", "--data-dir", tiny_data, "--run-dir", "f", "--set", "train.max_steps=12",
                       "--fault", "kill:rank=1:step=9", cwd=tmp_path)
    assert killed.returncode != 0 and "fault injection: SIGKILL after 9 steps" in killed.stdout + killed.stderr
    assert "fault" not in (tmp_path / "f" / "config.toml").read_text().replace("fault = \"\"", "")
    resumed = paratrain("train", "--resume", "f", "--data-dir", tiny_data, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "fault injection" not in resumed.stdout + resumed.stderr
    assert checkpoint.load(checkpoint.latest(tmp_path / "f"))["step"] == 12


def test_a_refused_start_writes_nothing(tmp_path, tiny_data):
    (tmp_path / "tiny.toml").write_text(TINY)
    env_cpu_only = {"CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run([sys.executable, "-m", "paratrain.cli", "train", "tiny.toml", "--strategy", "replicate",
                          "--devices", "cuda:0,cuda:1", "--strict-placement", "--run-dir", "r", "--data-dir",
                          str(tiny_data)], cwd=tmp_path, env={**os.environ, **env_cpu_only}, capture_output=True,
                         text=True, timeout=START_UP)
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.strip().splitlines() == [
        "paratrain: error: device 'cuda:0' does not exist (strict placement); devices here: cpu"]
    assert not (tmp_path / "r").exists()
    again = paratrain("train", "tiny.toml", "--strategy", "replicate", "--devices", "cpu:0,cpu:1", "--run-dir", "r",
                      "--data-dir", tiny_data, "--set", "train.max_steps=2", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]  # the same --run-dir is free to use


@contextmanager
def small_filesystem(where: Path, size: str, read_only: bool = False):
    """A tmpfs of ``size`` mounted at ``where`` (root), removed after."""
    where.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)]).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        if read_only:
            subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True)
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)])


def test_a_full_disk_stops_with_one_line_and_the_last_checkpoint_loads(tmp_path, tiny_data):
    (tmp_path / "tiny.toml").write_text(TINY)
    with small_filesystem(tmp_path / "small", "200k") as small:
        r = paratrain("train", "tiny.toml", "--data-dir", tiny_data, "--run-dir", small / "run", "--set",
                      "train.epochs=100000", "--set", "train.checkpoint_every=20", "--set",
                      "train.keep_checkpoints=100", cwd=tmp_path, timeout=300)
        assert r.returncode == 1
        said = [ln for ln in r.stderr.replace("\r", "\n").splitlines() if "paratrain: stopped:" in ln]
        assert len(said) == 1 and "No space left on device" in said[0] and str(small / "run") in said[0], r.stderr
        assert "Traceback" not in r.stderr
        last = checkpoint.latest(small / "run")
        assert checkpoint.load(last)["step"] > 0


def test_a_read_only_run_dir_is_one_line(tmp_path, tiny_data):
    (tmp_path / "tiny.toml").write_text(TINY)
    with small_filesystem(tmp_path / "ro", "1m", read_only=True) as ro:
        r = paratrain("train", "tiny.toml", "--data-dir", tiny_data, "--run-dir", ro / "run", cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"paratrain: error: cannot write to run dir {str(ro / 'run')!r} (Read-only file system); free space or "
        f"make it writable, or choose another --run-dir"]


LAYOUTS = {"allreduce-2": ("--strategy", "allreduce", "--nproc", "2"), "single": ("--strategy", "single"),
           "ps-sync-2": ("--strategy", "ps-sync", "--nproc", "2", "--num-ps", "1")}


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory, tiny_data):
    """Runs of TINY made once per module, on first use: ``("full", "single")`` 12 uninterrupted steps
    on one device, ``("part", LAYOUT)`` the first 6 steps in LAYOUT (tests resume copies)."""
    tmp = tmp_path_factory.mktemp("layouts")
    (tmp / "tiny.toml").write_text(TINY)
    made: dict[tuple[str, str], Path] = {}

    def get(kind: str, layout: str) -> Path:
        if (kind, layout) not in made:
            steps = 12 if kind == "full" else 6
            name = f"{kind}-{layout}"
            r = paratrain("train", "tiny.toml", *LAYOUTS[layout], "--run-dir", name, "--data-dir", tiny_data,
                          "--set", f"train.max_steps={steps}", cwd=tmp)
            assert r.returncode == 0, r.stderr[-2000:]
            made[kind, layout] = tmp / name
        return made[kind, layout]
    return get


@pytest.mark.parametrize("before,after", [("single", "allreduce-2"), ("allreduce-2", "single"),
                                          ("allreduce-2", "ps-sync-2"), ("ps-sync-2", "allreduce-2")])
def test_resume_under_another_world_size_or_strategy_keeps_the_data_order(tmp_path, tiny_data, layout_runs, before,
                                                                          after):
    """6 steps in one layout, 6 more resumed in another, equal to 12 uninterrupted steps on one device
    at the same global batch (float64): nothing skipped or repeated, the BPTT state of every stream
    carried."""
    (tmp_path / "tiny.toml").write_text(TINY)
    shutil.copytree(layout_runs("part", before), tmp_path / "part")
    resumed = paratrain("train", "--resume", "part", *LAYOUTS[after], "--data-dir", tiny_data, "--set",
                        "train.max_steps=12", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = final_model(layout_runs("full", "single")), final_model(tmp_path / "part")
    worst = max(((a[k] - b[k]).abs().max() / a[k].abs().max().clamp_min(1e-12)).item() for k in a)
    assert worst < 1e-10, worst


def test_resume_on_another_vocabulary_names_the_tensors_that_differ(tmp_path, stopped):
    from ..conftest import write_tiny_corpus

    copy_of(stopped, tmp_path, "v")
    other = write_tiny_corpus(tmp_path / "other", vocab=50)
    r = paratrain("train", "--resume", "v", "--data-dir", other, "--set", "train.max_steps=8", cwd=tmp_path)
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    assert "embedding.weight (41, 8) in the checkpoint vs (51, 8) here" in line, line
    assert "decoder.weight (41, 12) in the checkpoint vs (51, 12) here" in line, line
