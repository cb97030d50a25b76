"""``paratrain plan --validate``'s report (:mod:`.plan_validate` runs and scores the layouts):
``validation.md`` (:func:`markdown`) and what it says of the runs: their spread
(:func:`between_runs`), the machine's change of speed since the profile (:func:`machine_drift`) and
each step error at the machine's speed measured just before each of its runs, or in its round
(:func:`same_speed_errors`)."""
from __future__ import annotations

import math
import statistics

from .plan_inputs import measured_workload, step_s


def _ms(x: float | None) -> str:
    return f"{x:.0f}" if x is not None and math.isfinite(x) else "-"


def pct(x: float) -> str:
    """A signed percentage of a fraction with one decimal (0.123 -> "+12.3%"); "-" for NaN or inf."""
    return f"{100 * x:+.1f}%" if math.isfinite(x) else "-"


def markdown(result: dict) -> str:
    per_run = (result.get("side_by_side") or {}).get("pace") == "run"  # --validate-pace run
    lines = [f"# paratrain plan --validate — {result['config']}", "",
             "Step parts in ms, predicted (compute + comm + bubble + optimizer) and measured on rank 0 "
             "(forward + backward + data, comm, idle, optimizer).", "",
             *([f"**Partial: {result['partial']['runs_done']} of {result['partial']['runs']} runs** when this was "
                f"written (the validation was stopped, or is still running); a layout's row holds its runs so far, "
                f"and `paratrain plan` reads validation.json, which a whole validation writes.", ""]
               if result.get("partial") else []),
             "| layout | N | predicted step ms | measured step ms | step error | runs ms (spread) | "
             f"step error at the {'run' if per_run else 'round'}'s measured speed | "
             "predicted memory MiB | measured memory MiB | memory error | predicted parts | measured parts |",
             "|" + "---|" * 12]
    for r in result["rows"]:
        p, m = r.get("predicted_ms", {}), r.get("measured_ms", {})
        got = (f"{_ms(m.get('forward', 0) + m.get('backward', 0) + m.get('compute', 0) + m.get('data', 0))} + "
               f"{_ms(m.get('comm'))} + {_ms(m.get('idle'))} + {_ms(m.get('optimizer'))}") if m else "-"
        lines.append(f"| {r['label']} | {r['n']} | {r['predicted_step_ms']:.1f} | {r['measured_step_ms']:.1f} | "
                     f"{pct(r['step_error'])} | {_spread(r)} | {pct(r.get('step_error_same_speed', math.nan))} | "
                     f"{r['predicted_memory_bytes'] / 2**20:.1f} | "
                     f"{r['measured_memory_bytes'] / 2**20:.1f} | {pct(r['memory_error'])} | "
                     f"{_ms(p.get('compute'))} + {_ms(p.get('comm'))} + {_ms(p.get('bubble'))} + "
                     f"{_ms(p.get('optimizer'))} | {got} |")
    c = result.get("choice")
    if c:
        lines += ["", f"At N = 2 the plan recommends {c['recommended']}; measured fastest: {c['measured_fastest']} "
                      f"(the recommendation is {100 * c['shortfall']:.1f}% slower than it)."]
        if c.get("runoff"):
            lines += [runoff_line(c["runoff"])]
        if c.get("first_not_run"):
            lines += [f"The plan ranks {c['first_not_run']} first at N = 2, and it was not run here (or gave no step "
                      f"time): the recommendation above is the predicted fastest of the layouts run. Validate "
                      f"again to run it."]
        if c.get("close_calls"):  # (by construction these bands hold the measured rates: not a check)
            lines += [f"Too close to call at N = 2 by these step errors (a layout whose predicted rate, raised by its "
                      f"own measured error, reaches the recommendation's, lowered by its own): "
                      f"{', '.join(c['close_calls'])}."]
    over = [r for r in result["rows"] if r["n"] <= 2 and math.isfinite(r["step_error"])
            and abs(r["step_error"]) > STEP_TARGET and len(_finite_runs(r)) >= 2]  # runs to compare with
    inside = [r for r in over if between_runs(r)]
    if over:
        named = ", ".join(f"{r['label']} at {r['n']}" for r in inside)
        lines += ["", f"{len(over)} layout(s) at N <= 2 with two or more runs are over the "
                      f"{100 * STEP_TARGET:.0f}% step target; "
                      + (f"for {len(inside)} of them the prediction lies between the layout's own fastest and "
                         f"slowest runs, so there the runs differ by as much as the error ({named})." if inside else
                         "no prediction of theirs lies between the layout's own fastest and slowest runs.")]
    drift = machine_drift(result["rows"])
    if drift is not None:
        lines += ["", f"The one-device step ran {100 * abs(drift):.0f}% {'slower' if drift > 0 else 'faster'} here "
                      f"than the profile measured it: the machine's speed changed between the profile and these "
                      f"runs, and every error above includes that change. Validate again with --reprofile, "
                      f"on a quieter machine."
                      + (f" The profile's own runs of it took "
                         f"{', '.join(f'{x:.1f}' for x in result['profile_rounds_ms'])} ms (the median round taken)."
                         if len(result.get("profile_rounds_ms") or []) > 1 else "")]
    paired = [r for r in result["rows"] if r["n"] <= 2 and math.isfinite(r.get("step_error_same_speed", math.nan))]
    if paired:
        worst = max(paired, key=lambda r: abs(r["step_error_same_speed"]))
        paced = result.get("side_by_side")
        own = [x for r in result["rows"] for x in r.get("side_by_side_ms_all") or [] if _timed(x)]
        measured = (f"the one-thread one-device runs side by side measured again just before each of its runs "
                    f"({min(own):.1f}-{max(own):.1f} ms)" if own else
                    f"that round's one-thread one-device runs side by side, measured again before it "
                    f"({', '.join(f'{x:.1f}' for x in (paced or {}).get('rounds_ms', []))} ms)")
        how = (f"each N > 1 prediction's work on the cores (compute, optimizer, bubble) scaled by {measured}, over "
               f"the profile's ({paced['profile_ms']:.1f} ms): the prediction with the compute it would have "
               f"measured then"
               if paced else
               "the prediction times that round's measured one-device step over the profile's; the error of the "
               "predicted slowdown from one device, which a uniform change of the machine's speed does not move")
        when = "just before each run" if per_run else "of each run's own round"
        lines += ["", f"At the machine's measured speed {when} ({how}), the step errors at N <= 2 "
                      f"are within {100 * abs(worst['step_error_same_speed']):.1f}% (the largest: {worst['label']} at "
                      f"{worst['n']}). The targets are judged on the step errors themselves."]
    return "\n".join(lines) + "\n"


STEP_TARGET = 0.15
"""Issue 13's target for |step error| at N <= 2."""


def _finite_runs(row: dict) -> list[float]:
    return [x for x in row.get("measured_step_ms_all") or [] if x is not None and math.isfinite(x)]


def _spread(row: dict) -> str:
    """A layout's fastest and slowest measured step in ms and their spread (slowest / fastest - 1);
    "-" for fewer than two runs."""
    runs = _finite_runs(row)
    if len(runs) < 2:
        return "-"
    return f"{min(runs):.1f}-{max(runs):.1f} ({100 * (max(runs) / min(runs) - 1):.0f}%)"


def runoff_line(ro: dict) -> str:
    """The sentence of :func:`~.plan_validate.run_off`'s answer ``ro``."""
    pairs = "; ".join(f"{a:.1f} / {b:.1f}" for a, b in ro["rates"])
    s = ro["shortfall"]
    ahead = ", ".join(str(k + 1) for k, f in enumerate(ro["first"]) if f == ro["recommended"]) or "-"
    verdict = ("no pair gave two rates, so the 5% target is judged on the rounds' shortfall above"
               if not math.isfinite(s) else
               f"the median ratio {1 - s:.3f}: the recommendation is {100 * abs(s):.1f}% "
               f"{'slower' if s > 0 else 'faster'} than {ro['measured_fastest']}")
    return (f"Run-off: the two ran again in {len(ro['rates'])} pair(s) back to back, the order alternating "
            f"({ro['recommended']} first in pairs {ahead}); "
            f"their rates per s, the recommendation's / the fastest's: {pairs}; {verdict}."
            + (" The 5% target is judged on this: each pair ran a minute apart, where the rounds' runs of two "
               "layouts lie minutes apart on a machine whose speed drifts." if math.isfinite(s) else ""))


def between_runs(row: dict) -> bool:
    """Whether the predicted step lies between the layout's fastest and slowest measured runs (two
    or more): the error is then no larger than the runs' own spread, and the median run could as
    well have been on either side of the prediction."""
    runs = _finite_runs(row)
    return len(runs) >= 2 and min(runs) <= row["predicted_step_ms"] <= max(runs)


def side_by_side_ms(prof: dict) -> float | None:
    """The profile's one-device step (ms: data, forward, backward, optimizer) of one-thread runs side by
    side, one per core (:func:`~.profile_runs.loop_workloads`, ``workloads["1"]``): what each of N
    processes computes on this machine's shared cores, which every N > 1 prediction here prices its
    compute by. None where the profile has none (a GPU's, one core)."""
    one = (prof.get("workloads") or {}).get("1") or {}
    if prof.get("device") != "cpu" or not one.get("concurrent"):
        return None
    return step_ms(one)


def profile_rounds_ms(prof: dict) -> list[float]:
    """The profile's one-device runs at the default threads (the one-device row's prediction), each
    round's step in ms in the order they ran (``rounds_step_s``, since profile version 38 spread across
    the profile: :func:`~.profile_runs.median_rounds`); [] for a profile with one round, or older."""
    return [1000 * s for s in (measured_workload(prof) or {}).get("rounds_step_s", [])]


def step_ms(parts: dict[str, float]) -> float:
    """Milliseconds of a one-device step's parts in seconds (data, forward, backward, optimizer:
    :func:`~.profile_runs.loop_workloads`' entries)."""
    return 1000 * step_s(parts)


def _timed(ms: float | None) -> bool:
    """Whether a run gave a step time (a failed run's is None or NaN)."""
    return ms is not None and math.isfinite(ms) and ms > 0


def same_speed_errors(rows: list[dict], side_by_side: dict | None = None) -> list[dict]:
    """Set each row's ``step_error_same_speed``: its step error at the machine's speed measured just
    before each of its runs, or in the run's own round. With ``side_by_side`` (``{"profile_ms",
    "rounds_ms"}``: the profile's one-thread runs side by side, :func:`side_by_side_ms`, and the same
    runs repeated before each round of layouts), an N > 1 row's prediction in round r has its work on
    the cores (the predicted compute, optimizer and bubble parts) scaled by ``rounds_ms[r] /
    profile_ms``, and the error is the median over the rounds of ``prediction_r / run r - 1``: the
    model's error with the compute it would have measured then. A row's own ``side_by_side_ms_all``
    (``--validate-pace run``: the same runs repeated just before each of its runs) takes the place of
    ``rounds_ms``. Otherwise (no such measurement: a GPU's profile, a validation before 2026-11-28,
    N = 1), its step error with the prediction taken at the machine's speed of the same round of runs
    (``--validate-repeats`` goes round the layouts, so run r of every layout is in round r), the
    prediction times (the one-device ``single`` row's measured step in that round / its predicted
    step, the profile's own measurement): the relative error of ``predicted / predicted_one`` against
    the median over the rounds of ``measured / measured_one`` (run r of the layout over the one-device
    run r; the mean of the middle two of an even count). A change of the machine's speed between the
    profile and the runs (:func:`machine_drift`) that scales both steps of a round alike cancels (a
    uniform change: communication need not slow with compute); what remains is the error of the
    predicted slowdown from one device (the speedup's, inverted), and the one-device run's own noise.
    NaN for the one-device row itself, a failed row, or without a one-device row. Returns ``rows``."""
    from .costmodel import relative_error

    one = next((r for r in rows if r["n"] == 1 and r["strategy"] == "single" and r["ok"]), None)
    base = (one or {}).get("measured_step_ms_all") or []
    profile_ms = (side_by_side or {}).get("profile_ms")
    for r in rows:
        # the machine's speed of run r: measured before it (--validate-pace run), else before its round
        speeds = (r.get("side_by_side_ms_all") or (side_by_side or {}).get("rounds_ms") or []) if profile_ms else []
        if r["n"] > 1 and r["ok"] and speeds:
            on_cores = sum(r.get("predicted_ms", {}).get(k, 0.0) for k in ("compute", "optimizer", "bubble"))
            errs = [(r["predicted_step_ms"] + (s / profile_ms - 1) * on_cores) / m - 1  # (a failed measurement: NaN)
                    for m, s in zip(r.get("measured_step_ms_all") or [], speeds) if _timed(m) and _timed(s)]
            if errs:
                r["step_error_same_speed"] = statistics.median(errs)
                continue
        ratios = [m / s for m, s in zip(r.get("measured_step_ms_all") or [], base) if _timed(m) and _timed(s)]
        ok = r is not one and r["ok"] and ratios and one["predicted_step_ms"] > 0
        r["step_error_same_speed"] = (relative_error(r["predicted_step_ms"] / one["predicted_step_ms"],
                                                     statistics.median(ratios)) if ok else math.nan)
    return rows


DRIFT = 0.10
"""How far the one-device step may move between the profile and ``--validate`` before the report
says that the machine's speed changed (:func:`machine_drift`)."""


def machine_drift(rows: list[dict]) -> float | None:
    """measured / predicted - 1 of the one-device layout (``single`` at N = 1), whose prediction is the
    profile's own measurement of the same run: how much the machine itself slowed (> 0) or sped up
    between the profile and the validation runs. None when it is within :data:`DRIFT`, or absent."""
    one = next((r for r in rows if r["n"] == 1 and r["strategy"] == "single" and r["ok"]), None)
    if one is None or not (math.isfinite(one["measured_step_ms"]) and one["predicted_step_ms"] > 0):
        return None
    drift = one["measured_step_ms"] / one["predicted_step_ms"] - 1
    return drift if abs(drift) > DRIFT else None
