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

from .dist_config import CPU_ALLOCATORS
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


# glibc's malloc(3) parameters (malloc.h): M_TRIM_THRESHOLD -1, M_MMAP_THRESHOLD -3, M_ARENA_MAX -8
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
RETAIN_MMAP_THRESHOLD = 1 << 30  # bytes: a main-thread block below it comes from the heap and is reused when freed
OLD_GLIBC_MMAP_THRESHOLD = 32 << 20  # the most a glibc before 2.35 takes (HEAP_MAX_SIZE / 2 on 64-bit)
RETAIN_TRIM_THRESHOLD = -1  # mallopt(3): the heap's free top is never trimmed (given back to the kernel)
# the same for MALLOC_TRIM_THRESHOLD_: more than any heap, in 19 digits (glibc 2.39's tunables reject a value that
# fills 64 bits, 2 ** 64 - 1, as unparsed; before 2.26 glibc read it with atoi, which gives -1)
NEVER_TRIM = str(2 ** 63)
RETAIN_ARENA_MAX = 1  # every thread allocates from the main arena (a thread arena's heaps hold at most 64 MiB)
_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX")
_SET_BY = "PARATRAIN_CPU_ALLOCATOR"  # "retain": paratrain set the variables above in this process tree
CPU_ALLOCATOR_VARIABLES = (*_ENV, _SET_BY)  # what retain may put into os.environ (tests restore them)


def _users_own(environ) -> bool:
    """Whether the user set glibc's malloc parameters themselves (not a paratrain parent)."""
    own = environ.get(_SET_BY) != "retain" and any(k in environ for k in _ENV)
    return own or "glibc.malloc." in environ.get("GLIBC_TUNABLES", "")


# what glibc read at this process' start (it reads the variables once, at exec)
_STATE = {"user": _users_own(os.environ),
          "retain": os.environ.get(_SET_BY) == "retain" and all(k in os.environ for k in _ENV)}


def without_cpu_allocator(environ) -> dict[str, str]:
    """``environ`` without glibc's ``MALLOC_*`` variables and paratrain's marker of them: for a process
    that must start with glibc's own behaviour (a peer's program, a test's measurement)."""
    return {k: v for k, v in environ.items() if not k.startswith("MALLOC_") and k != _SET_BY}


def _glibc_mallopt():
    """glibc's ``mallopt``, or None where the C library is not glibc (macOS, musl)."""
    import ctypes

    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return None
        mallopt = ctypes.CDLL(None).mallopt
    except (ValueError, OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


def apply_cpu_allocator(mode: str = "retain") -> str:
    """Host memory between steps, for this process and the processes it starts (``dist.cpu_allocator``).

    ``"retain"``: glibc's malloc keeps the blocks a step frees for the next step. By default it gives
    a freed block of more than its mmap threshold (128 KiB, raised by each freed block up to 32 MiB)
    back to the kernel, and trims the heap's free top above twice that; a training step frees and
    allocates the same large activations every step, so the kernel maps and zeroes their pages again
    every step (minor page faults, in system time). Here the mmap threshold is 1 GiB (32 MiB where a
    glibc before 2.35 refuses more) and the heap is never trimmed: a trim threshold of 2 GiB - 1 (the
    most ``mallopt`` takes as a number) still trimmed the top of gpt_wt2's heap at batch 64, whose
    step frees more than 2 GiB. Also by default, a thread other than the main one allocates from an
    arena of its own, whose heaps hold at most 64 MiB (glibc's ``HEAP_MAX_SIZE``) and are unmapped
    when empty: a larger block of such a thread (a CPU tower's forward, an intra-op worker's
    temporary) is mapped and unmapped per allocation whatever the thresholds. So the number of
    arenas is 1 (``M_ARENA_MAX``): every thread allocates from the main arena's heap. Its lock is
    shared; measured on 2 vCPUs, the all-reduce and parameter-server steps (gloo and RPC threads) moved
    within the machine's drift (RESULTS). The limit holds only for the threads that have not allocated
    yet: a thread that allocated before the call keeps its arena, and a later thread may be handed one
    of those; call it first in a process (``paratrain train`` does before it loads the data), or
    export ``MALLOC_ARENA_MAX=1`` before the process starts. Where such arenas exist when it sets
    the limit (:func:`malloc_arenas`), it warns once a process (RuntimeWarning).

    glibc takes these by ``mallopt(3)`` in this process, and by the variables
    ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_`` and ``MALLOC_ARENA_MAX`` in ``os.environ``
    (only the values glibc took) for the processes it starts, which glibc reads at their start.
    PyTorch's CPU performance tuning guide recommends an allocator that reuses memory (jemalloc,
    tcmalloc) for the same reason; these are glibc's own settings and need no library. Measured with
    ``benchmarks/cpu_allocator.py`` (``benchmarks/RESULTS.md``, "Host memory", 2-vCPU VM): the
    thresholds made gpt_wt2's step 1.58x and ptb_small's 1.12-1.24x faster; in A/B runs the single
    arena made gpt_wt2's towers 1.29x faster again, and no trimming their backward 1.37x. The cost:
    memory a step frees stays with the process, and the peak resident set can grow where blocks glibc
    mapped apart now share the heap (gpt_wt2's by 47%).

    ``"default"``: glibc's own behaviour for the processes this one starts: the variables a parent
    set (``$PARATRAIN_CPU_ALLOCATOR``) are removed from ``os.environ``. This process keeps what glibc
    read at its start and what an earlier call set (glibc cannot go back to its dynamic thresholds).

    Where the user set glibc's malloc parameters (any of the three variables, ``MALLOC_ARENA_MAX``
    alone too, or ``glibc.malloc.*`` in ``GLIBC_TUNABLES``), both modes leave them and glibc to the
    user: no threshold or arena is set, and summaries say ``"user"``. Returns what holds in this
    process after the call (:func:`cpu_allocator_in_effect`). Raises UsageError for another ``mode``. Call it
    in every process that trains, before its first step; a CUDA device's memory is not affected."""
    if mode not in CPU_ALLOCATORS:
        raise UsageError(f"dist.cpu_allocator = {mode!r} is not allowed; use one of {', '.join(CPU_ALLOCATORS)}")
    if _STATE["user"] or _users_own(os.environ):
        return cpu_allocator_in_effect()
    if mode == "default":
        if os.environ.get(_SET_BY) == "retain":
            for key in (*_ENV, _SET_BY):
                os.environ.pop(key, None)
        return cpu_allocator_in_effect()
    mallopt = _glibc_mallopt()
    if mallopt is None:
        return cpu_allocator_in_effect()
    took = {}
    for value in (RETAIN_MMAP_THRESHOLD, OLD_GLIBC_MMAP_THRESHOLD):
        if mallopt(_M_MMAP_THRESHOLD, value):
            took["MALLOC_MMAP_THRESHOLD_"] = str(value)
            break
    if mallopt(_M_TRIM_THRESHOLD, RETAIN_TRIM_THRESHOLD):
        took["MALLOC_TRIM_THRESHOLD_"] = NEVER_TRIM
    if mallopt(_M_ARENA_MAX, RETAIN_ARENA_MAX):
        took["MALLOC_ARENA_MAX"] = str(RETAIN_ARENA_MAX)
    if len(took) == len(_ENV):
        os.environ.update(took, **{_SET_BY: "retain"})
        _STATE["retain"] = True
        _report_late_arenas()
    return cpu_allocator_in_effect()


def malloc_arenas() -> int | None:
    """How many malloc arenas glibc has in this process: the ``<heap nr=...>`` entries of
    ``malloc_info(3)``, the main arena and one per arena a thread took. None where the C library is
    not glibc or the count cannot be read. Any thread may call it; it takes each arena's lock briefly."""
    import ctypes
    import tempfile

    if _glibc_mallopt() is None:
        return None
    libc = ctypes.CDLL(None)
    libc.fdopen.restype, libc.fdopen.argtypes = ctypes.c_void_p, [ctypes.c_int, ctypes.c_char_p]
    libc.malloc_info.argtypes, libc.fclose.argtypes = [ctypes.c_int, ctypes.c_void_p], [ctypes.c_void_p]
    try:
        with tempfile.TemporaryFile() as f:
            fd = os.dup(f.fileno())
            stream = libc.fdopen(fd, b"w")
            if not stream:
                os.close(fd)
                return None
            ok = libc.malloc_info(0, stream) == 0
            libc.fclose(stream)  # closes fd
            f.seek(0)
            return f.read().count(b"<heap nr=") if ok else None
    except OSError:  # no writable temporary directory
        return None


def _report_late_arenas() -> None:
    """A RuntimeWarning, once a process, where ``retain`` set one arena after threads had taken
    arenas of their own (:func:`malloc_arenas` above 1): those threads keep them. A warning, not a
    line of its own: a process ``paratrain`` starts applies it first and never has such threads; a
    caller that runs the CLI in a process with a history (a test harness) filters or captures it."""
    if _STATE.get("reported"):
        return
    arenas = malloc_arenas()
    if arenas and arenas > 1:
        _STATE["reported"] = True
        warnings.warn(f"dist.cpu_allocator: {arenas - 1} malloc arena(s) of threads that allocated before it was "
                      "applied stay in use (their blocks over 64 MiB are mapped per allocation); call pt.init() "
                      "before other work, or export MALLOC_ARENA_MAX=1 before the process starts",
                      RuntimeWarning, stacklevel=3)


def cpu_allocator_in_effect() -> str:
    """How this process' glibc keeps host memory, for summaries: ``"retain"`` (:func:`apply_cpu_allocator`
    set it here, or a parent did before this process started), ``"user"`` (the user's own malloc
    parameters) or ``"default"`` (glibc's own, or not glibc)."""
    if _STATE["user"]:
        return "user"
    return "retain" if _STATE["retain"] else "default"


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated bytes on a CUDA device; on CPU the process' peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def host_memory_split() -> tuple[int, int] | None:
    """This process' host memory now, in bytes: (private, shared), private its unique set size (pages no
    other process maps: what each more process of a job adds to the host) and shared the rest of its
    resident set (the libraries' pages, which every process of a job maps once for the host); psutil's
    ``memory_full_info`` (Linux: /proc/PID/smaps). None where the platform does not tell."""
    import psutil

    try:
        info = psutil.Process().memory_full_info()
        return int(info.uss), max(0, int(info.rss - info.uss))
    except (psutil.Error, AttributeError, OSError):
        return None


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (a CUDA device's kernels run asynchronously), before a
    clock is read; nothing on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
