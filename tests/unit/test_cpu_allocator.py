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
from paratrain.devices import apply_cpu_allocator, without_cpu_allocator
from paratrain.errors import UsageError

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc" or "[always]" in (
    _THP.read_text() if _THP.exists() else ""), reason="glibc's malloc, 4 KiB pages (huge pages fault 512 times less)")

BLOCK = 64 * 2**20  # bytes: above glibc's largest dynamic mmap threshold (32 MiB), as an LM's logits are
STEPS, WARMUP = 10, 20
PAGES = BLOCK // os.sysconf("SC_PAGE_SIZE")

# a "step" allocates and fills a block, then frees it: the faults of STEPS steps after WARMUP, and the state
_MEASURE = f"""
import json, resource, torch
from paratrain.devices import cpu_allocator_in_effect
for _ in range({WARMUP}):  # glibc settles in the first steps (an aligned request outgrows a freed block)
    torch.empty({BLOCK} // 4).fill_(1.0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range({STEPS}):
    torch.empty({BLOCK} // 4).fill_(1.0)
print(json.dumps([resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, cpu_allocator_in_effect()]))
"""


def _clean_env(**extra: str) -> dict:
    env = without_cpu_allocator(os.environ)
    env.pop("GLIBC_TUNABLES", None)
    return {**env, **extra}


def _measure(modes: list[str], *, in_child: bool = False, **env: str) -> dict:
    """A fresh process applies ``modes`` in turn; then it (or, ``in_child``, a process it starts, which
    applies nothing itself) runs the steps. Returns the faults, the measuring process' state
    (:func:`cpu_allocator_in_effect`), what each call returned and the malloc variables passed on."""
    script = textwrap.dedent(f"""
        import json, os, subprocess, sys
        from paratrain.devices import apply_cpu_allocator
        got = [apply_cpu_allocator(m) for m in {modes!r}]
        passed = {{k: v for k, v in os.environ.items() if k.startswith("MALLOC_") or k == "PARATRAIN_CPU_ALLOCATOR"}}
        if {in_child!r}:
            print(subprocess.run([sys.executable, "-c", {_MEASURE!r}], capture_output=True, text=True, check=True,
                                 timeout=100).stdout.strip())
        else:
            exec({_MEASURE!r})
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
def test_the_processes_it_starts_retain_too_and_a_later_default_starts_them_with_glibcs_own():
    child = _measure(["retain"], in_child=True)
    assert child["faults"] < PAGES and child["state"] == "retain"
    assert set(child["passed"]) == {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "PARATRAIN_CPU_ALLOCATOR"}
    # retain, then default in the same process: it cannot undo its own glibc (and says so); its children can
    later = _measure(["retain", "default"], in_child=True)
    assert later["returned"] == ["retain", "retain"] and later["passed"] == {}
    assert later["faults"] >= STEPS * PAGES // 2 and later["state"] == "default"


@glibc
def test_the_users_own_malloc_settings_are_left_to_the_user():
    got = _measure(["retain"], in_child=True, MALLOC_TRIM_THRESHOLD_="131072")
    assert got["returned"] == ["user"] and got["state"] == "user"
    assert got["passed"] == {"MALLOC_TRIM_THRESHOLD_": "131072"}  # nothing added, nothing removed


def test_an_unknown_allocator_is_a_usage_error():
    with pytest.raises(UsageError, match="cpu_allocator"):
        apply_cpu_allocator("jemalloc")
    with pytest.raises(UsageError, match="cpu_allocator"):
        config.load(None, ['dist.cpu_allocator="jemalloc"'])
    assert config.load(None, ['dist.cpu_allocator="default"']).dist.cpu_allocator == "default"
    assert config.load(None, []).dist.cpu_allocator == "retain"
