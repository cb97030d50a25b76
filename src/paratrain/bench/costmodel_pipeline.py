"""The alpha-beta cost model of :mod:`.costmodel` for the ``pipeline`` strategy (and its hybrid
data-parallel x pipeline layouts).

* ``pipeline`` (GPipe / 1F1B, Huang et al. 2019; Narayanan et al. 2019): S stages with measured
  shares of the forward + backward, M micro-batches: sum_s t_s + (M - 1) max_s t_s for stage s's
  time t_s per micro-batch (S equal stages: ``(M + S - 1)`` slots of ``(forward + backward) / (S M)``,
  the bubble (S-1)/(M+S-1) of them, for both schedules), plus the fill and drain transfers on the
  critical path, 2 (S-1) point-to-point messages of one micro-batch's activations, plus the shared
  parameters' all-reduce over the stages and the largest stage's gradient all-reduce over the D
  replicas (not overlapped); the optimizer on the largest stage's parameters (a tied embedding is
  in two stages and updated by both); micro-batches cost the measured ``microbatch_factor`` more
  than the whole batch. With more processes than cores, a stage waiting in the bubble leaves its
  core to the others: the schedule is the larger of the critical path and each core's share of all
  the work (:func:`pipeline_schedule_s`).

Units: seconds (``_s``), bytes. Bad arguments raise :class:`~paratrain.errors.UsageError`.
"""
from __future__ import annotations

from typing import Sequence

from ..errors import UsageError
from .costmodel import Link, Prediction, Workload, _check_n, allreduce_s, prediction


def predict_pipeline(w: Workload, replicas: int, stages: int, microbatches: int, link: Link, *,
                     activation_bytes: float, shared_bytes: float = 0.0, compute_scale: float = 1.0,
                     stage_fractions: Sequence[float] | None = None, stage_param_bytes: Sequence[float] | None = None,
                     microbatch_factor: float = 1.0, p2p_link: Link | None = None,
                     stage_link: Link | None = None, step_allreduce_bytes: Sequence[float] = ()) -> Prediction:
    """One ``pipeline`` step of ``replicas`` x ``stages`` processes with ``microbatches`` per replica.
    ``activation_bytes``: what one stage sends the next for a replica's whole batch (forward; the
    backward sends as many); ``shared_bytes``: parameters used by several stages (a tied embedding),
    all-reduced over the stages; ``stage_fractions``: each stage's share of the forward + backward
    (measured; default equal); ``stage_param_bytes``: each stage's parameters, shared ones in each
    stage that holds them (default 1/S of the model's): the largest stage's optimizer step and
    gradient all-reduce over the replicas pace the step; ``microbatch_factor``: the forward +
    backward of M micro-batches over that of the whole batch (measured; smaller products are
    slower). With t_s = stage s's forward + backward of one micro-batch, the schedule's compute is
    sum_s t_s (the first micro-batch through every stage) + (M-1) max_s t_s (the slowest stage
    paces the rest): (M+S-1) t for S equal stages, the bubble (S-1)/(M+S-1). With ``compute_scale``
    above 1 (more processes than cores, taking turns), a stage waiting in the bubble leaves its core
    to the others: :func:`pipeline_schedule_s`. ``p2p_link``: a point-to-point send's own measured
    link for the activations (default ``link``); ``stage_link``: the link of the tied parameters'
    all-reduce over the stages (default ``link``; ``link`` is the replicas' all-reduce's).
    ``step_allreduce_bytes``: the small all-reduces over the stages every step, after the schedule
    (:class:`~paratrain.strategies.pipeline.Pipeline`: the loss and each stage's bubble, 8 (1 + S) bytes;
    with gradient clipping the squared norm, 8 bytes), each priced on the stage link."""
    _check_n(replicas, "replicas")
    _check_n(stages, "stages")
    _check_n(microbatches, "microbatches")
    s, S, M = compute_scale, stages, microbatches
    fractions = list(stage_fractions) if stage_fractions is not None else [1.0 / S] * S
    if len(fractions) != S or min(fractions) < 0 or not sum(fractions) > 0:
        raise UsageError(f"stage_fractions {fractions}: give {S} shares >= 0 of the forward + backward")
    total = sum(w.param_bytes)
    largest = max(stage_param_bytes) if stage_param_bytes else total / S
    if not microbatch_factor > 0 or largest < 0:
        raise UsageError(f"microbatch_factor = {microbatch_factor} must be > 0 and stage_param_bytes >= 0")
    per_mb = stage_microbatch_s(w, fractions, M, microbatch_factor)
    hop = p2p_link or link
    p2p = hop.alpha_s + activation_bytes / M * hop.beta_s_per_byte if S > 1 else 0.0
    optimizer = w.optimizer_s * min(1.0, largest / total) if total else w.optimizer_s / S
    # the bubble is idle compute (above the cores, other processes' turn)
    compute = pipeline_schedule_s(per_mb, M, s) + (w.data_s + optimizer) * s
    # no tied parameters: no message
    tied = stage_link or link
    shared = allreduce_s(shared_bytes, S, tied) if shared_bytes else 0.0
    shared += sum(allreduce_s(b, S, tied) for b in step_allreduce_bytes)
    step = compute + 2 * (S - 1) * p2p + shared + allreduce_s(min(largest, total), replicas, link)
    return prediction(w, replicas * S, step, compute, "stages", optimizer_s=optimizer * s, replicas=replicas)


def stage_microbatch_s(w: Workload, fractions: Sequence[float], microbatches: int,
                       microbatch_factor: float = 1.0) -> list[float]:
    """Each stage's forward + backward of one micro-batch on a core of its own (unscaled), t_s: the
    step's forward + backward times ``microbatch_factor``, stage s's share ``fractions[s] /
    sum(fractions)`` of it, over ``microbatches``. For :func:`pipeline_schedule_s`."""
    return [(w.forward_s + w.backward_s) * microbatch_factor * f / sum(fractions) / microbatches for f in fractions]


def pipeline_schedule_s(per_mb: Sequence[float], microbatches: int, compute_scale: float = 1.0) -> float:
    """Seconds of one replica's pipeline schedule (1F1B or GPipe: every micro-batch's forward and
    backward through every stage). ``per_mb``: each stage's forward + backward of one micro-batch on
    a core of its own (unscaled). Each stage's own core: the critical path sum_s t_s + (M-1) max_s t_s.
    ``compute_scale`` s > 1: the job's processes take turns on fewer cores, s = processes x threads /
    cores. A stage that waits in the bubble leaves its core to the others, so the machine runs the
    job's work back to back where it can: each core's share of every process' busy time, s x M x
    mean_s t_s, and the critical path are both lower bounds of any schedule, and this takes the
    larger of the two. It is a lower bound: Graham (1969) bounds a work-conserving list schedule
    above by their sum, so a scheduler that leaves a core idle while work waits is slower than this.
    For s = 1 the critical path is always the larger; for s < 1 (a faster device) the critical path
    is s times as long, as before. On the 2-vCPU VM, gpt_wt2's 2 x 2 pipeline (its second stage holds
    95% of the work, the output layer) took 2.2-2.7 s a step, where s x the critical path predicted
    3.7 s and this predicts 2.0 s."""
    M = microbatches
    critical = sum(per_mb) + (M - 1) * max(per_mb)
    return max(min(1.0, compute_scale) * critical, compute_scale * M * sum(per_mb) / len(per_mb))


def bubble_fraction(stages: int, microbatches: int) -> float:
    """(S-1)/(M+S-1): the idle part of a GPipe or 1F1B step of S equal stages, transfers aside."""
    _check_n(stages, "stages")
    _check_n(microbatches, "microbatches")
    return (stages - 1) / (microbatches + stages - 1)


__all__ = ["predict_pipeline", "stage_microbatch_s", "pipeline_schedule_s", "bubble_fraction"]
