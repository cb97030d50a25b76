"""What a measurement step sees of CPU towers (MFU's FLOP count, ``train.track_memory_step``'s
MemTracker) and what synchronised BatchNorm keeps for its backward."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.bench.memory import track_memory
from paratrain.bench.mfu import count_flops
from paratrain.strategies.sync_batchnorm import SyncBatchNorm
from paratrain.strategies.towers import CPUTowers


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 64), nn.ReLU(),
                         nn.Linear(64, 10))


def _step(model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    def run():
        model.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss
    return run


def test_flop_count_of_two_towers_equals_one_device_with_the_same_global_batch():
    """torch's flop counter is a thread-local dispatch mode: before the towers shared it with their
    threads, it saw tower 0's forward alone (the backward runs in the caller's thread)."""
    x, y = torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,))
    model = _cnn()
    _, one = count_flops(_step(model, x, y))
    _, towers = count_flops(_step(CPUTowers(model, 2, 0, threads=2), x, y))
    assert one > 0
    assert towers == one


def test_tracked_memory_of_two_towers_holds_both_towers_activations():
    """The activations of B samples split over 2 towers are those of B samples on one device (the
    same tensors, halved), so the tracked peaks agree; with tower 1 unseen the peak was 35% low."""
    torch.manual_seed(0)  # small weights, 4096 samples: the activations make the peak
    model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(64, 64), nn.Tanh())], nn.Linear(64, 10))
    x, y = torch.randn(4096, 64), torch.randint(0, 10, (4096,))
    _, one = track_memory(_step(model, x, y), model, [])
    _, towers = track_memory(_step(CPUTowers(model, 2, 0, threads=2), x, y), model, [])
    assert one["activations"] > 20 * one["params"]
    assert abs(towers["peak"] - one["peak"]) <= 0.1 * one["peak"], (towers, one)


class _Alone:
    """A reducer over one replica: the sum of one tensor is itself."""

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def updates_buffers(self) -> bool:
        return True


def _saved_full_size_bytes(bn: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct input-sized tensors autograd keeps for ``bn``'s backward."""
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.numel() >= x.numel():
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = bn(x)
    out.sum().backward()
    return sum(kept.values())


def test_sync_batchnorm_keeps_one_input_sized_tensor_for_backward_as_plain_batchnorm_does():
    """(x - mean) * (weight / std) + bias keeps x - mean; (x - mean) / std * weight + bias kept the
    normalised x too, one more input-sized tensor per layer (+1 MiB a step on the digits CNN)."""
    x = torch.randn(16, 4, 8, 8, requires_grad=True)
    plain = nn.BatchNorm2d(4)
    sync = SyncBatchNorm(4, reducer=_Alone())
    assert _saved_full_size_bytes(plain, x) == x.numel() * x.element_size()
    assert _saved_full_size_bytes(sync, x) == x.numel() * x.element_size()


def test_sync_batchnorm_over_one_replica_equals_plain_batchnorm_in_float64():
    torch.manual_seed(0)
    x = torch.randn(16, 4, 8, 8, dtype=torch.float64, requires_grad=True)
    plain = nn.BatchNorm2d(4).double()
    with torch.no_grad():
        plain.weight.uniform_(0.5, 1.5)
        plain.bias.uniform_(-0.5, 0.5)
    sync = SyncBatchNorm(4, reducer=_Alone()).double()
    sync.load_state_dict(plain.state_dict())
    grads = []
    for bn in (plain, sync):
        x.grad = None
        out = bn(x)
        (out * torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view_as(out)).sum().backward()
        grads.append((out.detach(), x.grad.clone(), bn.weight.grad.clone(), bn.bias.grad.clone(),
                      bn.running_var.clone()))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_dataparallel_replica_threads_reach_the_callers_flop_counter(monkeypatch):
    """CUDA towers (``SeededDataParallel``) run every replica in a thread of torch's
    ``parallel_apply``; here a CPU stand-in for it runs them in threads the same way."""
    import importlib
    import threading

    from paratrain.strategies.towers import SeededDataParallel

    def threaded(modules, inputs, kwargs, devices=None):
        out = [None] * len(modules)

        def run(i):
            out[i] = modules[i](*inputs[i], **kwargs[i])
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(modules))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    # the module, not torch.nn.parallel's function of the same name
    monkeypatch.setattr(importlib.import_module("torch.nn.parallel.data_parallel"), "parallel_apply", threaded)
    model = _cnn()
    x = torch.randn(16, 1, 8, 8)
    dp = SeededDataParallel(model)  # no CUDA: a plain holder of the module; its parallel_apply is what runs
    _, one = count_flops(lambda: model(x))
    _, both = count_flops(lambda: dp.parallel_apply([model, model], [(x[:8],), (x[8:],)], [{}, {}]))
    assert one > 0
    assert both == one
    # one replica: torch runs it in this thread, where the modes are already (counted once, not twice)
    monkeypatch.setattr(importlib.import_module("torch.nn.parallel.data_parallel"), "parallel_apply",
                        lambda modules, inputs, kwargs, devices=None: [modules[0](*inputs[0], **kwargs[0])])
    _, alone = count_flops(lambda: dp.parallel_apply([model], [(x,)], [{}]))
    assert alone == one
