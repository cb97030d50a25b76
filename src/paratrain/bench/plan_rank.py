"""``paratrain plan``'s ranking: what a row's formula is known to leave out (:func:`unpriced`), the
tie (:data:`TIE`) and the pick within it, the order of the rows and the recommendation
(:func:`rank`, :func:`recommendation`), the layouts the measured errors cannot tell from it
(:func:`close_calls`), and the errors a ``--validate`` measured (:func:`read_validation`,
:func:`row_error`). Pure, apart from reading ``validation.json``."""
from __future__ import annotations

import json
import math
from pathlib import Path

from .costmodel_hooks import measured_hook
from .strategy_model import TOWERS

CHECKPOINTED = " + checkpointing"
"""What a layout's label gains with every block checkpointed (``model.activation_checkpointing``);
:func:`read_validation` keys a strategy's checkpointed runs by its name and this."""


def unpriced(model: str | None, prof: dict, *, on_this_machine: bool, comm_hook: str | None = None) -> str:
    """What the step formula of cost model ``model`` is known to leave out on the profiled device
    ('' where nothing is known): the row is listed, but :func:`rank` recommends it only where no
    fully priced synchronous row fits. Towers on GPUs: torch's DataParallel replicates the module
    and launches every tower from the one process' threads each step (host work under the GIL),
    which :func:`~.costmodel_towers.predict_towers` does not price off a CPU. Two towers on one
    H200 (soft placement) stepped 5.4x the one-device step for digits_cnn, and 6x on an H100, of
    which sharing the one GPU explains at most 2x; the formula gives 1.0x for two GPUs
    (benchmarks/RESULTS.md). What two GPUs take is not measured. Towers of a CPU's profile on a
    preset interconnect (``on_this_machine`` false): their devices are one process' virtual CPU
    devices, which share one machine's cores, so a preset's N devices of the profiled machine's
    speed do not exist for them (the command would run N towers on this machine's cores). A 16-bit
    compression hook (``comm_hook``) on a CPU's profile, unless it is bf16 planned on this machine with
    its cost measured there (:func:`~.costmodel_hooks.measured_hook`, profile version 25): priced as
    half the bytes on the link fitted to float32 all-reduces, it leaves out its casts and gloo's 16-bit
    reduction, which on CPUs cost more than the halved bytes save (2026-11-27, the 2-vCPU Xeon:
    digits_cnn without sync BN, N = 2, allreduce + bf16 hook was predicted 0.1 ms under allreduce's 9.2
    ms and measured 0.5 ms over its 8.6). On a preset interconnect the casts would be this CPU's and the
    reduction the preset's devices': neither is measured."""
    measured = comm_hook == "bf16" and measured_hook(prof, on_this_machine)
    if comm_hook in ("fp16", "bf16") and prof["device"] == "cpu" and not measured:
        return f"{comm_hook} hook on CPUs: its casts and gloo's {comm_hook} reduction are not measured"
    if model == TOWERS and prof["device"] != "cpu":
        return "towers on GPUs: DataParallel's host work is not priced"
    if model == TOWERS and not on_this_machine:
        return "towers on CPUs: one process' virtual devices share one machine's cores, not a preset's N devices"
    return ""


TIE = 0.01
"""Predictions closer than this fraction are a tie: the plan's inputs are medians of runs that spread
by more than that (the profile's repeats differ by 5-10% on this VM), so it cannot tell such
layouts apart, and it recommends the simplest (:func:`simplicity`): the one on the fewest processes
(devices, and a parameter server's servers: :func:`processes`), then one that trains on exact
gradients (:func:`compresses`), then the one that leaves the most device memory (:func:`pick`)."""


def processes(n: int, overrides: dict | None) -> int:
    """The processes a layout of ``n`` devices runs: the devices' and a parameter server's K servers
    (``num_ps``), which hold a host's cores and memory beside them (on one machine's CPU, the same
    cores). The tie-break of :func:`pick`: a layout within :data:`TIE` of another's rate that needs K
    more processes is not the simpler choice (digits_cnn on the 2-vCPU VM: ps-sync K=2 at N = 2, 4
    processes on 2 cores, predicted 1% under allreduce and 0.2 MiB a device lighter, measured 23%
    slower than it)."""
    return n + int((overrides or {}).get("num_ps", 0))


def compresses(overrides: dict | None) -> bool:
    """Whether a layout compresses its gradients (``dist.comm_hook`` fp16, bf16 or PowerSGD): it then
    trains on rounded or low-rank gradients, not on what one device computes. Within a tie
    (:data:`TIE`) the plan does not trade that for a speed it cannot tell apart (gpt_wt2 on the
    2-vCPU VM: allreduce + bf16 hook predicted 0.1% over allreduce, measured 3% faster in one
    validation and 7% slower in the next)."""
    return (overrides or {}).get("comm_hook") not in (None, "none")


def simplicity(n: int, overrides: dict | None, memory_bytes: float) -> tuple:
    """The key :func:`pick` takes the least of among tied layouts: fewest processes
    (:func:`processes`), then exact gradients before compressed ones (:func:`compresses`), then the
    least memory per device (bytes)."""
    return processes(n, overrides), compresses(overrides), memory_bytes


def pick(items: list, value, key) -> int:
    """Index of the recommended item: among those whose ``value(item)`` (higher is better) is within
    :data:`TIE` of the best, the one with the least ``key(item)`` (:func:`simplicity`), the faster of
    equals. -1 for no items."""
    if not items:
        return -1
    best = max(value(x) for x in items)
    tied = [i for i, x in enumerate(items) if value(x) >= best * (1 - TIE)]
    return min(tied, key=lambda i: (key(items[i]), -value(items[i])))


def objective_value(row: dict, objective: str) -> float:
    """What the plan ranks a row by (higher is better): its units/s, or units/s per device for the
    ``cost`` objective."""
    return row["units_per_s"] / (row["n"] if objective == "cost" else 1)


def close_calls(rows: list[dict], best: dict | None, objective: str) -> list[dict]:
    """The feasible synchronous rows that the measured errors cannot tell apart from ``best`` (the
    recommendation), best first: where each row's ``measured_error`` e (its strategy's largest
    |step error| at its N on the profiled machine, ``--validate``: :func:`row_error`; a layout that
    was not run itself, another K or hook, carries its strategy's) applies (measured, not
    extrapolated), its true rate lies in ``[v (1 - e), v (1 + e)]`` around the predicted ``v``
    (:func:`objective_value`; a step error of e = predicted / measured step - 1 makes the measured rate
    exactly ``v (1 + e)``); a row is a close call when its band reaches the recommendation's:
    ``v (1 + e) >= v_best (1 - e_best)``. An unpriced row (:func:`unpriced`) is never one: its
    prediction leaves out a known term, so the band does not hold for it. Empty where ``best`` has no
    measured error. What "say how sure it is" asks of the recommendation: the plan still recommends
    ``best`` (:func:`rank`), and says which others may be as fast."""
    def usable(r: dict) -> bool:
        return r.get("measured_error") is not None and not r.get("extrapolated", True)

    if best is None or not usable(best):
        return []
    floor = objective_value(best, objective) * (1 - best["measured_error"])
    return sorted((r for r in rows if r is not best and r["feasible"] and r["synchronous"] and usable(r)
                   and not r.get("unpriced") and objective_value(r, objective) * (1 + r["measured_error"]) >= floor),
                  key=lambda r: -objective_value(r, objective))


def rank(rows: list[dict], objective: str) -> list[dict]:
    """Feasible synchronous rows best first by the objective (words/s, or words/s per device for
    cost; equal: fewer devices), those with a known unpriced term (:func:`unpriced`) after the rest,
    then the asynchronous ones, then the infeasible ones. The first is the recommendation: of the
    feasible synchronous rows within :data:`TIE` of the best (the fully priced ones, where any fits),
    the one on the fewest processes (:func:`processes`: devices and servers), then on exact gradients
    (:func:`compresses`), then with the least memory per device (:func:`pick`, :func:`simplicity`)."""
    def value(r):
        return objective_value(r, objective)

    out = sorted(rows, key=lambda r: (not r["feasible"], not r["synchronous"], bool(r.get("unpriced")),
                                      -value(r), r["n"]))
    top = [r for r in out if r["feasible"] and r["synchronous"]]
    top = [r for r in top if not r.get("unpriced")] or top
    i = pick(top, value, lambda r: simplicity(r["n"], r.get("overrides"), r["memory"]["total"]))
    if i > 0:
        out.insert(0, out.pop(out.index(top[i])))
    return out


def recommendation(ranked: list[dict]) -> dict | None:
    """The row :func:`rank` recommends: the first feasible synchronous one of its order, or None
    where no such row exists (every layout infeasible, or asynchronous only)."""
    return next((r for r in ranked if r["feasible"] and r["synchronous"]), None)


def read_validation(out: Path) -> dict[str, dict]:
    """{key: {"error": max |step error| over every N measured, "by_n": {N: max |step error| of its
    layouts at N}, "memory_error": max |memory error|, "max_n": largest N with a step time}} from a
    previous ``--validate`` in ``out`` (empty when none; a run without a step time, failed, measures
    nothing). The key is the strategy for its plain runs and the strategy + :data:`CHECKPOINTED` for
    its runs with every block checkpointed (``--validate --activation-checkpointing``): their
    recompute is a term of their own. A plan row at a measured N carries that N's error
    (:func:`row_error`)."""
    try:
        v = json.loads((out / "validation.json").read_text())
    except (OSError, ValueError):
        return {}
    errs: dict[str, dict] = {}
    for r in v.get("rows", []):
        key = r["strategy"] + (CHECKPOINTED if r.get("checkpointing") else "")
        e = errs.setdefault(key, {"error": 0.0, "memory_error": 0.0, "max_n": 0, "by_n": {}})
        if math.isfinite(r.get("step_error", math.nan)):
            e["error"] = max(e["error"], abs(r["step_error"]))
            e["by_n"][r["n"]] = max(e["by_n"].get(r["n"], 0.0), abs(r["step_error"]))
            e["max_n"] = max(e["max_n"], r["n"])
        if math.isfinite(r.get("memory_error", math.nan)):
            e["memory_error"] = max(e["memory_error"], abs(r["memory_error"]))
    return errs


def row_error(checked: dict[str, dict], strategy: str, n: int, checkpointing: bool = False) -> float | None:
    """The measured step error a plan row of ``strategy`` at ``n`` devices carries (``checked``:
    :func:`read_validation`'s): its strategy's at that N where N was measured, else its largest at any
    N measured; a checkpointed row (``checkpointing``) its strategy's checkpointed runs' where they
    were validated, else its plain runs' (the recompute then unmeasured: :func:`extrapolated`); None
    where the strategy was not validated or none of its runs gave a step time."""
    v = checked.get(_key(checked, strategy, checkpointing))
    if not v or not v.get("by_n"):
        return None
    return v["by_n"].get(n, v["error"])


def _key(checked: dict[str, dict], strategy: str, checkpointing: bool) -> str:
    """The validation's key a plan row reads: its checkpointed runs' where any gave a step time."""
    ckpt = checked.get(strategy + CHECKPOINTED) if checkpointing else None
    return strategy + CHECKPOINTED if ckpt and ckpt.get("by_n") else strategy


def extrapolated(checked: dict[str, dict], strategy: str, n: int, preset: bool, checkpointing: bool = False) -> bool:
    """Whether a plan row of ``strategy`` at ``n`` devices is beyond what was measured (``checked``:
    :func:`read_validation`'s): its strategy was not validated, ``n`` is above the largest N measured,
    or ``preset`` (the plan prices an ``--interconnect`` preset, not the measured link) at ``n`` > 1;
    a checkpointed row (``checkpointing``) also where its strategy was not validated checkpointed. At
    N = 1 no link is used: the one-device row's prediction is the measured one's on any interconnect."""
    key = _key(checked, strategy, checkpointing)
    if checkpointing and key == strategy:  # its recompute not measured
        return True
    v = checked.get(key)
    return v is None or n > v["max_n"] or (preset and n > 1)
