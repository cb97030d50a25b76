"""CPU towers in ``paratrain plan``'s profile: their step as the training loop runs it
(:func:`loop_towers`), from which the plan prices this machine's towers rows
(:func:`~.plan_inputs.loop_towers_parts`). The runs go through :mod:`.profile_runs`' bench sweep."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from .profile_runs import loop_run, loop_spec, median_rounds, sync_batchnorm_strategies


def loop_towers(config: str, task_entry: str | None, overrides: tuple[str, ...], data_dir: str | None, batch: int,
                steps: int, towers: int, repeats: int = 1, accumulation: int = 1) -> dict[str, Any] | None:
    """The CPU towers' step as ``paratrain train`` runs it (since 2026-12-01, an optional key of profile
    version 44): the registry's towers
    strategy (``replicate``: :func:`sync_batchnorm_strategies`' second) as ``towers`` towers of one
    process, one per core, of the recipe's ``batch`` each (global batch ``towers`` x ``batch``, as the
    plan's rows and ``--validate`` run them), with the recipe's keys (its ``model.sync_batchnorm``
    included), ``repeats`` rounds: ``{"towers", "data_s", "forward_s", "backward_s", "optimizer_s"}``,
    rank 0's parts (:func:`~.validate.workload_from_record`) of the round with the median step (their
    sum; the lower middle of an even count), with every round's step (``rounds_step_s``) where there
    were several. The plan prices n CPU towers from it (:func:`~.plan_inputs.loop_towers_parts`).

    Why the loop and not only the towers timed in the profile's process
    (:func:`~.microbench_towers.towers_forward`, kept to price sync BatchNorm at other n): on the
    2-vCPU EPYC VM (2026-12-01) that timing of digits_cnn's two towers (forward, backward and sync
    BatchNorm) was 5.9%, 13.9% and 23.8% under ``paratrain train --strategy replicate``'s forward and
    backward on the same batch, a minute apart, and the loop's optimizer took 0.70-0.76 ms against
    the one-device run's 0.44; the plan's towers row was 25.1% under its run. None, with a line,
    where a run fails or times no step, or the batch does not split into ``accumulation``
    micro-batches: the plan then prices the towers from the in-process timing."""
    import math
    import tempfile

    from .plan_inputs import STEP_PARTS
    from .sweep import RunPlan
    from .validate import workload_from_record

    _, strategy = sync_batchnorm_strategies()

    def left_out(why: str) -> None:
        print(f"[plan] CPU towers in the loop: not measured ({why}); the towers are priced from their forward "
              f"and backward timed in the profile's process", flush=True)

    if batch % accumulation:
        return left_out(f"a batch of {batch} per tower does not split into {accumulation} micro-batches")
    spec = loop_spec(config, task_entry, overrides, data_dir, (strategy,), (towers,), "strong", steps)
    rounds: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="paratrain-profile-towers-") as tmp:
        for r in range(repeats):
            plan = RunPlan(strategy=strategy, n=towers, global_batch=batch * towers, repeat=r)
            rec, rc, said = loop_run(spec, plan, Path(tmp) / plan.name)
            if not (rec["ok"] and math.isfinite(rec["train_step_ms"])):
                return left_out(f"its run failed (exit {rc}): {said}" if not rec["ok"] else
                                "no step was timed (too few steps)")
            w = workload_from_record(rec, [0], rec["units_per_step"])
            rounds.append({k: getattr(w, k) for k in STEP_PARTS})
    got = median_rounds({"towers": rounds})["towers"]
    return {"towers": towers, **got}
