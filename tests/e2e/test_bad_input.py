"""Bad input to ``paratrain train``: one line on stderr, exit code 2, nothing written.

Each case runs the command line's ``paratrain.cli.main(["train", ...])`` in the test's
process (and seven of them, one of each kind, the real ``python -m paratrain.cli train ...``
in a new process) with ``cwd=tmp_path``, after laying out the files it needs there:
a tiny TOML recipe (``cfg.toml``), a tiny fake PTB corpus (``data/ptb/``) and
whatever the case adds, changes or removes. Every case checks the contract of
:mod:`paratrain.cli`:

- exit code 2;
- stderr is exactly one non-empty line that starts with ``paratrain: error:``
  and names the problem (``match``); stdout is empty;
- no ``Traceback`` anywhere;
- nothing in ``tmp_path`` changed: same files with the same bytes and mtimes,
  same folders (so no run directory was created and none was written into).

Downloads cannot reach the network: ``PARATRAIN_DATA_URL`` points at a port on
127.0.0.1 that is bound but not listening (connection refused at once), and the
cache dir is inside ``tmp_path``. All errors happen before any worker process
is started. In a new process each case would cost an interpreter start and the torch
import (2.5-4 s of CPU on the 2-core machine); in this process, milliseconds.
"""
from __future__ import annotations

import contextlib
import io
import json
import math
import os
import socket
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest

# ---------------------------------------------------------------- the fixtures of every case

# A recipe that trains 3 steps in well under a second on the corpus below.
TINY: dict[str, dict[str, Any]] = {
    "data": {"corpus": "ptb", "mode": "bptt", "bptt": 5, "eval_batch_size": 2},
    "model": {"embed_dim": 8, "hidden_dim": 8, "num_layers": 1},
    "train": {"epochs": 1, "batch_size": 4, "lr": 1.0},
    "dist": {"strategy": "single", "nproc": 1},
}

# 10 lines x (6 words + <eos>) = 70 tokens: (70 // 4 - 1) // 5 = 3 BPTT steps of global batch 4.
TRAIN_TXT = " the cat sat on the mat \n" * 10
VALID_TXT = " the cat sat on the mat \n the mat \n"
TEST_TXT = " the cat sat \n on the mat \n"
CORPUS = {
    "data/ptb/ptb.train.txt": TRAIN_TXT,
    "data/ptb/ptb.valid.txt": VALID_TXT,
    "data/ptb/ptb.test.txt": TEST_TXT,
}


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    if isinstance(v, float) and math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(v)


def recipe(changes: dict[str, Any] | None = None, top: str = "") -> str:
    """TINY as TOML text with ``{"section.key": value}`` changes; ``top`` goes before the tables."""
    sections = {sec: dict(values) for sec, values in TINY.items()}
    for dotted, value in (changes or {}).items():
        sec, key = dotted.split(".", 1)
        sections.setdefault(sec, {})[key] = value
    lines = [top] if top else []
    for sec, values in sections.items():
        lines.append(f"[{sec}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in values.items()]
        lines.append("")
    return "\n".join(lines)


def run_config_toml() -> str:
    """The config.toml that ``paratrain train`` writes into a run dir for TINY."""
    from paratrain import config

    raw = tomllib.loads(recipe())
    return config.to_toml(config.from_dict({**raw, "name": "tiny"}))


def truncated_checkpoint() -> bytes:
    """The first half of a real ``torch.save`` file: what a crash mid-copy leaves behind."""
    import torch

    buf = io.BytesIO()
    torch.save({"model": {"w": torch.zeros(64)}, "step": 1, "format": 1}, buf)
    data = buf.getvalue()
    return data[: len(data) // 2]


def checkpoint_with(**fields) -> Callable[[], bytes]:
    """A loadable checkpoint of the right keys with ``fields`` on top (format, model, ...)."""
    def make() -> bytes:
        import torch

        buf = io.BytesIO()
        torch.save({"model": {"w": torch.zeros(64)}, "step": 1, "format": 1, **fields}, buf)
        return buf.getvalue()
    return make


class _RunsCode:
    def __reduce__(self):  # unpickling would call os.system
        return (os.system, ("touch pwned",))


def crafted_checkpoint() -> bytes:
    """A pickle that runs a shell command when loaded without weights_only."""
    import pickle

    return pickle.dumps({"model": {}, "x": _RunsCode()})


USER_TASK = {"user_task.py": (Path(__file__).with_name("user_task.py")).read_text()}  # a user's task file

# ---------------------------------------------------------------- the table

CFG = "cfg.toml"
DATA = ("--data-dir", "data")
RUN = ("--run-dir", "run")
NEW = (CFG, *DATA, *RUN)  # a new run of cfg.toml into ./run


@dataclass(frozen=True)
class Case:
    id: str
    args: tuple[str, ...]
    match: str  # a piece of the error line that shows the right check fired
    # rel path -> text | bytes | callable returning either | None (remove); on top of cfg.toml + CORPUS
    files: dict[str, str | bytes | Callable[[], str | bytes] | None] = field(default_factory=dict)
    real_run: str = ""  # copy the run dir of a real tiny training run (fixture tiny_run) to this folder first


def cfg(changes: dict[str, Any] | None = None, top: str = "") -> dict:
    return {CFG: recipe(changes, top)}


CASES = [
    # --- the config file itself
    Case("config-missing", ("missing.toml", *DATA, *RUN), "config file 'missing.toml' does not exist"),
    Case("no-config-no-resume", (*DATA, *RUN), "no config given"),
    Case("toml-syntax-error", NEW, "is not valid TOML", {CFG: "[train]\nbatch_size = = 4\n"}),
    Case("config-not-utf8", NEW, "is not UTF-8", {CFG: b"[train]\nlr = 1.0 # \xff\xfe\x80\n"}),
    Case("unknown-section", NEW, "unknown config section 'trian'", cfg({"trian.lr": 0.5})),
    Case("dist-section-not-a-table", NEW, "[dist] must be a table", {CFG: "dist = 3\n"}),
    Case("unknown-key", NEW, "unknown config key train.lrr", cfg({"train.lrr": 0.5})),
    Case("empty-name", NEW, "name = '' must be a non-empty string", cfg(top='name = ""')),
    # --- types
    Case("str-for-int", NEW, "train.batch_size = '20' has type str", cfg({"train.batch_size": "20"})),
    Case("bool-for-int", NEW, "train.batch_size = True has type bool", cfg({"train.batch_size": True})),
    # --- ranges
    Case("lr-zero", NEW, "train.lr = 0.0 is out of range", cfg({"train.lr": 0})),
    Case("lr-negative", NEW, "train.lr = -1.0 is out of range", cfg({"train.lr": -1})),
    Case("lr-nan", NEW, "train.lr = nan", cfg({"train.lr": float("nan")})),
    Case("dropout-1.5", NEW, "model.dropout = 1.5 is out of range", cfg({"model.dropout": 1.5})),
    Case("bptt-zero", NEW, "data.bptt = 0 is out of range", cfg({"data.bptt": 0})),
    Case("epochs-zero", NEW, "train.epochs = 0 is out of range", cfg({"train.epochs": 0})),
    Case("train-fraction-zero", NEW, "data.train_fraction = 0.0 is out of range", cfg({"data.train_fraction": 0})),
    # --- choices
    Case("mode-words", NEW, "data.mode = 'words' is not allowed", cfg({"data.mode": "words"})),
    Case("optimizer-rmsprop", NEW, "train.optimizer = 'rmsprop' is not allowed", cfg({"train.optimizer": "rmsprop"})),
    Case("strategy-unknown-in-toml", NEW, "dist.strategy = 'ring' is not allowed", cfg({"dist.strategy": "ring"})),
    Case("strategy-unknown-flag", (*NEW, "--strategy", "unknown"), "invalid choice: 'unknown'"),
    Case("nproc-not-int", (*NEW, "--nproc", "two"), "invalid int value: 'two'"),
    # --- consistency between keys
    Case("tie-weights-embed-ne-hidden", NEW, "model.tie_weights = true needs model.embed_dim == model.hidden_dim",
         cfg({"model.tie_weights": True, "model.hidden_dim": 16})),
    Case("accumulation-not-dividing-batch", NEW, "not divisible by train.accumulation 3",
         cfg({"train.accumulation": 3})),
    # --- --set
    Case("set-no-equals", (*NEW, "--set", "train.lr"), "--set 'train.lr' is malformed"),
    Case("set-unknown-key", (*NEW, "--set", "train.foo=1"), "unknown config key train.foo"),
    # --- world size against the global batch
    Case("batch-not-divisible-by-world", (*NEW, "--nproc", "2"), "global batch 21 is not divisible by world_size 2",
         cfg({"train.batch_size": 21, "dist.strategy": "allreduce"})),
    Case("nproc-larger-than-batch", (*NEW, "--strategy", "allreduce", "--nproc", "8"),
         "8 worker processes for a global batch of 4"),
    Case("nproc-zero", (*NEW, "--nproc", "0"), "--nproc 0 is not allowed"),
    Case("strategy-single-with-nproc-2", (*NEW, "--strategy", "single", "--nproc", "2"),
         "--strategy single runs one process"),
    Case("strategy-single-with-nproc-2-in-toml", NEW, "dist.nproc", cfg({"dist.nproc": 2})),
    Case("nnodes-without-endpoint", (*NEW, "--strategy", "allreduce", "--nnodes", "2"), "dist.rdzv_endpoint"),
    # --- run directories
    Case("run-dir-not-empty", NEW, "run dir 'run' already exists and is not empty", {"run/notes.txt": "keep me\n"}),
    Case("run-dir-is-a-file", NEW, "run dir 'run' already exists", {"run": "not a folder\n"}),
    Case("resume-missing-dir", ("--resume", "nope", *DATA), "resume dir 'nope' does not exist"),
    Case("resume-dir-without-config", ("--resume", "old", *DATA), "resume dir 'old' has no config.toml",
         {"old/checkpoint-00000001.pt": truncated_checkpoint}),
    Case("resume-dir-without-checkpoint", ("--resume", "old", *DATA), "resume dir 'old' has no checkpoint-*.pt",
         {"old/config.toml": run_config_toml}),
    Case("resume-and-other-run-dir", ("--resume", "old", *DATA, "--run-dir", "other"), "name different folders",
         {"old/config.toml": run_config_toml, "old/checkpoint-00000001.pt": truncated_checkpoint}),
    Case("resume-set-changes-model-shape", ("--resume", "old", *DATA, "--set", "model.hidden_dim=16"),
         "model.hidden_dim", real_run="old"),
    Case("resume-truncated-checkpoint", ("--resume", "old", *DATA),
         "checkpoint 'old/checkpoint-00000001.pt' cannot be loaded",
         {"old/config.toml": run_config_toml, "old/checkpoint-00000001.pt": truncated_checkpoint}),
    Case("resume-checkpoint-newer-format", ("--resume", "old", *DATA), "newer than this paratrain reads",
         {"old/config.toml": run_config_toml, "old/checkpoint-00000001.pt": checkpoint_with(format=99)}),
    Case("resume-crafted-pickle", ("--resume", "old", *DATA), "cannot be loaded",
         {"old/config.toml": run_config_toml, "old/checkpoint-00000001.pt": crafted_checkpoint}),
    Case("resume-checkpoint-wrong-model", ("--resume", "old", *DATA), "holds a different model",
         {"old/config.toml": run_config_toml, "old/checkpoint-00000001.pt": checkpoint_with()}),
    Case("resume-checkpoint-checksum-mismatch", ("--resume", "old", *DATA), "does not match its checksum",
         {"old/checkpoint-00000003.pt.sha256": "0" * 64 + "  checkpoint-00000003.pt\n"}, real_run="old"),
    # --- flags of the reliability and measurement features
    Case("on-nonfinite-unknown", (*NEW, "--on-nonfinite", "ignore"), "invalid choice: 'ignore'"),
    Case("fault-unknown-kind", (*NEW, "--fault", "explode:rank=1"), "unknown kind 'explode'"),
    Case("fault-without-rank", (*NEW, "--fault", "kill:step=3"), "needs rank=R"),
    Case("timeout-zero", NEW, "train.timeout_s = 0", cfg({"train.timeout_s": 0})),
    Case("keep-checkpoints-zero", NEW, "train.keep_checkpoints = 0 is out of range", cfg({"train.keep_checkpoints": 0})),
    Case("rdzv-port-in-use", (*NEW, "--strategy", "allreduce", "--nnodes", "2", "--node-rank", "0",
                              "--rdzv-endpoint", "127.0.0.1:{busy_port}"), "is in use here"),
    # --- tasks: the entry, its factory, the Task it returns, the sections it owns
    Case("task-unknown-name", (*NEW, "--task", "nosuch"), "task 'nosuch' is not a built-in task"),
    Case("task-unknown-in-toml", NEW, "task 'nope' is not a built-in task", cfg({"task.entry": "nope"})),
    Case("task-module-missing", (*NEW, "--task", "nosuchmod:make"), "cannot import module 'nosuchmod'"),
    Case("task-file-missing", (*NEW, "--task", "missing.py:make"), "file 'missing.py' does not exist"),
    Case("task-factory-missing", (*NEW, "--task", "user_task.py:nothing"), "has no 'nothing'", USER_TASK),
    Case("task-factory-raises", (*NEW, "--task", "user_task.py:broken"),
         "the factory raised ValueError: no data here", USER_TASK),
    Case("task-lacks-methods", (*NEW, "--task", "user_task.py:incomplete"),
         "lacks steps_per_epoch, train_steps, loss, eval_batches, eval_sums, metrics", USER_TASK),
    Case("task-model-key-of-another-task", (*NEW, "--task", "gpt"), "unknown config key model.embed_dim"),
    Case("dist-key-of-another-strategy", (*NEW, "--strategy", "allreduce", "--nproc", "2"),
         "dist.backup_workers applies to --strategy ps-sync only", cfg({"dist.backup_workers": 1})),
    # --- data files
    Case("data-missing-download-fails", NEW, "cannot download",
         {"data/ptb/ptb.train.txt": None, "data/ptb/ptb.valid.txt": None, "data/ptb/ptb.test.txt": None}),
    Case("data-train-empty", NEW, "cannot download", {"data/ptb/ptb.train.txt": b""}),  # empty = missing
    Case("data-train-no-tokens", NEW, "has no tokens", {"data/ptb/ptb.train.txt": "\n  \n\t\n"}),
    Case("data-train-binary", NEW, "is binary", {"data/ptb/ptb.train.txt": b"the cat\x00\x01\x02 sat\n" * 10}),
    Case("data-train-not-utf8", NEW, "is not UTF-8", {"data/ptb/ptb.train.txt": b" the caf\xe9 sat \n" * 10}),
    Case("data-valid-word-not-in-train", NEW, "has word 'zebra' that is not in the training split",
         {"data/ptb/ptb.valid.txt": " the zebra sat \n"}),
    Case("data-too-small-for-batch", NEW, "too small for one step of global batch 64",
         cfg({"train.batch_size": 64})),
]


# ---------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def closed_url():
    """An http URL on 127.0.0.1 whose port is bound but not listening: connect is refused at once."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    try:
        yield f"http://127.0.0.1:{s.getsockname()[1]}"
    finally:
        s.close()


@pytest.fixture(scope="module")
def busy_port():
    """A port on 127.0.0.1 that this test process listens on."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:
        yield s.getsockname()[1]
    finally:
        s.close()


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, closed_url) -> dict[str, bytes]:
    """The files of a finished run of TINY (config.toml and its last checkpoint), trained once per module."""
    root = tmp_path_factory.mktemp("tiny-run")
    _layout(root, {})
    proc = subprocess.run([sys.executable, "-m", "paratrain.cli", "train", *NEW], cwd=root,
                          env=_env(root, closed_url), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = root / "run"
    checkpoints = sorted(run.glob("checkpoint-*.pt"))
    assert checkpoints, sorted(p.name for p in run.iterdir())
    side = checkpoints[-1].with_name(checkpoints[-1].name + ".sha256")
    return {"config.toml": (run / "config.toml").read_bytes(), checkpoints[-1].name: checkpoints[-1].read_bytes(),
            side.name: side.read_bytes()}


def _layout(root: Path, files: dict) -> None:
    (root / "data" / "ptb").mkdir(parents=True, exist_ok=True)  # the corpus folder exists even without its files
    for rel, content in {CFG: recipe(), **CORPUS, **files}.items():
        path = root / rel
        if content is None:
            path.unlink(missing_ok=True)
            continue
        if callable(content):
            content = content()
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, str):
            content = content.encode("utf-8")
        path.write_bytes(content)


def _snapshot(root: Path) -> tuple[dict[str, tuple[bytes, int]], set[str]]:
    files, dirs = {}, set()
    for dirpath, dirnames, filenames in os.walk(root):
        base = Path(dirpath)
        dirs.update(str((base / d).relative_to(root)) for d in dirnames)
        for f in filenames:
            p = base / f
            files[str(p.relative_to(root))] = (p.read_bytes(), p.stat().st_mtime_ns)
    return files, dirs


def _differences(before, after) -> list[str]:
    (fb, db), (fa, da) = before, after
    out = [f"new file {f}" for f in sorted(fa.keys() - fb.keys())]
    out += [f"removed file {f}" for f in sorted(fb.keys() - fa.keys())]
    for f in sorted(fa.keys() & fb.keys()):
        if fa[f][0] != fb[f][0]:
            out.append(f"changed bytes of {f}")
        elif fa[f][1] != fb[f][1]:
            out.append(f"rewritten {f} (same bytes, new mtime)")
    out += [f"new folder {d}" for d in sorted(da - db)]
    out += [f"removed folder {d}" for d in sorted(db - da)]
    return out


def _env(tmp_path: Path, data_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PARATRAIN_") and k.lower() not in ("http_proxy", "https_proxy", "all_proxy")}
    env.update(PARATRAIN_DATA_URL=data_url, XDG_CACHE_HOME=str(tmp_path / "xdg-cache"),
               PYTHONDONTWRITEBYTECODE="1")
    return env


# ---------------------------------------------------------------- the test


def _prepare(case: Case, tmp_path: Path, request: pytest.FixtureRequest) -> tuple[list[str], tuple]:
    """Lay out the case's files in ``tmp_path``; return its ``paratrain train`` arguments and a snapshot."""
    files = dict(case.files)
    if case.real_run:
        files = {f"{case.real_run}/{name}": data for name, data in request.getfixturevalue("tiny_run").items()} | files
    _layout(tmp_path, files)
    args = [a.format(busy_port=request.getfixturevalue("busy_port")) if "{busy_port}" in a else a for a in case.args]
    return ["train", *args], _snapshot(tmp_path)


def _check(case: Case, tmp_path: Path, before: tuple, code: int | None, out: str, err: str) -> None:
    shown = f"\n--- exit {code}\n--- stdout:\n{out}\n--- stderr:\n{err}"
    assert "Traceback" not in out + err, shown
    assert code == 2, shown
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].strip(), f"stderr must be exactly one non-empty line{shown}"
    assert lines[0].startswith("paratrain: error: "), shown
    assert case.match in lines[0], f"expected {case.match!r} in the error line{shown}"
    assert out == "", f"nothing may be printed before the error is found{shown}"
    assert not (tmp_path / "runs").exists(), "a default run dir was created"
    assert not (tmp_path / "pwned").exists(), "a checkpoint ran code"
    changes = _differences(before, _snapshot(tmp_path))
    assert not changes, f"the command changed files: {changes}{shown}"


@contextlib.contextmanager
def _as_a_fresh_process(tmp_path: Path, closed_url: str, monkeypatch: pytest.MonkeyPatch, case_id: str):
    """This process made to look like a fresh ``paratrain``'s for the body, and put back after it,
    whatever the body raised: the environment (exactly ``_env``'s), the working directory, no
    bytecode written, ``sys.path`` (a user's task folder joins it), a user's task modules
    (``paratrain_task_*``, by their files' paths), :func:`paratrain.runs.start_run` (a failure:
    bad input must not reach it) and glibc's malloc arenas as a fresh process has them when the
    command applies ``dist.cpu_allocator`` (the main one alone: this process' threads took more)."""
    from paratrain import devices, runs

    environ, modules = dict(os.environ), set(sys.modules)
    fresh = _env(tmp_path, closed_url)
    try:
        for name in set(os.environ) - set(fresh):
            monkeypatch.delenv(name)
        for name, value in fresh.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setattr(sys, "dont_write_bytecode", True)
        monkeypatch.setattr(sys, "path", list(sys.path))
        monkeypatch.setattr(runs, "start_run", lambda run: pytest.fail(f"{case_id}: bad input reached start_run"))
        monkeypatch.setattr(devices, "malloc_arenas", lambda: 1)
        monkeypatch.chdir(tmp_path)
        yield
    finally:
        for name in set(sys.modules) - modules:
            if name.startswith("paratrain_task_"):
                del sys.modules[name]
        monkeypatch.undo()
        os.environ.clear()
        os.environ.update(environ)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(case: Case, tmp_path: Path, closed_url: str,
                                                        request: pytest.FixtureRequest,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        capfd: pytest.CaptureFixture,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """Every case through the command's own ``main`` in this process (its one line, its exit code,
    its output at the file descriptors, and no warning or log record that a new process would print),
    with the environment and working directory of a fresh ``paratrain``; nothing may start a run. The
    test below runs some cases as real processes."""
    import signal
    import warnings

    from paratrain import cli

    argv, before = _prepare(case, tmp_path, request)
    handler = signal.getsignal(signal.SIGTERM)
    with _as_a_fresh_process(tmp_path, closed_url, monkeypatch, case.id):
        capfd.readouterr()
        caplog.set_level("WARNING")
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            try:
                code = cli.main(argv)
            except SystemExit as e:  # argparse's refusals
                code = e.code
    out, err = capfd.readouterr()
    shown = [f"{w.category.__name__}: {w.message}" for w in warned
             if not issubclass(w.category, (DeprecationWarning, PendingDeprecationWarning, ImportWarning,
                                            ResourceWarning))]
    shown += [f"log {r.levelname} {r.name}: {r.getMessage()}" for r in caplog.records]
    assert not shown, f"a new process would print these too: {shown}"
    assert signal.getsignal(signal.SIGTERM) is handler, "cli.main left its SIGTERM handler behind"
    _check(case, tmp_path, before, code, out, err)


# one case of each kind of check, as the real command line in a new process: argparse, the recipe,
# a checkpoint, the launcher, a user's task file, a built-in task's model keys, a failed download
PROCESS_CASES = ["nproc-not-int", "toml-syntax-error", "resume-crafted-pickle", "rdzv-port-in-use",
                 "task-factory-raises", "task-model-key-of-another-task", "data-missing-download-fails"]


@pytest.mark.parametrize("case", [c for c in CASES if c.id in PROCESS_CASES],
                         ids=[c.id for c in CASES if c.id in PROCESS_CASES])
def test_the_command_line_in_a_new_process_keeps_the_contract(case: Case, tmp_path: Path, closed_url: str,
                                                              request: pytest.FixtureRequest) -> None:
    argv, before = _prepare(case, tmp_path, request)
    proc = subprocess.run([sys.executable, "-m", "paratrain.cli", *argv], cwd=tmp_path,
                          env=_env(tmp_path, closed_url), capture_output=True, text=True, timeout=60)
    _check(case, tmp_path, before, proc.returncode, proc.stdout, proc.stderr)


def test_table_is_large_and_ids_unique() -> None:
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))
    assert len(CASES) >= 30
    assert set(PROCESS_CASES) <= set(ids)


def test_tiny_recipe_and_corpus_are_valid(tmp_path: Path) -> None:
    """The baseline every case perturbs passes all checks (so each case fails for its own reason)."""
    import argparse

    from paratrain import runs

    _layout(tmp_path, {})
    args = argparse.Namespace(config=str(tmp_path / CFG), strategy=None, nproc=None, run_dir=tmp_path / "run",
                              resume=None, data_dir=str(tmp_path / "data"), overrides=[], max_restarts=None,
                              nnodes=None, node_rank=None, rdzv_endpoint=None)
    run = runs.prepare_run(args)
    assert run.cfg.train.batch_size == 4 and run.cfg.dist.strategy == "single"
    assert (tmp_path / "run" / "config.toml").is_file()

