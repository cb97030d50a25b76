"""A markdown table of the run summaries that benchmarks/*_runs.sh keep (``keep`` in _runs_lib.sh):
one row per run NAME (``OUT/NAME.summary.json``), one column per summary KEY; ``KEY/`` is the value
over the first run's (a ratio from the same set of runs). A key a run lacks shows as "-".

    python benchmarks/_table.py OUT NAME ... -- KEY ...
"""
from __future__ import annotations

import json
import sys


def cell(value) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.2f}"


def main(argv: list[str]) -> None:
    out, rest = argv[0], argv[1:]
    names, keys = rest[:rest.index("--")], rest[rest.index("--") + 1:]
    runs = {n: json.loads(open(f"{out}/{n}.summary.json").read()) for n in names}
    base = runs[names[0]]
    print("| run | " + " | ".join(f"{k[:-1]} vs {names[0]}" if k.endswith("/") else k for k in keys) + " |")
    print("|---|" + "---|" * len(keys))
    for name, s in runs.items():
        cells = []
        for k in keys:
            key = k.rstrip("/")
            if key not in s:
                cells.append("-")
            else:
                cells.append(f"{s[key] / base[key]:.3f}" if k.endswith("/") else cell(s[key]))
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
