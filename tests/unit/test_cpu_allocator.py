"""``dist.cpu_allocator``: glibc keeps the blocks a step frees (``retain``) or gives them back to the
kernel (``default``), here and in the processes it starts. Measured by page faults, which count the
kernel mapping memory again (minor faults), not by time."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import pytest

from paratrain import config
from paratrain.devices import RETAIN_MMAP_THRESHOLD, apply_cpu_allocator, cpu_allocator_in_effect
from paratrain.errors import UsageError

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc settings")

BLOCK = 64 * 2**20  # bytes: above glibc's largest dynamic mmap threshold (32 MiB), as an LM's logits are
STEPS = 10
WARMUP = 20

# one "step" allocates and fills a block, then frees it; the faults of the last STEPS steps
_STEPS = f"""
import resource, torch
def faults():
    for _ in range({WARMUP}):  # glibc settles in the first steps (an aligned request outgrows a freed block)
        torch.empty({BLOCK} // 4).fill_(1.0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range({STEPS}):
        torch.empty({BLOCK} // 4).fill_(1.0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
"""


def _faults(mode: str, *, in_child: bool = False) -> int:
    """Minor page faults of STEPS steps in a fresh process that applied ``mode`` (``in_child``: in a
    process that one started after applying it, which does not apply it itself)."""
    measure = _STEPS + "print(faults())"
    script = textwrap.dedent(f"""
        import os, subprocess, sys
        from paratrain.devices import apply_cpu_allocator
        apply_cpu_allocator({mode!r})
        if {in_child!r}:
            print(subprocess.run([sys.executable, "-c", {measure!r}], capture_output=True, text=True,
                                 check=True).stdout.strip())
        else:
            exec({measure!r})
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "PARATRAIN_CPU_ALLOCATOR"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


@glibc
def test_retain_reuses_a_freed_block_where_default_maps_it_again_every_step():
    pages = BLOCK // os.sysconf("SC_PAGE_SIZE")
    default, retain = _faults("default"), _faults("retain")
    assert default >= STEPS * pages // 2  # glibc's default: the block's pages mapped again every step
    assert retain < pages  # retain: the block came back from the heap, its pages already mapped


@glibc
def test_the_processes_it_starts_retain_too():
    pages = BLOCK // os.sysconf("SC_PAGE_SIZE")
    assert _faults("retain", in_child=True) < pages
    assert _faults("default", in_child=True) >= STEPS * pages // 2


def test_default_removes_what_retain_set_and_leaves_the_users_own(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(RETAIN_MMAP_THRESHOLD))
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "12345")  # the user's own value of the other
    monkeypatch.setenv("PARATRAIN_CPU_ALLOCATOR", "retain")
    assert cpu_allocator_in_effect() == "retain"
    assert apply_cpu_allocator("default") is False
    assert "MALLOC_MMAP_THRESHOLD_" not in os.environ and "PARATRAIN_CPU_ALLOCATOR" not in os.environ
    assert os.environ["MALLOC_TRIM_THRESHOLD_"] == "12345"
    assert cpu_allocator_in_effect() == "user"
    assert apply_cpu_allocator("retain") is True  # the user's setting stands: nothing is changed
    assert os.environ["MALLOC_TRIM_THRESHOLD_"] == "12345" and "MALLOC_MMAP_THRESHOLD_" not in os.environ


def test_an_unknown_allocator_is_a_usage_error():
    with pytest.raises(UsageError, match="cpu_allocator"):
        apply_cpu_allocator("jemalloc")
    with pytest.raises(UsageError, match="cpu_allocator"):
        config.load(None, ['dist.cpu_allocator="jemalloc"'])
    assert config.load(None, ['dist.cpu_allocator="default"']).dist.cpu_allocator == "default"
    assert config.load(None, []).dist.cpu_allocator == "retain"
