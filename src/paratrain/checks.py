"""One-line checks of config values (any section, a task's too): each raises
:class:`~paratrain.errors.UsageError` naming ``section.key``, the value and what to use instead."""
from __future__ import annotations

import math
import typing
from dataclasses import fields, replace
from typing import Any

from .errors import UsageError


def check_choice(section: str, key: str, value: Any, allowed: tuple) -> None:
    """UsageError unless ``value`` is one of ``allowed`` (names the key and the choices)."""
    if value not in allowed:
        raise UsageError(
            f"{section}.{key} = {value!r} is not allowed; use one of {', '.join(map(repr, allowed))}"
        )


def check_at_least(section: str, key: str, value: float, low: float, strict: bool = False) -> None:
    """UsageError unless ``value`` is finite and >= ``low`` (> with ``strict``)."""
    if not math.isfinite(value):
        raise UsageError(f"{section}.{key} = {value!r} is out of range; use a finite number")
    if value < low or (strict and value == low):
        op = ">" if strict else ">="
        raise UsageError(f"{section}.{key} = {value!r} is out of range; use a value {op} {low}")


def check_probability(section: str, key: str, value: float) -> None:
    """UsageError unless ``value`` is in [0, 1) (a dropout probability)."""
    if not 0 <= value < 1:
        raise UsageError(f"{section}.{key} = {value!r} is out of range; use a value in [0, 1)")


def key_hint(name: str, candidates: list[str]) -> str:
    """" (did you mean ...?)" for a misspelt key, else the list of known keys."""
    import difflib

    close = difflib.get_close_matches(name, candidates, n=1)
    return f" (did you mean {close[0]!r}?)" if close else f"; known keys: {', '.join(candidates)}"


def coerce(section: str, key: str, value: Any, typ: Any) -> Any:
    """Check ``value`` against the field type; ints are accepted for floats."""
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    ok = isinstance(value, typ) and not (typ is int and isinstance(value, bool))
    if not ok:
        raise UsageError(
            f"{section}.{key} = {value!r} has type {type(value).__name__}; it must be {typ.__name__}"
        )
    return value


def section_table(sec: str, value: Any) -> dict:
    """``value`` if it is a TOML table (the section ``[sec]``), else UsageError."""
    if not isinstance(value, dict):
        raise UsageError(f"config section [{sec}] must be a table of key = value lines")
    return value


def update_section(sec: str, start: Any, value: dict) -> Any:
    """A config section: ``start`` (a dataclass instance, or a dict for a task without a schema)
    with ``value``'s keys, each checked against the field's type."""
    if isinstance(start, dict):
        return {**start, **value}
    cls = type(start)
    hints = typing.get_type_hints(cls)
    known = [f.name for f in fields(cls)]
    updates = {}
    for key, v in value.items():
        if key not in known:
            raise UsageError(f"unknown config key {sec}.{key}{key_hint(key, known)}")
        updates[key] = coerce(sec, key, v, hints[key])
    return replace(start, **updates)
