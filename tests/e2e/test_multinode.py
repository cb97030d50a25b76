"""Two nodes for real: two `paratrain train` launchers, each its own "node" with its own address and
its own run dir (no shared filesystem), form one job over the network between them.

Each node runs in a network namespace of its own (created here, removed after), joined by a veth
pair: node 0 is 10.211.0.1, node 1 is 10.211.0.2, and nothing else is reachable. Where namespaces
cannot be made (not root, no iproute2), the nodes use the loopback addresses 127.0.0.2 and
127.0.0.3 instead; the test says which it used.

What is checked: 2 nodes x 1 worker on ptb_quick for 20 steps equal `single` at the same global
batch, whichever node starts first, with node 0 (by --node-rank)
holding rank 0; a node that never starts ends the other within --rdzv-timeout with one line, and
nothing survives; a worker killed on node 1 under --max-restarts 1 resumes from rank 0's checkpoint
(node 1 has none of its own) and ends equal to the uninterrupted run, under allreduce and under
ps-sync (a worker and a parameter server per node).

The comparison runs in float64 (tolerance 1e-10). In float32 the two nodes are bitwise equal to
the same job on one node (`--nproc 2`), and differ from `single` by float32 rounding that lr 20
amplifies: 1.1e-6 after 10 steps, 1.7e-4 after 20 (measured), so 1e-5 at step 20 would test
rounding growth rather than the distribution.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import pytest

from .test_cli import final_model, paratrain
from .test_reliability import records, survivors

REPO = Path(__file__).resolve().parents[2]
STEPS = ("--set", "train.max_steps=20", "--set", "model.dropout=0.0", "--set", "data.eval_fraction=0.02",
         "--set", 'train.dtype="float64"',
         "--set", "train.checkpoint_every=5", "--threads", "1")
RDZV_TIMEOUT = 20  # seconds a node waits for the other
ALONE_TIMEOUT = 8  # the same, where the other node never comes
START_UP = 90  # launcher, torch import, data and model build on a busy 2-core machine


class Nodes:
    """Two node addresses, and how to run a command on each."""

    def __init__(self, addrs: tuple[str, str], prefixes: tuple[list[str], list[str]], kind: str) -> None:
        self.addrs, self.prefixes, self.kind = addrs, prefixes, kind

    def start(self, node: int, args, cwd: Path, log: Path) -> subprocess.Popen:
        cmd = [*self.prefixes[node], sys.executable, "-m", "paratrain.cli", *map(str, args)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("SLURM_JOB_ID", None)
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                start_new_session=True)


def _ip(*args: str) -> bool:
    return subprocess.run(["ip", *args], capture_output=True).returncode == 0


@contextmanager
def two_nodes():
    tag = uuid.uuid4().hex[:6]
    ns, veth = (f"pt{tag}a", f"pt{tag}b"), (f"pv{tag}a", f"pv{tag}b")
    made: list[str] = []
    ok = shutil.which("ip") is not None and os.geteuid() == 0
    try:
        if ok:
            for n in ns:
                ok = ok and _ip("netns", "add", n)
                if ok:
                    made.append(n)
            ok = ok and _ip("link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
            for i in (0, 1):
                ok = (ok and _ip("link", "set", veth[i], "netns", ns[i])
                      and _ip("-n", ns[i], "addr", "add", f"10.211.0.{i + 1}/24", "dev", veth[i])
                      and _ip("-n", ns[i], "link", "set", veth[i], "up")
                      and _ip("-n", ns[i], "link", "set", "lo", "up"))
        if ok:
            yield Nodes(("10.211.0.1", "10.211.0.2"), tuple(["ip", "netns", "exec", n] for n in ns),
                        "network namespaces joined by a veth pair")
        else:
            yield Nodes(("127.0.0.2", "127.0.0.3"), ([], []), "loopback addresses (no network namespaces here)")
    finally:
        for n in made:
            _ip("netns", "del", n)


@pytest.fixture
def nodes():
    with two_nodes() as n:
        print(f"two nodes on {n.kind}: {n.addrs}")
        yield n


def _free_port() -> int:
    import random

    return random.randint(30000, 39999)


def node_args(nodes: Nodes, node: int, run_dir: Path, port: int, data: Path, *extra,
              rdzv_timeout: int = RDZV_TIMEOUT) -> list:
    return ["train", REPO / "configs" / "ptb_quick.toml", "--data-dir", data, "--nproc", 1, "--nnodes", 2,
            "--node-rank", node, "--rdzv-endpoint", f"{nodes.addrs[0]}:{port}", "--rdzv-timeout", rdzv_timeout,
            "--run-dir", run_dir, *STEPS, *extra]


def wait(procs: list[subprocess.Popen], deadline_s: float) -> list[int | None]:
    """Exit codes; None for a process still running at the deadline (then killed with its group)."""
    end = time.monotonic() + deadline_s
    codes: list[int | None] = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(0.1, end - time.monotonic())))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            codes.append(None)
    return codes


def max_rel_diff(a: dict, b: dict) -> float:
    return max(((a[k].double() - b[k].double()).abs().max() / b[k].double().abs().max().clamp_min(1e-12)).item()
               for k in b)


@pytest.fixture(scope="module")
def single_20(real_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("single")
    r = paratrain("train", REPO / "configs" / "ptb_quick.toml", "--data-dir", real_data, "--strategy", "single",
                  "--run-dir", "one", *STEPS, cwd=tmp, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return final_model(tmp / "one")


@pytest.mark.slow
@pytest.mark.parametrize("first", [1, 0])
def test_two_nodes_equal_single_in_any_start_order(nodes, real_data, single_20, tmp_path, first):
    port = _free_port()
    procs = {}
    for node in (first, 1 - first):
        procs[node] = nodes.start(node, node_args(nodes, node, tmp_path / f"node{node}", port, real_data),
                                  tmp_path, tmp_path / f"node{node}.log")
        time.sleep(3)  # the other node arrives late
    codes = wait([procs[0], procs[1]], START_UP + 240)
    logs = [(tmp_path / f"node{n}.log").read_text() for n in (0, 1)]
    assert codes == [0, 0], f"{codes}\n--- node 0\n{logs[0][-2500:]}\n--- node 1\n{logs[1][-2500:]}"
    assert "world_size 2" in logs[0] and "world_size 2" in logs[1]
    # --node-rank is honoured: node 0 holds rank 0 (it writes the checkpoints and metrics), node 1 none
    assert list((tmp_path / "node0").glob("checkpoint-*.pt")) and not list((tmp_path / "node1").glob("checkpoint-*"))
    two = final_model(tmp_path / "node0")
    diff = max_rel_diff(two, single_20)
    print(f"two nodes ({nodes.kind}) vs single, 20 steps, float64: max relative difference {diff:.2e}")
    assert diff < 1e-10


@pytest.mark.slow
@pytest.mark.parametrize("present", [0, 1])
def test_a_node_that_never_starts_ends_the_other_within_the_timeout(nodes, real_data, tmp_path, present):
    port = _free_port()
    run_dir = tmp_path / f"node{present}"
    log = tmp_path / "alone.log"
    p = nodes.start(present, node_args(nodes, present, run_dir, port, real_data, rdzv_timeout=ALONE_TIMEOUT),
                    tmp_path, log)
    t0 = time.monotonic()
    [code] = wait([p], START_UP + ALONE_TIMEOUT + 30)
    elapsed = time.monotonic() - t0
    out = log.read_text()
    assert code == 2, f"exit {code} after {elapsed:.0f} s\n{out[-2500:]}"
    where = f"{nodes.addrs[0]}:{port}"
    want = (f"only 1 of 2 nodes joined the rendezvous at {where} within {ALONE_TIMEOUT} s" if present == 0
            else f"node 1 could not reach node 0's rendezvous at {where}")
    lines = [ln for ln in out.splitlines() if ln.startswith("paratrain:")]
    assert lines and want in lines[-1], out[-2500:]
    assert "Traceback" not in out
    time.sleep(1)
    assert survivors(str(run_dir)) == []


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["allreduce", "ps-sync"])
def test_worker_killed_on_node_1_resumes_from_rank_0s_checkpoint(nodes, real_data, single_20, tmp_path, strategy):
    """ps-sync: each node runs its worker and a parameter server; node 0 learns of the death from the
    stopped heartbeats or the lost server (train.timeout_s stays 600 s); the restarted servers get rank 0's checkpoint
    from rank 0 (through set_params), the worker on node 1 over the worker group."""
    port = _free_port()
    kill = ("--fault", "kill:rank=1:step=12", "--max-restarts", 1, "--strategy", strategy,
            *(("--num-ps", 1) if strategy == "ps-sync" else ()))
    procs = [nodes.start(n, node_args(nodes, n, tmp_path / f"node{n}", port, real_data, *kill), tmp_path,
                         tmp_path / f"node{n}.log") for n in (0, 1)]
    codes = wait(procs, START_UP * 2 + 300)
    logs = [(tmp_path / f"node{n}.log").read_text() for n in (0, 1)]
    assert codes == [0, 0], f"{codes}\n--- node 0\n{logs[0][-3000:]}\n--- node 1\n{logs[1][-3000:]}"
    assert "fault injection: SIGKILL after 12 steps" in logs[1]
    assert "restart 1 of 1: resuming from step 10 (checkpoint-00000010.pt)" in logs[0]
    if strategy == "ps-sync":  # node 0 learns of the death in one line, long before timeout_s (600 s):
        # from the stopped heartbeats of worker 1, or from its lost connection to the server on node 1
        # (whichever comes first: node 1's agent stops that server when it restarts its processes)
        told = ("connection to worker(s) [1] lost (no heartbeat for 20 s)",
                "parameter server 1 (rank 3, shard 1: 7 parameter tensors) is gone")
        assert any(t in logs[0] for t in told), logs[0][-3000:]
        assert "Traceback" not in logs[0]
    resumed = [r for r in records(tmp_path / "node0", "resume")]
    assert len(resumed) == 1 and resumed[0]["step"] == 10
    assert not list((tmp_path / "node1").glob("checkpoint-*"))  # node 1 resumed from what rank 0 sent
    diff = max_rel_diff(final_model(tmp_path / "node0"), single_20)
    print(f"two nodes ({strategy}) with a kill and a restart vs single, 20 steps, float64: "
          f"max relative difference {diff:.2e}")
    assert diff < 1e-10


@pytest.mark.slow
def test_a_dead_node_is_reported_as_dead_by_the_survivor(nodes, real_data, tmp_path):
    port = _free_port()
    kill = ("--fault", "kill:rank=1:step=12", "--set", "train.timeout_s=600")
    procs = [nodes.start(n, node_args(nodes, n, tmp_path / f"node{n}", port, real_data, *kill), tmp_path,
                         tmp_path / f"node{n}.log") for n in (0, 1)]
    t0 = time.monotonic()
    codes = wait(procs, START_UP * 2 + 120)  # far below timeout_s=600: the death is seen, not waited out
    logs = [(tmp_path / f"node{n}.log").read_text() for n in (0, 1)]
    assert codes[0] not in (0, None) and codes[1] not in (0, None), f"{codes} after {time.monotonic() - t0:.0f} s"
    said = [ln for ln in logs[0].splitlines() if "paratrain: stopped:" in ln]
    # namespaces share the host name and pid space, so the survivor may see the process gone as well
    assert len(said) == 1 and ("connection to rank 1 lost" in said[0] or "rank 1 exited" in said[0]), logs[0][-3000:]
    assert "the gradient all-reduce of step 12 cannot complete" in said[0]
    assert "did not arrive" not in logs[0] and "Traceback" not in logs[0]
    assert "paratrain: rank 1 failed first: killed by signal SIGKILL at step 12 (before the step)" in logs[1]
