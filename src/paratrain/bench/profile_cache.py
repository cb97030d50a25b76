"""The profile's cache for ``paratrain plan`` (:mod:`.profile`): ``DIR/profile.json`` with a key of
everything the measurement depends on, so re-planning for another cluster reads it instead of
measuring again."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable

import torch

from .profile import PROFILE_VERSION


def profile_key(config_text: str, cores: int) -> str:
    """What a cached profile depends on: the recipe after overrides, versions, cores."""
    import platform

    from .. import __version__

    text = json.dumps([PROFILE_VERSION, config_text, torch.__version__, __version__, cores, platform.node()])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cached_profile(path: Path, key: str, measure: Callable[[], dict]) -> tuple[dict, bool]:
    """(profile, True if read from ``path``): the cached one when its key matches, else measured now
    and written (atomically)."""
    try:
        cached = json.loads(path.read_text())
        if cached.get("key") == key:
            return cached, True
    except (OSError, ValueError):
        pass
    prof = {**measure(), "key": key}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(prof, indent=1))
    tmp.replace(path)
    return prof, False
