"""Process hygiene as a user meets it: workers die with their launcher (even `kill -9`), Ctrl-C and
SIGTERM end a multi-process run with one line and the conventional exit code, leaving the last
checkpoint loadable, and `paratrain launch` keeps a worker's own exit code and names the rank that
failed first."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paratrain.train import checkpoint

from .test_cli import TINY, paratrain
from .test_reliability import survivors

pytestmark = pytest.mark.slow
START_UP = 120  # launcher, two workers, torch import and the first steps on a busy 2-core machine


def start_long_run(tmp_path: Path, tiny_data: Path, run: str) -> subprocess.Popen:
    (tmp_path / "tiny.toml").write_text(TINY)
    cmd = [sys.executable, "-m", "paratrain.cli", "train", "tiny.toml", "--data-dir", str(tiny_data),
           "--run-dir", str(tmp_path / run), "--set", "train.epochs=1000", "--set", "train.checkpoint_every=3"]
    return subprocess.Popen(cmd, cwd=tmp_path, env={**os.environ, "PYTHONUNBUFFERED": "1"}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def wait_for_checkpoints(run_dir: Path, n: int, proc: subprocess.Popen) -> None:
    """Start-up deadline: until training has written ``n`` checkpoints."""
    end = time.monotonic() + START_UP
    while len(checkpoint.list_checkpoints(run_dir)) < n:
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.monotonic() < end, "training did not start within the start-up deadline"
        time.sleep(0.2)


def process_states(run_dir: Path, launcher: int) -> str:
    """The launcher's and the run's live processes: pid, state, kernel wait channel and threads, for a
    test whose run did not end in time (seen once in a full suite: the launcher still up 30 s after
    Ctrl-C), so that a next time says where each process waited."""
    import psutil

    lines = []
    for proc in psutil.process_iter(["pid", "cmdline", "status", "num_threads"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if proc.info["pid"] == launcher or str(run_dir) in cmd:
            try:
                wchan = Path(f"/proc/{proc.info['pid']}/wchan").read_text()
            except OSError:
                wchan = "?"
            lines.append(f"pid {proc.info['pid']} {proc.info['status']} wchan {wchan} threads "
                         f"{proc.info['num_threads']}: {cmd[:160]}")
    return "\n".join(lines) or "none"


def workers_of(run_dir: Path) -> list[str]:
    return [c for c in survivors(str(run_dir)) if "paratrain.worker" in c and "paratrain.cli" not in c]


def test_kill_9_of_the_launcher_ends_every_worker(tmp_path, tiny_data):
    run_dir = tmp_path / "orphans"
    p = start_long_run(tmp_path, tiny_data, "orphans")
    try:
        wait_for_checkpoints(run_dir, 1, p)
        assert len(workers_of(run_dir)) == 2
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        end = time.monotonic() + 10  # the behaviour under test: the workers follow their launcher
        while workers_of(run_dir) and time.monotonic() < end:
            time.sleep(0.1)
        assert workers_of(run_dir) == [], "workers outlived their launcher"
        written = checkpoint.list_checkpoints(run_dir)
        time.sleep(2)
        assert checkpoint.list_checkpoints(run_dir) == written  # nobody writes into the run dir any more
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        if survivors(str(run_dir)):
            subprocess.run(["pkill", "-9", "-f", str(run_dir)])


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupt_ends_every_process_with_one_line(tmp_path, tiny_data, sig, code):
    run_dir = tmp_path / "stopped"
    p = start_long_run(tmp_path, tiny_data, "stopped")
    try:
        wait_for_checkpoints(run_dir, 2, p)
        if sig == signal.SIGINT:
            os.killpg(p.pid, sig)  # Ctrl-C in a terminal reaches the whole foreground process group
        else:
            os.kill(p.pid, sig)  # a scheduler or `kill` signals the launcher
        try:
            out, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"the run did not end within 30 s of {sig.name}; its processes:\n"
                        f"{process_states(run_dir, p.pid)}\nits stderr's tail: {(e.stderr or b'')[-600:]!r}")
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == code, err[-2000:]
    # the progress bar is the only other output; the worker's bar may end without a newline (tqdm gives
    # its rate as "s/step" below one step a second, as on a busy machine's first steps)
    said = [ln[ln.index("paratrain:"):] for ln in err.replace("\r", "\n").splitlines() if "paratrain:" in ln]
    others = [ln for ln in err.replace("\r", "\n").splitlines() if ln.strip() and "step/s" not in ln
              and "s/step" not in ln and "paratrain:" not in ln]
    assert len(said) == 1 and not others and "Traceback" not in err, err[-3000:]
    lines = said
    assert lines[-1].startswith(f"paratrain: {sig.name} received: stopped every worker"), err[-3000:]
    assert "--resume" in lines[-1] and str(run_dir) in lines[-1]
    assert workers_of(run_dir) == []
    last = checkpoint.latest(run_dir)
    assert checkpoint.load(last)["step"] > 0  # the newest checkpoint is complete and loadable


def test_launch_keeps_the_exit_code_and_names_the_first_failure(tmp_path):
    script = tmp_path / "boom.py"
    script.write_text("import os, sys, time\n"
                      "import torch.distributed as dist\n"
                      "dist.init_process_group('gloo')\n"
                      "if dist.get_rank() == 1:\n"
                      "    sys.exit(3)\n"
                      "time.sleep(600)  # rank 0 waits: it is stopped because rank 1 failed\n")
    t0 = time.monotonic()
    res = paratrain("launch", "--nproc", 2, script, cwd=tmp_path)
    assert time.monotonic() - t0 < 120
    assert res.returncode == 3, res.stderr[-2000:]
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("paratrain:")]
    assert lines == ["paratrain: rank 1 failed first: exit code 3 (its output is above)",
                     "paratrain: stopped the other ranks because of it (0)"], res.stderr[-2000:]
    assert "Traceback" not in res.stderr


def test_a_failed_job_leaves_no_agent_folder_in_the_temporary_folder(tmp_path):
    """torchrun's agent writes each worker's error file under a log folder; without ``--log-dir`` it
    makes a ``torchelastic_*`` folder in the temporary folder per job and never removes it."""
    script = tmp_path / "boom.py"
    script.write_text("import sys\n"
                      "import torch.distributed as dist\n"
                      "from torch.distributed.elastic.multiprocessing.errors import record\n"
                      "@record\n"
                      "def main():\n"
                      "    dist.init_process_group('gloo')\n"
                      "    raise ValueError(f'rank {dist.get_rank()} gave up')\n"
                      "main()\n")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1"}
    res = subprocess.run([sys.executable, "-m", "paratrain.cli", "launch", "--nproc", "2", str(script)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert res.returncode == 1, res.stderr[-2000:]
    first = [ln for ln in res.stderr.splitlines() if ln.startswith("paratrain: rank")]
    assert len(first) == 1 and "ValueError: rank" in first[0] and "gave up" in first[0], res.stderr[-2000:]
    assert list(tmp.iterdir()) == []


def test_only_the_command_freezes_the_heap_for_its_exit(tmp_path):
    """``paratrain`` (``cli.entry``) leaves what is alive at its end out of the interpreter's last
    garbage collection (``gc.freeze``: a second of CPU at each exit); ``cli.main``, which a program may
    call, leaves the caller's heap and SIGTERM handler as they were."""
    import gc

    from paratrain import cli

    frozen, handler = gc.get_freeze_count(), signal.getsignal(signal.SIGTERM)
    assert cli.main(["devices"]) == 0
    assert gc.get_freeze_count() == frozen and signal.getsignal(signal.SIGTERM) is handler
    code = ("import gc, sys; from paratrain import cli; sys.argv = ['paratrain', 'devices']; "
            "assert cli.entry() == 0; print(gc.get_freeze_count())")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout.splitlines()[-1]) > 10_000  # torch's modules and everything built from them
