"""Tasks: the models ``paratrain train`` trains, built-in and users' own.

A task entry names a factory (see :mod:`paratrain.tasks.base` for the protocol):
a built-in name from :data:`BUILTIN`, ``package.module:factory`` (imported as
``python -m`` would, the working directory included) or
``path/to/file.py:factory``. :func:`build` makes the Task and checks it; every
failure is a one-line :class:`~paratrain.errors.UsageError` naming the entry.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, Callable

from ..errors import UsageError
from .base import REQUIRED, Task, TaskBase, TaskEnv, TrainStep, check_task, optional

BUILTIN: dict[str, str] = {
    "lstm-lm": "paratrain.tasks.lstm_lm:make_task",
    "gpt": "paratrain.tasks.gpt:make_task",
    "digits-cnn": "paratrain.tasks.digits_cnn:make_task",
}
DEFAULT = "lstm-lm"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200]}" if text else type(e).__name__


def _load_file(entry: str, where: str):
    path = Path(where)
    if not path.is_file():
        raise UsageError(f"task {entry!r}: file {where!r} does not exist; give path/to/file.py:factory")
    name = f"paratrain_task_{path.stem}_{abs(hash(str(path.resolve()))) % 10**8}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - a user's module: report it in one line
        del sys.modules[name]
        raise UsageError(f"task {entry!r}: importing {where} raised {_first_line(e)}") from None
    return module


def _import(entry: str, where: str):
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as e:
        if os.getcwd() not in sys.path and e.name == where.split(".")[0]:
            sys.path.insert(0, os.getcwd())  # as python -m does
            return _import(entry, where)
        raise UsageError(f"task {entry!r}: cannot import module {where!r} ({_first_line(e)}); "
                         f"use a built-in task ({', '.join(BUILTIN)}), module:factory or "
                         f"path/to/file.py:factory") from None
    except Exception as e:  # noqa: BLE001
        raise UsageError(f"task {entry!r}: importing {where} raised {_first_line(e)}") from None


def resolve(entry: str) -> Callable[..., Any]:
    """The factory an entry names. Raises UsageError naming the entry and what is wrong."""
    target = BUILTIN.get(entry, entry)
    if ":" not in target:
        raise UsageError(f"task {entry!r} is not a built-in task ({', '.join(BUILTIN)}); give one of them, "
                         f"module:factory or path/to/file.py:factory")
    where, name = target.rsplit(":", 1)
    module = _load_file(entry, where) if where.endswith(".py") or os.sep in where else _import(entry, where)
    factory = getattr(module, name, None)
    if factory is None:
        raise UsageError(f"task {entry!r}: {where} has no {name!r}; name a factory function or class defined there")
    if not callable(factory):
        raise UsageError(f"task {entry!r}: {where}:{name} is a {type(factory).__name__}, not a callable factory")
    return factory


def normalise(entry: str) -> str:
    """The entry with a file path made absolute (a run dir's config works from any directory)."""
    if entry in BUILTIN or ":" not in entry:
        return entry
    where, name = entry.rsplit(":", 1)
    if where.endswith(".py") and Path(where).is_file():
        return f"{Path(where).resolve()}:{name}"
    return entry


def config_sections(entry: str) -> dict[str, type]:
    """The dataclasses a factory declares for its ``[data]`` / ``[model]`` tables (may be empty)."""
    return dict(getattr(resolve(entry), "config_sections", {}) or {})


def build(entry: str, section: dict, env: TaskEnv) -> Task:
    """Call the factory of ``entry`` and check the Task it returns. UsageError for an unknown
    entry, a factory that raises, or a Task missing a method (each names the entry)."""
    factory = resolve(entry)
    try:
        task = factory(section, env)
    except UsageError:
        raise
    except Exception as e:  # noqa: BLE001 - a user's factory: report it in one line
        raise UsageError(f"task {entry!r}: the factory raised {_first_line(e)}") from None
    check_task(task, entry)
    return task


__all__ = ["BUILTIN", "DEFAULT", "REQUIRED", "Task", "TaskBase", "TaskEnv", "TrainStep", "build", "check_task",
           "config_sections", "normalise", "optional", "resolve"]
