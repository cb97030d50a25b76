"""The minimal-change API as a user runs it: the example ports under ``paratrain launch --strategy S``
compute what the same script computes in one plain ``python`` process.

* ``examples/lm_paratrain.py`` (stateful BPTT: the hidden state is carried from batch to batch on
  every rank, clipping on) in float64: ``allreduce``, ``fsdp`` and ``zero1`` with 2 processes,
  ``ps-sync`` with 2 workers and a server, ``replicate`` with 2 towers == one process, to 1e-10;
* ``examples/image_classifier.py`` (a DataLoader, BatchNorm with sync_batchnorm, accumulation 2 with
  pt.no_sync) in float64: ``allreduce`` and ``ps-sync`` with 2 == one process, to 1e-10;
* bad launch input: one line, exit 2.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ..conftest import REPO
from ..distributed.harness import max_rel_diff
from ..preload import run_cli

pytestmark = pytest.mark.slow
LM = ("--emsize", "8", "--nhid", "12", "--nlayers", "2", "--dropout", "0", "--batch-size", "4", "--bptt", "5",
      "--max-batches", "12", "--epochs", "1", "--lr", "1.0", "--clip", "0.25", "--dtype", "float64",
      "--log-interval", "5")
IMAGES = ("--epochs", "1", "--batch-size", "32", "--accumulation", "2", "--dtype", "float64", "--lr", "0.1")


def run(args: list, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    """``python ARGS`` in ``cwd`` (a user's script in a new interpreter), output captured; ``-m
    paratrain.cli ...`` runs as :func:`tests.preload.run_cli` (its workers are new interpreters)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("PARATRAIN_STRATEGY", None)
    args = [str(a) for a in args]
    if args[:2] == ["-m", "paratrain.cli"]:
        return run_cli(args[2:], cwd, env, timeout)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def launch(*args) -> list:
    return ["-m", "paratrain.cli", "launch", *args]


@pytest.fixture(scope="module")
def lm_runs(tiny_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lm-port")
    script, data = REPO / "examples" / "lm_paratrain.py", ("--data", tiny_data / "ptb")
    runs = {"single": run([script, *LM, *data, "--save", "single.pt"], tmp),
            "allreduce": run(launch("--nproc", 2, script, *LM, *data, "--save", "allreduce.pt"), tmp),
            "ps-sync": run(launch("--nproc", 2, "--strategy", "ps-sync", "--num-ps", 1, script, *LM, *data,
                                  "--save", "ps-sync.pt"), tmp),
            **{s: run(launch("--nproc", 2, "--strategy", s, script, *LM, *data, "--save", f"{s}.pt"), tmp)
               for s in ("fsdp", "zero1")},
            "replicate": run(launch("--strategy", "replicate", "--devices", "cpu:0,cpu:1", script, *LM, *data,
                                    "--save", "replicate.pt"), tmp)}
    return tmp, runs


@pytest.mark.parametrize("strategy", ["allreduce", "ps-sync", "replicate", "fsdp", "zero1"])
def test_bptt_port_equals_one_process(lm_runs, strategy):
    tmp, runs = lm_runs
    for name in ("single", strategy):
        assert runs[name].returncode == 0, runs[name].stderr[-3000:]
    out = runs[strategy].stdout
    assert out.count("| end of training |") == 1, out  # rank 0 alone prints (from paratrain import print)
    diff = max_rel_diff(torch.load(tmp / f"{strategy}.pt", weights_only=True),
                        torch.load(tmp / "single.pt", weights_only=True))
    print(f"DIFF lm port {strategy}: {diff:.3e}")
    assert diff <= 1e-10, f"{strategy}: max relative difference {diff:.2e}"


def test_the_port_trained_and_the_script_diff_is_small(lm_runs):
    tmp, runs = lm_runs
    lines = [ln for ln in runs["single"].stdout.splitlines() if "batches |" in ln]
    losses = [float(ln.split("loss")[1].split()[0]) for ln in lines]
    assert len(losses) >= 2 and losses[-1] < losses[0]  # not a comparison of two untrained models
    import difflib

    before = (REPO / "examples" / "lm_single.py").read_text().splitlines()
    after = (REPO / "examples" / "lm_paratrain.py").read_text().splitlines()
    added = [ln for ln in difflib.unified_diff(before, after, lineterm="", n=0)
             if ln.startswith("+") and not ln.startswith("+++")]
    assert len(added) <= 10, added


@pytest.fixture(scope="module")
def image_one(tmp_path_factory) -> Path:
    """examples/image_classifier.py in one plain process: its saved model."""
    pytest.importorskip("sklearn", reason="the example reads scikit-learn's digits")
    tmp = tmp_path_factory.mktemp("image-one")
    one = run([REPO / "examples" / "image_classifier.py", *IMAGES, "--save", "one.pt"], tmp)
    assert one.returncode == 0, one.stderr[-2000:]
    return tmp / "one.pt"


@pytest.mark.parametrize("strategy", ["allreduce", "ps-sync"])
def test_dataloader_port_with_sync_batchnorm_equals_one_process(tmp_path, image_one, strategy):
    script = REPO / "examples" / "image_classifier.py"
    extra = ("--strategy", "ps-sync", "--num-ps", 1) if strategy == "ps-sync" else ()
    two = run(launch("--nproc", 2, *extra, script, *IMAGES, "--save", "two.pt"), tmp_path)
    assert two.returncode == 0, two.stderr[-2000:]
    assert "world_size 2" in two.stdout and two.stdout.count("epoch  1") == 1
    a, b = torch.load(tmp_path / "two.pt", weights_only=True), torch.load(image_one, weights_only=True)
    assert any("running_var" in k for k in b)  # the BatchNorm statistics are compared too
    diff = max_rel_diff(a, b)
    print(f"DIFF image port {strategy}: {diff:.3e}")
    assert diff <= 1e-10, f"{strategy}: max relative difference {diff:.2e}"


@pytest.mark.parametrize("args, match", [
    (("--strategy", "single", "--nproc", "2"), "dist.strategy = 'single' runs one process"),
    (("--strategy", "replicate", "--nproc", "2"), "strategy 'replicate' runs one process over --devices"),
    (("--strategy", "allreduce", "--num-ps", "2"), "dist.num_ps applies to --strategy ps-sync or ps-async only"),
    (("--set", "train.lr=3"), "paratrain launch takes dist.* and train.timeout_s"),
    (("--strategy", "ps-sync", "--nproc", "2", "--backup-workers", "2"), "leaves no gradient to aggregate"),
])
def test_bad_launch_input_is_one_line_exit_2(tmp_path, args, match):
    script = tmp_path / "s.py"
    script.write_text("raise SystemExit('must not run')\n")
    r = run(launch(*args, script), tmp_path)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("paratrain: error: ") and match in lines[0], r.stderr
