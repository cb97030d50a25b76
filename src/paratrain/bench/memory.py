"""Peak memory of one training step, by kind, on any device (the CPU allocator keeps no peak).

:func:`track_memory` runs a step under ``torch.distributed._tools.mem_tracker.MemTracker`` (torch's
tensor-level tracker: every storage allocated, freed, and what it is: parameters, buffers,
gradients, optimizer state, activations, temporaries). DDP's gradient buckets are allocated by its
C++ reducer where the tracker cannot see them; :func:`ddp_bucket_bytes` reads their sizes from DDP's
own logging data and the peak counts them where the gradients at that moment do not already hold
them (``gradient_as_bucket_view``: a gradient is a view of its bucket).

Private torch APIs (no public one measures a CPU step's peak), guarded where they are entered and
read (a torch that renames them gives no number): ``torch.distributed._tools.mem_tracker``,
and DDP's ``_get_ddp_logging_data()`` for the bucket sizes.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

MEMORY_KINDS = {"PARAM": "params", "BUFFER": "buffers", "GRAD": "grads", "OPT": "optimizer", "ACT": "activations",
                "TEMP": "temporaries", "OTH": "other"}


def ddp_bucket_bytes(engine: Any) -> float:
    """Bytes of a DistributedDataParallel's gradient buckets (0 for anything else)."""
    if not isinstance(engine, torch.nn.parallel.DistributedDataParallel):
        return 0.0
    try:
        sizes = str(engine._get_ddp_logging_data().get("bucket_sizes", ""))
        return float(sum(int(x) for x in sizes.split(",") if x.strip()))
    except Exception:  # noqa: BLE001 - a DDP without logging data: nothing to add
        return 0.0


def _tracker(per_module: bool):
    """torch's MemTracker; ``per_module=False``: without its module hooks (they tell activations from
    temporaries but refuse a module called several times in one step, as a pipeline stage is per
    micro-batch), so what is neither a parameter, a gradient nor optimizer state counts as
    ``temporaries``."""
    from torch.distributed._tools.mem_tracker import MemTracker

    if per_module:
        return MemTracker()

    class Totals(MemTracker):
        def __enter__(self):
            if self._depth == 0:
                from torch._guards import active_fake_mode

                self._fake_mode_on_entry = active_fake_mode()  # as MemTracker.__enter__ (DTensor's ops)
                self._register_global_optimizer_hook()
                self._track_resize()
                self._peak_mem_snap = self.get_tracker_snapshot()
                self._peak_mem = {dev: snap["Total"] for dev, snap in self._peak_mem_snap.items()}
            torch.utils._python_dispatch.TorchDispatchMode.__enter__(self)
            self._depth += 1
            return self

        def __exit__(self, *args):
            self._depth -= 1
            if self._depth == 0:
                self._deregister_param_and_optimizer_hooks()
                self._restore_resize()
            return torch.utils._python_dispatch.TorchDispatchMode.__exit__(self, *args)

    return Totals()


def track_memory(fn: Callable[[], Any], module: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer],
                 untracked: float = 0.0,
                 per_module: bool = False) -> tuple[Any, dict[str, float]]:
    """(fn(), {"peak": bytes, kind: bytes at that peak}) of this process' tensors during the call:
    ``torch.distributed._tools.mem_tracker.MemTracker`` with ``module``'s parameters, buffers,
    gradients and the state of ``optimizers`` (the strategy's ``state_optimizers()``, e.g. zero1's
    sharded one, whose state the user's optimizer does not hold; [] for none)
    tracked from before the call and every tensor allocated during it (the CPU allocator keeps no
    peak of its own); kinds: params, buffers, grads,
    optimizer, activations, temporaries, other; ``untracked``: bytes allocated outside the tracker's
    sight (DDP's buckets), added to the peak (as ``grad_buckets``) less the gradients it counted
    then; ``per_module``: see :func:`_tracker`. {} where the tracker cannot follow the call (the
    result is kept either way)."""
    optimizers = list(optimizers)  # a bad argument raises here, not in the try that means "no tracker"
    try:
        tracker = _tracker(per_module)
        tracker.track_external(module, *optimizers)
        tracker.__enter__()
    except Exception:  # noqa: BLE001 - tracking is optional
        return fn(), {}
    try:
        out = fn()
    finally:
        try:
            tracker.__exit__(None, None, None)
            kinds: dict[str, float] = {}
            for per_device in tracker.get_tracker_snapshot("peak").values():
                for k, v in per_device.items():
                    name = "peak" if str(k) == "Total" else MEMORY_KINDS.get(str(k).rsplit(".", 1)[-1], str(k))
                    kinds[name] = kinds.get(name, 0.0) + float(v)
            if untracked and kinds:
                kinds["grad_buckets"] = max(0.0, untracked - kinds.get("grads", 0.0))
                kinds["peak"] += kinds["grad_buckets"]
        except Exception:  # noqa: BLE001
            kinds = {}
    return out, kinds
