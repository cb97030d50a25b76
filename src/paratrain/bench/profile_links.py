"""The links of the one-device profile (:mod:`.profile`) and, on a CPU, what its processes' sharing
of the cores costs: micro-benchmarks (each in its own module; most start their own processes), run
one after the other.

The links (:func:`~.microbench.measured_links`):
:func:`~.microbench.measured_link` (gloo all-reduce, 2 processes), the all-gather's and reduce-scatter's
own (:func:`~.microbench.measured_collective`), one send (:func:`~.microbench.measured_p2p`) and one
RPC message (:func:`~.microbench_rpc.measured_rpc`, the parameter server's transport) and a parameter
server's update of the model (``ps_update_s``, :func:`~.microbench_rpc.measured_ps_update`) and a
``ps-async`` worker's whole exchange with one server (``ps_round_trip_s``,
:func:`~.microbench_rpc.measured_ps_round_trip`, the PS's link: :func:`~.plan_ps.ps_message_link`; on a
CPU also the mean exchange of two, and of four, workers that compute between exchanges on the same
cores, and what those exchanges take of the workers' compute (``stolen``), ``ps_round_trips_loaded``
and ``ps_round_trips_loaded_4``, :func:`~.microbench_rpc.measured_ps_round_trips_loaded`), what the
optimizer's step on DTensor shards costs beyond the plain step (``sharded_optimizer_s``,
:func:`~.microbench_sharded.measured_sharded_optimizer`, zero1's and fsdp's) and the gradient's norm
on them (``sharded_norm_s``, :func:`~.microbench_sharded.measured_sharded_norm`, fsdp's); on a CPU, memory
copies (:func:`~.microbench.measure_copies`: 4 KiB ... 256 MiB, two towers' outputs, the fsdp units
whole and halved), what a blocking collective costs two processes reaching it from compute
(``meetings``, :func:`~.microbench_meetings.measured_meetings`; on fewer than 4 cores also four processes
taking turns on them, ``meetings_oversubscribed``) and what FSDP2 adds to each unit size between
two processes (a unit of its own parameters' shapes), collectives, copies and hooks (``fsdp_units``,
:func:`~.microbench_sharded.measured_fsdp_units`),
and what ZeRO-1's and FSDP2's optimizer steps add to allreduce's between two processes (``zero1_step_s``,
``fsdp_step_s``, :func:`~.microbench_sharded.measured_sharded_step`): in both, each rank runs the recipe's
model's forward and backward on its batch before each pass or step, as in training (since profile
version 39; ``sharded_workload`` False where the model could not run in their processes, which then
time them with nothing between, as before) and what DDP's bf16 compression hook
costs a bucket between two processes (``bf16_hook``, :func:`~.microbench_hooks.measured_compress_hook`).

Which ranks: none (each micro-benchmark starts and ends its own processes or one-rank group).
Units: seconds, bytes.
"""
from __future__ import annotations

from typing import Any, Callable

from ..env import default_threads


def profile_links(model, optimizer, cfg, device, prof: dict[str, Any], data_dir: str | None = None) -> dict[str, Any]:
    """The keys above for ``model`` (its parameters, on ``device``) and its ``optimizer``, each process at
    its share of ``prof["cores"]`` in the layouts validated here; ``prof``: the profile so far (read:
    ``cores``, ``output_bytes`` and ``strategy_inputs``' fsdp ``units``); ``cfg`` and ``data_dir``: the
    recipe the sharded steps' ranks build their model and batch from. Returns the new keys."""
    from .microbench import measured_links
    from .microbench_rpc import measured_ps_round_trip, measured_ps_update
    from .microbench_sharded import measured_sharded_norm, measured_sharded_optimizer

    params, cores = list(model.parameters()), prof["cores"]
    out: dict[str, Any] = {"links": measured_links()}
    # a server's share of the cores in the layout validated here: 2 workers and 1 server
    out["ps_update_s"] = measured_ps_update(params, optimizer, cfg.train.clip, threads=default_threads(3, cores))
    # a ps-async worker's whole exchange with its server (push, update, answer, load), for the PS's link
    out["ps_round_trip_s"] = measured_ps_round_trip(params, optimizer, threads=default_threads(3, cores))
    # zero1's and fsdp's step on DTensor shards, at a worker's share of the cores of 2 workers
    out["sharded_optimizer_s"] = measured_sharded_optimizer(params, optimizer, threads=default_threads(2, cores))
    # fsdp's guard takes the norm of its DTensor gradients every step
    out["sharded_norm_s"] = measured_sharded_norm(params, threads=default_threads(2, cores))
    if device.type == "cpu":  # what the processes' sharing of this machine's cores costs
        out.update(_shared_cores(model, params, optimizer, prof, out["ps_round_trip_s"],
                                 {"config": cfg, "data_dir": data_dir}))
    return out


def _shared_cores(model, params, optimizer, prof: dict[str, Any], round_trip_s: float,
                  workload: dict[str, Any]) -> dict[str, Any]:
    """A CPU's keys of :func:`profile_links` from ``ps_round_trips_loaded`` on (see the module);
    ``workload``: the recipe whose model's forward and backward run between the sharded steps."""
    from ..strategies import modelled
    from ..strategies.precision import LOW_DTYPES
    from .microbench import measure_copies
    from .microbench_hooks import measured_compress_hook
    from .microbench_meetings import measured_meetings
    from .microbench_rpc import measured_ps_round_trips_loaded
    from .microbench_sharded import measured_fsdp_units, measured_sharded_step
    from .plan_inputs import in_process_step_s
    from .plan_ps import LOADED_PS_KEYS
    from .profile_runs import OVERSUBSCRIBED
    from .strategy_model import STEP_PATHS, fsdp_unit_parameters

    cores, out = prof["cores"], {}
    low = LOW_DTYPES.get(workload["config"].train.precision)  # the units under fsdp's MixedPrecisionPolicy
    low = None if low is None else str(low).removeprefix("torch.")
    # the ps-async exchange again, with 2 and 4 workers computing between exchanges on the same cores
    for workers, key in LOADED_PS_KEYS.items():
        out[key] = {"workers": workers, **measured_ps_round_trips_loaded(
            params, optimizer, workers=workers, threads=default_threads(workers + 1, cores), exchange_s=round_trip_s)}
    units = prof["strategy_inputs"]["units"]  # CPU towers' join and FSDP2's buffers: copies in one memory
    out["memory_copy"] = measure_copies([4 ** k for k in range(6, 15, 2)] + [2 * prof["output_bytes"]]
                                        + [b for u in units for b in (u, u // 2)])
    out["meetings"] = measured_meetings()  # FSDP2's collectives block on a CPU (no streams)
    if cores < OVERSUBSCRIBED:  # and more processes than cores take turns on them
        out["meetings_oversubscribed"] = {"processes": OVERSUBSCRIBED,
                                          "points": measured_meetings(processes=OVERSUBSCRIBED)}
    # both run the model's forward and backward at a rank's batch (half the recipe's) before each pass
    # or step: at most about 50 of them per unit size and per sharded strategy, each about the one-device
    # step at the default threads scaled to the rank's (one for the units); 4x that, for a busy machine
    default_s = in_process_step_s(prof)

    def deadline(runs: int, threads: int) -> float:
        return 300 + 4 * 50 * runs * default_s * max(1.0, prof["default_threads"] / (2 * threads))

    def measured(run: Callable[[dict | None], Any]) -> Any:
        """``run(workload)``; where the recipe's model cannot run in the micro-benchmarks' processes
        (a task whose data loader starts processes of its own, say), again without it, with a line."""
        nonlocal workload
        if workload is not None:
            try:
                return run(workload)
            except RuntimeError as e:
                print(f"[plan] the recipe's model could not run between the sharded micro-benchmarks' steps "
                      f"({str(e)[:200]}); FSDP2's units and the sharded steps are timed with nothing between "
                      f"them", flush=True)
                workload = None
        return run(None)

    sizes = len({u for u in units if u > 0})
    out["fsdp_units"] = measured(lambda w: measured_fsdp_units(units, parameters=fsdp_unit_parameters(model),
                                                               workload=w, timeout_s=deadline(sizes, 1),
                                                               param_dtype=low))
    out["bf16_hook"] = measured_compress_hook()  # DDP's bf16 hook: casts, gloo's bf16 all-reduce
    threads = default_threads(2, cores)
    for cost_model, key in STEP_PATHS.items():  # zero1's and fsdp's step above allreduce's, 2 ranks
        out[key] = measured(lambda w, name=modelled(cost_model)[0]: measured_sharded_step(
            name, params, optimizer, threads=threads, workload=w, timeout_s=deadline(1, threads)))
    out["sharded_workload"] = workload is not None  # whether the model ran between their steps
    return out
