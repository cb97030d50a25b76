"""``paratrain plan --profile FILE``: a profile measured on another machine is read only when it
holds what this paratrain measures on its device and is this recipe's (:func:`read_profile`)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from paratrain.bench.plan_profile import read_profile
from paratrain.bench.profile_cache import DEVICE_ONLY_CHANGES, MIXED_PRECISION_ONLY_CHANGES, PROFILE_VERSION, compatible
from paratrain.bench.validate import model_gradient_bytes
from paratrain.config import load
from paratrain.consistency import config_text
from paratrain.errors import UsageError

RECIPE = str(Path(__file__).resolve().parents[2] / "configs" / "digits_cnn.toml")


def test_a_profile_is_readable_at_its_version_or_where_every_change_since_was_another_devices(monkeypatch):
    from paratrain.bench import profile_cache

    assert compatible(PROFILE_VERSION, "cpu") and compatible(PROFILE_VERSION, "cuda:0")
    # 44: a CPU's sync BatchNorm between processes (one function since): a GPU's 43 is whole, a CPU's is not
    assert PROFILE_VERSION == 44 and DEVICE_ONLY_CHANGES[44] == "cpu"
    assert not compatible(43, "cpu") and compatible(43, "cuda:0", "bf16") and not compatible(42, "cuda:0")
    monkeypatch.setattr(profile_cache, "PROFILE_VERSION", 43)  # as at version 43
    # 43: what each pipeline stage saves and the batch's storage, on any device in any precision: no older one is whole
    assert 43 not in DEVICE_ONLY_CHANGES and 43 not in MIXED_PRECISION_ONLY_CHANGES
    assert not compatible(42, "cpu") and not compatible(42, "cuda:0", "bf16") and compatible(43, "cuda:0", "bf16")
    monkeypatch.setattr(profile_cache, "PROFILE_VERSION", 42)  # as at version 42
    # 42: what checkpointing costs the step, measured on any device in any precision: no older profile is whole
    assert 42 not in DEVICE_ONLY_CHANGES and 42 not in MIXED_PRECISION_ONLY_CHANGES
    assert not compatible(41, "cpu") and not compatible(41, "cuda:0", "bf16") and not compatible(39, "cpu")
    assert not compatible(32, "cuda:0", "fp32") and compatible(42, "cpu", "bf16") and compatible(42, "cuda:0")
    monkeypatch.setattr(profile_cache, "PROFILE_VERSION", 41)  # the history below, as at version 41
    assert DEVICE_ONLY_CHANGES[20] == DEVICE_ONLY_CHANGES[21] == "cpu"  # the CPU's loop runs alone
    # 32: a GPU's stage profiles on the GPU, a CPU's of a mixed-precision recipe under autocast: no older one is whole
    assert not compatible(31, "cuda:0") and not compatible(31, "cpu")
    # 33: a CPU's PS workers' guard in the loop: a GPU's 32 is whole, a CPU's is not
    # 34: a CPU's step under the allocator that keeps freed blocks: a GPU's 32 is still whole, a CPU's 33 is not
    # 35: a CPU's step with one malloc arena: a GPU's 32 is still whole, a CPU's 34 is not
    # 36: a CPU's towers' backward and sync BatchNorm in one process: a GPU's 32 is still whole, a CPU's 35 is not
    # 37: a CPU's FSDP2 units of their own parameters; 38: a CPU's one-device step over rounds spread across the
    # profile; 39: a CPU's FSDP2 units and sharded steps after the model's compute: a GPU's 32 is still whole,
    # a CPU's 38 is not
    assert compatible(32, "cuda:0") and not compatible(38, "cpu")
    assert not compatible(34, "cpu") and compatible(34, "cuda:0")
    assert not compatible(35, "cpu") and compatible(35, "cuda:0")
    # 40: a bf16 or fp16 recipe's whole-model profile under autocast, on any device: an fp32 recipe's 39 (a
    # CPU's) and 32 (a GPU's) are still whole, a mixed-precision recipe's are not, on either
    # 41: a bf16 or fp16 recipe's autocast casts apart and its FSDP2 units under the mixed-precision policy:
    # the same, and a mixed-precision recipe's 40 is not whole either
    assert MIXED_PRECISION_ONLY_CHANGES == {40, 41} and 40 not in DEVICE_ONLY_CHANGES and 41 not in DEVICE_ONLY_CHANGES
    assert compatible(39, "cpu") and compatible(39, "cpu", "fp32") and compatible(32, "cuda:0", "fp32")
    assert compatible(40, "cpu", "fp32") and compatible(40, "cuda:0")
    assert not compatible(39, "cpu", "bf16") and not compatible(32, "cuda:0", "bf16")
    assert not compatible(39, "cpu", "fp16") and not compatible(38, "cpu", "fp32")
    assert not compatible(40, "cpu", "bf16") and not compatible(40, "cuda:0", "fp16")
    assert compatible(41, "cpu", "bf16") and compatible(41, "cuda:0", "fp16")
    assert not compatible(19, "cpu") and not compatible(20, "cpu")  # a CPU's 19 lacks what 20 measures, 20 21's
    # 23, 24: a CPU's loaded PS exchange (2, then 4 workers) and FSDP2 step
    assert DEVICE_ONLY_CHANGES[23] == DEVICE_ONLY_CHANGES[24] == "cpu"
    assert not compatible(PROFILE_VERSION + 1, "cuda:0") and not compatible(None, "cpu") and not compatible("20", "cpu")
    # 30: a reverted commit's, on any device
    assert not compatible(30, "cpu") and not compatible(30, "cuda:0") and 30 not in DEVICE_ONLY_CHANGES.values()


def test_compatible_reads_the_device_only_changes(monkeypatch):
    """As at version 31 (every change since 20 a CPU's, 30 skipped): a GPU's profile of 19 or later
    is whole, except 30; a CPU's only at 31."""
    from paratrain.bench import profile_cache

    monkeypatch.setattr(profile_cache, "PROFILE_VERSION", 31)
    monkeypatch.setattr(profile_cache, "DEVICE_ONLY_CHANGES", {v: "cpu" for v in range(20, 32)})
    assert profile_cache.compatible(19, "cuda:0") and profile_cache.compatible(19, "cuda")
    assert not profile_cache.compatible(19, "cpu") and not profile_cache.compatible(20, "cpu")
    assert profile_cache.compatible(22, "cuda:0") and not profile_cache.compatible(22, "cpu")
    assert not profile_cache.compatible(18, "cuda:0")  # 19 added a GPU's one-rank runs
    assert profile_cache.compatible(29, "cuda:0") and not profile_cache.compatible(29, "cpu")
    assert profile_cache.compatible(31, "cpu") and not profile_cache.compatible(30, "cuda:0")


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


WHOLE = {"task": "digits-cnn", "unit": "samples", "batch_size": 64, "tokens_per_step": 64, "cores": 16,
         "workloads": {}, "links": {}, "strategy_inputs": {}, "param_total_bytes": 1, "memory_measured": {},
         "peak_flops_source": "datasheet", "flops_per_unit": 1.0, "blocks": [], "activation_bytes": 1,
         "autocast_copy_bytes": 0, "data_bytes": 1, "output_bytes": 1, "peak_flops": 1e12, "buffer_bytes": 0,
         "optimizer_state_bytes": 0, "batchnorm_inputs": [[64, 16, 8, 8]], "default_threads": 1,
         "workloads_in_process": {}, "ps_update_s": {}, "ps_round_trip_s": 0.1}  # what the plan reads, right types


def test_a_profile_recording_its_recipe_is_read_for_that_recipe_alone(digits):
    cfg, task, tmp = digits
    prof = {**WHOLE, "version": PROFILE_VERSION, "device": "cuda:0", "recipe": config_text(cfg), "param_bytes": []}
    assert read_profile(_write(tmp, prof), cfg, task) == prof
    other = load(RECIPE, ["train.batch_size=128"])
    with pytest.raises(UsageError, match=r"another recipe \(the profile has 'batch_size = 128' where this recipe "
                                         r"has 'batch_size = 64'\)"):
        read_profile(_write(tmp, {**prof, "recipe": config_text(other)}), cfg, task)


def test_a_gpu_profile_older_than_a_recipe_key_is_read_for_the_recipe_without_it(digits, monkeypatch):
    from paratrain.bench import profile_cache

    monkeypatch.setattr(profile_cache, "PROFILE_VERSION", 41)  # as at version 41, which read a GPU's 33
    cfg, task, tmp = digits
    here = config_text(cfg)
    assert 'cpu_allocator = "retain"' in here  # added by profile version 34
    written = "".join(line for line in here.splitlines(keepends=True) if not line.startswith("cpu_allocator"))
    prof = {**WHOLE, "version": 33, "device": "cuda:0", "recipe": written, "param_bytes": []}
    assert read_profile(_write(tmp, prof), cfg, task) == prof
    with pytest.raises(UsageError, match="another recipe"):  # at version 34 the key is the recipe's
        read_profile(_write(tmp, {**prof, "version": 41}), cfg, task)
    monkeypatch.setattr(profile_cache, "PROFILE_VERSION", 42)  # 42 reads no GPU's 33
    with pytest.raises(UsageError, match="is profile version 33 of cuda:0; .* --reprofile"):
        read_profile(_write(tmp, prof), cfg, task)


def test_a_profile_without_its_recipe_is_checked_by_task_batch_precision_parameters_and_sync_batchnorm(digits):
    """As a profile from before 2026-11-27 was (no ``recipe``): since version 32 none of those is
    read, so this one is of the current version with the key left out."""
    cfg, task, tmp = digits  # digits_cnn: model.sync_batchnorm = true over three BatchNorm layers
    mine = {**WHOLE, "version": PROFILE_VERSION, "device": "cuda:0", "task": cfg.task.entry,
            "batch_size": cfg.train.batch_size, "dtype": cfg.train.dtype, "precision": cfg.train.precision,
            "param_bytes": model_gradient_bytes(task, cfg.train.dtype), "batchnorm_inputs": [[64, 16, 8, 8]]}
    assert read_profile(_write(tmp, mine), cfg, task) == mine
    wider = [*mine["param_bytes"][:-1], mine["param_bytes"][-1] * 2]
    for key, value, said in (("batch_size", 128, "batch_size 128 there, 64 here"),
                             ("precision", "bf16", "precision bf16 there, fp32 here"),
                             ("param_bytes", wider, f"gradients {len(wider)} parameters, {sum(wider)} bytes there"),
                             ("batchnorm_inputs", [], "sync BatchNorm measured False there, True here")):
        with pytest.raises(UsageError, match=said):
            read_profile(_write(tmp, {**mine, key: value}), cfg, task)
    # measured with sync BatchNorm, planned for a recipe without it (its terms would be priced where none are)
    off = load(RECIPE, ["model.sync_batchnorm=false"])
    with pytest.raises(UsageError, match="sync BatchNorm measured True there, False here"):
        read_profile(_write(tmp, mine), off, task)


@pytest.mark.parametrize("drop, said", [("links", "lacks links"), ("workloads", "lacks workloads"),
                                        ("unit", "lacks unit")])
def test_a_profile_missing_what_the_plan_reads_is_one_line(digits, drop, said):
    cfg, task, tmp = digits
    prof = {**WHOLE, "version": PROFILE_VERSION, "device": "cpu", "recipe": config_text(cfg), "param_bytes": []}
    del prof[drop]
    with pytest.raises(UsageError, match=said):
        read_profile(_write(tmp, prof), cfg, task)
    with pytest.raises(UsageError, match="lacks recipe"):
        read_profile(_write(tmp, {**WHOLE, "version": PROFILE_VERSION, "device": "cpu", "param_bytes": [],
                                  "recipe": 7}), cfg, task)


def test_an_older_profile_is_read_by_its_recipes_precision(digits, monkeypatch):
    """A CPU's profile of version 39 holds what 40 measures for an fp32 recipe (40 changed only bf16 and
    fp16 recipes' profiles), not for a bf16 one: that is refused with what to run (as at version 41;
    42 measured checkpointing's cost on every profile)."""
    from paratrain.bench import profile_cache

    monkeypatch.setattr(profile_cache, "PROFILE_VERSION", 41)
    cfg, task, tmp = digits
    prof = {**WHOLE, "version": 39, "device": "cpu", "recipe": config_text(cfg), "param_bytes": [],
            "precision": "fp32"}
    assert read_profile(_write(tmp, prof), cfg, task) == prof
    with pytest.raises(UsageError, match="is profile version 39 of cpu; .* --reprofile"):
        read_profile(_write(tmp, {**prof, "precision": "bf16"}), cfg, task)


@pytest.mark.parametrize("text, said", [
    (None, "cannot read it"),
    ("{not json", "is not JSON"),
    ("[1, 2]", "is not a profile"),
    (json.dumps({"version": 19, "device": "cpu"}), "is profile version 19 of cpu; this paratrain measures version"),
    (json.dumps({"version": PROFILE_VERSION + 1, "device": "cpu"}), "newer than this paratrain's"),
    (json.dumps({"version": 19, "device": None}), "is not a profile"),
])
def test_a_file_that_is_no_readable_profile_says_what_to_give(digits, text, said):
    cfg, task, tmp = digits
    path = tmp / "profile.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(UsageError, match=said):
        read_profile(path, cfg, task)


SHIPPED = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "plan-xeon" / "digits_cnn-v44" / \
    "profile.json"


def test_each_key_the_plan_reads_missing_or_of_another_type_is_one_line_naming_it(digits):
    """The shipped digits_cnn profile (version 44) is read whole; without any key the plan reads
    unconditionally, or with any key it reads in another type (a string, a bool for a number), or with a
    block that is no mapping, reading it is one UsageError naming the key, not a traceback in the plan."""
    from paratrain.bench.plan_profile import OPTIONAL, REQUIRED

    cfg, task, tmp = digits
    whole = json.loads(SHIPPED.read_text())
    assert read_profile(_write(tmp, whole), cfg, task) == whole
    for key in REQUIRED:
        if key in ("version", "device"):  # (no profile at all: its own message)
            continue
        with pytest.raises(UsageError, match=f"lacks {key} \\(or has the wrong type\\)"):
            read_profile(_write(tmp, {k: v for k, v in whole.items() if k != key}), cfg, task)
    kinds = {**REQUIRED, **OPTIONAL}
    for key in [*REQUIRED, *(k for k in OPTIONAL if k in whole)]:
        if key in ("version", "device"):
            continue
        with pytest.raises(UsageError, match=f"lacks {key} \\(or has"):
            read_profile(_write(tmp, {**whole, key: 7 if kinds[key] is str else "x"}), cfg, task)
    # values a profile legitimately holds: no checkpointing measured (no blocks, or no room on a GPU), no
    # towers' forward, a peak with no MFU (NaN)
    for key, value in (("checkpointing", None), ("towers_forward_threads", None), ("peak_flops", float("nan"))):
        assert read_profile(_write(tmp, {**whole, key: value}), cfg, task)[key] is value or key == "peak_flops"
    with pytest.raises(UsageError, match="lacks peak_flops"):
        read_profile(_write(tmp, {**whole, "peak_flops": True}), cfg, task)
    with pytest.raises(UsageError, match="lacks blocks \\(each a mapping\\)"):
        read_profile(_write(tmp, {**whole, "blocks": [*whole["blocks"], 3]}), cfg, task)
    # the towers' step in the loop (an optional key since 2026-12-01) read whole, or one line naming it
    looped = {"towers": 2, "data_s": 0.0004, "forward_s": 0.0103, "backward_s": 0.0058, "optimizer_s": 0.0007}
    assert read_profile(_write(tmp, {**whole, "loop_towers": looped}), cfg, task)["loop_towers"] == looped
    for bad in ({k: v for k, v in looped.items() if k != "forward_s"}, {**looped, "towers": 2.0},
                {**looped, "optimizer_s": "x"}):
        with pytest.raises(UsageError, match="lacks loop_towers \\(towers, data_s"):
            read_profile(_write(tmp, {**whole, "loop_towers": bad}), cfg, task)


def test_reprofiling_replaces_the_cached_profile_only_with_a_whole_new_one(tmp_path):
    """``--reprofile`` (``fresh``) measures again although the cached profile's key matches, and writes
    the new one; a measurement interrupted part-way (Ctrl-C in the profile's minutes) leaves the last
    profile as it was (it was deleted before the measurement began); without ``fresh``, the cached one
    is read and nothing is measured."""
    from paratrain.bench.profile_cache import cached_profile

    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"key": "k", "old": True}))

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        cached_profile(path, "k", interrupted, fresh=True)
    assert json.loads(path.read_text()) == {"key": "k", "old": True}
    assert cached_profile(path, "k", interrupted) == ({"key": "k", "old": True}, True)
    assert cached_profile(path, "k", lambda: {"new": True}, fresh=True) == ({"new": True, "key": "k"}, False)
    assert json.loads(path.read_text()) == {"new": True, "key": "k"} and not list(tmp_path.glob("*.tmp"))
