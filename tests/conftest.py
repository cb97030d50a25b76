"""Shared fixtures: a tiny synthetic PTB-style corpus, the real data location, and a
deadline-bounded multi-process runner (gloo + FileStore, no ports)."""
from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"

# a relative $PARATRAIN_DATA (the README's `export PARATRAIN_DATA=../shared/data`) names a folder beside the
# directory pytest started in; the e2e tests run paratrain in temporary directories, so it is made absolute
# here, before the xdist workers start and inherit it
if os.environ.get("PARATRAIN_DATA"):
    os.environ["PARATRAIN_DATA"] = str(Path(os.environ["PARATRAIN_DATA"]).resolve())

from paratrain.devices import CPU_ALLOCATOR_VARIABLES as _MALLOC_KEYS  # noqa: E402


@pytest.fixture(autouse=True)
def _malloc_environment():
    """pt.init() and the paratrain commands a test runs in its own process put glibc's malloc variables
    into os.environ for the processes they start (devices.apply_cpu_allocator): each test leaves the
    ones it found, so that no later test's processes inherit them."""
    saved = {k: os.environ.get(k) for k in _MALLOC_KEYS}
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def write_tiny_corpus(root: Path, seed: int = 0, vocab: int = 40, lines: int = 600) -> Path:
    """root/ptb/ptb.{train,valid,test}.txt with a learnable pattern; returns root."""
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(vocab - 1)] + ["<unk>"]
    folder = root / "ptb"
    folder.mkdir(parents=True, exist_ok=True)
    for name, n in (("train", lines), ("valid", lines // 6), ("test", lines // 6)):
        out = []
        for _ in range(n):
            k = rng.randint(2, 12)
            start = rng.randrange(vocab)
            out.append(" ".join(words[(start + 3 * j + rng.randint(0, 1)) % vocab] for j in range(k)))
        (folder / f"ptb.{name}.txt").write_text("\n".join(out) + "\n")
    # make sure every word appears in train so valid/test have no unseen types
    with open(folder / "ptb.train.txt", "a") as f:
        f.write(" ".join(words) + "\n")
    return root


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    return write_tiny_corpus(tmp_path_factory.mktemp("tiny_data"))


@pytest.fixture(scope="session")
def real_data() -> Path:
    d = Path(os.environ.get("PARATRAIN_DATA", SHARED_DATA))
    if not (d / "ptb" / "ptb.train.txt").is_file():
        pytest.skip(f"PTB not found under {d}; set PARATRAIN_DATA")
    return d
