"""``dist.cpu_allocator``: glibc keeps the blocks a step frees (``retain``) or gives them back to the
kernel (``default``), here and in the processes it starts. Measured by page faults, which count the
kernel mapping memory again (minor faults), not by time. Each case runs in a fresh process: glibc's
settings cannot be undone in the process that made them."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from paratrain import config
from paratrain.devices import NEVER_TRIM, RETAIN_MMAP_THRESHOLD, apply_cpu_allocator, without_cpu_allocator
from paratrain.errors import UsageError

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_LIBC, _LIBC_VERSION = platform.libc_ver()
glibc = pytest.mark.skipif(
    _LIBC != "glibc" or tuple(int(x) for x in _LIBC_VERSION.split(".")[:2]) < (2, 35)
    or "[always]" in (_THP.read_text() if _THP.exists() else ""),
    reason="glibc 2.35 or later (before, retain's mmap threshold is 32 MiB), 4 KiB pages (huge ones fault 512x less)")


def _available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return 0.0

BLOCK = 64 * 2**20  # bytes: above glibc's largest dynamic mmap threshold (32 MiB), as an LM's logits are
STEPS, WARMUP = 10, 20
PAGES = BLOCK // os.sysconf("SC_PAGE_SIZE")

# a "step" allocates and fills a block, then frees it: the faults of STEPS steps after WARMUP, and the
# state. The steps run in the main thread, or (THREAD) in a thread started after the settings, as a CPU
# tower's forward does: a thread arena's heap holds at most 64 MiB, so BLOCK does not fit one.
_MEASURE = f"""
import json, resource, threading, torch
from paratrain.devices import cpu_allocator_in_effect
def steps(out):
    for _ in range({WARMUP}):  # glibc settles in the first steps (an aligned request outgrows a freed block)
        torch.empty({BLOCK} // 4).fill_(1.0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range({STEPS}):
        torch.empty({BLOCK} // 4).fill_(1.0)
    out.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
out = []
if THREAD:
    t = threading.Thread(target=steps, args=(out,))
    t.start()
    t.join()
else:
    steps(out)
print(json.dumps([out[0], cpu_allocator_in_effect()]))
"""


def _clean_env(**extra: str) -> dict:
    env = without_cpu_allocator(os.environ)
    env.pop("GLIBC_TUNABLES", None)
    return {**env, **extra}


def _measure(modes: list[str], *, in_child: bool = False, in_thread: bool = False, **env: str) -> dict:
    """A fresh process applies ``modes`` in turn; then it (or, ``in_child``, a process it starts, which
    applies nothing itself) runs the steps, in its main thread or (``in_thread``) a thread it starts
    after. Returns the faults, the measuring process' state
    (:func:`cpu_allocator_in_effect`), what each call returned and the malloc variables passed on."""
    measure = f"THREAD = {in_thread!r}\n{_MEASURE}"
    script = textwrap.dedent(f"""
        import json, os, subprocess, sys
        from paratrain.devices import apply_cpu_allocator
        got = [apply_cpu_allocator(m) for m in {modes!r}]
        passed = {{k: v for k, v in os.environ.items() if k.startswith("MALLOC_") or k == "PARATRAIN_CPU_ALLOCATOR"}}
        if {in_child!r}:
            print(subprocess.run([sys.executable, "-c", {measure!r}], capture_output=True, text=True, check=True,
                                 timeout=100).stdout.strip())
        else:
            exec({measure!r})
        print(json.dumps({{"returned": got, "passed": passed}}))
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=_clean_env(**env),
                         timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.strip().splitlines()
    (faults, state), tail = json.loads(lines[-2]), json.loads(lines[-1])
    return {"faults": faults, "state": state, **tail}


@glibc
def test_retain_reuses_a_freed_block_where_default_maps_it_again_every_step():
    default, retain = _measure(["default"]), _measure(["retain"])
    assert default["faults"] >= STEPS * PAGES // 2 and default["state"] == "default"  # mapped again every step
    assert retain["faults"] < PAGES and retain["state"] == "retain"  # from the heap, its pages still mapped


@glibc
def test_retain_reuses_a_threads_freed_block_larger_than_a_thread_arenas_heap():
    # a tower's thread: by default it has an arena of its own, whose 64 MiB heaps cannot hold BLOCK,
    # so BLOCK is mapped and unmapped every step even under the thresholds; with one arena it is not
    default = _measure(["default"], in_thread=True)
    assert default["faults"] >= STEPS * PAGES // 2
    thresholds_only = _measure(["default"], in_thread=True, MALLOC_MMAP_THRESHOLD_=str(2**30),
                               MALLOC_TRIM_THRESHOLD_=str(2**31 - 1))
    assert thresholds_only["faults"] >= STEPS * PAGES // 2
    retain = _measure(["retain"], in_thread=True)
    assert retain["faults"] < PAGES and retain["state"] == "retain"
    child = _measure(["retain"], in_child=True, in_thread=True)  # the arena limit reaches the processes it starts
    assert child["faults"] < PAGES and child["passed"]["MALLOC_ARENA_MAX"] == "1"


# a step of gpt_wt2 at batch 64 frees more than 2 GiB: three blocks under the mmap threshold, freed together
# into the heap's top (glibc's malloc and memset, no torch: its aligned requests settle only after many steps)
_LARGE_STEP = """
import ctypes, json, os, resource
from paratrain.devices import apply_cpu_allocator
got = apply_cpu_allocator("retain") if os.environ.get("APPLY") else None
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes, libc.memset.argtypes = [ctypes.c_void_p], [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
size = 800 << 20
def step():
    blocks = [libc.malloc(size) for _ in range(3)]
    assert all(blocks), "malloc returned NULL"
    for b in blocks:
        libc.memset(b, 1, size)
    for b in blocks:
        libc.free(b)
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(2):
    step()
print(json.dumps([resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, got]))
"""


@glibc
@pytest.mark.skipif(_available_gib() < 6, reason="needs about 3 GiB free for a step of 2.4 GiB")
def test_retain_keeps_a_heap_top_larger_than_2_gib_that_a_trim_threshold_of_2_gib_gives_back():
    def faults(**env: str) -> tuple[int, str | None]:
        res = subprocess.run([sys.executable, "-c", _LARGE_STEP], capture_output=True, text=True,
                             env=_clean_env(**env), timeout=120)
        assert res.returncode == 0, f"rc {res.returncode}: {res.stderr[-2000:]}"
        return tuple(json.loads(res.stdout.strip().splitlines()[-1]))

    pages = 3 * (800 << 20) // os.sysconf("SC_PAGE_SIZE")
    count, got = faults(APPLY="1")
    assert got == "retain" and count < pages // 10  # never trimmed: the three blocks' pages stay mapped
    # a process it starts reads the same from the variables it passes on (glibc parses the trim threshold)
    passed = {"MALLOC_MMAP_THRESHOLD_": str(RETAIN_MMAP_THRESHOLD), "MALLOC_TRIM_THRESHOLD_": NEVER_TRIM}
    assert faults(**passed)[0] < pages // 10
    # the largest trim threshold mallopt takes as a number: the heap's top is given back every step
    assert faults(MALLOC_MMAP_THRESHOLD_=str(2**30), MALLOC_TRIM_THRESHOLD_=str(2**31 - 1))[0] >= pages


@glibc
def test_the_processes_it_starts_retain_too_and_a_later_default_starts_them_with_glibcs_own():
    child = _measure(["retain"], in_child=True)
    assert child["faults"] < PAGES and child["state"] == "retain"
    assert set(child["passed"]) == {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX",
                                    "PARATRAIN_CPU_ALLOCATOR"}
    # retain, then default in the same process: it cannot undo its own glibc (and says so); its children can
    later = _measure(["retain", "default"], in_child=True)
    assert later["returned"] == ["retain", "retain"] and later["passed"] == {}
    assert later["faults"] >= STEPS * PAGES // 2 and later["state"] == "default"


@glibc
def test_the_users_own_malloc_settings_are_left_to_the_user():
    got = _measure(["retain"], in_child=True, MALLOC_TRIM_THRESHOLD_="131072")
    assert got["returned"] == ["user"] and got["state"] == "user"
    assert got["passed"] == {"MALLOC_TRIM_THRESHOLD_": "131072"}  # nothing added, nothing removed
    arenas = _measure(["retain", "default"], MALLOC_ARENA_MAX="2")  # a container's usual setting, alone
    assert arenas["returned"] == ["user", "user"] and arenas["passed"] == {"MALLOC_ARENA_MAX": "2"}


def test_an_unknown_allocator_is_a_usage_error():
    with pytest.raises(UsageError, match="cpu_allocator"):
        apply_cpu_allocator("jemalloc")
    with pytest.raises(UsageError, match="cpu_allocator"):
        config.load(None, ['dist.cpu_allocator="jemalloc"'])
    assert config.load(None, ['dist.cpu_allocator="default"']).dist.cpu_allocator == "default"
    assert config.load(None, []).dist.cpu_allocator == "retain"


# a thread allocates (taking an arena of its own unless the limit is already 1), before or after retain
_LATE = """
import json, os, threading
from paratrain.devices import apply_cpu_allocator, malloc_arenas
def allocate():
    global kept
    kept = [bytearray(4096) for _ in range(8)]
def thread():
    t = threading.Thread(target=allocate)
    t.start()
    t.join()
before = malloc_arenas()
if os.environ["ORDER"] == "thread first":
    thread()
import warnings
warnings.simplefilter("always")  # a second warning would show, from either line: once a process is the code's
got = [apply_cpu_allocator("retain")]
got.append(apply_cpu_allocator("retain"))
if os.environ["ORDER"] == "retain first":
    thread()
print(json.dumps({"before": before, "after": malloc_arenas(), "got": got}))
"""


@glibc
def test_retain_says_once_when_a_thread_took_an_arena_before_it_and_not_when_it_came_first():
    def run(order: str) -> tuple[dict, str]:
        res = subprocess.run([sys.executable, "-c", _LATE], capture_output=True, text=True,
                             env=_clean_env(ORDER=order), timeout=60)
        assert res.returncode == 0, res.stderr[-2000:]
        return json.loads(res.stdout.strip().splitlines()[-1]), res.stderr

    late, said = run("thread first")
    assert late["before"] == 1 and late["after"] == 2 and late["got"] == ["retain", "retain"]
    lines = [line for line in said.splitlines() if "malloc arena" in line]
    assert len(lines) == 1 and "1 malloc arena(s)" in lines[0] and "MALLOC_ARENA_MAX=1" in lines[0]
    first, said = run("retain first")
    assert first["before"] == 1 and first["after"] == 1 and "malloc arena" not in said
