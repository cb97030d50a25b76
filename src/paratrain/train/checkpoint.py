"""Checkpoints: one file per save, written by rank 0 only, atomically.

A checkpoint ``checkpoint-<step>.pt`` in the run directory is a dict of plain
types and CPU tensors, loadable with ``torch.load(..., weights_only=True)`` on
any device and for any world_size:

``model`` (plain state_dict), ``optimizer``, ``schedule``, ``step`` (optimizer
steps done), ``epoch`` (1-based epoch of the next step), ``batch_index``
(index of the next step in that epoch), ``hidden`` (the carried BPTT state for
the *whole* global batch, {key: [h, c]} each (L, B, H), or empty),
``format`` and ``paratrain`` (versions).

Writes go to a temp file in the same folder, are fsynced, then renamed over the
target, so a crash during a save leaves the previous checkpoint intact; a
``checkpoint-<step>.pt.sha256`` sidecar holds the file's sha256, checked on load.
The newest ``train.keep_checkpoints`` are kept.

Sharded strategies (``fsdp``, ``zero1``) write ``checkpoint-<step>.dcp/`` instead: a
``torch.distributed.checkpoint`` folder that every rank writes its shards into (``model``, and
``optim`` keyed by parameter name), plus ``meta.pt`` (everything else above, written by rank 0).
The folder is written under a hidden temp name and renamed into place once complete, so it is
whole or absent. It loads under any world size and strategy (:mod:`paratrain.strategies.sharded`);
``paratrain export`` turns it into a plain ``.pt``. Several nodes must share the run dir for it.
"""
from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..errors import UsageError
from ..interrupts import signals_held

FORMAT = 1
_NAME = re.compile(r"^checkpoint-(\d+)\.(pt|dcp)$")
META = "meta.pt"  # a DCP checkpoint's everything-but-model-and-optimizer


def to_cpu(obj: Any) -> Any:
    """Copy every tensor in a nested dict/list/tuple to CPU (detached)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def _fsync_write(path: Path, write) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(folder: Path) -> None:
    """fsync a directory so that renames into it are durable (POSIX; a no-op where unsupported)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def checksum_path(path: Path) -> Path:
    """The sidecar ``checkpoint-<step>.pt.sha256`` of a checkpoint."""
    return path.with_name(path.name + ".sha256")


def atomic_torch_save(obj, path: Path) -> None:
    """``torch.save(obj)`` to a temp file beside ``path``, fsync, rename over ``path``: a crash leaves
    either the old file or the complete new one, never a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        with signals_held():  # an interrupt mid-write lands after it (see signals_held)
            _fsync_write(Path(tmp), lambda f: torch.save(obj, f))
            os.replace(tmp, path)
            _fsync_dir(path.parent)
    finally:
        Path(tmp).unlink(missing_ok=True)


def save(run_dir: Path, state: dict, step: int, keep: int = 3) -> Path:
    """Write ``state`` as ``checkpoint-<step>.pt`` with its sha256 sidecar; keep the newest ``keep``.

    Order (each file written to a temp name and fsynced): the checkpoint is renamed into place
    first, then its sidecar, then the directory is fsynced so that both renames survive a power
    loss. A process killed at any point leaves the previous checkpoints as they were and the new
    one either absent, complete without its sidecar (loadable; it is then checked by unpickling),
    or complete with it. A step is saved once (no second save overwrites a checkpoint under its
    sidecar). Rank 0 only. Returns the path written.
    """
    run_dir = Path(run_dir)
    path = run_dir / f"checkpoint-{step:08d}.pt"
    payload = to_cpu({**state, "format": FORMAT, "step": step})
    fd, tmp = tempfile.mkstemp(prefix=".checkpoint-", suffix=".tmp", dir=run_dir)
    os.close(fd)
    side_tmp = Path(tmp + ".sha256")
    try:
        with signals_held():  # an interrupt mid-write lands after it, the checkpoint complete (see signals_held)
            try:
                _fsync_write(Path(tmp), lambda f: torch.save(payload, f))
            except RuntimeError as e:  # torch's zip writer reports a failed write (full disk) as a RuntimeError
                import errno
                import shutil

                full = shutil.disk_usage(run_dir).free < 1 << 20
                cause = "No space left on device" if full else str(e).strip().splitlines()[0][:120]
                raise OSError(errno.ENOSPC if full else errno.EIO, cause, str(path)) from None
            digest = sha256_of(Path(tmp))
            _fsync_write(side_tmp, lambda f: f.write(f"{digest}  {path.name}\n".encode()))
            checksum_path(path).unlink(missing_ok=True)  # a stale sidecar must never describe the new file
            os.replace(tmp, path)
            os.replace(side_tmp, checksum_path(path))
            _fsync_dir(run_dir)
    finally:
        for t in (Path(tmp), side_tmp):
            t.unlink(missing_ok=True)
    prune(run_dir, keep)
    return path


def prune(run_dir: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints (files with their sidecars, DCP folders)."""
    import shutil

    for stale in Path(run_dir).glob(".checkpoint-*.dcp.*"):  # a save killed midway (no save runs now)
        shutil.rmtree(stale, ignore_errors=True)
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)
            checksum_path(old).unlink(missing_ok=True)


def save_sharded(run_dir: Path, sharded: dict, meta: dict, step: int, *, is_main: bool, barrier,
                 keep: int = 3) -> Path:
    """Write ``checkpoint-<step>.dcp/``: ``sharded`` (this rank's ``{"model", "optim"}``) with
    ``torch.distributed.checkpoint.save`` from every rank, ``meta`` (CPU, plain) by rank 0, then the
    folder renamed into place (rank 0). Every rank must call it; ``barrier()`` waits for all of them.
    An interrupt during ``dcp.save`` (a collective: holding it there could wait on a dead peer) leaves
    the hidden temp folder, which :func:`prune` removes, and the previous checkpoints as they were; one
    during the renames lands after them (:func:`~paratrain.interrupts.signals_held`). Returns the folder's path."""
    import shutil

    import torch.distributed.checkpoint as dcp

    run_dir = Path(run_dir)
    path = run_dir / f"checkpoint-{step:08d}.dcp"
    tmp = run_dir / f".checkpoint-{step:08d}.dcp.tmp"
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    dcp.save(sharded, storage_writer=dcp.FileSystemWriter(str(tmp), sync_files=True))
    barrier()  # every shard is written
    if is_main:
        atomic_torch_save(to_cpu({**meta, "format": FORMAT, "step": step}), tmp / META)
        old = run_dir / f".checkpoint-{step:08d}.dcp.old"
        shutil.rmtree(old, ignore_errors=True)
        # the renames are local to rank 0 and quick: an interrupt between the two of a replaced step
        # would leave that step only under a hidden name, so it lands after them (see signals_held)
        with signals_held():
            if path.exists():  # the same step again (after a resume from an older one): the new one replaces it
                os.replace(path, old)
            os.replace(tmp, path)
            _fsync_dir(run_dir)
        # the replaced folder goes outside the held signals (a large one may take a while); one an
        # interrupt leaves is hidden from list_checkpoints, and prune removes it at the next save
        shutil.rmtree(old, ignore_errors=True)
        prune(run_dir, keep)
    barrier()
    return path


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint files of a run dir, oldest first (by step). A save in progress is a hidden
    temp file, so every listed checkpoint was completely written."""
    if not Path(run_dir).is_dir():
        return []
    found = [(int(m.group(1)), p) for p in Path(run_dir).iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def latest(run_dir: Path, warn=None) -> Path:
    """The newest checkpoint that loads and matches its checksum (see :func:`newest_loadable`)."""
    return newest_loadable(run_dir, warn)[0]


def newest_loadable(run_dir: Path, warn=None, mmap: bool = True) -> tuple[Path, dict]:
    """(path, contents) of the newest checkpoint that loads and matches its checksum. A damaged
    newer one (truncated, checksum mismatch) is passed over with ``warn(line)`` (default: a line on
    stderr). UsageError if there is none, or none loads (the newest one's error)."""
    import sys

    found = list_checkpoints(run_dir)
    if not found:
        raise UsageError(
            f"resume dir {str(run_dir)!r} has no checkpoint-*.pt; give a run dir written by paratrain train"
        )
    first_error = None
    for path in reversed(found):
        try:
            state = load(path, mmap=mmap)
        except UsageError as e:
            first_error = first_error or e
            continue
        if first_error is not None:
            line = f"paratrain: warning: {first_error}; resuming from {path.name}, the newest checkpoint that loads"
            (warn or (lambda m: print(m, file=sys.stderr, flush=True)))(line)
        return path, state
    raise first_error


def should_resume(run_dir: Path, resume: bool) -> bool:
    """Resume when asked, or when torchrun restarted the group and a checkpoint exists."""
    restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
    return resume or (restarted and bool(list_checkpoints(run_dir)))


def load(path: Path, mmap: bool = False) -> dict:
    """Load a checkpoint onto CPU with ``weights_only=True`` (no code runs on unpickling),
    after checking the sha256 sidecar when there is one.

    ``mmap=True`` maps the file instead of reading it (a cheap validity check).
    Raises UsageError for unreadable, truncated or foreign files.
    """
    if Path(path).is_dir():
        return _load_meta(Path(path))
    side = checksum_path(Path(path))
    if side.is_file():
        want = side.read_text().split()[0] if side.read_text().strip() else ""
        if sha256_of(Path(path)) != want:
            raise UsageError(f"checkpoint {str(path)!r} does not match its checksum ({side.name}): the file is "
                             f"damaged")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # truncated zip, crafted pickle, not a checkpoint
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        first = first if len(first) <= 160 else first[:157].rsplit(" ", 1)[0] + " ..."
        raise UsageError(f"checkpoint {str(path)!r} cannot be loaded ({first}): it is truncated or not a "
                         f"checkpoint") from None
    if not isinstance(state, dict) or "model" not in state:
        raise UsageError(f"checkpoint {str(path)!r} is not a paratrain checkpoint (no 'model' key)")
    if state.get("format", FORMAT) > FORMAT:
        raise UsageError(
            f"checkpoint {str(path)!r} has format {state['format']}, newer than this paratrain reads ({FORMAT}); "
            f"upgrade paratrain"
        )
    return state


def _load_meta(path: Path) -> dict:
    """A DCP checkpoint's ``meta.pt`` with ``"dcp": True`` (model and optimizer stay in the folder)."""
    if not (path / ".metadata").is_file() or not (path / META).is_file():
        raise UsageError(f"checkpoint {str(path)!r} is not a complete DCP checkpoint (no .metadata or {META}): "
                         f"it is damaged")
    try:
        from torch.distributed.checkpoint import FileSystemReader

        meta = torch.load(path / META, map_location="cpu", weights_only=True)
        md = FileSystemReader(str(path)).read_metadata()
    except Exception as e:
        raise UsageError(f"checkpoint {str(path)!r} cannot be loaded ({type(e).__name__} in {META} or .metadata): "
                         f"it is damaged") from None
    missing = sorted({v.relative_path for v in md.storage_data.values()} - {f.name for f in path.iterdir()})
    if missing:
        raise UsageError(f"checkpoint {str(path)!r} lacks {missing[0]} (written on another node without a shared "
                         f"run dir, or deleted): it is incomplete")
    shapes = {k[len("model."):]: tuple(v.size) for k, v in md.state_dict_metadata.items()
              if k.startswith("model.") and hasattr(v, "size")}
    return {**meta, "dcp": True, "model_shapes": shapes}
