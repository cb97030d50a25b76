"""Devices: discovery, resolution with soft placement, placement plans and their log, memory controls.

Device strings: ``auto`` (first GPU, else CPU), ``cpu``, ``cpu:N`` (virtual CPU
devices: the same memory and cores, used to run towers or model-parallel
stages on machines without GPUs through the same code path), ``cuda``,
``cuda:N``. Soft placement (TensorFlow's ``allow_soft_placement``): a device
that does not exist falls back to the next available GPU, then to the CPU, with
a one-line warning; ``strict=True`` makes it a UsageError that lists what exists.
"""
from __future__ import annotations

import fnmatch
import os
import warnings
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from torch import nn

from .errors import UsageError


@dataclass(frozen=True)
class DeviceInfo:
    """name (``cpu``, ``cuda:0``), description, memory in bytes (total; None for the CPU's)."""

    name: str
    description: str
    memory_bytes: int | None


def list_devices() -> list[DeviceInfo]:
    """Every device this process can use: the CPU (with its cores) and each visible CUDA device."""
    from .env import available_cores

    out = [DeviceInfo("cpu", f"{available_cores()} cores ({os.cpu_count()} on the machine)", None)]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            out.append(DeviceInfo(f"cuda:{i}", p.name, p.total_memory))
    return out


def set_visible_devices(spec: str) -> None:
    """Restrict the CUDA devices this process sees (``"0,2"``), the CUDA_VISIBLE_DEVICES way.

    Must run before CUDA is initialised; raises UsageError if it already is.
    """
    if torch.cuda.is_initialized():
        raise UsageError("--visible-devices must be set before CUDA starts; pass it on the command line")
    os.environ["CUDA_VISIBLE_DEVICES"] = spec


def resolve(spec: str, strict: bool = False) -> torch.device:
    """Turn a device string into a torch.device (soft placement unless ``strict``)."""
    spec = spec.strip().lower()
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if spec == "auto":
        return torch.device("cuda", 0) if n_gpu else torch.device("cpu")
    try:
        dev = torch.device(spec)
    except RuntimeError:
        raise UsageError(f"device {spec!r} is not a device name; use auto, cpu, cpu:N, cuda or cuda:N") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise UsageError(f"device {spec!r} is not supported; use auto, cpu, cpu:N, cuda or cuda:N")
    index = 0 if dev.index is None else dev.index
    if index < n_gpu:
        return torch.device("cuda", index)
    existing = ", ".join(d.name for d in list_devices())
    if strict:
        raise UsageError(f"device {spec!r} does not exist (strict placement); devices here: {existing}")
    fallback = torch.device("cuda", index % n_gpu) if n_gpu else torch.device("cpu")
    warnings.warn(f"device {spec} does not exist; placed on {fallback} instead (soft placement)", stacklevel=2)
    return fallback


def resolve_list(spec: str, strict: bool = False) -> list[torch.device]:
    """``"cuda:0,cuda:1"`` or ``"cpu:0,cpu:1"`` -> resolved devices (order kept)."""
    names = [s for s in (p.strip() for p in spec.split(",")) if s]
    if not names:
        raise UsageError("empty device list; give devices like cpu:0,cpu:1 or cuda:0,cuda:1")
    return [resolve(n, strict) for n in names]


# ---- placement plans ---------------------------------------------------------
Plan = Mapping[str, str] | Callable[[str, nn.Module], str | None]


@dataclass(frozen=True)
class Placement:
    """One row of the placement log: a module that owns parameters, its device, its parameters."""

    module: str
    device: str
    params: int
    bytes: int


def plan_device(plan: Plan, name: str, module: nn.Module) -> str | None:
    """The device a plan gives module ``name``: a function's answer, or the device of
    the longest pattern (fnmatch; a pattern also matches the module's children) that matches."""
    if callable(plan):
        return plan(name, module)
    best = None
    for pattern, device in plan.items():
        if fnmatch.fnmatchcase(name, pattern) or name.startswith(pattern + "."):
            if best is None or len(pattern) > len(best[0]):
                best = (pattern, device)
    return best[1] if best else None


def _move_inputs(device: torch.device):
    def to_device(x):
        if isinstance(x, torch.Tensor):
            return x.to(device)
        if isinstance(x, (tuple, list)):
            return type(x)(to_device(v) for v in x)
        return x

    def hook(module, args, kwargs):
        return to_device(args), {k: to_device(v) for k, v in kwargs.items()}

    return hook


def apply_placement(model: nn.Module, plan: Plan, default: str = "cpu", strict: bool = False) -> list[Placement]:
    """Move every module to the device its plan gives (children follow their parent
    unless the plan names them) and make each placed module move its inputs to its
    device, so activations cross devices automatically (model parallelism).

    Returns the placement log: every parameter appears exactly once, under the module
    that owns it. Raises UsageError for unknown devices under ``strict``.
    """
    assigned: dict[str, str] = {"": default}
    rows: list[Placement] = []
    seen: set[int] = set()  # a tied (shared) parameter stays with the first module that owns it
    for name, module in model.named_modules():
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        own = plan_device(plan, name, module) if name else None
        assigned[name] = own or assigned.get(parent, default)
        dev = resolve(assigned[name], strict)
        for p_name, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            p.data = p.data.to(dev)  # the Parameter object stays (optimizers keep pointing at it)
            if p.grad is not None:
                p.grad = p.grad.to(dev)
            full = f"{name}.{p_name}" if name else p_name
            rows.append(Placement(full, str(dev), p.numel(), p.numel() * p.element_size()))
        for b_name, b in module.named_buffers(recurse=False):
            module._buffers[b_name] = b.to(dev)
        if own is not None or not name:
            module.register_forward_pre_hook(_move_inputs(dev), with_kwargs=True)
    return rows


def format_placement_log(rows: list[Placement]) -> str:
    """A table: parameter, device, parameter count, bytes, and a total line."""
    w = max([len(r.module) for r in rows] + [9])
    lines = [f"{'parameter':<{w}}  {'device':<8} {'params':>12} {'bytes':>14}"]
    lines += [f"{r.module:<{w}}  {r.device:<8} {r.params:>12,} {r.bytes:>14,}" for r in rows]
    lines.append(f"{'total':<{w}}  {'':<8} {sum(r.params for r in rows):>12,} {sum(r.bytes for r in rows):>14,}")
    return "\n".join(lines)


# ---- memory ---------------------------------------------------------------------
def apply_memory_controls(device: torch.device, fraction: float = 0.0, expandable_segments: bool = False) -> list[str]:
    """Per-process memory fraction (torch.cuda.set_per_process_memory_fraction) and
    expandable segments (PYTORCH_CUDA_ALLOC_CONF, before the first CUDA allocation).
    Returns notes to print; on CPU the options say they do not apply instead of failing."""
    notes = []
    if device.type != "cuda":
        if fraction:
            notes.append("memory fraction applies to CUDA devices only; ignored on cpu")
        if expandable_segments:
            notes.append("expandable segments apply to CUDA devices only; ignored on cpu")
        return notes
    if expandable_segments:
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if fraction:
        torch.cuda.set_per_process_memory_fraction(fraction, device)
    return notes


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated bytes on a CUDA device; on CPU the process' peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (a CUDA device's kernels run asynchronously), before a
    clock is read; nothing on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
