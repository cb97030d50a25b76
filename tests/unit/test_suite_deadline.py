"""The suite's per-test deadline (pyproject's ``faulthandler_timeout`` with
``faulthandler_exit_on_timeout`` and ``--max-worker-restart 0``): a test that hangs, even blocked in
C, with or without the GIL, fails by name with every thread's stack printed, and the run ends."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

HANGS = {
    # blocks in C with the GIL released (a lock acquired twice)
    "lock": "import threading\n\n\ndef test_a_hang_in_c():\n    lock = threading.Lock()\n    lock.acquire()\n"
            "    lock.acquire()\n",
    # blocks in C holding the GIL: ctypes.PyDLL keeps it through the call, so no Python thread runs again
    "gil": "import ctypes\n\n\ndef test_a_hang_in_c():\n    ctypes.PyDLL(None).sleep(3600)\n",
}


@pytest.mark.slow
@pytest.mark.parametrize("hang", sorted(HANGS))
def test_a_test_hung_in_c_fails_by_name_with_its_stack_and_the_run_ends(tmp_path, hang):
    """pytest with this project's configuration (two xdist workers, loadfile, no worker restart) on a
    file whose test blocks forever in C and six files of one passing test each, the deadline lowered
    to 4 s: pytest exits 1, faulthandler's dump shows the hung test's frame, the failure names it, no
    worker replaces the ended one (so the test runs once), and the other worker's tests pass. The
    environment is fixed (no CI or BUILD_NUMBER, 80 columns) so that pytest's summary lines read the
    same everywhere; the subprocess' own bound covers the start-up of pytest and its workers."""
    (tmp_path / "test_hang.py").write_text(HANGS[hang])
    for i in range(6):
        (tmp_path / f"test_ok{i}.py").write_text(f"def test_ok{i}():\n    pass\n")
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "BUILD_NUMBER", "PYTEST_ADDOPTS")}
    env["COLUMNS"] = "80"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "--rootdir",
                           str(tmp_path), "-p", "no:cacheprovider", "-o", "faulthandler_timeout=4", "-q",
                           str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "Timeout (0:00:04)!" in out and "in test_a_hang_in_c" in out, out  # faulthandler's stack dump
    assert re.search(r"^FAILED test_hang.py::test_a_hang_in_c - worker 'gw\d' crashed", out, re.M), out
    crashed = re.findall(r"^worker 'gw\d' crashed while running 'test_hang.py::test_a_hang_in_c'$", out, re.M)
    assert len(crashed) == 1 and "replacing crashed worker" not in out, out  # run once, no restart
    summary = re.search(r"(\d+) failed, (\d+) passed", out)
    assert summary and summary[1] == "1" and int(summary[2]) >= 1, out
