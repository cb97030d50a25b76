"""The cost model of a ``replicate`` step: towers in one process (torch's DataParallel; TensorFlow's
towers), on separate devices or as CPU threads on shared cores. Pure arithmetic on a
:class:`~.costmodel.Workload` and a :class:`~.costmodel.Link` (:mod:`.costmodel`). Units: seconds
(``_s``), bytes."""
from __future__ import annotations

from typing import Callable

from .costmodel import Link, Prediction, Workload, _check_n, prediction


def predict_towers(w: Workload, n: int, link: Link, *, output_bytes: float, compute_scale: float = 1.0,
                   shared_cores: bool = False, copy_s: Callable[[float], float] | None = None,
                   forward_side_by_side_s: float | None = None, joined: bool = False,
                   backward_measured_s: float | None = None, data_measured_s: float | None = None,
                   optimizer_measured_s: float | None = None) -> Prediction:
    """One ``replicate`` step: n towers in one process, each on the measured per-replica batch
    (torch's DataParallel; Krizhevsky 2014, "One weird trick", and TensorFlow's towers). On separate
    devices, each phase after the other (DataParallel is synchronous): broadcast the parameters from
    device 0 (pipelined: (n-1) alpha + P beta), the towers' forward and backward side by side, gather
    their outputs to device 0 for the loss and scatter the outputs' gradient back ((n-1) x (alpha +
    ``output_bytes`` beta) each way through device 0's link), reduce the gradients onto device 0
    ((n-1) alpha + P (beta + gamma)), one optimizer step. ``shared_cores``: CPU virtual devices,
    towers as threads of one process on the same cores (no transfers; the parameters are shared):
    the forwards run side by side in the tower threads, each with its share of the threads:
    ``forward_side_by_side_s``, measured that way (None: n x forward, one after the other); the one
    backward runs in the calling thread with every thread through the n towers' graphs (n x backward);
    the join of their outputs is a memory copy of n x ``output_bytes``: ``copy_s(n output_bytes)``
    (none without ``copy_s``), unless ``joined``: ``forward_side_by_side_s`` was measured with the
    join and the loss on the joined outputs in it (:func:`~.microbench_towers.measured_towers_forward`).
    ``backward_measured_s``: that backward as measured after that forward (shared cores only; None: n x
    backward). ``data_measured_s``, ``optimizer_measured_s``: the towers' data and optimizer step as
    measured in the training loop (shared cores only; :func:`~.plan_inputs.loop_towers_parts`; None:
    the one-device step's)."""
    _check_n(n)
    s, P = compute_scale, sum(w.param_bytes)
    towers = n if shared_cores else 1
    measured = shared_cores and forward_side_by_side_s is not None
    forward = forward_side_by_side_s if measured else w.forward_s * towers
    backward = backward_measured_s if shared_cores and backward_measured_s is not None else w.backward_s * towers
    data = data_measured_s if shared_cores and data_measured_s is not None else w.data_s
    optimizer = optimizer_measured_s if shared_cores and optimizer_measured_s is not None else w.optimizer_s
    compute = (forward + backward + data + optimizer) * s
    if n == 1:
        comm = 0.0
    elif shared_cores:
        comm = copy_s(n * output_bytes) if copy_s and not (measured and joined) else 0.0
    else:
        comm = ((n - 1) * link.alpha_s + P * link.beta_s_per_byte
                + 2 * (n - 1) * (link.alpha_s + output_bytes * link.beta_s_per_byte)
                + (n - 1) * link.alpha_s + P * (link.beta_s_per_byte + link.gamma_s_per_byte))
    return prediction(w, n, compute + comm, compute, "towers", optimizer_s=optimizer * s)


__all__ = ["predict_towers"]
