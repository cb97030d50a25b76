"""The watchdog's diagnosis from facts: a gone process, silent heartbeats, a late peer, or not a
communication failure at all."""
from __future__ import annotations

import json
import os
import socket
import time

import torch.distributed as dist

from paratrain.watchdog import Watchdog


class FakeStore:
    def __init__(self, posts: dict[int, dict]) -> None:
        self.posts = posts

    def check(self, keys):
        return all(int(k) in self.posts for k in keys)

    def get(self, key):
        return json.dumps(self.posts[int(key)]).encode()


def watchdog(posts: dict[int, dict], step: int = 12, op: str = "gradient all-reduce") -> Watchdog:
    w = Watchdog(0, 1, timeout_s=600, interval_s=0.05)  # world_size 1: no store of its own
    w.world_size, w.store, w.step, w.op = 2, FakeStore(posts), step, op
    return w


def post(step: int, op: str, pid: int, host: str, age: float = 0.0) -> dict:
    return {"step": step, "op": op, "t": time.time() - age, "pid": pid, "host": host}


def dead_pid() -> int:
    pid = 2**22 - 7
    while os.path.exists(f"/proc/{pid}"):
        pid -= 1
    return pid


def test_a_peer_whose_process_is_gone_is_reported_exited():
    w = watchdog({0: post(12, "gradient all-reduce", os.getpid(), socket.gethostname()),
                  1: post(10, "gradient all-reduce", dead_pid(), socket.gethostname())})
    said = w.diagnose(RuntimeError("Connection reset by peer"))
    assert said.startswith("rank 1 exited (process") and "last seen at step 10" in said
    assert said.endswith("the gradient all-reduce of step 12 cannot complete")


def test_a_peer_on_another_host_whose_heartbeats_stopped_is_reported_lost():
    w = watchdog({1: post(11, "gradient all-reduce", 1234, "other-node", age=1.0)})
    said = w.diagnose(RuntimeError("Connection closed by peer"))
    assert said.startswith("connection to rank 1 lost (no heartbeat for") and "from other-node" in said


def test_a_peer_that_is_alive_and_behind_is_reported_late():
    class Beating(FakeStore):
        def get(self, key):  # a live peer posts a fresh heartbeat at every read
            self.posts[int(key)]["t"] = time.time()
            return super().get(key)

    w = watchdog({})
    w.store = Beating({1: post(12, "before the step", os.getpid(), socket.gethostname())})
    said = w.diagnose(RuntimeError("Timed out waiting 600000ms for recv operation to complete"))
    assert said == ("rank 1 did not arrive at the gradient all-reduce of step 12 within timeout_s=600 "
                    "(rank 1 is at step 12, before the step, alive)")


def test_an_error_that_is_not_about_communication_is_left_alone():
    class Beating(FakeStore):
        def get(self, key):
            self.posts[int(key)]["t"] = time.time()
            return super().get(key)

    w = watchdog({})
    w.store = Beating({1: post(12, "gradient all-reduce", os.getpid(), socket.gethostname())})
    assert w.diagnose(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None
    assert "although every rank reached it" in w.diagnose(dist.DistBackendError("NCCL error"))
