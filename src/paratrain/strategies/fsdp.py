"""``fsdp``: fully sharded data parallel with FSDP2 (``torch.distributed.fsdp.fully_shard``).

Each of the W ranks keeps 1/W of every parameter, of its gradient and of its optimizer state
(parameters are ``DTensor`` shards on a 1-D ``DeviceMesh``). A block's parameters are all-gathered
before its forward and, with ``dist.reshard_after_forward = true`` (ZeRO-3-like), freed after it and
gathered again for the backward (not the root's own parameters, which the backward needs first);
``false`` keeps them until the backward (ZeRO-2-like: less communication, more memory). Gradients are
reduce-scattered, averaged over the replicas, so the optimizer updates each shard with the gradient of
the global mean, as ``allreduce`` does (Rajbhandari
et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"; Zhao et al.
2023, "PyTorch FSDP").

Units of sharding: the model's blocks (:func:`paratrain.models.checkpointing.blocks`: Transformer
blocks, LSTM layers), each direct child that holds parameters of its own and shares none (an
untied embedding or decoder), then the root (what is left, e.g. tied embedding and decoder).
``train.precision = "bf16"`` or ``"fp16"`` adds FSDP2's ``MixedPrecisionPolicy`` (parameters
all-gathered and computed in the low dtype, gradients reduced in float32, float32 outputs) under
part 1's autocast; the sharded master weights stay float32. fp16 scales the loss with
``torch.amp.GradScaler``: its inf/NaN check runs on the gradients' DTensor shards, and DTensor
reduces the flag over the mesh, so an overflow in one rank's shard is every rank's skipped step
(tested). Checkpoints are DCP folders (:mod:`.sharded`).
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ContextManager

import torch
import torch.distributed as dist
from torch import nn

from ..errors import UsageError
from .allreduce import AllReduce
from .precision import LOW_DTYPES
from .sharded import ShardedCheckpoints, by_index, by_name, parameter_names

# FSDP2 warns when a wrapped module returns a view (nn.LSTM's outputs); paratrain does no in-place op on them
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules ``fully_shard`` wraps before the root (see the module docstring), innermost first."""
    from ..models.checkpointing import blocks

    units = [b for b in blocks(model) if b is not model and any(True for _ in b.parameters())]
    inside = {id(p) for u in units for p in u.parameters()}
    counts: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            counts[id(p)] = counts.get(id(p), 0) + 1
    for child in model.children():
        own = list(child.parameters())
        if not own or any(id(p) in inside for p in own) or any(u is child for u in units):
            continue
        if all(counts[id(p)] == 1 for p in own):  # a tied parameter stays with the root
            units.append(child)
    return units


class FSDP(ShardedCheckpoints, AllReduce):
    """Options: ``reshard_after_forward`` (default True)."""

    name = "fsdp"
    dist_keys = ("reshard_after_forward",)
    cost_model = "sharded_parameters"  # paratrain.bench.costmodel_sharded.predict_fsdp
    collective_forward = True  # every forward all-gathers: ranks run the same number of forwards

    @classmethod
    def options(cls, cfg) -> dict[str, Any]:
        return {"reshard_after_forward": cfg.dist.reshard_after_forward}

    @classmethod
    def check_config(cls, cfg) -> None:
        super().check_config(cfg)
        if cfg.placement:
            raise UsageError("strategy 'fsdp' shards every parameter over the ranks; a [placement] plan (model "
                             "parallel) cannot apply: remove [placement] or use dist.strategy = 'allreduce'")
        if cfg.dist.check_sync_every:
            raise UsageError("dist.check_sync_every compares replicas' parameters, but strategy 'fsdp' keeps one "
                             "shard of each per rank; set dist.check_sync_every = 0")

    def _wrap(self, module: nn.Module, batch_dim: int) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        self._ensure_group()
        for t in module.state_dict().values():  # every rank shards rank 0's values (as DDP broadcasts them)
            if self.env.world_size > 1:
                dist.broadcast(t.data, 0)
        self._before = dict(module.named_parameters())
        mesh = init_device_mesh(self.device.type, (self.env.world_size,))
        low = LOW_DTYPES.get(self.precision)
        mp = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32,
                                  output_dtype=torch.float32) if low is not None else MixedPrecisionPolicy()
        reshard = bool(self.options.get("reshard_after_forward", True))
        self.units = shard_units(module)
        for unit in self.units:
            fully_shard(unit, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
        # the root keeps its parameters from its forward to its backward (FSDP2's choice for a root left
        # at None: freed, they would be gathered again at once)
        fully_shard(module, mesh=mesh, reshard_after_forward=None if reshard else False, mp_policy=mp)
        return module

    def _after_setup(self) -> None:
        """``fully_shard`` made new (DTensor) parameters: the optimizer now steps those, by name."""
        after = dict(self.module.named_parameters())
        new = {id(p): after[n] for n, p in self._before.items()}
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group["params"] = [new.get(id(p), p) for p in group["params"]]
            if self.optimizer.state:
                raise UsageError("strategy 'fsdp' shards the optimizer state: pass an optimizer that has not "
                                 "stepped yet to setup, and load its state afterwards (optimizer.load_state_dict)")
        self._before = {}

    def describe(self) -> list[str]:
        names = {id(m): n for n, m in self.module.named_modules()}
        units = [names.get(id(u), type(u).__name__) for u in self.units] + ["(root)"]
        return [f"fsdp: {len(units)} units over {self.env.world_size} ranks "
                f"(reshard_after_forward {bool(self.options.get('reshard_after_forward', True))}): "
                f"{', '.join(units)}"]

    def no_sync(self) -> ContextManager:
        """Accumulation micro-steps: gradients stay unreduced until the last micro-batch's backward."""
        return self._no_sync()

    @contextmanager
    def _no_sync(self):
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def _grad_norm(self, grads: list[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
        """The norm of the sharded gradients, all-reduced (every rank calls it), as torchtitan computes it."""
        from torch.distributed.tensor import DTensor

        norm = super()._grad_norm(grads, norm_type)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    # ---- state: full state dicts are collectives over the ranks ------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's plain state_dict on every rank (all-gathered: every rank must call it)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        whole = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True))
        return {k: v.cpu() for k, v in whole.items()}  # (cpu_offload=True would leave ranks > 0 empty)

    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True):
        """Load a whole plain state_dict (any strategy's) into this rank's shards. Every rank."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        return set_model_state_dict(self.module, state, options=StateDictOptions(full_state_dict=True, strict=strict))

    def nonfinite_parameters(self) -> list[str]:
        """Names of this rank's non-finite shards; when only other ranks have some, one placeholder (a
        max all-reduce: every rank calls it and every rank agrees whether the list is empty)."""
        local = ((n, p.to_local() if hasattr(p, "to_local") else p)  # (a gathered root holds plain ones)
                 for n, p in self.module.named_parameters())
        mine = [n for n, t in local if not bool(torch.isfinite(t).all())]
        anywhere = self.all_reduce(torch.tensor(float(len(mine)), device=self.device), "max")
        return mine or (["(on other ranks)"] if float(anywhere) > 0 else [])

    def sharded_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        with self._plain_optimizer():
            model, optim = get_state_dict(self.module, self.optimizer)
        return {"model": model, "optim": optim}

    def load_sharded(self, path: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self.sharded_state()  # the targets: this rank's shards (the optimizer's state initialised)
        dcp.load(state, checkpoint_id=str(path))
        with self._plain_optimizer():
            set_state_dict(self.module, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])

    _torch_view = False  # inside torch.distributed.checkpoint: the optimizer's own (sharded) state dicts

    def optimizer_step(self, optimizer: torch.optim.Optimizer, base_step, closure=None):
        """Inside torch's state-dict functions (``get_state_dict`` creates a stateless optimizer's state
        with a step of zero gradients at lr 0, on every save): the optimizer's own step, no training
        step (no guard, no loss-scale update). Otherwise :meth:`Strategy.optimizer_step`."""
        if self._torch_view:
            return base_step()
        return super().optimizer_step(optimizer, base_step, closure)

    @contextmanager
    def _plain_optimizer(self):
        """While torch's state-dict functions run: they call ``optimizer.state_dict()`` and
        ``load_state_dict()``, which must be the optimizer's own (its DTensor shards), not the whole
        state :meth:`optimizer_state_dict` assembles with them."""
        self._torch_view = True
        try:
            yield
        finally:
            self._torch_view = False

    def eval_context(self) -> ContextManager:
        """Under bf16/fp16 the shards are gathered in the low dtype and each unit returns float32
        (``MixedPrecisionPolicy``): evaluation runs under the training autocast too."""
        return self.autocast()

    @staticmethod
    def plain_tensors(obj: Any) -> Any:
        """DTensors in ``obj`` (tensors, tuples, lists, dicts) as plain tensors: a replicated one is its
        local tensor (``weight.new_zeros(...)`` in a user's ``init_hidden``), a sharded one all-gathered
        (a collective: every rank makes it). The rest unchanged."""
        from torch.distributed.tensor import DTensor, Replicate

        if isinstance(obj, DTensor):
            return obj.to_local() if all(isinstance(p, Replicate) for p in obj.placements) else obj.full_tensor()
        if isinstance(obj, (tuple, list)):
            items = [FSDP.plain_tensors(x) for x in obj]
            return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
        if isinstance(obj, dict):
            return {k: FSDP.plain_tensors(v) for k, v in obj.items()}
        return obj

    def optimizer_state_dict(self) -> dict:
        """The whole optimizer state by index, on every rank (all-gathered: every rank must call it)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        if self._torch_view:
            return super().optimizer_state_dict()
        with self._plain_optimizer():
            named = get_optimizer_state_dict(self.module, self.optimizer,
                                             options=StateDictOptions(full_state_dict=True))
        return by_index(named, parameter_names(self.module, self.optimizer))

    def load_optimizer_state_dict(self, state: dict) -> None:
        """Load a whole by-index optimizer state (any strategy's) into this rank's shards. Every rank."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        if self._torch_view:
            return super().load_optimizer_state_dict(state)
        named = by_name(state, parameter_names(self.module, self.optimizer))
        with self._plain_optimizer():
            set_optimizer_state_dict(self.module, self.optimizer, named, options=StateDictOptions(full_state_dict=True))

    def load_whole(self, model: dict[str, torch.Tensor], optim: dict) -> None:
        """Load whole state (a ``.pt`` checkpoint's model and by-index optimizer state) into the shards."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        named = by_name(optim, parameter_names(self.module, self.optimizer))
        with self._plain_optimizer():
            set_state_dict(self.module, self.optimizer, model_state_dict=model, optim_state_dict=named,
                           options=StateDictOptions(full_state_dict=True))
