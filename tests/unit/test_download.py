"""``ensure_corpus`` / ``download`` against a local HTTP server (no network).

A ``ThreadingHTTPServer`` on 127.0.0.1 and a free port serves a temp folder laid
out like the mirror that ``$PARATRAIN_DATA_URL`` names (``<root>/ptb/ptb.train.txt``
...), holding copies of the real PTB files, made in ``tmp_path`` at test time.
``PARATRAIN_DATA_URL`` reaches the library through its ``environ`` argument and
the CLI through the subprocess environment. The real files come from the
``real_data`` fixture (``$PARATRAIN_DATA``, else ``../shared/data``); without
them the tests that serve them are skipped.
"""
from __future__ import annotations

import functools
import hashlib
import http.server
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from paratrain.data.corpus import CORPORA, download, ensure_corpus
from paratrain.errors import DataError

PTB = CORPORA["ptb"]
NAMES = [f.name for f in PTB.files.values()]  # ptb.train.txt, ptb.valid.txt, ptb.test.txt


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch):
    """urllib reads proxy settings from os.environ; 127.0.0.1 must be reached directly."""
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def real_ptb(real_data) -> Path:
    """The folder with the real (read-only) PTB files; never written to."""
    folder = real_data / "ptb"
    if not all((folder / n).is_file() for n in NAMES):
        pytest.skip(f"real PTB files not all found in {folder}")
    return folder


@pytest.fixture
def server(tmp_path, request, real_ptb):
    """Serve ``tmp_path/srv`` (``ptb/`` = copies of the real files); ``requests`` lists the GET paths."""
    root = tmp_path / "srv"
    (root / "ptb").mkdir(parents=True)
    for name in NAMES:
        shutil.copyfile(real_ptb / name, root / "ptb" / name)  # copyfile: writable copies of read-only files
    requests: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def do_GET(self):
            requests.append(self.path)
            super().do_GET()

        def log_message(self, format, *args):  # keep test output clean
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(root)))
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="test-http",
                              daemon=True)
    thread.start()

    def stop():
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)

    request.addfinalizer(stop)
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    return SimpleNamespace(url=url, root=root, requests=requests, environ={"PARATRAIN_DATA_URL": url})


@pytest.fixture
def closed_url():
    """A URL whose port is bound but not listening: connections are refused at once."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    try:
        yield f"http://127.0.0.1:{s.getsockname()[1]}"
    finally:
        s.close()


def leftovers(folder: Path) -> list[str]:
    """Files in ``folder`` other than the corpus files (temp/partial downloads)."""
    return sorted(p.name for p in folder.iterdir() if p.name not in NAMES) if folder.is_dir() else []


def test_downloads_all_three_files_into_an_empty_data_dir(server, tmp_path):
    data = tmp_path / "data"
    paths = ensure_corpus("ptb", data, environ=server.environ)

    for split, f in PTB.files.items():
        assert paths[split] == data / "ptb" / f.name
        assert sha256(paths[split]) == f.sha256
    assert sorted(server.requests) == sorted(f"/ptb/{n}" for n in NAMES)
    assert leftovers(data / "ptb") == []


def test_base_url_with_trailing_slash(server, tmp_path):
    paths = ensure_corpus("ptb", tmp_path / "data", environ={"PARATRAIN_DATA_URL": server.url + "/"})
    assert sorted(server.requests) == sorted(f"/ptb/{n}" for n in NAMES)
    assert all(sha256(paths[s]) == f.sha256 for s, f in PTB.files.items())


def test_corrupt_served_file_raises_sha256_error_and_leaves_no_file(server, tmp_path):
    served = server.root / "ptb" / "ptb.valid.txt"
    data = bytearray(served.read_bytes())
    data[1000] ^= 0x01  # one bit, same length
    served.write_bytes(bytes(data))
    dest = tmp_path / "data" / "ptb" / "ptb.valid.txt"

    with pytest.raises(DataError) as e:
        ensure_corpus("ptb", tmp_path / "data", environ=server.environ)

    msg = str(e.value)
    assert "sha256" in msg and str(dest) in msg, msg
    assert "\n" not in msg
    assert not dest.exists()
    assert leftovers(dest.parent) == []  # no ptb.valid.txt.*.part
    assert "/ptb/ptb.valid.txt" in server.requests


def test_download_checksum_mismatch_keeps_dest_absent(server, tmp_path):
    dest = tmp_path / "d" / "ptb.test.txt"
    with pytest.raises(DataError, match="sha256"):
        download(f"{server.url}/ptb/ptb.test.txt", dest, "0" * 64)
    assert not dest.exists()
    assert list(dest.parent.iterdir()) == []


def test_404_raises_data_error_naming_where_to_put_the_file(server, tmp_path):
    (server.root / "ptb" / "ptb.test.txt").unlink()
    dest = tmp_path / "data" / "ptb" / "ptb.test.txt"

    with pytest.raises(DataError) as e:
        ensure_corpus("ptb", tmp_path / "data", environ=server.environ)

    msg = str(e.value)
    assert f"put the file at {dest}" in msg, msg
    assert f"{server.url}/ptb/ptb.test.txt" in msg, msg
    assert not dest.exists()
    assert leftovers(dest.parent) == []


def test_closed_port_raises_data_error_quickly(closed_url, tmp_path):
    dest = tmp_path / "data" / "ptb" / "ptb.train.txt"
    t0 = time.perf_counter()
    with pytest.raises(DataError) as e:
        ensure_corpus("ptb", tmp_path / "data", environ={"PARATRAIN_DATA_URL": closed_url})
    elapsed = time.perf_counter() - t0

    assert elapsed < 5, f"took {elapsed:.1f} s"
    msg = str(e.value)
    assert "cannot download" in msg and f"put the file at {dest}" in msg, msg
    assert not dest.exists()
    assert leftovers(dest.parent) == []


def test_existing_files_are_not_downloaded_again(server, tmp_path, real_ptb):
    folder = tmp_path / "data" / "ptb"
    folder.mkdir(parents=True)
    for name in NAMES:
        shutil.copyfile(real_ptb / name, folder / name)
    # a user's own (modified) file is used as it is: only downloads are checksummed
    (folder / "ptb.test.txt").write_text(" my own test file \n", encoding="utf-8")
    before = {n: ((folder / n).read_bytes(), (folder / n).stat().st_mtime_ns) for n in NAMES}

    paths = ensure_corpus("ptb", tmp_path / "data", environ=server.environ)

    assert server.requests == []
    assert {s: p.name for s, p in paths.items()} == {s: f.name for s, f in PTB.files.items()}
    assert {n: ((folder / n).read_bytes(), (folder / n).stat().st_mtime_ns) for n in NAMES} == before


def test_empty_file_is_downloaded_again(server, tmp_path, real_ptb):
    folder = tmp_path / "data" / "ptb"
    folder.mkdir(parents=True)
    for name in NAMES:
        shutil.copyfile(real_ptb / name, folder / name)
    (folder / "ptb.valid.txt").write_bytes(b"")

    ensure_corpus("ptb", tmp_path / "data", environ=server.environ)

    assert server.requests == ["/ptb/ptb.valid.txt"]
    assert sha256(folder / "ptb.valid.txt") == PTB.files["valid"].sha256


def test_no_download_allowed_raises_without_a_request(server, tmp_path):
    with pytest.raises(DataError, match="is missing"):
        ensure_corpus("ptb", tmp_path / "data", allow_download=False, environ=server.environ)
    assert server.requests == []


def test_cli_data_ptb_downloads_and_reports_vocab(server, tmp_path):
    data = tmp_path / "data"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PARATRAIN_") and k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
    env.update(PARATRAIN_DATA_URL=server.url, XDG_CACHE_HOME=str(tmp_path / "cache"))

    proc = subprocess.run([sys.executable, "-m", "paratrain.cli", "data", "ptb", "--data-dir", str(data)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)

    shown = f"\n--- exit {proc.returncode}\n--- stdout:\n{proc.stdout}\n--- stderr:\n{proc.stderr}"
    assert proc.returncode == 0, shown
    assert "vocab 10,000" in proc.stdout, shown
    assert "Traceback" not in proc.stderr, shown
    assert sorted(server.requests) == sorted(f"/ptb/{n}" for n in NAMES)
    for f in PTB.files.values():
        assert sha256(data / "ptb" / f.name) == f.sha256
    assert not (tmp_path / "cache").exists()
