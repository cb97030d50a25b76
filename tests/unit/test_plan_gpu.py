"""What ``paratrain plan`` does with a GPU's profile, checked on a CPU: the N it plans and validates
with the measured interconnect, the device its validation runs use, the device memory it takes from
the profile, how the profile moves a task's batch to the device, and the collectives' names on the
older torch a GPU image may carry (2.11: ``all_gather_into_tensor``)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from paratrain.bench import microbench
from paratrain.bench.costmodel import PRESETS
from paratrain.bench.plan_report import _device_limit, _gpu_nproc
from paratrain.bench.plan_validate import validation_counts
from paratrain.bench.profile import _to
from paratrain.data.batching import LMBatch
from paratrain.errors import UsageError

GPU = {"device": "cuda:0"}
CPU = {"device": "cpu"}


def test_a_gpu_profile_validates_n_1_alone_on_the_gpu(monkeypatch):
    assert validation_counts(CPU, "2,1,4,1") == ([1, 2, 4], (), [])
    assert validation_counts(CPU, None) == ([1, 2], (), [])
    with pytest.raises(UsageError, match=r"--validate: the profile is of a GPU \(cuda:0\) and this machine has none"):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        validation_counts(GPU, None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert validation_counts(GPU, None) == ([1], ('dist.device="cuda"',), [2])  # the default's N = 2 skipped
    assert validation_counts(GPU, "1") == ([1], ('dist.device="cuda"',), [])
    for asked in ("1,2", "2"):  # an explicit N > 1 (or no N = 1 at all) is refused, not skipped to nothing
        with pytest.raises(UsageError, match=f"--validate-nproc {asked}: .* not NCCL between GPUs; give "
                                             f"--validate-nproc 1"):
            validation_counts(GPU, asked)


def test_a_gpu_profile_plans_n_1_alone_with_the_measured_link(capsys):
    assert _gpu_nproc([1, 2, 4], True, None, None) == [1]  # the default --nproc: cut, with a line
    assert "only N = 1 is planned" in capsys.readouterr().out
    with pytest.raises(UsageError, match="--nproc 1,2 with --interconnect measured: .* not NCCL between GPUs; "
                                         "plan N > 1 with --interconnect nvlink"):
        _gpu_nproc([1, 2], True, None, "1,2")
    assert _gpu_nproc([1, 2, 8], True, PRESETS["nvlink"], "1,2,8") == [1, 2, 8]  # a preset: every N
    assert _gpu_nproc([1, 2, 4], False, None, "1,2,4") == [1, 2, 4]  # a CPU's profile: its own links
    assert _gpu_nproc([1], True, None, "1") == [1]


def test_the_device_memory_comes_from_the_profiled_gpu_also_on_another_machine():
    assert _device_limit(None, {"device": "cuda:0", "device_memory_bytes": 150_754_820_096}) == 150_754_820_096
    assert _device_limit(80, {"device": "cuda:0", "device_memory_bytes": 150_754_820_096}) == 80e9
    assert _device_limit(None, CPU) is None
    if not torch.cuda.is_available():  # an older GPU profile without the key, read where there is no GPU
        assert _device_limit(None, {"device": "cuda:0"}) is None


@dataclasses.dataclass
class _Step:  # a task's own micro-batch: a dataclass of tensors, as gpt's and lstm-lm's batches are
    inputs: torch.Tensor
    targets: torch.Tensor
    count: int


def test_the_profile_moves_a_tasks_dataclass_and_lm_batches_to_the_device():
    # the GPU's profile failed with "index is on cpu" when only tensors, tuples and dicts were moved
    meta = torch.device("meta")
    x = torch.zeros(4, 3, dtype=torch.long)
    step = _to(_Step(x, x, 12), meta)
    assert step.inputs.device == meta and step.targets.device == meta and step.count == 12
    lm = _to([LMBatch(inputs=x, targets=x, mask=None, hidden_key=0, num_tokens=12)], meta)[0]
    assert lm.inputs.device == meta and lm.targets.device == meta
    pair = _to((x, {"y": x}), meta)
    assert pair[0].device == meta and pair[1]["y"].device == meta


@pytest.mark.parametrize("new, old, helper, args", [
    ("all_gather_single", "all_gather_into_tensor", microbench.all_gather_single, ("out", "part")),
    ("reduce_scatter_single", "reduce_scatter_tensor", microbench.reduce_scatter_single, ("part", "whole")),
])
def test_the_collectives_take_their_older_name_on_an_older_torch(monkeypatch, new, old, helper, args):
    import torch.distributed as dist

    calls = []
    monkeypatch.setattr(dist, new, lambda *a: calls.append((new, a)), raising=False)
    monkeypatch.setattr(dist, old, lambda *a: calls.append((old, a)), raising=False)
    helper(*args)
    monkeypatch.delattr(dist, new)  # torch 2.11 has only the older name
    helper(*args)
    assert calls == [(new, args), (old, args)]
