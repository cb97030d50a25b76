"""``paratrain bench`` results: scaling tables (pure), ``results.json``, ``report.md`` and PNG plots.

Speedup S(N) = t(1) / t(N), where t is the time to train a fixed number of units
(the task's: words for a language model, samples for a classifier; so S(N) =
units/s(N) / units/s(1)) against the measured reference (``single``) run at the
same per-replica batch (weak scaling) or the same global batch (strong scaling);
scaling efficiency E(N) = S(N) / N.
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any, Sequence

from ..strategies import REFERENCE
from .sweep import BenchSpec, RunOutcome, finite
from .timing import summarise_ranks

PARTS = ("data_ms", "compute_ms", "comm_ms", "idle_ms", "optimizer_ms", "other_ms")


def run_record(o: RunOutcome) -> dict[str, Any]:
    """One run's numbers: units/s after warm-up (``unit``: the task's), rank-mean breakdown, per-rank rows, skew,
    and coverage = rank 0's (data + compute + comm + idle + optimizer) / rank 0's wall time per
    step by the throughput clock (which also holds logging)."""
    p = o.plan
    rec: dict[str, Any] = {"name": p.name, "strategy": p.strategy, "n": p.n, "global_batch": p.global_batch,
                           "threads": p.threads, "repeat": p.repeat, "rc": o.rc, "ok": o.ok, "run_dir": str(o.run_dir)}
    if not o.ok:
        return rec
    ranks = summarise_ranks(o.ranks)
    measured = o.summary.get("train_step_ms", math.nan)  # rank 0's clock: compare with rank 0's parts
    parts = sum(ranks["per_rank"][0][k] for k in PARTS if k != "other_ms")
    unit = o.summary.get("unit", "words")
    rec.update({"per_replica_batch": o.summary.get("per_replica_batch"), "unit": unit,
                "units_per_s": o.summary.get(f"{unit}_per_s_after_warmup", math.nan),
                "units_per_step": o.summary.get("units_per_step"),
                "threads_per_process": o.summary.get("threads_per_process"),
                "train_step_ms": measured, "breakdown_ms": ranks["mean"], "rank0_timing_ms": o.ranks[0],
                "per_rank_ms": ranks["per_rank"],
                "compute_skew": ranks["compute_skew"], "slowest_rank": ranks["slowest_rank"],
                "breakdown_coverage": parts / measured if finite(measured) and measured > 0 else math.nan,
                "valid_loss": o.summary.get("valid_loss"), "valid_ppl": o.summary.get("valid_ppl"),
                "mfu": o.summary.get("mfu", math.nan), "peak_flops_source": o.summary.get("peak_flops_source"),
                **{k: o.summary[k] for k in ("host_private_mb", "host_shared_mb") if k in o.summary}})
    return rec


def median_run(recs: list[dict], key: str = "units_per_s") -> dict | None:
    """The successful run with the median ``key`` (the lower middle for an even count), or None."""
    ok = sorted((r for r in recs if r["ok"] and finite(r.get(key))), key=lambda r: r[key])
    return ok[(len(ok) - 1) // 2] if ok else None


def scaling_rows(records: Sequence[dict], spec: BenchSpec, recipe_batch: int) -> dict[str, list[dict]]:
    """Per scaling mode, one row per (batch, strategy, N): median units/s over repeats (min,
    max), speedup and efficiency against the single-device baseline, the median run's breakdown."""
    by_key: dict[tuple, list[dict]] = {}
    for r in records:
        by_key.setdefault((r["strategy"], r["n"], r["global_batch"], r["threads"]), []).append(r)
    tables: dict[str, list[dict]] = {}
    for scaling in spec.scaling:
        rows = []
        for b in spec.batches or (recipe_batch,):
            base = median_run(by_key.get((REFERENCE, 1, b, None), []))
            for s in spec.strategies:
                for n in spec.nprocs:
                    if (s == REFERENCE and n != 1) or (scaling == "strong" and b % n):
                        continue
                    g = b * n if scaling == "weak" else b
                    recs = by_key.get((s, n, g, None), [])
                    rows.append(_row(scaling, s, n, g, recs, base))
        tables[scaling] = rows
    return tables


def _row(scaling: str, strategy: str, n: int, g: int, recs: list[dict], base: dict | None) -> dict:
    med = median_run(recs)
    row: dict[str, Any] = {"scaling": scaling, "strategy": strategy, "n": n, "global_batch": g,
                           "per_replica_batch": g // n, "runs_ok": sum(r["ok"] for r in recs), "runs": len(recs)}
    if med is None:
        return row
    wps = [r["units_per_s"] for r in recs if r["ok"]]
    row.update({"unit": med.get("unit", "words"), "units_per_s": statistics.median(wps), "units_per_s_min": min(wps),
                "units_per_s_max": max(wps),
                **{k: med[k] for k in ("train_step_ms", "breakdown_ms", "per_rank_ms", "breakdown_coverage",
                                       "compute_skew", "slowest_rank", "threads_per_process")},
                "mfu": med.get("mfu", math.nan), "peak_flops_source": med.get("peak_flops_source")})
    if base is not None:
        from .costmodel import scaling

        bw = base["units_per_s"]  # the median baseline run
        row["baseline_units_per_s"] = bw
        row.update(scaling({n: row["units_per_s"]}, bw)[n])
    return row


def _fmt(x: Any, nd: int = 1) -> str:
    if isinstance(x, float):
        return f"{x:,.{nd}f}" if math.isfinite(x) else "-"
    return "-" if x is None else str(x)


def markdown(results: dict) -> str:
    """The human report: machine, command, one table per scaling mode, per-rank skew, model validation."""
    m = results["machine"]
    unit = results.get("unit", "words")
    lines = [f"# paratrain bench — {results['date']}", "",
             f"Machine: {m['cpu_cores']} CPU cores, {m['device']}, torch {m['torch']}. Command: `{results['command']}`",
             "", f"Speedup S(N) = {unit}/s(N) / {unit}/s of the measured single-device run (same per-replica batch for "
             "weak scaling, same global batch for strong); efficiency = S(N)/N. Step-time columns are ms per step, "
             "mean over ranks, warm-up steps left out; coverage = rank 0's (data+compute+comm+idle+optimizer) / its "
             "wall time per step (logging included); skew = (max - min) / mean of the ranks' compute; MFU = model "
             "FLOPs per step (counted) / step time / (N x peak FLOP/s of a device).", ""]
    sources = sorted({str(r["peak_flops_source"]) for rows in results["scaling"].values() for r in rows
                      if r.get("peak_flops_source")})
    if sources:
        lines += ["Peak FLOP/s for MFU: " + "; ".join(sources) + ".", ""]
    if any(r.get("n", 0) > m["cpu_cores"] for rows in results["scaling"].values() for r in rows):
        lines += [f"N above {m['cpu_cores']} is oversubscribed: more processes than cores.", ""]
    head = (f"| strategy | N | global batch | per-replica | {unit}/s (min-max) | speedup | efficiency | step ms "
            "| data | compute | comm | idle | optimizer | other | coverage | skew | MFU |")
    for scaling, rows in results["scaling"].items():
        lines += [f"## {scaling} scaling", "", head, "|" + "---|" * 17]
        for r in rows:
            b = r.get("breakdown_ms", {})
            lines.append(
                f"| {r['strategy']} | {r['n']} | {r['global_batch']} | {r['per_replica_batch']} | "
                f"{_fmt(r.get('units_per_s'), 0)} "
                f"({_fmt(r.get('units_per_s_min'), 0)}-{_fmt(r.get('units_per_s_max'), 0)}) | "
                f"{_fmt(r.get('speedup'), 2)} | {_fmt(r.get('efficiency'), 2)} | {_fmt(r.get('train_step_ms'))} | "
                + " | ".join(_fmt(b.get(k)) for k in PARTS)
                + f" | {_fmt(r.get('breakdown_coverage'), 3)} | {_fmt(r.get('compute_skew'), 3)} "
                f"| {_fmt(r.get('mfu'), 3)} |")
        lines.append("")
    per_rank = [r for rows in results["scaling"].values() for r in rows if len(r.get("per_rank_ms", [])) > 1]
    if per_rank:
        lines += ["## per rank (ms per step)", "", "| scaling | strategy | N | rank | step | compute | comm | idle |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in per_rank:
            for i, pr in enumerate(r["per_rank_ms"]):
                lines.append(f"| {r['scaling']} | {r['strategy']} | {r['n']} | {i} | {_fmt(pr['step_ms'])} | "
                             f"{_fmt(pr['compute_ms'])} | {_fmt(pr['comm_ms'])} | {_fmt(pr['idle_ms'])} |")
        lines.append("")
    v = results.get("model_validation")
    if v:
        lines += ["## cost model validation (allreduce, weak scaling)", "", v["note"], "",
                  "| N | predicted step ms | measured step ms | relative error | note |", "|---|---|---|---|---|"]
        for n, e in v["points"].items():
            lines.append(f"| {n} | {_fmt(e['predicted_step_ms'])} | {_fmt(e['measured_step_ms'])} | "
                         f"{_fmt(100 * e['step_time_rel_error'], 1)}% | {e.get('note', '')} |")
        lines.append("")
    return "\n".join(lines)


def plots(results: dict, out_dir: Path) -> list[Path]:
    """throughput.png, efficiency.png (vs N, one line per strategy, one panel per scaling mode) and
    breakdown.png (stacked ms per step per strategy and N)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tables = results["scaling"]
    written = []
    unit = results.get("unit", "words")
    for fname, key, ylabel in (("throughput.png", "units_per_s", f"{unit}/s"), ("efficiency.png", "efficiency",
                                                                              "scaling efficiency S(N)/N")):
        fig, axes = plt.subplots(1, len(tables), figsize=(5.5 * len(tables), 4), squeeze=False)
        for ax, (scaling, rows) in zip(axes[0], tables.items()):
            for s in sorted({r["strategy"] for r in rows}):
                pts = sorted((r["n"], r[key]) for r in rows if r["strategy"] == s and finite(r.get(key)))
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=s)
            if key == "efficiency":
                ax.axhline(1.0, color="grey", linestyle=":", linewidth=1)
                ax.set_ylim(0, max(1.1, max((r.get(key) or 0) for r in rows) * 1.05))
            ax.set_xscale("log", base=2)
            ns = sorted({r["n"] for r in rows})
            ax.set_xticks(ns, [str(n) for n in ns])
            ax.set_xlabel("N (replicas)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{scaling} scaling")
            ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / fname, dpi=110)
        plt.close(fig)
        written.append(out_dir / fname)
    fig, axes = plt.subplots(1, len(tables), figsize=(6 * len(tables), 4), squeeze=False)
    for ax, (scaling, rows) in zip(axes[0], tables.items()):
        rows = [r for r in rows if r.get("breakdown_ms")]
        labels = [f"{r['strategy']}\nN={r['n']}" for r in rows]
        bottom = [0.0] * len(rows)
        for part in PARTS:
            vals = [max(r["breakdown_ms"][part], 0.0) for r in rows]
            ax.bar(labels, vals, bottom=bottom, label=part[:-3])
            bottom = [a + b for a, b in zip(bottom, vals)]
        ax.set_ylabel("ms per step (mean over ranks)")
        ax.set_title(f"{scaling} scaling: where the step time goes")
        ax.legend(fontsize=8)
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "breakdown.png", dpi=110)
    plt.close(fig)
    written.append(out_dir / "breakdown.png")
    return written


def write(results: dict, out_dir: Path) -> list[Path]:
    """Write results.json, report.md and the plots into ``out_dir``; returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (out_dir / "report.md").write_text(markdown(results) + "\n")
    return [out_dir / "results.json", out_dir / "report.md", *plots(results, out_dir)]
