"""``paratrain plan --profile FILE``: a profile measured on another machine is read only when it
holds what this paratrain measures on its device and is this recipe's (:func:`read_profile`)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from paratrain.bench.plan_profile import read_profile
from paratrain.bench.profile import DEVICE_ONLY_CHANGES, PROFILE_VERSION, compatible
from paratrain.bench.validate import model_gradient_bytes
from paratrain.config import load
from paratrain.consistency import config_text
from paratrain.errors import UsageError

RECIPE = str(Path(__file__).resolve().parents[2] / "configs" / "digits_cnn.toml")


def test_a_profile_is_readable_at_its_version_or_where_every_change_since_was_another_devices():
    assert compatible(PROFILE_VERSION, "cpu") and compatible(PROFILE_VERSION, "cuda:0")
    assert DEVICE_ONLY_CHANGES[20] == DEVICE_ONLY_CHANGES[21] == "cpu"  # the CPU's sync BatchNorm runs alone
    assert compatible(19, "cuda:0") and compatible(19, "cuda")
    assert not compatible(19, "cpu") and not compatible(20, "cpu")  # a CPU's 19 lacks what 20 measures, 20 21's
    assert not compatible(18, "cuda:0")  # 19 added a GPU's one-rank runs
    assert not compatible(PROFILE_VERSION + 1, "cuda:0") and not compatible(None, "cpu") and not compatible("20", "cpu")


@pytest.fixture
def digits(tmp_path):
    pytest.importorskip("sklearn")  # the digits data set
    from paratrain.runs import build_task

    cfg = load(RECIPE, [])
    return cfg, build_task(cfg, None, world_size=1), tmp_path


def _write(tmp_path, prof) -> Path:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(prof))
    return path


def test_a_profile_recording_its_recipe_is_read_for_that_recipe_alone(digits):
    cfg, task, tmp = digits
    prof = {"version": PROFILE_VERSION, "device": "cuda:0", "recipe": config_text(cfg), "workloads": {"x": 1}}
    assert read_profile(_write(tmp, prof), cfg, task) == prof
    other = load(RECIPE, ["train.batch_size=128"])
    with pytest.raises(UsageError, match=r"another recipe \(-batch_size = 128; \+batch_size = 64"):
        read_profile(_write(tmp, {**prof, "recipe": config_text(other)}), cfg, task)


def test_an_older_profile_without_its_recipe_is_checked_by_task_batch_precision_and_parameters(digits):
    cfg, task, tmp = digits
    mine = {"version": 19, "device": "cuda:0", "task": cfg.task.entry, "batch_size": cfg.train.batch_size,
            "dtype": cfg.train.dtype, "precision": cfg.train.precision,
            "param_bytes": model_gradient_bytes(task, cfg.train.dtype)}
    assert read_profile(_write(tmp, mine), cfg, task) == mine
    wider = [*mine["param_bytes"][:-1], mine["param_bytes"][-1] * 2]
    for key, value, said in (("batch_size", 128, "batch_size 128 there, 64 here"),
                             ("precision", "bf16", "precision bf16 there, fp32 here"),
                             ("param_bytes", wider, f"param_bytes {len(wider)} parameters, {sum(wider)} bytes there")):
        with pytest.raises(UsageError, match=said):
            read_profile(_write(tmp, {**mine, key: value}), cfg, task)


@pytest.mark.parametrize("text, said", [
    (None, "cannot read it"),
    ("{not json", "is not JSON"),
    ("[1, 2]", "is not a profile"),
    (json.dumps({"version": 19, "device": "cpu"}), "is profile version 19 of cpu; this paratrain measures version"),
])
def test_a_file_that_is_no_readable_profile_says_what_to_give(digits, text, said):
    cfg, task, tmp = digits
    path = tmp / "profile.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(UsageError, match=said):
        read_profile(path, cfg, task)
