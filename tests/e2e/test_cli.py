"""The command line as a user runs it: train with 2 workers, resume as single, launch a user script."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from paratrain.devices import without_cpu_allocator

from ..conftest import REPO
from ..preload import run_cli

TINY = """
name = "tiny"
[data]
corpus = "ptb"
bptt = 5
eval_batch_size = 4
[model]
embed_dim = 8
hidden_dim = 12
num_layers = 2
[train]
batch_size = 4
lr = 0.5
clip = 0.5
convention = "mean_over_tokens"
dtype = "float64"
log_every = 2
checkpoint_every = 4
schedule = "constant"
[dist]
strategy = "allreduce"
nproc = 2
"""


def paratrain(*args, cwd: Path, timeout: float = 180, fresh: bool = False) -> subprocess.CompletedProcess:
    """``python -m paratrain.cli ARGS`` in ``cwd``, its output captured: a process forked from the
    tests' preloaded server (:func:`tests.preload.run_cli`), or with ``fresh`` a new interpreter."""
    env = {**without_cpu_allocator(os.environ), "PYTHONUNBUFFERED": "1"}  # glibc's malloc as paratrain sets it
    if not fresh:
        return run_cli([str(a) for a in args], cwd, env, timeout)
    return subprocess.run([sys.executable, "-m", "paratrain.cli", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def final_model(run_dir: Path) -> dict:
    """The newest checkpoint's model (a ``.pt`` file, or a sharded strategy's DCP folder read whole)."""
    from paratrain.strategies.sharded import read_whole
    from paratrain.train.checkpoint import latest

    last = latest(run_dir)
    return read_whole(last)["model"] if last.is_dir() else torch.load(last, weights_only=True)["model"]


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    (tmp / "tiny.toml").write_text(TINY)
    full = paratrain("train", "tiny.toml", "--nproc", 2, "--run-dir", "full", "--data-dir", tiny_data,
                     "--set", "train.max_steps=10", cwd=tmp, fresh=True)  # a new interpreter, as a user's
    part = paratrain("train", "tiny.toml", "--nproc", 2, "--run-dir", "part", "--data-dir", tiny_data,
                     "--set", "train.max_steps=6", cwd=tmp)
    resumed = paratrain("train", "--resume", "part", "--strategy", "single", "--data-dir", tiny_data,
                        "--set", "train.max_steps=10", cwd=tmp)
    return tmp, full, part, resumed


def test_train_two_workers(runs):
    tmp, full, _, _ = runs
    assert full.returncode == 0, full.stderr[-3000:]
    out = full.stdout
    assert "valid perplexity" in out and "test perplexity" in out
    assert "world_size" in out and "words_per_s" in out and "global_batch" in out  # the summary table
    recs = records(tmp / "full")
    kinds = {r["kind"] for r in recs}
    assert {"train", "valid", "test", "summary"} <= kinds
    assert all(r["words_per_s"] > 0 for r in recs if r["kind"] == "train")
    summary = [r for r in recs if r["kind"] == "summary"][-1]
    assert summary["world_size"] == 2 and summary["steps"] == 10 and summary["test_ppl"] > 1
    assert summary["cpu_allocator"] == "retain"  # the default, in the workers too (by their environment)
    # rank 0's host memory at the end (the plan's host bound): its own pages, and the libraries' it shares
    assert summary["host_private_mb"] > 50 and summary["host_shared_mb"] > 10
    assert list((tmp / "full" / "tb").glob("events.out.tfevents.*")), "TensorBoard scalars written"
    assert (tmp / "full" / "config.toml").is_file()


def test_resume_under_other_world_size_matches_uninterrupted(runs):
    tmp, full, part, resumed = runs
    assert part.returncode == 0, part.stderr[-3000:]
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from checkpoint-00000006.pt" in resumed.stdout
    a, b = final_model(tmp / "full"), final_model(tmp / "part")
    for k in a:
        rel = float((a[k] - b[k]).abs().max() / a[k].abs().max())
        assert rel < 1e-10, (k, rel)
    assert any(r["kind"] == "resume" for r in records(tmp / "part"))


def test_new_run_never_overwrites(runs, tiny_data):
    tmp = runs[0]
    before = {p: p.stat().st_mtime_ns for p in (tmp / "full").rglob("*")}
    res = paratrain("train", "tiny.toml", "--run-dir", "full", "--data-dir", tiny_data, cwd=tmp)
    assert res.returncode == 2 and "--resume" in res.stderr and "Traceback" not in res.stderr
    assert before == {p: p.stat().st_mtime_ns for p in (tmp / "full").rglob("*")}


def test_launch_user_script(tmp_path):
    res = paratrain("launch", "--nproc", 2, REPO / "examples" / "custom_model.py", "--epochs", 2, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("[rank 0] epoch")]
    assert len(lines) == 2 and "world_size 2" in lines[-1]
    assert float(lines[-1].split("mean loss ")[1].split()[0]) < 0.5


def test_train_help_documents_keys(tmp_path):
    res = paratrain("train", "--help", cwd=tmp_path)
    assert res.returncode == 0
    for key in ("train.max_steps", "train.batch_size", "train.timeout_s", "--resume", "--set", "--nproc"):
        assert key in res.stdout


def test_quick_recipe_on_real_ptb(real_data, tmp_path):
    """The quick-start recipe on the real corpus, cut to 30 steps: learns, and reports perplexities."""
    res = paratrain("train", REPO / "configs" / "ptb_quick.toml", "--nproc", 2, "--run-dir", "q",
                    "--data-dir", real_data, "--set", "train.max_steps=30", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = [r for r in records(tmp_path / "q") if r["kind"] == "summary"][-1]
    assert summary["world_size"] == 2 and summary["global_batch"] == 20
    assert 1 < summary["valid_ppl"] < 2000  # an untrained model is at ~10,000 (the vocabulary size)


def test_replicate_towers_and_placement_log(tiny_data, tmp_path):
    (tmp_path / "tiny.toml").write_text(TINY)
    res = paratrain("train", "tiny.toml", "--strategy", "replicate", "--devices", "cpu:0,cpu:1", "--log-placement",
                    "--cpu-allocator", "default", "--run-dir", "rep", "--data-dir", tiny_data,
                    "--set", "train.max_steps=4", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    text = (tmp_path / "rep" / "placement.txt").read_text()
    assert "tower 0: cpu:0" in text and "tower 1: cpu:1" in text and "decoder.weight" in text
    summary = [r for r in records(tmp_path / "rep") if r["kind"] == "summary"][-1]
    assert summary["strategy"] == "replicate" and summary["per_replica_batch"] == 2 and summary["peak_memory_mb"] > 0
    assert summary["cpu_allocator"] == "default"  # --cpu-allocator default: glibc's own


def test_model_parallel_recipe_places_by_plan_and_trains_like_the_unplaced_model(real_data, tmp_path):
    """configs/ptb_small_mp.toml (layers split over cpu:0 / cpu:1 by its [placement]) for 3 steps in float64,
    dropout 0: every parameter on its planned device, and the same parameters as the same recipe without
    [placement] and with the one-module nn.LSTM: exactly single-process, to rounding as hybrid (2 processes
    x 2 devices)."""
    from paratrain import config
    from paratrain.env import DistEnv
    from paratrain.models.lstm_lm import convert_state_dict
    from paratrain.train import Trainer

    recipe = REPO / "configs" / "ptb_small_mp.toml"
    text = recipe.read_text()
    assert "\n[placement]\n" in text
    (tmp_path / "unplaced.toml").write_text(text.split("\n[placement]\n")[0] + "\n")
    same = ["--data-dir", real_data, "--set", "train.max_steps=3", "--set", "data.eval_fraction=0.02",
            "--set", 'train.dtype="float64"', "--set", "model.dropout=0.0"]
    res = paratrain("train", recipe, "--log-placement", "--run-dir", "mp", *same, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = {ln.split()[0]: ln.split()[1] for ln in (tmp_path / "mp" / "placement.txt").read_text().splitlines()[1:-1]}
    layer = {f"rnn.layers.{i}.{w}_{g}_l0": f"cpu:{i}" for i in (0, 1) for w in ("weight", "bias") for g in ("ih", "hh")}
    assert rows == {"embedding.weight": "cpu:0", **layer, "decoder.weight": "cpu:1", "decoder.bias": "cpu:1"}
    ref = paratrain("train", "unplaced.toml", "--log-placement", "--set", "model.layerwise=false", "--run-dir", "ref",
                    *same, cwd=tmp_path)
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert "rnn.weight_ih_l1" in (tmp_path / "ref" / "placement.txt").read_text()  # the reference is unsplit
    hybrid = paratrain("train", recipe, "--strategy", "allreduce", "--nproc", 2, "--run-dir", "hybrid", *same,
                       cwd=tmp_path)
    assert hybrid.returncode == 0, hybrid.stderr[-3000:]
    want = final_model(tmp_path / "ref")
    (tmp_path / "init").mkdir()
    init = Trainer(config.load(tmp_path / "ref" / "config.toml"), DistEnv(), tmp_path / "init", str(real_data),
                   verbose=False)  # the same recipe and seed, not trained: the initial parameters
    start = init.strategy.state_dict()
    init.close()
    for name, tol in (("mp", 0.0), ("hybrid", 1e-10)):
        got = convert_state_dict(final_model(tmp_path / name), layerwise=False)
        assert got.keys() == want.keys()
        for k in want:
            assert got[k].dtype == torch.float64
            rel = float((got[k] - want[k]).abs().max() / want[k].abs().max())
            assert rel <= tol, (name, k, rel)
    # the comparison is between trained models: 3 steps moved every parameter tensor
    assert want.keys() == start.keys() and all(not torch.equal(want[k], start[k]) for k in want)
