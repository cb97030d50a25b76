"""``paratrain train --strategy pipeline`` as a user runs it: gpt in 2 stages resumes bitwise after
a killed stage (DCP checkpoints of both stages), the 2 x 2 hybrid runs from the command line, and
what cannot be pipelined is refused in one line."""
from __future__ import annotations

import pytest
import torch

from paratrain.strategies.sharded import read_whole
from paratrain.train.checkpoint import latest

from .test_cli import TINY, paratrain
from .test_reliability import records

pytestmark = pytest.mark.slow
GPT = """
name = "tiny-gpt"
[task]
entry = "gpt"
[data]
corpus = "ptb"
bptt = 6
eval_batch_size = 4
eval_fraction = 0.3
[model]
n_layer = 2
n_head = 2
d_model = 16
dropout = 0.1
[train]
batch_size = 8
optimizer = "adam"
lr = 0.01
clip = 0.5
convention = "mean_over_tokens"
log_every = 5
checkpoint_every = 4
schedule = "constant"
[dist]
strategy = "pipeline"
nproc = 2
microbatches = 4
"""


def test_killed_stage_restarts_and_ends_bitwise_equal(tmp_path, tiny_data):
    (tmp_path / "gpt.toml").write_text(GPT)
    common = ("--data-dir", tiny_data, "--set", "train.max_steps=120", "--set", "train.epochs=10")
    a = paratrain("train", "gpt.toml", *common, "--run-dir", "plain", cwd=tmp_path, timeout=300)
    assert a.returncode == 0, a.stderr[-2000:]
    b = paratrain("train", "gpt.toml", *common, "--run-dir", "killed", "--fault", "kill:rank=1:step=50",
                  "--max-restarts", "1", cwd=tmp_path, timeout=300)
    assert b.returncode == 0, b.stderr[-3000:]
    assert "restart 1 of 1: resuming from step 48 (checkpoint-00000048.dcp)" in b.stdout + b.stderr
    plain, killed = (read_whole(latest(tmp_path / d))["model"] for d in ("plain", "killed"))
    assert all(torch.equal(plain[k], killed[k]) for k in plain), "restarted run differs from the uninterrupted one"
    summary = records(tmp_path / "plain", "summary")[-1]
    assert summary["steps"] == 120 and summary["valid_ppl"] < 40  # the tiny corpus' 40 words: it learned


def test_two_replicas_of_two_stages_from_the_command_line_in_fp16(tmp_path, tiny_data):
    (tmp_path / "gpt.toml").write_text(GPT)
    r = paratrain("train", "gpt.toml", "--data-dir", tiny_data, "--run-dir", "hybrid", "--nproc", "4",
                  "--set", "dist.microbatches=2", "--set", "dist.pipeline_schedule=gpipe", "--set", "train.max_steps=8",
                  "--set", "train.precision=fp16", cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert records(tmp_path / "hybrid", "summary")[-1]["steps"] == 8
    losses = [t["loss"] for t in records(tmp_path / "hybrid", "train")]
    assert len(losses) == 2 and all(0 < x < 10 for x in losses)  # finite: no shape-inference NaN in step 1's log


@pytest.mark.parametrize("config, extra, words", [
    ("tiny.toml", ("--strategy", "pipeline"), "carries its hidden state"),
    ("gpt.toml", ("--set", "dist.microbatches=3"), "micro-batches"),
    ("gpt.toml", ("--nproc", "3"), "divide the number of processes"),
    ("gpt.toml", ("--set", "train.accumulation=2"), "train.accumulation = 1"),
    ("gpt.toml", ("--set", "dist.pipeline_stages=4", "--nproc", "4"), "pipeline stages"),
    ("gpt.toml", ("--set", "dist.pipeline_split=1,x"), "whole numbers >= 0"),
    ("gpt.toml", ("--set", "dist.pipeline_split=3,0"), "add up to 2"),
])
def test_what_cannot_be_pipelined_is_one_line(tmp_path, tiny_data, config, extra, words):
    (tmp_path / "tiny.toml").write_text(TINY)
    (tmp_path / "gpt.toml").write_text(GPT)
    r = paratrain("train", config, "--data-dir", tiny_data, "--run-dir", "bad", *extra, cwd=tmp_path, timeout=300)
    assert r.returncode == 2 and words in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
