"""Any model through ``paratrain train --task``: a user's task file gets every feature (strategies,
checkpoints and resume across world sizes, restart after a killed worker, the NaN guard, verify,
bench); the built-in ``digits-cnn`` and ``gpt`` recipes train; ``verify`` passes for digits with
sync BatchNorm and names BatchNorm without it; a missing scikit-learn is one line naming the extra."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from ..conftest import REPO
from ..distributed.harness import max_rel_diff
from .test_cli import final_model, paratrain, records

pytestmark = pytest.mark.slow
USER = Path(__file__).with_name("user_task.py")
RECIPE = """
name = "user"
[task]
entry = "user_task.py:make"
hidden = 12
[train]
batch_size = 40
max_steps = 12
epochs = 100
optimizer = "sgd"
lr = 0.2
momentum = 0.5
clip = 1.0
convention = "mean_over_tokens"
schedule = "constant"
dtype = "float64"
log_every = 4
checkpoint_every = 3
[dist]
strategy = "single"
nproc = 1
"""


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("user-task")
    shutil.copy(USER, tmp / "user_task.py")
    (tmp / "user.toml").write_text(RECIPE)
    runs = {"single": paratrain("train", "user.toml", "--run-dir", "single", cwd=tmp),
            "allreduce": paratrain("train", "user.toml", "--nproc", 2, "--run-dir", "allreduce", cwd=tmp),
            "ps-sync": paratrain("train", "user.toml", "--strategy", "ps-sync", "--nproc", 2, "--num-ps", 1,
                                 "--run-dir", "ps-sync", cwd=tmp),
            "replicate": paratrain("train", "user.toml", "--strategy", "replicate", "--devices", "cpu:0,cpu:1",
                                   "--run-dir", "replicate", cwd=tmp),
            **{s: paratrain("train", "user.toml", "--strategy", s, "--nproc", 2, "--run-dir", s, cwd=tmp)
               for s in ("fsdp", "zero1", "pipeline")},
            "part": paratrain("train", "user.toml", "--nproc", 2, "--run-dir", "part", "--set", "train.max_steps=7",
                              cwd=tmp)}
    runs["resumed"] = paratrain("train", "--resume", "part", "--strategy", "single", "--set", "train.max_steps=12",
                                cwd=tmp)
    return tmp, runs


@pytest.mark.parametrize("strategy", ["single", "allreduce", "ps-sync", "fsdp", "zero1", "pipeline"])
def test_user_task_summary_counts_its_model_flops_for_mfu(user, strategy):
    """The MLP 8 -> 12 -> 1 on a global batch of 40: forward 2 x 40 x (8 x 12 + 12 x 1) FLOPs; backward
    the weights' gradients (as many) and the hidden layer's input gradient (2 x 40 x 12): 38 x 40 x 12
    per step, whatever the strategy splits (summed over the ranks)."""
    tmp, runs = user
    assert runs[strategy].returncode == 0, runs[strategy].stderr[-3000:]
    summary = records(tmp / strategy)[-1]
    assert summary["model_flops_per_step"] == 38 * 40 * 12 and summary["flops_per_sample"] == 38 * 12
    assert 0 < summary["mfu"] < 1 and summary["peak_flops_source"].startswith("measured: float64")


@pytest.mark.parametrize("strategy", ["allreduce", "ps-sync", "replicate", "fsdp", "zero1", "pipeline"])
def test_user_task_every_strategy_equals_single(user, strategy):
    tmp, runs = user
    for name in ("single", strategy):
        assert runs[name].returncode == 0, runs[name].stderr[-3000:]
    summary = records(tmp / strategy)[-1]
    assert summary["kind"] == "summary" and summary["task"].endswith("user_task.py:make")
    assert summary["unit"] == "samples" and summary["samples_per_s"] > 0 and summary["steps"] == 12
    assert summary["valid_rmse"] > 0 and summary["test_rmse"] > 0
    assert "valid rmse" in runs[strategy].stdout
    assert max_rel_diff(final_model(tmp / strategy), final_model(tmp / "single")) <= 1e-10


def test_user_task_checkpoint_resumes_under_another_world_size(user):
    tmp, runs = user
    assert runs["resumed"].returncode == 0, runs["resumed"].stderr[-3000:]
    assert "resumed from checkpoint-00000007.pt" in runs["resumed"].stdout
    assert max_rel_diff(final_model(tmp / "part"), final_model(tmp / "single")) <= 1e-10
    config = (tmp / "single" / "config.toml").read_text()
    assert str((tmp / "user_task.py").resolve()) in config  # the run dir works from any directory


def test_user_task_restart_after_a_killed_worker_is_bitwise_and_nan_is_skipped(user):
    tmp, _ = user
    common = ("--nproc", 2, "--set", 'train.dtype="float32"', "--set", "train.max_steps=20")
    plain = paratrain("train", "user.toml", *common, "--run-dir", "plain32", cwd=tmp)
    killed = paratrain("train", "user.toml", *common, "--run-dir", "killed32", "--max-restarts", 1,
                       "--fault", "kill:rank=1:step=8", cwd=tmp)
    assert plain.returncode == 0 and killed.returncode == 0, killed.stderr[-3000:]
    assert [r["step"] for r in records(tmp / "killed32") if r["kind"] == "resume"] == [6]
    a, b = final_model(tmp / "plain32"), final_model(tmp / "killed32")
    assert all(torch.equal(a[k], b[k]) for k in a)
    nan = paratrain("train", "user.toml", *common, "--run-dir", "nan", "--fault", "nan:rank=1:step=4", cwd=tmp)
    assert nan.returncode == 0, nan.stderr[-2000:]
    (rec,) = [r for r in records(tmp / "nan") if r["kind"] == "nonfinite"]
    assert rec["step"] == 4 and rec["ranks"] == [1]


def test_verify_bench_and_predict_take_a_user_task(user):
    tmp, _ = user
    v = paratrain("verify", "user.toml", "--strategy", "ps-sync", "--nproc", 2, "--steps", 3, cwd=tmp, timeout=300)
    assert v.returncode == 0 and "[verify] OK: ps-sync x 2 equals single" in v.stdout, v.stdout + v.stderr[-2000:]
    b = paratrain("bench", "user.toml", "--strategies", "single,allreduce", "--nproc", "1,2", "--scaling", "weak",
                  "--steps", 12, "--warmup", 3, "--out", "bench", "--set", 'train.dtype="float32"', cwd=tmp,
                  timeout=600)
    assert b.returncode == 0, b.stdout[-2000:] + b.stderr[-2000:]
    results = json.loads((tmp / "bench" / "results.json").read_text())
    assert results["unit"] == "samples" and "samples/s" in (tmp / "bench" / "report.md").read_text()
    assert all(r["ok"] and r["units_per_s"] > 0 for r in results["runs"])
    p = paratrain("predict", "user.toml", "--nproc", 4, "--interconnect", "eth25", "--from-bench", "bench", cwd=tmp)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rows = [ln.split() for ln in p.stdout.splitlines() if ln.strip() and ln.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == [1, 2, 4] and "40 samples/step" in p.stdout and "samples/s" in p.stdout


def test_digits_recipe_trains_with_two_workers(tmp_path):
    pytest.importorskip("sklearn")
    r = paratrain("train", REPO / "configs" / "digits_cnn.toml", "--nproc", 2, "--run-dir", "d",
                  "--set", "train.epochs=2", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = records(tmp_path / "d")[-1]
    assert summary["task"] == "digits-cnn" and summary["world_size"] == 2
    assert summary["test_accuracy"] > 0.8 and 0 < summary["valid_accuracy"] <= 1
    assert "test accuracy" in r.stdout


def test_gpt_recipe_trains_on_wikitext2(real_data, tmp_path):
    r = paratrain("train", REPO / "configs" / "gpt_wt2.toml", "--nproc", 2, "--run-dir", "g", "--data-dir",
                  real_data, "--set", "train.max_steps=6", "--set", "data.eval_fraction=0.02", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = records(tmp_path / "g")[-1]
    assert summary["task"] == "gpt" and summary["steps"] == 6 and summary["words_per_s"] > 0
    assert 1 < summary["valid_ppl"] < 40_000  # 33,278 words: an untrained model is near the vocabulary size


def test_verify_digits_passes_with_sync_batchnorm_and_names_batchnorm_without(tmp_path):
    pytest.importorskip("sklearn")
    cfg = REPO / "configs" / "digits_cnn.toml"
    ok = paratrain("verify", cfg, "--nproc", 2, "--steps", 2, "--set", "model.dropout=0.0", cwd=tmp_path, timeout=300)
    assert ok.returncode == 0 and "[verify] OK: allreduce x 2 equals single" in ok.stdout, ok.stdout + ok.stderr
    bad = paratrain("verify", cfg, "--nproc", 2, "--steps", 2, "--set", "model.sync_batchnorm=false", cwd=tmp_path,
                    timeout=300)
    assert bad.returncode == 1 and "the model has BatchNorm" in bad.stderr and "model.sync_batchnorm" in bad.stderr


def test_digits_without_scikit_learn_is_one_line_naming_the_extra(tmp_path):
    fake = tmp_path / "fake"
    (fake / "sklearn").mkdir(parents=True)
    (fake / "sklearn" / "__init__.py").write_text("raise ImportError('No module named sklearn')\n")
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": f"{fake}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run([sys.executable, "-m", "paratrain.cli", "train", str(REPO / "configs" / "digits_cnn.toml"),
                        "--run-dir", "x"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert 'pip install "paratrain[digits]"' in r.stderr and not (tmp_path / "x").exists()


def test_a_run_too_short_to_time_reports_no_breakdown_rather_than_zeros(user):
    """3 steps inside the 5 warm-up steps: no interval is timed, and the summary says so with NaN (it
    said step_ms 0.00 and compute_ms 0.00, as if the steps had cost nothing)."""
    tmp, _ = user
    got = paratrain("train", "user.toml", "--run-dir", "short", "--set", "train.max_steps=3", "--set",
                    "train.timing_warmup_steps=5", cwd=tmp)
    assert got.returncode == 0, got.stderr[-2000:]
    summary = records(tmp / "short")[-1]
    assert summary["kind"] == "summary" and summary["steps"] == 3 and summary["timed_steps"] == 0
    for key in ("step_ms", "compute_ms", "data_ms", "comm_ms", "optimizer_ms", "other_ms", "train_step_ms"):
        assert math.isnan(summary[key]), (key, summary[key])
