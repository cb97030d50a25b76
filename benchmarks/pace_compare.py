"""Which measurement of the machine's speed explains `paratrain plan --validate`'s step times best?

For validations run with ``--validate-pace run`` (the default since 2026-11-28: the profile's
one-thread runs side by side measured again just before each N > 1 run), the N > 1 rows' step
errors, each the median over the layout's runs of ``prediction_r / run r - 1``, with the
prediction's work on the cores (compute, optimizer, bubble) scaled by:

- ``none``: 1 (no measurement of the speed; the plain error of each run, then their median);
- ``round``: the first measurement of run r's round (what ``--validate-pace round`` measures: once,
  before the round's first N > 1 layout; approximated by the first N > 1 row's measurement);
- ``run``: the measurement just before run r (``--validate-pace run``).

The same runs under each rule, so the rules compare like for like (the report's plain "step error"
is of the median run alone, the faster of two, which is another estimator). A failed run or
measurement is left out, as the report does. Prints the sum and largest |error|.

    python benchmarks/pace_compare.py benchmarks/results/plan-amd/*-pace/validation.json
"""
from __future__ import annotations

import json
import math
import sys

from paratrain.bench.plan_validate_report import same_speed_errors


def errors(result: dict) -> dict[str, list[float]]:
    """{rule: the N > 1 rows' errors} of one ``validation.json`` (``result``) paced per run: the
    report's own :func:`~paratrain.bench.plan_validate_report.same_speed_errors`, each row given the
    rule's speeds; a row is kept where every rule gives it an error."""
    rows = [r for r in result["rows"] if r["n"] > 1 and r["ok"] and r.get("side_by_side_ms_all")]
    if not rows or not (result.get("side_by_side") or {}).get("profile_ms"):
        raise SystemExit("no row with side_by_side_ms_all: validate on a CPU with --validate-pace run")
    profile_ms = result["side_by_side"]["profile_ms"]
    firsts = rows[0]["side_by_side_ms_all"]  # each round's first measurement
    rules = {"none": lambda r: [profile_ms] * len(r["measured_step_ms_all"]), "round": lambda r: firsts,
             "run": lambda r: r["side_by_side_ms_all"]}
    got = {rule: [r["step_error_same_speed"] for r in same_speed_errors(
        [{**r, "side_by_side_ms_all": speeds(r)} for r in rows], result["side_by_side"])]
        for rule, speeds in rules.items()}
    kept = [i for i in range(len(rows)) if all(math.isfinite(errs[i]) for errs in got.values())]
    return {rule: [errs[i] for i in kept] for rule, errs in got.items()}


def main(paths: list[str]) -> None:
    for path in paths:
        with open(path) as f:
            got = errors(json.load(f))
        for rule, errs in got.items():
            print(f"{path}: {rule:>5}: sum |error| {100 * sum(map(abs, errs)):6.1f} points, "
                  f"largest {100 * max(map(abs, errs)):5.1f}% over {len(errs)} rows")


if __name__ == "__main__":
    main(sys.argv[1:])
