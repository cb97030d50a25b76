"""``paratrain plan --validate``: every modelled strategy run here at N = 1 and 2 (``--validate-nproc``;
``--validate-repeats`` runs per layout, taken round-robin over the layouts so that a slow spell of
the machine hits every layout alike; the median step kept) (``paratrain train``
through the bench sweep: weak scaling, the recipe's batch per replica, one layout each: a pipeline of
2 stages, K = 1 server; the ``dist`` keys of the plan's command, DDP's bucket its prediction chose
included), its measured step time (rank 0's ``train_step_ms`` after warm-up) and peak
memory (``train.track_memory_step``: torch's MemTracker over one step, the largest rank) against the
plan's predictions for this machine (the profile's links and per-thread step, N processes sharing
the cores). Writes ``validation.json`` and ``validation.md`` in the plan folder (after each run, the
rows so far in :data:`PARTIAL`'s files, removed at the end: an interrupted validation keeps them); the next
``paratrain plan`` there shows each strategy's error beside its predictions. Targets: |step error|
<= 15% at N <= 2, |memory error| <= 20%, and the recommended layout at N = 2 measured within 5%
of the fastest measured one. Beside each step error, the same error at the machine's speed measured
again just before each of the rounds' N > 1 runs on a CPU (``--validate-pace run``, the default;
``round``: once before each round of layouts; the run-off's pairs are judged by their ratio and need
none) (:func:`~.plan_validate_report.same_speed_errors`); the report:
:mod:`.plan_validate_report`. Where the recommendation at N = 2 is not the measured fastest, the two
run again in a paired run-off (:func:`run_off`, ``--validate-runoff`` pairs), and the 5% target is
judged on it: two layouts' runs minutes apart on a machine whose speed drifts by 20-30% compare the
moments as much as the layouts.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
from pathlib import Path

from . import plan as pl
from .plan_profile import run_steps
from .plan_rank import simplicity
from .plan_validate_runs import checkpointed_runs, plan_first, validation_runs  # noqa: F401 (API; validate calls them)
from .plan_validate_report import (between_runs, machine_drift, markdown, same_speed_errors,  # noqa: F401 (API)
                                   pct, profile_rounds_ms, side_by_side_ms, step_ms)


def run_overrides(steps: int) -> tuple[int, tuple[str, ...]]:
    """(warm-up steps, ``--set`` overrides) of a validation run of ``steps`` (>= 6): a third warm-up
    (at least 3), no checkpoints, 6 log intervals, and memory tracked on the last but one warm-up step:
    the step under MemTracker is slow (its hooks) and must not be timed, and from the second step on
    the optimizer state exists."""
    warmup = max(3, steps // 3)
    return warmup, ("train.checkpoint_every=0", f"train.track_memory_step={warmup - 1}",
                    f"train.timing_warmup_steps={warmup}", f"train.log_every={max(1, steps // 6)}")


def validate(args: argparse.Namespace, cfg, task, prof: dict, out: Path,
             counts: tuple[list[int], tuple[str, ...], list[int]]) -> int:
    """Run and score the layouts (see the module); ``counts``: :func:`validation_counts`' answer."""
    from .costmodel import Link
    from .report import run_record
    from .sweep import BenchSpec, RunPlan, run_sweep

    link = Link(name="measured", **prof["links"]["all_reduce"])
    ns, device_sets, skipped = counts
    if skipped:
        print(f"[plan] the profile is of a GPU: --validate runs N = 1 only (N = {', '.join(map(str, skipped))} "
              f"skipped: {GPU_LINK})", flush=True)
    first = plan_first(prof, cfg, link, 2, args.config, args.task, args.overrides) if 2 in ns else None
    runs = validation_runs(prof, cfg, ns, args.config, args.task, args.overrides, first)
    checkpointed = [False] * len(runs)
    if getattr(args, "activation_checkpointing", False):  # each layout again with every block checkpointed
        more = checkpointed_runs(prof, runs, args.config, args.task, args.overrides)
        runs, checkpointed = runs + more, checkpointed + [True] * len(more)
    print(f"[plan] validating {len(runs)} layouts here, at least {args.validate_steps} steps each and about "
          f"{args.timed_seconds:g} s timed, {args.validate_repeats} run(s) per layout (the median; repeats go "
          f"round the layouts)", flush=True)
    paced = side_by_side_ms(prof)  # the profile's one-thread runs side by side, repeated in each round
    rounds: list[float] = []
    with tempfile.TemporaryDirectory(prefix="paratrain-plan-") as tmp:
        done: list[list] = [[] for _ in runs]  # (record, outcome) per layout
        specs, counts, preds = [], [], []
        for (lay, n), ckpt in zip(runs, checkpointed):
            preds.append(pl.predict_layout(lay, prof, cfg, link, on_this_machine=True, global_batch=None,
                                           checkpointing=ckpt))
            steps = run_steps(args.validate_steps, preds[-1]["step_s"], args.timed_seconds)
            warmup, base = run_overrides(steps)
            # the dist keys the prediction priced (DDP's bucket it chose), after the command's --set: the run
            # is what was predicted
            overrides = (*device_sets, *args.overrides, *base, *((pl.CHECKPOINTING_KEY,) if ckpt else ()),
                         *(f"dist.{k}={json.dumps(v)}" for k, v in preds[-1]["overrides"].items()))
            replicas = n // lay.overrides.get("pipeline_stages", 1)
            counts.append(steps)
            specs.append((BenchSpec(config=args.config, task=args.task, strategies=(lay.strategy,),
                                    nprocs=(replicas,), scaling=("weak",), steps=steps,
                                    warmup_steps=warmup, overrides=overrides, data_dir=args.data_dir),
                          replicas))

        def run(i: int, r: int) -> tuple[dict, object]:  # layout i's run number r: (record, outcome)
            (lay, _), (spec, replicas) = runs[i], specs[i]
            plan = RunPlan(strategy=lay.strategy, n=replicas, global_batch=cfg.train.batch_size * replicas, repeat=r)
            outcome = run_sweep(spec, [plan], Path(tmp) / str(i), progress=False)[0]
            return run_record(outcome), outcome

        def speed_now(when: str) -> float:  # the machine's speed measured again, said
            ms = _side_by_side_now(args, cfg, prof, paced)
            print(f"[plan] {when}: {prof['cores']} one-thread one-device runs side by side: step {ms:.1f} ms "
                  f"(the profile's {paced:.1f} ms)", flush=True)
            return ms

        per_run = args.validate_pace == "run"
        paced_runs: list[list[float]] = [[] for _ in runs]  # per_run: the machine's speed before each run

        def scored(runoff: dict | None = None) -> dict:  # the result of the runs done so far
            rows = []
            for (lay, n), got, steps, pred, own, ckpt in zip(runs, done, counts, preds, paced_runs, checkpointed):
                if not got:  # not run yet (a partial result)
                    continue
                row = _row(lay, n, got, pred)
                row.update(steps=steps, overrides=pred["overrides"])  # the dist keys it ran with
                if ckpt:
                    row["checkpointing"] = True
                if own:  # its runs' own measurements of the machine's speed, run r's before run r
                    row["side_by_side_ms_all"] = own[:len(got)]
                rows.append(row)
            paced_rounds = ({"profile_ms": paced, "rounds_ms": rounds, "pace": "run" if per_run else "round"}
                            if rounds or any(paced_runs) else None)
            same_speed_errors(rows, paced_rounds)
            return {"config": args.config, "steps": args.validate_steps, "link": prof["links"], "rows": rows,
                    "rounds": True, "side_by_side": paced_rounds, "runoff": runoff,
                    "choice": _choice(rows, first.label if first else None, runoff),
                    "profile_rounds_ms": profile_rounds_ms(prof)}

        total = len(runs) * args.validate_repeats
        print(f"[plan] after each run the rows so far are written to {out / PARTIAL}.json and .md (kept where "
              f"the validation is stopped; validation.json is written when it ends)", flush=True)
        for r in range(args.validate_repeats):  # round-robin: a slow spell of the machine hits every layout alike
            if paced is not None and any(n > 1 for _, n in runs) and not per_run:
                rounds.append(speed_now(f"round {r + 1}"))
            for i, (lay, n) in enumerate(runs):
                if paced is not None and per_run and n > 1:
                    paced_runs[i].append(speed_now(f"before {lay.label} N={n}"))
                done[i].append(run(i, r))
                print(f"[plan] run {r * len(runs) + i + 1}/{total}: {lay.label} N={n}: "
                      f"step {done[i][-1][0].get('train_step_ms', math.nan):.1f} ms", flush=True)
                _write(out, PARTIAL, {**scored(), "partial": {"runs_done": r * len(runs) + i + 1, "runs": total}})
        result = scored()
        for row in result["rows"]:
            print(f"[plan] {row['label']:>22} N={row['n']}: step predicted {row['predicted_step_ms']:8.1f} ms, "
                  f"measured {row['measured_step_ms']:8.1f} ms ({pct(row['step_error'])}); memory predicted "
                  f"{row['predicted_memory_bytes'] / 2**20:7.1f} MiB, measured "
                  f"{row['measured_memory_bytes'] / 2**20:7.1f} MiB ({pct(row['memory_error'])})", flush=True)
        choice = result["choice"]
        if args.validate_runoff and choice and choice["recommended"] != choice["measured_fastest"]:
            where = {lay.label: i for i, (lay, n) in enumerate(runs) if n == 2}
            pair = (choice["recommended"], choice["measured_fastest"])
            print(f"[plan] run-off at N = 2: {pair[0]} (recommended) against {pair[1]} (measured fastest), "
                  f"{args.validate_runoff} pair(s) back to back", flush=True)
            runoff = run_off(lambda i, k: run(i, args.validate_repeats + k)[0], where[pair[0]], where[pair[1]],
                             args.validate_runoff, pair)
            result = scored(runoff)
    text = _write(out, "validation", result)
    for suffix in (".json", ".md"):  # the whole result is written: the partial one is not needed
        (out / f"{PARTIAL}{suffix}").unlink(missing_ok=True)
    print(text)
    return 0 if all(r["ok"] for r in result["rows"]) else 1


PARTIAL = "validation.partial"
"""The stem of the files a validation writes after each run (``.json``, ``.md``: the rows so far, with
``"partial": {"runs_done", "runs"}``), removed when it writes ``validation.json``: what an interrupted or
timed-out validation measured is kept, and a previous whole validation is not replaced by a part."""


def _write(out: Path, stem: str, result: dict) -> str:
    """Write ``result`` to ``out/stem.json`` and its table (:func:`markdown`) to ``out/stem.md``, each
    whole or not at all (a temporary file, then a rename: an interrupt mid-write leaves the last one);
    returns the table."""
    text = markdown(result)
    for suffix, body in ((".json", json.dumps(result, indent=1)), (".md", text)):
        tmp = out / f".{stem}{suffix}.tmp"
        tmp.write_text(body)
        tmp.replace(out / f"{stem}{suffix}")
    return text


GPU_LINK = "the profile's links are gloo between CPU processes, not NCCL between GPUs"
"""Why a GPU's profile plans and validates N = 1 alone with the measured interconnect."""


def on_gpu(prof: dict) -> bool:
    """Whether the profile was measured on a CUDA device."""
    return str(prof.get("device", "cpu")).startswith("cuda")


def validation_counts(prof: dict, asked: str | None) -> tuple[list[int], tuple[str, ...], list[int]]:
    """(N to validate, ``--set`` overrides every run adds, N skipped) for ``--validate-nproc``
    (``asked``; None: 1, 2). On a GPU's profile, N = 1 alone, on ``dist.device = "cuda"``: ``auto``
    would put two processes of a one-GPU host on the CPU and score a CPU run against the GPU's
    prediction, and the profile's links are gloo between CPU processes, not NCCL between GPUs; the
    default's N = 2 is skipped. Raises UsageError for a GPU's profile where no GPU is, or an
    explicit N > 1 with it."""
    from ..errors import UsageError
    from .commands import _ints

    ns = sorted(set(_ints(asked or "1,2", "--validate-nproc")))
    if not on_gpu(prof):
        return ns, (), []
    import torch

    if not torch.cuda.is_available():
        raise UsageError(f"--validate: the profile is of a GPU ({prof['device']}) and this machine has none; validate "
                         f"where it was profiled, or measure here with --reprofile")
    if asked and ns != [1]:
        raise UsageError(f"--validate-nproc {asked}: the profile is of a GPU, and {GPU_LINK}; give --validate-nproc 1")
    return [1], ('dist.device="cuda"',), [n for n in ns if n > 1]


def _row(lay: pl.Layout, n: int, got: list[tuple[dict, object]], pred: dict) -> dict:
    """One validation row: the median of a layout's runs (``got``: (record, outcome) per run)
    against its prediction ``pred``."""
    from .report import median_run

    records = [rec for rec, _ in got]
    rec = median_run(records, "train_step_ms") or records[0]
    outcome = got[records.index(rec)][1]
    measured = rec.get("train_step_ms", math.nan) if rec["ok"] else math.nan
    mem = outcome.summary.get("tracked_peak_memory_mb", math.nan) * 2 ** 20 if rec["ok"] else math.nan
    row = {"strategy": lay.strategy, "label": lay.label, "n": n, "ok": rec["ok"], "measured_step_ms": measured,
           "measured_memory_bytes": mem, "measured_units_per_s": rec.get("units_per_s", math.nan),
           "repeats": len(records), "measured_step_ms_all": [r.get("train_step_ms", math.nan) for r in records],
           # where the time goes, to tell which term is wrong: predicted parts vs rank 0's measured ones
           "measured_ms": ({k[:-3]: rec["rank0_timing_ms"].get(k, math.nan)
                            for k in ("data_ms", "compute_ms", "forward_ms", "backward_ms", "comm_ms",
                                      "idle_ms", "optimizer_ms")} if rec["ok"] else {}),
           "measured_memory_mb": outcome.summary.get("rank0_tracked_memory_mb", {}) if rec["ok"] else {}}
    return _predicted(row, pred)


def _predicted(row: dict, pred: dict) -> dict:
    """``row`` (its measured fields) with the prediction ``pred`` and the errors between them."""
    from .costmodel import relative_error

    measured, mem = row["measured_step_ms"], row["measured_memory_bytes"]
    row.update({"predicted_step_ms": 1000 * pred["step_s"], "predicted_memory_bytes": pred["memory"]["total"],
                "predicted_units_per_s": pred["units_per_s"], "synchronous": pred["synchronous"],
                "predicted_ms": {k[:-2]: 1000 * pred[k] for k in ("compute_s", "comm_s", "bubble_s", "optimizer_s")}})
    row["step_error"] = relative_error(row["predicted_step_ms"], measured) if math.isfinite(measured) else math.nan
    row["memory_error"] = (relative_error(row["predicted_memory_bytes"], mem)
                           if math.isfinite(mem) and mem > 0 else math.nan)
    return row


def rescore(cfg, prof: dict, out: Path, config: str, task: str | None = None, overrides: list[str] | None = None
            ) -> int:
    """``paratrain plan --rescore``: predict the layouts of ``out/validation.json`` again from ``prof``
    (the cached profile, or a new one with ``--reprofile``) and the current model, each with the
    ``dist`` keys it ran with (``overrides``, since 2026-11-28: DDP's bucket; before, the recipe's
    ``dist.bucket_mb``, which those runs had), keep the measured
    steps and memory, rewrite ``validation.json`` and ``validation.md``; each error at the measured
    speed is taken against ``prof``'s own side-by-side step. No training runs. Raises
    UsageError when a validated layout is no longer planned. ``config``, ``task``, ``overrides``: the
    command's (what the recipe refuses is not the plan's first layout, :func:`plan_first`)."""
    from ..errors import UsageError
    from .costmodel import Link

    path = out / "validation.json"  # there: paratrain plan checks before it profiles
    result = json.loads(path.read_text())
    link = Link(name="measured", **prof["links"]["all_reduce"])
    first = plan_first(prof, cfg, link, 2, config, task, overrides or [])
    for row in result["rows"]:
        ckpt = bool(row.get("checkpointing"))
        label = row["label"].removesuffix(pl.CHECKPOINTED) if ckpt else row["label"]
        lay = next((x for x in pl.layouts(row["n"], prof, cfg) if x.label == label), None)
        if lay is None:
            raise UsageError(f"--rescore: layout {row['label']!r} at N = {row['n']} is no longer planned; "
                             f"validate again (--validate)")
        # the keys it ran with; a run before they were kept had the recipe's bucket (the runs got the layout's keys)
        kept = row.get("overrides", {"bucket_mb": cfg.dist.bucket_mb})
        ran = pl.Layout(lay.strategy, lay.n, {**lay.overrides, **kept}, lay.label)
        row["overrides"] = ran.overrides  # what the score's tie rule reads (plan_rank.simplicity)
        _predicted(row, pl.predict_layout(ran, prof, cfg, link, on_this_machine=True, global_batch=None,
                                          checkpointing=ckpt))
    paced, now = result.get("side_by_side"), side_by_side_ms(prof)
    if paced and now is not None:  # the speeds measured in the runs, over the profile the predictions are of
        result["side_by_side"] = paced = {**paced, "profile_ms": now}
    if result.get("rounds") or all(len(r.get("measured_step_ms_all") or []) <= 1 for r in result["rows"]):
        # (before "rounds" was kept, run r of two layouts need not share a round)
        same_speed_errors(result["rows"], paced)
    result.update({"link": prof["links"], "rescored": True, "profile_rounds_ms": profile_rounds_ms(prof),
                   "choice": _choice(result["rows"], first.label if first else None, result.get("runoff"))})
    path.write_text(json.dumps(result, indent=1))
    text = markdown(result)
    (out / "validation.md").write_text(text)
    print(text)
    return 0


def run_off(run, a: int, b: int, pairs: int, labels: tuple[str, str]) -> dict:
    """A paired comparison of two layouts, ``a`` (the recommendation) and ``b`` (the measured
    fastest), indices for ``run(index, k)``, which runs that layout once more (``k``: the run-off's
    run, from 0) and gives its record (``units_per_s``: measured words or samples per second, NaN
    where it failed). ``pairs`` pairs run back to back, the order alternating (a b, b a, a b, ...)
    so that neither is always the second (a drifting machine's later moment); each pair gives a's
    rate over b's, and the shortfall is 1 - their median (negative: a was faster). Paired rounds,
    as :func:`~.strategy_model.stage_profile` times a pipeline's micro-batches: each ratio compares
    two runs a minute apart, not two rounds of every layout. Returns ``{"recommended", "measured_fastest":
    labels, "rates": [[a's, b's] per pair], "first": [label run first per pair], "ratios",
    "shortfall"}`` (shortfall NaN where no pair has two rates)."""
    rates, first = [], []
    for k in range(pairs):
        order = (a, b) if k % 2 == 0 else (b, a)
        got = {i: run(i, 2 * k + j).get("units_per_s", math.nan) for j, i in enumerate(order)}
        rates.append([got[a], got[b]])
        first.append(labels[0] if order[0] == a else labels[1])
        print(f"[plan] run-off pair {k + 1}/{pairs}: {labels[0]} {got[a]:.1f}, {labels[1]} {got[b]:.1f} per s",
              flush=True)
    ratios = [x / y for x, y in rates if math.isfinite(x) and math.isfinite(y) and y > 0]
    return {"recommended": labels[0], "measured_fastest": labels[1], "rates": rates, "first": first,
            "ratios": ratios, "shortfall": 1 - statistics.median(ratios) if ratios else math.nan}


def _choice(rows: list[dict], first: str | None = None, runoff: dict | None = None) -> dict:
    """The synchronous layout the plan recommends at N = 2 against the measured fastest: ``first``, the
    label of the layout the plan ranks first at N = 2 (:func:`plan_first`), where it was run; else, as
    for a validation run before the plan's first layout was (``plan_first`` None or not among the
    rows: ``first_not_run``), the predicted fastest of the layouts run (of predictions within
    :data:`~.plan.TIE`, the simplest: :func:`~.plan.pick`, :func:`~.plan_rank.simplicity`).
    ``runoff``: :func:`run_off`'s answer, kept as ``"runoff"`` where it ran the same two layouts
    (a rescore may recommend another); its ``shortfall`` is then the one the 5% target judges
    (``judged_shortfall``)."""
    two = [r for r in rows if r["n"] == 2 and r["synchronous"] and r["ok"] and not r.get("checkpointing")
           and math.isfinite(r["measured_units_per_s"])]  # (checkpointed rows: the plan ranks them apart)
    if not two:
        return {}
    chosen = next((r for r in two if r["label"] == first), None) or two[
        pl.pick(two, lambda r: r["predicted_units_per_s"],
                lambda r: simplicity(r["n"], r.get("overrides"), r["predicted_memory_bytes"]))]
    fastest = max(two, key=lambda r: r["measured_units_per_s"])
    # plan.close_calls' rule among the layouts run at N = 2, each with its own measured error here (the
    # next plan weighs all its layouts, at every N, against its own recommendation); each band holds its
    # layout's measured rate, v (1 + e), so it informs and checks nothing
    banded = [{"label": r["label"], "n": 2, "units_per_s": r["predicted_units_per_s"], "feasible": True,
               "synchronous": True, "extrapolated": False,
               "measured_error": abs(r["step_error"]) if math.isfinite(r.get("step_error", math.nan)) else None}
              for r in two]
    best = next(b for b in banded if b["label"] == chosen["label"])
    return judged({"recommended": chosen["label"], "measured_fastest": fastest["label"],
                   "shortfall": 1 - chosen["measured_units_per_s"] / fastest["measured_units_per_s"],
                   "close_calls": [b["label"] for b in pl.close_calls(banded, best, "words_per_s")],
                   "first_not_run": first if first and first != chosen["label"] else None}, runoff)


def judged(choice: dict, runoff: dict | None) -> dict:
    """``choice`` (:func:`_choice`'s) with ``"runoff"``, :func:`run_off`'s answer where it ran the
    same two layouts (else None), and ``"judged_shortfall"``, the shortfall the 5% target judges: the
    run-off's where it gave one, else the rounds'."""
    same = bool(runoff) and (runoff["recommended"], runoff["measured_fastest"]) == (
        choice["recommended"], choice["measured_fastest"])
    return {**choice, "runoff": runoff if same else None,
            "judged_shortfall": (runoff["shortfall"] if same and math.isfinite(runoff["shortfall"])
                                 else choice["shortfall"])}


def _side_by_side_now(args: argparse.Namespace, cfg, prof: dict, paced_ms: float) -> float:
    """:func:`side_by_side_ms` measured again now, the profile's runs repeated (a third warm-up, about
    ``--timed-seconds`` timed); NaN where one of the runs failed (the validation goes on, and the
    errors at the measured speed leave that run out: :func:`~.plan_validate_report.same_speed_errors`)."""
    from ..errors import UsageError
    from .profile_runs import loop_workloads

    steps = run_steps(args.validate_steps, paced_ms / 1000, args.timed_seconds)
    try:
        got = loop_workloads(args.config, args.task, tuple(args.overrides), args.data_dir, cfg.train.batch_size,
                             steps, (1,), concurrent=prof["workloads"]["1"]["concurrent"])["1"]
    except UsageError as e:  # one failed measurement does not end minutes of runs
        print(f"[plan] the one-thread runs side by side failed, so this measurement of the machine's speed is "
              f"left out: {e}", flush=True)
        return math.nan
    return step_ms(got)
