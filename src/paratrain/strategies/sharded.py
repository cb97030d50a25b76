"""What the sharded strategies (``fsdp``, ``zero1``) share: checkpoints in
``torch.distributed.checkpoint`` (DCP) format and the optimizer state's two key styles.

Optimizer state comes in two layouts:

* *whole, by index*: ``torch.optim.Optimizer.state_dict()`` of the whole model, parameters numbered
  in the optimizer's order (what ``checkpoint-<step>.pt`` files hold);
* *by name*: parameters named by their fully qualified name in the model (``"blocks.0.mlp.fc.weight"``),
  the layout of ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` and of DCP
  checkpoints, so that a checkpoint resharded to another world size or strategy finds every
  parameter's state by name.

:func:`by_name` and :func:`by_index` convert between them for one model and optimizer.
A sharded strategy saves ``{"model": ..., "optim": ...}`` with ``dcp.save`` from every rank
(:meth:`ShardedCheckpoints.sharded_state`) and loads it with ``dcp.load`` into its own shards;
every other strategy reads a DCP checkpoint whole (:func:`read_whole`).
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn


def parameter_names(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each parameter of ``optimizer``, in its order (flattened over param groups).
    A tied parameter has its first name (``named_parameters``' order). KeyError for a parameter the
    module does not hold."""
    names: dict[int, str] = {}
    for n, p in module.named_parameters():
        names.setdefault(id(p), n)
    return [names[id(p)] for g in optimizer.param_groups for p in g["params"]]


def by_name(state: dict, names: list[str]) -> dict:
    """Whole optimizer state by index -> by name (``names[i]`` is parameter ``i``'s name)."""
    return {"state": {names[int(i)]: s for i, s in state.get("state", {}).items()},
            "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in state["param_groups"]]}


def by_index(state: dict, names: list[str]) -> dict:
    """Optimizer state by name -> whole by index (``names[i]`` is parameter ``i``'s name). KeyError
    names a parameter of the state that the model lacks."""
    index = {n: i for i, n in enumerate(names)}
    return {"state": {index[n]: s for n, s in state.get("state", {}).items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]]}


def local_by_name(optimizer: torch.optim.Optimizer, names: list[str], state: dict) -> dict:
    """This rank's part of the optimizer state by name: ``state`` ({parameter: its state}, the
    parameters this rank updates) with the whole model's ``param_groups`` (``names[i]`` is the
    optimizer's parameter ``i``) as :func:`by_name` lays them out."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    name_of = {id(p): n for p, n in zip(params, names)}
    groups, start = [], 0
    for g in optimizer.param_groups:
        groups.append({**{k: v for k, v in g.items() if k != "params"},
                       "params": names[start:start + len(g["params"])]})
        start += len(g["params"])
    return {"state": {name_of[id(p)]: dict(s) for p, s in state.items()}, "param_groups": groups}


def read_whole(path: Path) -> dict:
    """Every entry of the DCP checkpoint folder ``path`` as plain CPU tensors, in this process alone
    (no process group): ``{"model": state_dict, "optim": by-name optimizer state}``. Uses
    ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` (through a temporary file)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory(prefix="paratrain-dcp-") as tmp:
        out = Path(tmp) / "whole.pt"
        dcp_to_torch_save(str(path), str(out))
        return torch.load(out, map_location="cpu", weights_only=True)


class ShardedCheckpoints:
    """Mixin of a strategy whose ranks hold different parts of the state: checkpoints are DCP folders
    written by every rank (:mod:`paratrain.train.checkpoint`), and full state dicts are assembled by a
    collective."""

    sharded = True  # (Strategy.sharded)

    def sharded_state(self) -> dict[str, Any]:
        """``{"model": ..., "optim": ...}`` of this rank for ``dcp.save`` (DTensors or this rank's part)."""
        raise NotImplementedError

    def load_sharded(self, path: Path) -> None:
        """Load model and optimizer from the DCP folder ``path`` into this rank's shards. Every rank."""
        raise NotImplementedError
