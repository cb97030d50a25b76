"""``replicate``: one process drives several devices (tower mode).

TensorFlow's tower model, PaddleFluid's ParallelDo, torch's DataParallel: the
wrapped model splits every training forward's batch along its batch dimension
over ``devices``, one tower per device, and joins the outputs; the loss over the
joined output and its one backward give the gradient of the whole batch, summed
over the towers into the master parameters (devices[0]); clipping and the update
act on it. See :mod:`.towers` for CUDA (``torch.nn.DataParallel``) and CPU
virtual devices (``cpu:0,cpu:1``: threads, shared parameters).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import UsageError
from .single import SingleDevice
from .sync_batchnorm import TowerReducer
from .towers import CPUTowers, SeededDataParallel, TowerGroup


class Replicate(SingleDevice):
    """Options: ``devices`` (list of torch.device, at least one; all CPU or all CUDA).
    One process: the collectives are those of :class:`SingleDevice` (nothing to reduce)."""

    name = "replicate"
    dist_keys = ("devices",)
    cost_model = "towers"  # paratrain.bench.costmodel_towers.predict_towers

    @classmethod
    def check_dist(cls, dist) -> None:
        if (dist.nproc, dist.nnodes) != (1, 1):
            raise UsageError("strategy 'replicate' runs one process over --devices; drop --nproc "
                             "(use allreduce for processes)")

    @classmethod
    def check_config(cls, cfg) -> None:
        super().check_config(cfg)
        if (cfg.model_value("activation_checkpointing", False) and cfg.model_value("dropout", 0.0)
                and cls.towers(cfg.dist) > 1 and "cuda" not in cfg.dist.devices):
            raise UsageError("model.activation_checkpointing with dropout on CPU towers: the backward's recomputation "
                             "would not draw from the tower's generator; set model.dropout = 0 or use allreduce")
        if (cfg.model_value("activation_checkpointing", False) and cfg.model_value("sync_batchnorm", False)
                and cls.towers(cfg.dist) > 1):
            raise UsageError("model.activation_checkpointing with model.sync_batchnorm on towers: the backward's "
                             "recomputation runs one tower at a time, so its BatchNorm meetings would wait for towers "
                             "that never come; turn one of them off or use allreduce")

    @classmethod
    def towers(cls, dist) -> int:
        return max(1, len([d for d in dist.devices.split(",") if d.strip()]))

    @classmethod
    def dist_for_replicas(cls, n: int) -> dict:
        return {"nproc": 1, "devices": ",".join(f"cpu:{i}" for i in range(n))}

    @classmethod
    def options(cls, cfg) -> dict[str, Any]:
        from ..devices import resolve_list

        return {"devices": resolve_list(cfg.dist.devices, cfg.dist.strict_placement)} if cfg.dist.devices else {}

    def __init__(self, env, **options: Any) -> None:
        super().__init__(env, **options)
        self.devices: list[torch.device] = list(options.get("devices") or [env.device])
        if len({d.type for d in self.devices}) != 1:
            raise UsageError(f"replicate needs devices of one kind, got {[str(d) for d in self.devices]}")
        self.group = TowerGroup(len(self.devices)) if len(self.devices) > 1 else None

    @property
    def towers_per_process(self) -> int:
        return len(self.devices)

    @property
    def device(self) -> torch.device:
        return self.devices[0] if self.devices[0].type == "cuda" else torch.device("cpu")

    def _sync_batchnorm(self, model: nn.Module) -> nn.Module:
        from .sync_batchnorm import convert

        return convert(model, TowerReducer(self.group) if self.group else None)

    def _wrap(self, module: nn.Module, batch_dim: int) -> nn.Module:
        if len(self.devices) == 1:
            return module
        if self.device.type == "cuda":
            ids = [d.index for d in self.devices]
            return SeededDataParallel(module, device_ids=ids, output_device=ids[0], dim=batch_dim, group=self.group)
        return CPUTowers(module, len(self.devices), batch_dim, torch.get_num_threads(), self.group)

    def describe(self) -> list[str]:
        mode = "torch.nn.DataParallel" if self.device.type == "cuda" else "shared parameters, one thread each"
        return [f"tower {t}: {d} ({mode})" for t, d in enumerate(self.devices)]

