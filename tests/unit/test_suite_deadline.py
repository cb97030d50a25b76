"""The suite's per-test deadline (pyproject's pytest-timeout and faulthandler settings): a test that
hangs, even blocked in C where no signal reaches it, fails by name, with every thread's stack printed,
and the rest of the suite still runs on the other pytest worker."""
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

HANGING = '''
import threading


def test_a_hang_in_c():
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()  # blocks forever in C
'''


@pytest.mark.slow
def test_a_test_hung_in_c_fails_by_name_with_its_stack_and_the_suite_goes_on(tmp_path):
    """pytest with this project's configuration (two xdist workers, loadfile, the thread method, no
    worker restart) on a file whose test blocks forever in C and six files of one passing test each,
    the deadline lowered to 6 s and the stack dump to 3 s: pytest exits 1 naming the hung test, its
    stack is printed, the hung test is run once (no restart runs it again) and the other worker runs
    passing tests. The outer bound covers the start-up of pytest and its workers besides."""
    (tmp_path / "test_hang.py").write_text(HANGING)
    for i in range(6):
        (tmp_path / f"test_ok{i}.py").write_text(f"def test_ok{i}():\n    pass\n")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "--rootdir",
                           str(tmp_path), "-p", "no:cacheprovider", "-o", "timeout=6", "-o", "faulthandler_timeout=3",
                           "-q", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "Timeout (0:00:03)!" in out and "in test_a_hang_in_c" in out, out  # faulthandler's stack dump
    assert re.search(r"FAILED test_hang.py::test_a_hang_in_c - worker 'gw\d' crashed", out), out
    assert out.count("crashed while running 'test_hang.py::test_a_hang_in_c'") == 1, out  # run once
    summary = re.search(r"(\d+) failed, (\d+) passed", out)
    assert summary and summary[1] == "1" and int(summary[2]) >= 1, out
    assert time.monotonic() - start < 240
