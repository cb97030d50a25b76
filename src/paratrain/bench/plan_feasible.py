"""Whether a plan row can run as priced (:func:`infeasible`): the device's memory, one machine's devices for
towers, this host's memory where the rows run here (:func:`host_memory`, :func:`host_demand`), the launcher
over several machines (:func:`~.plan_command.launch_refusal`), and the global batches the recipe's training
split cannot fill (:func:`data_refusals`). Split from :mod:`.plan_report`, which re-exports these names."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import UsageError
from .plan_command import launch_refusal
from .strategy_model import TOWERS


def data_refusals(cfg, data_dir: str | None, batches: set[int]) -> dict[int, str]:
    """{global batch: why the recipe's task refuses it} for those of ``batches`` whose run ``paratrain train``
    would refuse: the task's own check when it is built with that ``train.batch_size`` (e.g. digits-cnn's
    "the training split has 1197 images, fewer than one global batch of 4096"), or an epoch of no step.
    A larger batch never fits where a smaller one does not (so for the built-in tasks; a task that refuses
    small batches is missed, the safe way), so it builds the task for the largest and, where that fails,
    bisects for the smallest that fails (about log2 of the batches' count builds). Any UsageError of a
    build is a refusal of that batch: the plan built the task at the recipe's batch before (its data
    missing has been said then)."""
    import dataclasses

    from ..runs import build_task

    def why(batch: int) -> str:
        sized = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=batch))
        try:
            steps = build_task(sized, data_dir, world_size=1).steps_per_epoch()
        except UsageError as e:
            return str(e)
        return "" if steps > 0 else (f"an epoch of the training split holds no step of global batch {batch}; use "
                                     f"fewer devices or a smaller --global-batch")

    ordered = sorted(batches)
    if not ordered or not (last := why(ordered[-1])):
        return {}
    lo, hi, reasons = 0, len(ordered) - 1, {ordered[-1]: last}  # ordered[hi] fails; find the first that does
    while lo < hi:
        mid = (lo + hi) // 2
        reasons[ordered[mid]] = why(ordered[mid])
        lo, hi = (lo, mid) if reasons[ordered[mid]] else (mid + 1, hi)
    first = ordered[hi]
    return {b: reasons.get(b) or f"a global batch of {b}, over {first}, which the task refuses: {reasons[first]}"
            for b in ordered[hi:]}


@dataclass(frozen=True)
class HostMemory:
    """This host's memory where a plan's rows run on it (:func:`host_memory`), in bytes: ``total``
    (psutil's), ``process``, what each training process holds beyond its tensors (the profile's one-device
    ``paratrain train`` run: its private memory at the end less the profile's tracked peak of a step, at
    least 0: the interpreter's, torch's and the allocator's own), and ``shared``, the resident pages the
    processes share (the libraries': held once however many map them). ``measured``: False, and
    ``process`` and ``shared`` 0, for a profile that did not measure them (made before 2026-12-01; an
    optional measurement of version 44)."""
    total: float
    process: float = 0.0
    shared: float = 0.0
    measured: bool = False


def host_memory(prof: dict, preset) -> HostMemory | None:
    """This machine's memory where the plan's rows run on it: a CPU's profile planned on its measured links
    (``--interconnect measured``), measured on this host (its ``host``, the machine's name, is this one's);
    None otherwise (a preset: devices of their own; a GPU's profile). What a process holds beyond its
    tensors: the profile's default-thread one-device run's (``workloads``' ``host_private_bytes`` and
    ``host_shared_bytes``: :func:`~paratrain.devices.host_memory_split`), less ``memory_measured``'s
    ``peak_bytes``."""
    import platform

    import psutil

    from .plan_inputs import measured_workload
    from .plan_validate import on_gpu

    if preset is not None or on_gpu(prof) or prof.get("host", platform.node()) != platform.node():
        return None
    one = measured_workload(prof) or {}
    private, shared = (v if isinstance(v := one.get(k), (int, float)) else None
                       for k in ("host_private_bytes", "host_shared_bytes"))
    tracked = prof.get("memory_measured", {}).get("peak_bytes", 0.0)
    return HostMemory(total=float(psutil.virtual_memory().total),
                      process=max(0.0, private - tracked) if private is not None else 0.0,
                      shared=float(shared or 0.0), measured=private is not None)


def host_demand(row: dict, host: HostMemory | None = None) -> float:
    """Bytes a row's processes hold together on one host: towers (one process) their memory, else each of
    the N processes its peak, and a parameter server's K servers the busiest one's each; every process
    ``host.process`` more, the launcher of several processes (``paratrain train --nproc N``, no tensors
    of its own) ``host.process`` too, and ``host.shared`` once (None: none of these). A pipeline's processes
    are each counted at its busiest stage's peak (more than they hold, never less).

    On the 2-vCPU EPYC VM (digits_cnn, 2026-12-01: ``host.process`` 0.30 GB, ``host.shared`` 0.13 GB) this
    gives 1.05, 1.35 and 1.66 GB for allreduce at N = 2, ps-sync at N = 2 with K = 1 and allreduce at
    N = 4, where psutil, sampling each run's processes every 0.1 s, measured at most 0.91, 1.13 and 1.47
    GB (their private memory, the launcher's 0.20 GB in it, and the shared pages once): 13-19% above,
    the launcher taken at a training process' runtime; without the runtime, 0.14-0.27 GB."""
    from ..strategies import STRATEGIES

    mem = row["memory"]
    process, shared = (host.process, host.shared) if host else (0.0, 0.0)
    servers = row["overrides"].get("num_ps", 0)
    if STRATEGIES[row["strategy"]].cost_model == TOWERS:
        return mem["total"] + process + shared
    launcher = process if row["n"] + servers > 1 else 0.0
    return (mem["total"] + process) * row["n"] + (mem.get("server", 0.0) + process) * servers + launcher + shared


def infeasible(row: dict, limit: float | None, per_node: int | None, host: HostMemory | None = None,
                machine: int | None = None, flat_network: bool = False) -> str:
    """Why a predicted row cannot run ("" where it can): its peak memory per device over ``limit``
    (bytes; None: no limit), or towers (one process) over more devices than one machine holds
    (``per_node``, on a cluster's preset interconnect: a process drives its own machine's devices, as
    torch's DataParallel does; None: no bound, CPU virtual devices here), or, on this machine's CPU,
    its processes' memory together (:func:`host_demand`) over the host's (``host``; None: no bound),
    or a row over several machines of ``machine`` devices that the launcher cannot start as priced
    (:func:`~.plan_command.launch_refusal`)."""
    need = row["memory"]["total"]
    if limit is not None and need > limit:
        return f"needs {need / 1e9:.2f} GB per device > {limit / 1e9:.2f} GB"
    if host is not None and (demand := host_demand(row, host)) > host.total:
        return (f"its processes need {demand / 1e9:.1f} GB of this host's {host.total / 1e9:.1f} GB "
                f"of memory; use fewer devices")
    if why := launch_refusal(row, machine):
        return why
    from ..strategies import STRATEGIES

    if per_node is not None and STRATEGIES[row["strategy"]].cost_model == TOWERS and row["n"] > per_node:
        bound = ("1, a flat network preset's machine of one device" if flat_network
                 else f"--devices-per-node {per_node}")
        return (f"towers are one process, on one machine's devices: N = {row['n']} > {bound}; use a multi-process "
                f"strategy")
    return ""
