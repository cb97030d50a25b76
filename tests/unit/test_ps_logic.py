"""Parameter-server logic without processes: sharding, sync aggregation, backup workers,
async staleness, the staleness gate, the hung-step watchdog."""
from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paratrain.ps.layout import PSLayout
from paratrain.ps.server import ShardServer, StalenessGate
from paratrain.ps.sharding import shard_by_bytes


@given(sizes=st.lists(st.integers(1, 10_000), min_size=0, max_size=30), k=st.integers(1, 6))
def test_sharding_is_a_partition_and_balanced(sizes, k):
    shards = shard_by_bytes(sizes, k)
    assert sorted(i for s in shards for i in s) == list(range(len(sizes)))
    loads = [sum(sizes[i] for i in s) for s in shards]
    if sizes:  # LPT: the heaviest shard exceeds the lightest by at most one parameter
        assert max(loads) - min(loads) <= max(sizes)


def test_sharding_largest_first():
    assert shard_by_bytes([100, 60, 50, 10], 2) == [[0, 3], [1, 2]]


def test_layout_roles():
    lay = PSLayout(nproc=2, num_ps=1, nnodes=2)
    assert [lay.role(r) for r in range(6)] == [("worker", 0), ("worker", 1), ("server", 0),
                                               ("worker", 2), ("worker", 3), ("server", 1)]
    assert all(lay.global_rank(*lay.role(r)) == r for r in range(6))
    assert lay.num_workers == 4 and lay.num_servers == 2 and lay.world_size == 6


def server(mode, W=2, backup=0, staleness_lr=False):
    s = ShardServer(0, W, mode, backup_workers=backup, staleness_lr=staleness_lr, timeout_s=5)
    s.init([torch.zeros(3, dtype=torch.float64)], torch.optim.SGD, {"lr": 1.0})
    return s


def test_sync_waits_for_all_and_averages():
    s = server("sync")
    f0 = s.push(0, 0, [torch.ones(3, dtype=torch.float64)], 1.0, 0.0)
    assert not f0.done()
    f1 = s.push(1, 0, [3 * torch.ones(3, dtype=torch.float64)], 1.0, 0.0)
    assert f0.done() and f1.done()
    version, params, skipped = f0.wait()
    assert not skipped
    assert version == 1 and torch.equal(params[0], -2 * torch.ones(3, dtype=torch.float64))


def test_sync_backup_drops_late_gradient():
    s = server("sync", W=3, backup=1)
    s.push(0, 0, [torch.ones(3, dtype=torch.float64)], 1.0, 0.0)
    s.push(1, 0, [torch.ones(3, dtype=torch.float64)], 1.0, 0.0)
    late = s.push(2, 0, [100 * torch.ones(3, dtype=torch.float64)], 1.0, 0.0)
    assert late.done() and late.wait()[0] == 1  # answered at once with the new version
    st = s.stats()
    assert (st["version"], st["applied"], st["dropped"], st["received"]) == (1, 2, 1, 3)
    assert torch.equal(s.pull()[1][0], -torch.ones(3, dtype=torch.float64))


def test_sync_step_completes_when_a_worker_is_done():
    s = server("sync", W=2)
    f = s.push(0, 0, [torch.ones(3, dtype=torch.float64)], 1.0, 0.0)
    s.worker_done(1)
    assert f.done() and s.stats()["version"] == 1


def test_sync_watchdog_names_the_missing_worker():
    s = server("sync", W=3)
    f = s.push(0, 0, [torch.ones(3, dtype=torch.float64)], 1.0, 0.0)
    s.push(2, 0, [torch.ones(3, dtype=torch.float64)], 1.0, 0.0)
    dead, failures = s.check_liveness(s.step_started + 6)
    assert dead == [] and len(failures) == 2 and failures[0][0] is f
    assert "worker(s) [1]" in str(failures[0][1])


def test_async_records_staleness_and_scales_lr():
    s = server("async", staleness_lr=True)
    s.push(0, 0, [torch.ones(3, dtype=torch.float64)], 1.0, 0.0)  # staleness 0, lr 1
    s.push(1, 0, [torch.ones(3, dtype=torch.float64)], 1.0, 0.0)  # staleness 1, lr 1 / 1
    s.push(1, 0, [torch.ones(3, dtype=torch.float64)], 1.0, 0.0)  # staleness 2, lr 1 / 2
    assert s.stats()["staleness"] == [0, 1, 2]
    assert torch.allclose(s.pull()[1][0], -2.5 * torch.ones(3, dtype=torch.float64))


def test_lr_comes_from_rank_0():
    s = server("async")
    s.push(1, 0, [torch.ones(3, dtype=torch.float64)], 5.0, 0.0)  # rank 1's lr is ignored
    assert torch.equal(s.pull()[1][0], -torch.ones(3, dtype=torch.float64))


@settings(max_examples=60, deadline=None)
@given(s=st.integers(0, 3), W=st.integers(1, 5), seed=st.integers(0, 10_000))
def test_gate_bounds_staleness(s, W, seed):
    """Random interleavings of admitted workers: every applied update has staleness <= s."""
    rng = random.Random(seed)
    gate, shard = StalenessGate(s), server("async", W=W)
    waiting = {w: gate.request(w) for w in range(W)}
    pulled: dict[int, int] = {}
    updates = 0
    while updates < 40:
        for w, fut in list(waiting.items()):  # admitted workers pull
            if fut.done():
                pulled[w] = shard.pull()[0]
                del waiting[w]
        assert pulled, "deadlock: nobody is admitted"
        w = rng.choice(sorted(pulled))  # one of the computing workers pushes
        shard.push(w, pulled.pop(w), [torch.zeros(3, dtype=torch.float64)], 1.0, 0.0)
        updates += 1
        waiting[w] = gate.request(w)
    assert max(shard.stats()["staleness"]) <= s


def test_gate_thread_safety():
    gate = StalenessGate(1)
    done = []

    def run(w):
        for _ in range(50):
            gate.request(w).wait()
        gate.leave(w)
        done.append(w)

    threads = [threading.Thread(target=run, args=(w,)) for w in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(done) == [0, 1, 2]


def test_bad_ps_options():
    from paratrain import config
    from paratrain.errors import UsageError

    with pytest.raises(UsageError, match="backup_workers"):
        config.load(None, ["dist.strategy=ps-sync", "dist.nproc=2", "dist.backup_workers=2"])
    with pytest.raises(UsageError, match="ps-async only"):
        config.load(None, ["dist.strategy=allreduce", "dist.max_staleness=2"])
    with pytest.raises(UsageError, match="unknown kind"):
        config.load(None, ["dist.fault=explode:rank=1"])


def test_staleness_summary_from_histogram():
    from paratrain.ps.client import staleness_summary

    hist = {0: 50, 1: 40, 5: 9, 9: 1}
    s = staleness_summary(hist)
    assert s["staleness_mean"] == (40 + 45 + 9) / 100
    assert (s["staleness_p50"], s["staleness_p99"], s["staleness_max"]) == (0.0, 5.0, 9.0)  # nearest rank
    assert staleness_summary({})["staleness_max"] == 0.0


def test_sync_drops_the_whole_version_when_a_gradient_is_not_finite():
    s = server("sync", W=2)
    f0 = s.push(0, 0, [torch.ones(3, dtype=torch.float64)], 1.0, 0.0)
    f1 = s.push(1, 0, None, 1.0, 0.0)  # worker 1's gradient was NaN/Inf
    for f in (f0, f1):
        version, params, skipped = f.wait()
        assert version == 1 and skipped
        assert torch.equal(params[0], torch.zeros(3, dtype=torch.float64))  # nothing of worker 0's gradient applied
    assert s.applied == 0


def test_sync_clipping_all_reduce_runs_outside_the_lock_and_on_empty_shards():
    seen = []

    def norm_allreduce(t):
        seen.append((t.dtype, t.item(), empty.lock.locked()))
        return t

    empty = ShardServer(1, 1, "sync", norm_allreduce=norm_allreduce)
    empty.init([], torch.optim.SGD, {"lr": 1.0})
    empty.push(0, 0, [], 1.0, 0.5).wait()  # an empty shard still takes part in the global norm
    assert seen == [(torch.float64, 0.0, False)]


def test_async_applies_no_update_past_the_limit():
    s = server("async", W=2)
    for i in range(5):
        s.push(i % 2, s.version, [torch.ones(3, dtype=torch.float64)], 1.0, 0.0, limit=3)
    assert s.version == 3 and s.applied == 3 and s.dropped == 2  # W x steps updates, not one more


def test_snapshot_holds_parameters_and_optimizer_state_of_one_version():
    s = ShardServer(0, 1, "async", timeout_s=5)
    s.init([torch.zeros(3, dtype=torch.float64)], torch.optim.SGD, {"lr": 1.0, "momentum": 0.9})
    s.push(0, 0, [torch.ones(3, dtype=torch.float64)], 1.0, 0.0)
    version, params, opt = s.snapshot()
    s.push(0, 1, [torch.ones(3, dtype=torch.float64)], 1.0, 0.0)  # a later update changes neither copy
    assert version == 1 and torch.equal(params[0], -torch.ones(3, dtype=torch.float64))
    assert torch.equal(opt["state"][0]["momentum_buffer"], torch.ones(3, dtype=torch.float64))


def test_liveness_is_heartbeats_not_pushes():
    s = server("async", W=2)
    long_ago = time.monotonic() - 100  # neither worker has pushed for 100 s (> timeout_s = 5)
    s.last_seen = {0: long_ago, 1: long_ago}
    s.heartbeat(1)  # worker 1 is evaluating or checkpointing; its process is alive
    dead, _ = s.check_liveness(time.monotonic())
    assert dead == [0]  # silent: gone; worker 1 lives on its heartbeats alone


def test_sync_step_fails_soon_when_a_workers_heartbeats_stop():
    """A worker on another node dies (no launcher here sees it): its heartbeats stop, and the sync
    step waiting for it fails after ``lost_after_s`` (4 heartbeat intervals), not after timeout_s."""
    s = ShardServer(0, 2, "sync", timeout_s=600.0)
    s.init([torch.zeros(3, dtype=torch.float64)], torch.optim.SGD, {"lr": 1.0})
    assert s.lost_after_s < 600.0
    f = s.push(0, 0, [torch.ones(3, dtype=torch.float64)], 1.0, 0.0)
    now = s.step_started
    s.last_seen = {0: now, 1: now - 0.5 * s.lost_after_s}
    assert s.check_liveness(now) == ([], [])  # worker 1 beat recently: keep waiting
    s.last_seen[1] = now - s.lost_after_s - 1
    s.last_seen[0] = now
    dead, failures = s.check_liveness(now)
    assert dead == [] and [fut for fut, _ in failures] == [f]
    assert f"connection to worker(s) [1] lost (no heartbeat for {s.lost_after_s:g} s)" in str(failures[0][1])


@pytest.mark.parametrize("strategy, extra", [("ps-async", []), ("ps-sync", ["dist.backup_workers=1"])])
def test_sync_batchnorm_is_refused_by_the_config_where_workers_do_not_step_together(strategy, extra):
    """Refused when the config is read (one line, before any process starts; ``paratrain plan`` reads
    it too), not at set-up inside the launched workers."""
    from paratrain import config
    from paratrain.errors import UsageError

    recipe = Path(__file__).resolve().parents[2] / "configs" / "digits_cnn.toml"
    with pytest.raises(UsageError, match=f"sync_batchnorm needs workers that step together; {strategy}"):
        config.load(str(recipe), [f'dist.strategy="{strategy}"', "dist.nproc=2", *extra])
    config.load(str(recipe), ['dist.strategy="ps-sync"', "dist.nproc=2"])  # workers in step: accepted


def test_server_update_seconds_leave_out_the_servers_norm_all_reduce():
    """``update_s`` is the shard's own work: the clipping all-reduce among the servers waits for the
    other servers' pushes, so a 0.3 s wait there is not counted."""
    def slow_allreduce(t):
        time.sleep(0.3)
        return t

    s = ShardServer(0, 1, "sync", timeout_s=5, norm_allreduce=slow_allreduce)
    s.init([torch.zeros(3)], torch.optim.SGD, {"lr": 1.0})
    s.push(0, 0, [torch.ones(3)], 1.0, 1.0).wait()
    assert s.version == 1 and 0 < s.update_s < 0.2
