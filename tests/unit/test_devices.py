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
    # each parameter exactly once, on its planned device; the tied decoder weight is embedding.weight and
    # stays with the embedding (its first owner); the decoder keeps its bias
    lstm = [f"rnn.{w}_{g}_l{k}" for k in (0, 1) for w in ("weight", "bias") for g in ("ih", "hh")]
    want = {"embedding.weight": "cpu:0", **{n: "cpu:1" for n in lstm}, "decoder.bias": "cpu:1"}
    assert [r.module for r in rows] == [n for n, _ in model.named_parameters()]
    assert {r.module: r.device for r in rows} == want
    sizes = dict(model.named_parameters())
    assert all(r.params == sizes[r.module].numel() and r.bytes == 4 * r.params for r in rows)
    logits, _ = model(tokens)
    assert torch.equal(logits, ref_logits)
    table = format_placement_log(rows).splitlines()
    assert {ln.split()[0]: ln.split()[1] for ln in table[1:-1]} == want  # the log says the same, once each
    assert table[-1].split()[:2] == ["total", f"{sum(r.params for r in rows):,}"]


def test_memory_controls_do_not_apply_on_cpu():
    notes = apply_memory_controls(torch.device("cpu"), fraction=0.5, expandable_segments=True)
    assert len(notes) == 2 and all("CUDA devices only" in n for n in notes)
