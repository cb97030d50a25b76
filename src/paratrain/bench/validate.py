"""The cost model against this machine: the inputs of :func:`~paratrain.bench.costmodel.predict`
from measured runs (``paratrain predict``), and the check of its predictions against measured
``allreduce`` runs (``paratrain bench --validate-model``).

Model inputs: a single-device run's forward, backward, data and optimizer time per step (the
loop's remaining overhead is added to data, so N = 1 reproduces the measured step), the model's
gradient bytes in backward order, and a :class:`~paratrain.bench.costmodel.Link` (a preset or
fitted by the gloo micro-benchmark). On a CPU the replicas share the cores: N processes get
``max(1, cores // N)`` intra-op threads each (paratrain's default), so the compute of N = 2 is
the single-device run *at that thread count*, and N processes with more threads in total than
cores time-share them (compute scaled by N x threads / cores; the micro-benchmark's 2-process
link is used unchanged, which under-predicts oversubscribed communication).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from .costmodel import Link, Workload, predict, relative_error


def workload_from_record(rec: dict, param_bytes: Sequence[int], tokens_per_step: float) -> Workload:
    """A :class:`Workload` from a single-device :func:`~paratrain.bench.report.run_record`."""
    t = rec["rank0_timing_ms"]
    parts = t["data_ms"] + t["forward_ms"] + t["backward_ms"] + t["compute_ms"] + t["optimizer_ms"]
    overhead = max(0.0, rec["train_step_ms"] - parts) if math.isfinite(rec["train_step_ms"]) else 0.0
    return Workload(forward_s=(t["forward_ms"] + t["compute_ms"] / 3) / 1000,
                    backward_s=(t["backward_ms"] + 2 * t["compute_ms"] / 3) / 1000,
                    data_s=(t["data_ms"] + overhead) / 1000, optimizer_s=t["optimizer_ms"] / 1000,
                    param_bytes=tuple(param_bytes), tokens_per_step=tokens_per_step)


def model_gradient_bytes(task, dtype: str) -> list[int]:
    """Gradient bytes per parameter of the task's model in ``dtype``, in the order backward produces
    them (reverse module order, as DDP buckets them). The model is built on the meta device."""
    import torch

    with torch.device("meta"):
        model = task.build_model()
    size = torch.finfo(getattr(torch, dtype)).bits // 8
    return [p.numel() * size for p in reversed(list(model.parameters()))]


def cpu_share(n: int, cores: int) -> tuple[int, float]:
    """(threads per process, compute scale) of n processes on ``cores`` cores with paratrain's
    default threads: max(1, cores // n) threads; scale max(1, n x threads / cores) (time sharing)."""
    threads = max(1, cores // n)
    return threads, max(1.0, n * threads / cores)


def layout_cpu_share(workers: int, servers: int, cores: int, in_process: bool = False) -> tuple[int, float]:
    """(threads per process, compute scale) of a layout on this machine's ``cores``: the launcher gives
    every process of the job (``workers`` + parameter ``servers``) :func:`cpu_share`'s threads, but only
    the workers compute at once: a server sleeps until gradients arrive (its update is in the PS
    term), so the time sharing is ``workers`` x threads over ``cores``. ``in_process`` (towers): one
    process with every core."""
    if in_process:
        return cpu_share(1, cores)
    threads, _ = cpu_share(workers + servers, cores)
    return threads, max(1.0, workers * threads / cores)


def validate(points: dict[int, dict], workloads: dict[int, Workload], link: Link, cores: int,
             bucket_mb: float) -> dict[str, Any]:
    """Predicted vs measured step time of allreduce at each N in ``points`` ({N: run record}).
    ``workloads``: {threads: Workload measured at that thread count}. Pure."""
    out: dict[str, Any] = {"link": {"alpha_s": link.alpha_s, "beta_s_per_byte": link.beta_s_per_byte,
                                    "gamma_s_per_byte": link.gamma_s_per_byte,
                                    "bandwidth_bytes_per_s": (1 / link.beta_s_per_byte if link.beta_s_per_byte
                                                              else None)},
                           "cores": cores, "bucket_mb": bucket_mb, "points": {}}
    for n, rec in sorted(points.items()):
        threads, scale = cpu_share(n, cores)
        w = workloads.get(threads) or workloads[min(workloads, key=lambda t: abs(t - threads))]
        p = predict(w, n, link, algorithm="ring", bucket_mb=bucket_mb, compute_scale=scale)
        entry = {"predicted_step_ms": 1000 * p.step_s, "predicted_exposed_comm_ms": 1000 * p.exposed_comm_s,
                 "measured_step_ms": rec.get("train_step_ms", math.nan), "threads_per_process": threads,
                 "compute_scale": scale}
        m = entry["measured_step_ms"]
        known = m and math.isfinite(m)
        entry["step_time_rel_error"] = relative_error(entry["predicted_step_ms"], m) if known else math.nan
        if scale > 1:
            entry["note"] = f"oversubscribed: {n} processes x {threads} thread(s) on {cores} cores"
        out["points"][str(n)] = entry
    errs = [abs(e["step_time_rel_error"]) for k, e in out["points"].items() if int(k) <= 2]
    out["max_abs_error_n_le_2"] = max(errs) if errs else math.nan
    out["note"] = (f"Inputs: single-device runs at 1 and {cores} threads, link fitted by the gloo all-reduce "
                   f"micro-benchmark (alpha {link.alpha_s * 1e6:.1f} us, "
                   f"{(1 / link.beta_s_per_byte / 1e9) if link.beta_s_per_byte else math.inf:.2f} GB/s); "
                   f"target |error| <= 15% for N = 1, 2.")
    return out
