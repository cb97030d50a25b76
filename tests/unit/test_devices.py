"""Device resolution, soft/strict placement, placement plans and their log (CPU virtual devices)."""
from __future__ import annotations

import pytest
import torch

from paratrain.devices import (apply_memory_controls, apply_placement, format_placement_log, list_devices,
                               plan_device, resolve, resolve_list)
from paratrain.errors import UsageError
from paratrain.models import LSTMLM


def test_list_devices_has_cpu():
    devs = list_devices()
    assert devs[0].name == "cpu" and "cores" in devs[0].description


def test_resolve_cpu_and_virtual():
    assert resolve("cpu") == torch.device("cpu")
    assert resolve_list("cpu:0,cpu:1") == [torch.device("cpu", 0), torch.device("cpu", 1)]
    assert resolve("auto").type in ("cpu", "cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without GPUs")
def test_soft_placement_falls_back_with_a_warning():
    with pytest.warns(UserWarning, match="does not exist; placed on cpu"):
        assert resolve("cuda:3") == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without GPUs")
def test_strict_placement_lists_devices():
    with pytest.raises(UsageError, match=r"cuda:3.*does not exist.*devices here: cpu"):
        resolve("cuda:3", strict=True)


def test_bad_device_name():
    with pytest.raises(UsageError, match="not a device name"):
        resolve("gpu0")


def test_plan_longest_pattern_wins_and_children_inherit():
    plan = {"rnn": "cpu:0", "rnn.layer*": "cpu:1", "decoder": "cpu:1"}
    assert plan_device(plan, "rnn", None) == "cpu:0"
    assert plan_device(plan, "rnn.layers.0", None) == "cpu:1"
    assert plan_device(plan, "embedding", None) is None
    assert plan_device(lambda name, m: "cpu:1" if name == "decoder" else None, "decoder", None) == "cpu:1"


def test_placement_log_lists_every_parameter_once_and_forward_works():
    torch.manual_seed(0)
    model = LSTMLM(50, 8, 8, 2, tie_weights=True)
    tokens = torch.randint(0, 50, (5, 3))
    ref_logits, _ = model(tokens)
    rows = apply_placement(model, {"embedding": "cpu:0", "rnn": "cpu:1", "decoder": "cpu:1"})
    names = [r.module for r in rows]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())  # each exactly once (tied shared)
    assert {r.device for r in rows} == {"cpu:0", "cpu:1"} or {r.device for r in rows} == {"cpu"}
    logits, _ = model(tokens)
    assert torch.equal(logits, ref_logits)
    table = format_placement_log(rows)
    assert "total" in table and "rnn.weight_ih_l0" in table


def test_memory_controls_do_not_apply_on_cpu():
    notes = apply_memory_controls(torch.device("cpu"), fraction=0.5, expandable_segments=True)
    assert len(notes) == 2 and all("CUDA devices only" in n for n in notes)
