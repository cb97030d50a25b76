"""Which layouts ``paratrain plan --validate`` runs (:func:`validation_runs`, :func:`checkpointed_runs`)
and the one the plan ranks first on this machine (:func:`plan_first`). Split from :mod:`.plan_validate`,
which re-exports these names."""
from __future__ import annotations

from . import plan as pl
from .costmodel_hooks import measured_hook


def validation_runs(prof: dict, cfg, ns: list[int], config: str, task: str | None, overrides: list[str],
          first: pl.Layout | None = None) -> list[tuple[pl.Layout, int]]:
    """(layout, devices) to run: each modelled strategy's first plain layout at each N of ``ns``
    (N = 1: single); at N = 2 the bf16 hook's layouts too where this CPU's profile measured the
    hook (``bf16_hook``: their price is that measurement's, :mod:`.costmodel_hooks`); and ``first``
    (:func:`plan_first`, the layout the plan ranks first at N = 2) where it is not one of them
    (another K, ZeRO-2, a hook), so that the recommendation scored is the plan's own."""
    hooks_measured = bool(measured_hook(prof, on_this_machine=True))  # the runs are on this machine

    def skipped_hook(hook: str | None, n: int) -> bool:  # a hook's layout not priced by its own measurement
        return bool(hook) and not (hook == "bf16" and n == 2 and hooks_measured)

    seen, out = set(), []
    for n in ns:
        for lay in pl.layouts(n, prof, cfg):
            hook = lay.overrides.get("comm_hook")
            key = (lay.strategy, n, hook)
            if key in seen or any(isinstance(v, bool) for v in lay.overrides.values()) or skipped_hook(hook, n):
                continue
            seen.add(key)
            # what the recipe refuses at the run's global batch (weak scaling) is not run
            if _refusal(prof, config, task, overrides, lay) is None:
                out.append((lay, n))
    if first is not None and 2 in ns and all(lay.label != first.label for lay, n in out if n == 2):
        out.append((first, 2))
    return out


def _refusal(prof: dict, config: str, task: str | None, overrides: list[str], lay: pl.Layout) -> str | None:
    """:func:`~.plan.refusal` of ``lay`` at the global batch its validation run trains (weak scaling: the
    profile's batch a replica)."""
    return pl.refusal(config, task, overrides, lay, pl.layout_batch(lay, prof["batch_size"]))


def plan_first(prof: dict, cfg, link, n: int, config: str, task: str | None, overrides: list[str]
               ) -> pl.Layout | None:
    """The layout ``paratrain plan`` ranks first at ``n`` devices on this machine (its recommendation
    with ``--nproc n``: :func:`~.plan.rank` of every layout the recipe allows, no device memory limit on this
    machine's CPU, its processes within the host's memory, :func:`~.plan_feasible.host_memory`), or None where no
    synchronous layout exists at ``n``."""
    from .plan_feasible import host_demand, host_memory

    host = host_memory(prof, None)
    rows = []
    for lay in pl.layouts(n, prof, cfg):
        if _refusal(prof, config, task, overrides, lay) is None:
            row = pl.predict_layout(lay, prof, cfg, link, on_this_machine=True, global_batch=None)
            if row is not None:
                rows.append((lay, {**row, "feasible": host is None or host_demand(row, host) <= host.total}))
    ranked = pl.rank([row for _, row in rows], "words_per_s")
    best = pl.recommendation(ranked)
    return next((lay for lay, row in rows if row is best), None)


def checkpointed_runs(prof: dict, runs: list[tuple[pl.Layout, int]], config: str, task: str | None,
                      overrides: list[str]) -> list[tuple[pl.Layout, int]]:
    """``runs`` again with every block checkpointed (``--activation-checkpointing``), each labelled
    ``+ checkpointing`` (:data:`~.plan.CHECKPOINTED`): the ones the recipe allows with
    ``model.activation_checkpointing``; none where the profile found no blocks (nothing to checkpoint)."""
    if not prof.get("blocks"):
        return []
    keyed = [*overrides, pl.CHECKPOINTING_KEY]
    return [(pl.Layout(lay.strategy, lay.n, dict(lay.overrides), lay.label + pl.CHECKPOINTED), n) for lay, n in runs
            if _refusal(prof, config, task, keyed, lay) is None]
