"""``paratrain plan``'s profile: the one cached in ``--out`` or a new one, measured with a progress
bar (:func:`load_profile`): the in-process profile (:mod:`.profile`), the training loop's own runs
(:mod:`.profile_runs`: the one-device step, each strategy's one-rank runs, sync BatchNorm
or DDP's buffer broadcast in the loop, a PS worker's compute and guard in its job), and the layers'
micro-benchmarks for what the loop leaves out; a profile measured elsewhere, checked against the
recipe (:func:`read_profile`, ``--profile``); and how many steps a run of the profile or of
``--validate`` takes (:func:`run_steps`)."""
from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
from pathlib import Path

from .plan_inputs import STEP_PARTS

TIMED_S = 2.0
"""The least seconds of timed steps in a run of the profile or of ``--validate`` (:func:`run_steps`)."""


def run_steps(least: int, step_s: float, timed_s: float = TIMED_S, most: int = 2000) -> int:
    """Steps of a run whose timed two thirds (a third is warm-up) last about ``timed_s`` at ``step_s``
    seconds a step (an estimate: the profile's or the prediction's), at least ``least``, at most
    ``most``: a 5 ms step timed over 20 steps is a 0.1 s window, which one scheduler hiccup moves by
    a third."""
    if not (step_s > 0 and timed_s > 0):
        return least
    return max(least, min(most, math.ceil(1.5 * timed_s / step_s)))


def load_profile(args: argparse.Namespace, cfg, task, out: Path) -> tuple[dict, bool]:
    """The cached profile in ``out`` or a new one (with a progress bar)."""
    from tqdm import tqdm

    from ..consistency import config_text
    from ..env import available_cores
    from ..runs import build_task
    from .profile import profile_model
    from .profile_cache import PARTIAL, PartialProfile, cached_profile, profile_key
    from .plan_inputs import in_process_step_s, sends_buffers
    from .profile_runs import (OVERSUBSCRIBED, loop_buffer_broadcast, loop_one_rank_overheads, loop_sync_batchnorm,
                               loop_workload_rounds, median_rounds, sync_batchnorm_fallbacks,
                               sync_batchnorm_strategies, towers_sync_in_process)
    from .profile_runs_ps import PS_LOOP_WORKERS, loop_ps, ps_loop_applies
    from .profile_runs_towers import loop_towers

    path = out / "profile.json"
    key = profile_key(config_text(cfg), available_cores())
    # the most progress() calls: the profile's 6; the loop's 5 (the one-rank runs; the CPU towers; sync
    # BatchNorm's or DDP's buffer broadcast, as a recipe with sync BatchNorm sends no buffers; the PS jobs);
    # the fallbacks' 2. A GPU's: the loop's 1, the one-rank runs' 1, the fallbacks' 1 at most.
    phases = 13

    # what the measurement depends on beyond the key: a profile cut short resumes only under the same
    settings = {"profile_repeats": args.profile_repeats, "profile_steps": args.profile_steps,
                "timed_seconds": args.timed_seconds, "data_dir": args.data_dir,
                **{name: os.environ.get(name) for name in ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")}}

    def measure() -> dict:
        # each phase is kept in profile.partial.json as it ends: a profile cut short resumes at the next
        saved = PartialProfile(out / PARTIAL, key, settings)
        prof, extra = saved.profile, saved.extra
        if saved.other_settings is not None:
            differ = ", ".join(f"{k} {saved.other_settings.get(k)} there, {v} now" for k, v in saved.settings.items()
                               if saved.other_settings.get(k) != v)
            print(f"[plan] profile: {out / PARTIAL} holds a profile cut short under other settings ({differ}): "
                  f"measuring from the start", flush=True)
        if saved.resumed:
            done = len(saved.done)
            print(f"[plan] profile: resuming the one begun {saved.sittings[0]}, cut short after {done} "
                  f"phase{'s' if done > 1 else ''} ({', '.join(saved.done)}); delete {out / PARTIAL} to measure "
                  f"from the start", flush=True)
        with tqdm(total=phases, desc="[plan] profiling", unit="phase", dynamic_ncols=True) as bar:
            def progress(what: str) -> None:
                bar.set_postfix_str(what)
                bar.update(min(1, phases - bar.n))

            def phase(name: str, run) -> None:
                if not saved.phase(name, run):
                    progress(f"{name}: measured before")

            # in this process: its own phases (profile.PHASES), each kept as it ends
            profile_model(task, cfg, progress=progress, towers_task=lambda batch: build_task(
                dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=batch)), args.data_dir,
                world_size=1), data_dir=args.data_dir, out=prof, phase=phase)
            threads = (None, 1) if prof["device"] == "cpu" and prof["default_threads"] > 1 else (None,)
            guess = in_process_step_s(prof)
            steps = run_steps(args.profile_steps, guess, args.timed_seconds)
            recipe = (args.config, args.task, tuple(args.overrides), args.data_dir, cfg.train.batch_size)  # every run's

            def one_device() -> None:
                progress("the training loop's step: one-device runs")
                extra["rounds"] = loop_workload_rounds(*recipe, steps, threads, concurrent=prof["cores"],
                                                       repeats=args.profile_repeats)
                prof["workloads"] = median_rounds(extra["rounds"])
            phase("one-device runs", one_device)

            def later_round() -> None:
                """A CPU's default-thread one-device run once more, after a later phase: on the 2-vCPU EPYC
                VM its step moved 2.0-3.5 ms from run to run in spells of 6-30 s or more, within one
                process as well as between processes (2026-11-29); the profile's first rounds, back to
                back, could fall in one spell (3.0 and 3.2 ms at v37, where the validation's runs took
                2.4), so its median is taken over rounds spread across the profile."""
                if prof["device"] == "cpu":
                    for got, more in loop_workload_rounds(*recipe, steps, (None,)).items():
                        extra["rounds"].setdefault(got, []).extend(more)
                    prof["workloads"] = median_rounds(extra["rounds"])

            # each strategy's own work around its compute, at one rank: on a GPU it prices every N > 1; a
            # CPU's prices the presets (this machine's rows have their own two-process terms)
            def one_rank() -> None:
                progress("each strategy's own step: one-rank runs")
                prof["loop_one_rank_s"] = loop_one_rank_overheads(*recipe, steps, repeats=args.profile_repeats)
            phase("one-rank runs", one_rank)

            def cpu_towers() -> None:
                if prof.get("towers_forward_threads"):  # CPU towers, one a core (measurable in process)
                    towers = int(prof["towers_forward_threads"]["towers"])
                    progress(f"CPU towers in the loop's steps: {towers} towers")
                    # each step about towers times the one-device step's work: as many fewer steps
                    looped = loop_towers(*recipe, run_steps(args.profile_steps, guess * towers, args.timed_seconds),
                                         towers, repeats=args.profile_repeats, accumulation=cfg.train.accumulation)
                    if looped:
                        prof["loop_towers"] = looped
            phase("CPU towers", cpu_towers)
            phase("a later one-device round", later_round)

            def sync_batchnorm() -> None:
                if prof.get("batchnorm_inputs") and prof["device"] == "cpu" and prof["cores"] > 1:
                    over_cores = prof["cores"] < OVERSUBSCRIBED  # N > cores: the processes take turns on the cores
                    progress(f"sync BatchNorm in the loop's steps: 2 replicas"
                             f"{f', {OVERSUBSCRIBED}' if over_cores else ''}")
                    loop = functools.partial(loop_sync_batchnorm, *recipe, steps=steps, repeats=args.profile_repeats,
                                             accumulation=cfg.train.accumulation)
                    processes, towers = sync_batchnorm_strategies()
                    # the towers' term, since version 36, from their steps plain and synchronised in turn in one
                    # process (microbench_towers): the loop's on/off pair a minute apart moved with the machine
                    prof["loop_sync_batchnorm_s"] = loop(
                        strategies=(processes,) if towers_sync_in_process(prof) else (processes, towers))
                    if over_cores and processes in prof["loop_sync_batchnorm_s"]:  # a line needs the loop's 2 too
                        # each step about OVERSUBSCRIBED / cores times as long: as many fewer steps
                        fewer = run_steps(args.profile_steps, guess * OVERSUBSCRIBED / prof["cores"],
                                          args.timed_seconds)
                        over = loop(strategies=(processes,), replicas=OVERSUBSCRIBED, steps=fewer)
                        if processes in over:
                            prof["loop_sync_batchnorm_oversubscribed"] = {"processes": OVERSUBSCRIBED,
                                                                          "seconds": over[processes]}
            phase("sync BatchNorm", sync_batchnorm)

            def buffer_broadcast() -> None:
                if prof["device"] == "cpu" and prof["cores"] > 1 and sends_buffers(prof, cfg):
                    progress("DDP's buffer broadcast in the loop's steps: 2 replicas")
                    prof["loop_buffer_broadcast_s"] = loop_buffer_broadcast(
                        *recipe, steps, repeats=args.profile_repeats, accumulation=cfg.train.accumulation)
            phase("DDP's buffer broadcast", buffer_broadcast)

            def ps_jobs() -> None:
                if prof["device"] == "cpu" and ps_loop_applies(prof["cores"]):  # the workers share the cores
                    progress(f"a PS worker's compute and guard in the loop's steps: {PS_LOOP_WORKERS} workers")
                    prof["loop_ps_stolen_s"], prof["loop_ps_guard_s"] = loop_ps(
                        *recipe, steps, repeats=args.profile_repeats,
                        synced_batchnorm=bool(prof.get("batchnorm_inputs")))
            phase("PS jobs", ps_jobs)
            if any(k in prof for k in ("loop_sync_batchnorm_s", "loop_buffer_broadcast_s", "loop_ps_stolen_s")):
                # (after none of them it would run straight after the last round: no spread)
                phase("a last one-device round", later_round)
            # the layers' micro-benchmarks, only for what the loop did not measure (a GPU; a failed run)
            phase("layers' micro-benchmarks",
                  lambda: sync_batchnorm_fallbacks(prof, prof.get("loop_sync_batchnorm_s") or {}, progress))
            bar.update(phases - bar.n)
        if saved.resumed:
            prof["sittings"] = saved.sittings
        return prof

    prof, cached = cached_profile(path, key, measure, fresh=args.reprofile)
    if cached and PartialProfile(out / PARTIAL, key, settings).done:  # (one of another key is replaced unread)
        print(f"[plan] {out / PARTIAL} holds the phases of a profile cut short: --reprofile resumes it", flush=True)
    return prof, cached


_NUMBER = (int, float)
REQUIRED = {"version": int, "device": str, "task": str, "unit": str, "batch_size": int, "tokens_per_step": _NUMBER,
            "cores": int, "workloads": dict, "links": dict, "strategy_inputs": dict, "param_bytes": list,
            "param_total_bytes": int, "memory_measured": dict, "peak_flops_source": str, "flops_per_unit": _NUMBER,
            # written by every profile of the versions read (44 and the versions it accepts)
            "blocks": list, "activation_bytes": int, "autocast_copy_bytes": int, "data_bytes": int,
            "output_bytes": int, "peak_flops": _NUMBER, "buffer_bytes": int, "optimizer_state_bytes": int,
            "batchnorm_inputs": list, "default_threads": int, "workloads_in_process": dict, "ps_update_s": dict,
            "ps_round_trip_s": _NUMBER}
"""What every profile :func:`read_profile` accepts holds, by type (bool is not taken for a number)."""

OPTIONAL = {"towers_forward_threads": (dict, type(None)), "loop_one_rank_s": dict, "loop_ps_stolen_s": dict,
            "loop_ps_guard_s": dict, "loop_sync_batchnorm_s": dict, "loop_sync_batchnorm_oversubscribed": dict,
            "loop_buffer_broadcast_s": dict, "bf16_hook": dict, "loop_towers": dict,
            "fsdp_units": list,
            "checkpointing": (dict, type(None)),  # None: no blocks, or no room on the GPU for the model's copy
            "memory_copy": list, "meetings": list, "meetings_oversubscribed": dict, "ps_round_trips_loaded": dict,
            "ps_round_trips_loaded_4": dict, "zero1_step_s": _NUMBER, "fsdp_step_s": _NUMBER,
            "sharded_optimizer_s": _NUMBER, "sharded_norm_s": _NUMBER, "sync_batchnorm_s": _NUMBER,
            "device_memory_bytes": (int, float, type(None)), "recipe": str,
            "sittings": list}  # when each sitting of a profile that was cut short and resumed began
"""The keys a profile holds where it measured them, by type: checked where present."""


def malformed(prof: dict) -> list[str]:
    """The keys of ``prof`` that :data:`REQUIRED` names and it lacks, or that it holds in another type than
    :data:`REQUIRED` or :data:`OPTIONAL` give, a block (``blocks``) that is not a mapping, and a
    ``loop_towers`` without its count and parts in seconds."""
    def wrong(value, kind) -> bool:  # (a bool is an int to isinstance, not a number here)
        kinds = kind if isinstance(kind, tuple) else (kind,)
        return not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds)
    bad = [k for k, kind in REQUIRED.items() if wrong(prof.get(k), kind)]
    bad += [k for k, kind in OPTIONAL.items() if k in prof and wrong(prof[k], kind)]
    if "blocks" not in bad and not all(isinstance(b, dict) for b in prof["blocks"]):
        bad.append("blocks (each a mapping)")
    looped = prof.get("loop_towers")
    if isinstance(looped, dict) and (wrong(looped.get("towers"), int)
                                     or any(wrong(looped.get(k), _NUMBER) for k in STEP_PARTS)):
        bad.append(f"loop_towers (towers, {', '.join(STEP_PARTS)})")
    return bad


ADDED_KEYS = {34: ("cpu_allocator",)}
"""Recipe keys by the profile version that added them: a recipe written by an older profile lacks them."""


def recipe_as_of(text: str, version: int) -> str:
    """A recipe's TOML (:func:`~paratrain.consistency.config_text`) without the keys added after profile
    ``version`` (:data:`ADDED_KEYS`), as a profile of that version wrote its recipe."""
    later = {k for v, keys in ADDED_KEYS.items() if v > version for k in keys}
    return "".join(line for line in text.splitlines(keepends=True) if line.split(" = ", 1)[0] not in later)


def read_profile(path: Path, cfg, task) -> dict:
    """``paratrain plan --profile PATH``: a profile measured elsewhere (e.g. on a GPU lent for
    minutes), checked against this recipe, to plan from without measuring here.

    Checked, each failure a :class:`~paratrain.errors.UsageError` naming what to change: the file is
    a profile (JSON with a version and a device); its version holds what this paratrain measures on
    its device (:func:`~.profile.compatible`); it is this recipe's: the config text after overrides
    where the profile records it (``recipe``, since 2026-11-27), else the task, batch, dtype,
    precision, every parameter's gradient bytes and whether sync BatchNorm was measured (a recipe
    with ``model.sync_batchnorm`` and BatchNorm layers); and it holds the keys the plan reads
    (:data:`REQUIRED`)."""
    import difflib
    import json

    from ..consistency import config_text
    from ..errors import UsageError
    from .profile_cache import PROFILE_VERSION, compatible
    from .validate import model_gradient_bytes

    try:
        prof = json.loads(Path(path).read_text())
    except OSError as e:
        raise UsageError(f"--profile {path}: cannot read it ({e.strerror or e.__class__.__name__}); give the "
                         f"profile.json of a `paratrain plan --out DIR` run") from None
    except ValueError:
        raise UsageError(f"--profile {path} is not JSON; give the profile.json of a `paratrain plan --out DIR` "
                         f"run") from None
    if not (isinstance(prof, dict) and isinstance(prof.get("version"), int) and isinstance(prof.get("device"), str)):
        raise UsageError(f"--profile {path} is not a profile (no version or device); give the profile.json of a "
                         f"`paratrain plan --out DIR` run")
    if prof["version"] > PROFILE_VERSION:
        raise UsageError(f"--profile {path} is profile version {prof['version']}, newer than this paratrain's "
                         f"{PROFILE_VERSION}: plan with the paratrain that measured it, or upgrade paratrain here")
    if not compatible(prof["version"], prof["device"], str(prof.get("precision", cfg.train.precision))):
        raise UsageError(f"--profile {path} is profile version {prof['version']} of {prof['device']}; this paratrain "
                         f"measures version {PROFILE_VERSION}: profile again there (paratrain plan CONFIG --out DIR "
                         f"--reprofile)")
    wrong = malformed(prof)
    if wrong:
        raise UsageError(f"--profile {path} lacks {', '.join(wrong)} (or has the wrong type): give a whole "
                         f"profile.json of a `paratrain plan --out DIR` run")
    if "recipe" in prof:
        here = recipe_as_of(config_text(cfg), prof["version"])
        if prof["recipe"] != here:
            diff = [d for d in difflib.unified_diff(prof["recipe"].splitlines(), here.splitlines(), lineterm="", n=0)
                    if d[:1] in "+-" and d[:3] not in ("+++", "---")]
            theirs, mine = (next((repr(d[1:]) for d in diff if d[0] == side), "no such line") for side in "-+")
            raise UsageError(f"--profile {path} was measured for another recipe (the profile has {theirs} where this "
                             f"recipe has {mine}); give the CONFIG and --set it was profiled with")
        return prof

    def size(grads) -> str:
        return f"{len(grads)} parameters, {sum(g for g in grads if isinstance(g, (int, float)))} bytes"

    checks = [("task", prof.get("task"), cfg.task.entry), ("batch_size", prof.get("batch_size"), cfg.train.batch_size),
              ("dtype", prof.get("dtype"), cfg.train.dtype), ("precision", prof.get("precision"), cfg.train.precision),
              ("gradients", prof["param_bytes"], model_gradient_bytes(task, cfg.train.dtype)),
              # measured only for a recipe with sync BatchNorm (whose terms it prices) over BatchNorm layers
              ("sync BatchNorm measured", bool(prof.get("batchnorm_inputs")),
               bool(cfg.model_value("sync_batchnorm", False)) and _has_batchnorm(task))]
    for key, theirs, mine in checks:
        if theirs != mine:
            theirs, mine = (size(theirs), size(mine)) if key == "gradients" else (theirs, mine)
            raise UsageError(f"--profile {path} was measured for another recipe: {key} {theirs} there, {mine} "
                             f"here; give the CONFIG and --set it was profiled with")
    return prof


def _has_batchnorm(task) -> bool:
    """Whether the task's model (built on the meta device) has BatchNorm layers."""
    import torch

    from ..strategies.sync_batchnorm import has_batchnorm

    with torch.device("meta"):
        return has_batchnorm(task.build_model())
