"""Rank consistency: the same model, config and versions on every rank at start, and (optionally)
the same parameters every K steps (``--check-sync-every K``).

A rank started from another checkout, with another ``--set`` or another torch, trains a
different model and DDP may not notice (it checks shapes, not values or versions); replicas
that silently drift apart (a non-deterministic op, a missed broadcast) give a result nobody
can reproduce. Both end the run with one line naming the rank and the difference
(:class:`~paratrain.errors.TrainingStopped`).
"""
from __future__ import annotations

import hashlib
from typing import Any, Sequence

import torch
from torch import nn

from .errors import TrainingStopped


def fingerprint(model: nn.Module, config_text: str) -> dict[str, Any]:
    """What must agree across ranks: parameter names, shapes and dtypes; the config (sha256 of
    its TOML); paratrain and torch versions."""
    from . import __version__

    return {"parameters": [(n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()],
            "config_sha256": hashlib.sha256(config_text.encode()).hexdigest(),
            "paratrain": __version__, "torch": torch.__version__}


def config_text(cfg) -> str:
    """The config as every rank must hold it: its TOML with the node-specific ``dist.node_rank`` at 0."""
    import dataclasses

    from . import config

    return config.to_toml(dataclasses.replace(cfg, dist=dataclasses.replace(cfg.dist, node_rank=0)))


def first_difference(fps: Sequence[dict[str, Any]]) -> str | None:
    """None when every rank's fingerprint equals rank 0's, else a sentence naming the first rank
    that differs and how. Pure."""
    ref = fps[0]
    for r, fp in enumerate(fps[1:], start=1):
        for key in ("paratrain", "torch", "config_sha256"):
            if fp[key] != ref[key]:
                what = "config (a different --set or recipe)" if key == "config_sha256" else f"{key} version"
                return f"rank {r} has a different {what} than rank 0: {fp[key][:16]} vs {ref[key][:16]}"
        a, b = dict((n, s) for n, *s in ref["parameters"]), dict((n, s) for n, *s in fp["parameters"])
        if a != b:
            names = sorted(set(a) ^ set(b)) or [n for n in a if a[n] != b.get(n)]
            n = names[0]
            return (f"rank {r} has a different model than rank 0: parameter {n} is "
                    f"{b.get(n, 'missing')} on rank {r} and {a.get(n, 'missing')} on rank 0")
    return None


def check_ranks(model: nn.Module, config_text: str, all_gather_object) -> None:
    """Collective (every data-parallel rank): stop on every rank when a fingerprint differs.
    ``all_gather_object(obj) -> [obj of rank 0, obj of rank 1, ...]`` (the strategy's)."""
    fps = all_gather_object(fingerprint(model, config_text))
    if len(fps) < 2:
        return
    diff = first_difference(fps)
    if diff:
        raise TrainingStopped(diff + "; start every rank from the same checkout, config and environment")


def parameter_checksums(model: nn.Module) -> torch.Tensor:
    """(P,) float64: the sum of each parameter's values (P = number of parameters), on its device."""
    return torch.stack([p.detach().double().sum() for p in model.parameters()])


def check_sync(model: nn.Module, all_reduce, rank: int, world_size: int, step: int) -> None:
    """Collective: compare every rank's parameter checksums with rank 0's (exactly: replicas of a
    synchronous strategy are bitwise identical). ``all_reduce(tensor)`` sums over the ranks."""
    own = parameter_checksums(model)
    table = torch.zeros((world_size, own.numel()), dtype=torch.float64, device=own.device)
    table[rank] = own
    table = all_reduce(table).cpu()
    names = [n for n, _ in model.named_parameters()]
    for r in range(1, world_size):
        bad = torch.nonzero(table[r] != table[0]).flatten().tolist()
        if bad:
            i = bad[0]
            rel = float((table[r, i] - table[0, i]).abs() / table[0, i].abs().clamp_min(1e-30))
            raise TrainingStopped(f"replicas diverged at step {step}: rank {r} differs from rank 0 in "
                                  f"{len(bad)} parameter(s), first {names[i]} (checksum relative difference "
                                  f"{rel:.2e}); a non-deterministic op or a rank that skipped an update")
