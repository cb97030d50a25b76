"""CUDA towers (``SeededDataParallel``) with CPU stand-ins for torch's CUDA-only pieces: its
``parallel_apply`` (replicas in threads) and its ``scatter_kwargs`` (the batch split over devices).
Both bugs here were found on an H100 with two towers on one GPU (soft placement of cuda:0,cuda:1)."""
from __future__ import annotations

import importlib
import threading

import pytest
import torch
from torch import nn

from paratrain.strategies.sync_batchnorm import SyncBatchNorm, TowerReducer
from paratrain.strategies.towers import SeededDataParallel, TowerGroup, current_tower

DATA_PARALLEL = importlib.import_module("torch.nn.parallel.data_parallel")  # the module, not the class


def threaded(modules, inputs, kwargs, devices=None):
    """torch's parallel_apply without CUDA: module 0 in this thread (as CPU towers run tower 0), the
    others in threads of their own; the first error re-raised once every thread has ended (30 s each)."""
    out, errors = [None] * len(modules), []

    def run(i):
        try:
            out[i] = modules[i](*inputs[i], **kwargs[i])
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(1, len(modules))]
    for t in threads:
        t.start()
    run(0)
    for t in threads:
        t.join(30)
        assert not t.is_alive(), "a tower is still waiting at the towers' meeting"
    if errors:
        raise errors[0]
    return out


def test_replicas_run_as_their_tower_and_meet_in_sync_batchnorm(monkeypatch):
    """Two replicas on one device (the same module twice, as soft placement gives): sync BatchNorm's
    tower sum meets by tower index, so the joined output is BatchNorm over the whole batch. Before, the
    index came from the device, both replicas were tower 0, and the sum read an empty slot."""
    monkeypatch.setattr(DATA_PARALLEL, "parallel_apply", threaded)
    group = TowerGroup(2, timeout_s=30)
    synced = SyncBatchNorm(3, reducer=TowerReducer(group)).double()
    plain = nn.BatchNorm2d(3).double()
    seen = []

    class Probe(nn.Module):
        def forward(self, x):
            seen.append(current_tower())
            return synced(x)

    dp = SeededDataParallel(Probe())  # no CUDA: a holder of the module; its parallel_apply is what runs
    x = torch.randn(8, 3, 4, 4, dtype=torch.float64)
    out = dp.parallel_apply([dp.module, dp.module], [(x[:4],), (x[4:],)], [{}, {}])
    assert sorted(seen) == [0, 1]
    assert current_tower() == 0  # tower 0 ran in this thread, and left its index as it found it
    torch.testing.assert_close(torch.cat(out), plain(x), rtol=1e-12, atol=1e-12)
    # the running statistics are updated once (tower 0), with the whole batch's
    torch.testing.assert_close(synced.running_mean, plain.running_mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(synced.running_var, plain.running_var, rtol=1e-12, atol=1e-12)
    assert int(synced.num_batches_tracked) == 1


def test_scatter_gives_contiguous_parts(monkeypatch):
    """An LSTM's hidden state (layers, B, H) split along B: the part that stays on the first device
    is a strided view, which cuDNN refuses. SeededDataParallel's scatter hands contiguous parts."""
    def chunk_kwargs(inputs, kwargs, device_ids, dim=0):  # torch's scatter_kwargs, without CUDA's copies
        n = len(device_ids)

        def split(obj):
            if isinstance(obj, torch.Tensor):
                return obj.chunk(n, dim)
            parts = [split(x) for x in obj]
            return [type(obj)(p[i] for p in parts) for i in range(n)]
        return tuple(split(inputs)), tuple({} for _ in device_ids)

    monkeypatch.setattr(DATA_PARALLEL, "scatter_kwargs", chunk_kwargs)
    dp = SeededDataParallel(nn.Identity(), dim=1)
    dp.dim = 1  # DataParallel without CUDA keeps no settings
    tokens, h = torch.arange(6 * 4).view(6, 4), torch.randn(2, 4, 5)
    assert not h.chunk(2, 1)[0].is_contiguous()  # what the first device got before
    inputs, kwargs = dp.scatter((tokens, (h, h.clone())), {}, [0, 1])
    assert len(inputs) == 2 and kwargs == ({}, {})
    for i, (tok, (h0, c0)) in enumerate(inputs):
        assert tok.is_contiguous() and h0.is_contiguous() and c0.is_contiguous()
        torch.testing.assert_close(h0, h.chunk(2, 1)[i], rtol=0, atol=0)
        torch.testing.assert_close(tok, tokens.chunk(2, 1)[i], rtol=0, atol=0)


def test_repeated_devices_warn_that_masks_share_a_generator():
    with pytest.warns(UserWarning, match="share a device"):
        SeededDataParallel(nn.Identity(), device_ids=[0, 0]) if torch.cuda.is_available() else _holder([0, 0])


def _holder(ids):
    """SeededDataParallel's __init__ on a machine without CUDA: DataParallel keeps no device ids
    there, so give them as a one-GPU host's soft placement would."""
    from unittest import mock

    def init(self, module, device_ids=None, **kwargs):
        nn.Module.__init__(self)
        self.module, self.device_ids = module, list(device_ids)
    with mock.patch.object(nn.DataParallel, "__init__", init):
        return SeededDataParallel(nn.Identity(), device_ids=ids)


def test_a_failing_tower_breaks_the_meeting_instead_of_leaving_the_others_waiting(monkeypatch):
    """Tower 1 fails before sync BatchNorm's meeting: the towers' group is aborted, so tower 0 raises at
    once instead of waiting out the barrier's timeout (600 s); the next forward repairs the group."""
    import time

    monkeypatch.setattr(DATA_PARALLEL, "parallel_apply", threaded)
    group = TowerGroup(2, timeout_s=60)  # without the abort, tower 0 (this thread) would wait all of it
    synced = SyncBatchNorm(3, reducer=TowerReducer(group))

    class FailsInTower1(nn.Module):
        def forward(self, x):
            if current_tower() == 1:
                raise RuntimeError("tower 1 failed")
            return synced(x)

    dp = SeededDataParallel(FailsInTower1(), group=group)
    x = torch.randn(8, 3, 4, 4)
    start = time.monotonic()
    with pytest.raises((RuntimeError, threading.BrokenBarrierError)):
        dp.parallel_apply([dp.module, dp.module], [(x[:4],), (x[4:],)], [{}, {}])
    assert time.monotonic() - start < 30, "tower 0 waited out the barrier: the failing tower did not abort it"
    assert group.barrier.broken
    group.ready()  # what SeededDataParallel.forward does first
    assert not group.barrier.broken
