"""``paratrain plan``'s command: the flow (profile, predict, rank, recommend) and its outputs:
the printed table, ``plan.json``, ``plan.md``, ``throughput.png`` (predicted words/s vs N per
strategy) and ``memory.png`` (memory per device vs N against the device limit)."""
from __future__ import annotations

import argparse
import datetime
import json
import math
from pathlib import Path
from typing import Any

from ..errors import UsageError
from . import plan as pl
from . import plan_profile
from .costmodel import PRESETS, Link
from .costmodel_cluster import NETWORK_PRESETS, Cluster
from .costmodel_links import base_latency_words
from .plan_validate import GPU_LINK, on_gpu
from .plan_feasible import data_refusals, host_memory, infeasible


def cmd_plan(args: argparse.Namespace) -> int:
    from .commands import _load_config, _machine

    ns, preset = pl._args(args)
    cfg = _load_config(args.config, args.overrides, args.task)
    from ..runs import build_task

    task = build_task(cfg, args.data_dir, world_size=1)  # the whole global batch on one device
    out = args.out or Path("runs") / f"plan-{Path(args.config).stem}"
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file; give a folder")
    if args.rescore and not (out / "validation.json").exists():
        raise UsageError(f"--rescore: no {out / 'validation.json'}; run paratrain plan with --validate and --out {out} "
                         f"first")
    from ..devices import resolve
    from .plan_validate import validation_counts

    # bad input says so before the profile's minutes (with --profile, the file's device decides, below)
    if args.nproc and args.profile is None:
        _gpu_nproc(ns, resolve(cfg.dist.device).type == "cuda", preset, args.nproc)
    if args.profile is not None:  # measured elsewhere: checked against this recipe, nothing measured or written
        prof = plan_profile.read_profile(args.profile, cfg, task)
        print(f"[plan] profile: read from {args.profile} (version {prof['version']}, {prof['device']}"
              f"{', ' + prof['device_name'] if prof.get('device_name') else ''}"
              f"{', host ' + prof['host'] if prof.get('host') else ''}, {prof.get('date', '?')})", flush=True)
    else:
        prof, cached = plan_profile.load_profile(args, cfg, task, out)
        print(f"[plan] profile: {'read from' if cached else 'measured, saved to'} {out / 'profile.json'}"
              + (" (--reprofile measures again)" if cached else ""), flush=True)
    ns = _gpu_nproc(ns, on_gpu(prof), preset, args.nproc)
    counts = validation_counts(prof, args.validate_nproc) if args.validate else None  # bad input: before any file
    link = preset or Link(name="measured", **prof["links"]["all_reduce"])
    limit = _device_limit(args.device_memory_gb, prof)
    # the devices of one machine the rows are priced on: a cluster's; a flat network preset's one; else one machine
    machine = (args.devices_per_node if isinstance(preset, Cluster)
               else 1 if preset is not None and preset.name in NETWORK_PRESETS else None)
    # towers (one process) on one machine's devices: a preset's machine (a flat nvlink or pcie5: --devices-per-node)
    per_node = (machine or args.devices_per_node) if preset is not None else None  # CPU virtual devices here: none
    host = host_memory(prof, preset)  # this machine's CPU: every process (or tower) in its memory
    flat_network = machine == 1 and not isinstance(preset, Cluster)
    rows, refused, batches = [], {}, []  # batches[i]: rows[i]'s global batch (pl.layout_batch)
    for n in ns:
        for layout in pl.layouts(n, prof, cfg):
            batch = pl.layout_batch(layout, prof["batch_size"], args.global_batch)
            why = pl.refusal(args.config, args.task, args.overrides, layout, batch)
            if why:
                refused.setdefault(layout.label, why)
                continue
            for ckpt in ((False, True) if args.activation_checkpointing else (False,)):
                keyed = [*args.overrides, pl.CHECKPOINTING_KEY]
                why = pl.refusal(args.config, args.task, keyed, layout, batch) if ckpt else None
                if why:  # e.g. towers with sync BatchNorm
                    refused.setdefault(layout.label + pl.CHECKPOINTED, why)
                    continue
                row = pl.predict_layout(layout, prof, cfg, link, on_this_machine=preset is None,
                                        global_batch=args.global_batch, checkpointing=ckpt)
                if row is None:
                    continue
                row["reason"] = infeasible(row, limit, per_node, host, machine, flat_network=flat_network)
                row["feasible"] = not row["reason"]
                rows.append(row)
                batches.append(batch)
    if max(ns) >= 2 and not prof["strategy_inputs"].get("stage_profiles"):  # no stages were profiled: say why
        from ..strategies import STRATEGIES
        from ..strategies.stages import pipeline_refusal
        from .strategy_model import STAGES

        why = pipeline_refusal(task, 2)
        if why:
            refused.update({s: why for s, c in STRATEGIES.items() if c.cost_model == STAGES and s not in refused})
    too_large = data_refusals(cfg, args.data_dir, set(batches))
    for r, batch in zip(rows, batches):  # a global batch the training split cannot fill: the run would refuse it
        if not r["reason"] and too_large.get(batch):
            r["reason"], r["feasible"] = too_large[batch], False
    if limit is not None and not any(r["memory"]["total"] <= limit for r in rows):
        least = min(rows, key=lambda r: r["memory"]["total"])
        raise UsageError(f"no layout fits --device-memory-gb {args.device_memory_gb:g}: the smallest, {least['label']} "
                         f"at N = {least['n']}, needs {least['memory']['total'] / 1e9:.2f} GB per device; give more "
                         f"memory, more devices (--nproc) or --activation-checkpointing")
    rescored = None
    if args.rescore:  # before the plan reads the measured errors, so that it shows the rescored ones
        from .plan_validate import rescore

        rescored = rescore(cfg, prof, out, args.config, args.task, args.overrides)
    checked = pl.read_validation(out if args.profile is None else args.profile.parent)  # the profile's machine's
    for r in rows:
        r["measured_error"] = pl.row_error(checked, r["strategy"], r["n"], r["checkpointing"])
        r["extrapolated"] = pl.extrapolated(checked, r["strategy"], r["n"], preset is not None, r["checkpointing"])
    ranked = pl.rank(rows, args.objective)
    best = pl.recommendation(ranked)
    extra = list(args.overrides)
    for r in ranked:
        r["command"] = pl.command_line(r, args.config, extra, cfg.train.batch_size, str(prof["device"]).split(":")[0],
                                       machine)
    unit = prof["unit"]
    result = {"date": f"{datetime.datetime.now():%Y-%m-%d %H:%M}", "machine": _machine(), "config": args.config,
              "task": cfg.task.entry, "unit": unit, "interconnect": link.name,
              # a two-level cluster: "link" inside a machine, "network" between machines
              "link": (link.intra if isinstance(link, Cluster) else link).terms(),
              # (all_reduce: a collective's link over two full machines, its trees' too: Cluster.collective_link)
              "network": ({"intra": link.intra.name, "inter": link.inter.name, "link": link.inter.terms(),
                           "nics_per_node": link.nics_per_node,
                           "all_reduce": link.collective_link(2 * link.devices_per_node).terms()}
                          if isinstance(link, Cluster) else None),
              "device_memory_bytes": limit, "devices_per_node": per_node, "host_memory_bytes": host and host.total,
              # what each process holds beyond its tensors, and the pages they share (plan_feasible.HostMemory)
              "host_process_bytes": host.process if host and host.measured else None,
              "host_shared_bytes": host.shared if host and host.measured else None,
              # what this machine's CPU towers rows are priced from (plan._cpu_towers), and from which N
              "cpu_towers_step": _towers_source(prof) if preset is None else None,
              # one machine's devices in the commands (a flat network preset: 1; None: one machine)
              "machine_devices": machine,
              "objective": args.objective, "global_batch": args.global_batch,
              "profile_file": str(args.profile or out / "profile.json"),
              "profiled_on": ({k: prof.get(k) for k in ("host", "device", "device_name", "date", "version")}
                              if args.profile is not None else None),  # --profile: measured elsewhere
              "profile": {k: prof[k] for k in ("batch_size", "tokens_per_step", "flops_per_unit", "peak_flops",
                                               "peak_flops_source", "param_total_bytes", "optimizer_state_bytes",
                                               "activation_bytes", "device", "cores")},
              "rows": ranked, "recommended": best, "refused": refused,
              "close_calls": [{"label": r["label"], "n": r["n"]} for r in pl.close_calls(ranked, best, args.objective)]}
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps(result, indent=1, default=str))
    text = markdown(result)
    (out / "plan.md").write_text(text)
    written = plots(result, out)
    print(text)
    print(f"[plan] wrote {out / 'plan.json'}, {out / 'plan.md'}" + "".join(f", {p}" for p in written))
    if args.validate:
        from .plan_validate import validate

        return validate(args, cfg, task, prof, out, counts)
    return rescored or 0


def _gpu_nproc(ns: list[int], gpu: bool, preset: Link | Cluster | None, asked: str | None) -> list[int]:
    """The N to plan: ``ns``, but for a GPU (``gpu``: the profile's device, or the recipe's before it is
    profiled) with the measured interconnect (the profile's links are gloo between CPU processes, not
    NCCL between GPUs) N = 1 alone: the default --nproc is cut to 1 with a line; an --nproc with N > 1
    raises UsageError naming the presets."""
    if preset is not None or not gpu or ns == [1]:
        return ns
    if asked:
        raise UsageError(f"--nproc {asked} with --interconnect measured: the profile is of a GPU, and {GPU_LINK}; "
                         f"plan N > 1 with --interconnect {' | '.join(PRESETS)} or INTRA+INTER of them")
    print("[plan] the profile is of a GPU: with --interconnect measured only N = 1 is planned (give --interconnect "
          f"{' | '.join(PRESETS)} or INTRA+INTER of them, e.g. nvlink+ib400, for more GPUs)", flush=True)
    return [1]


def _device_limit(gb: float | None, prof: dict) -> float | None:
    if gb is not None:
        return gb * 1e9
    if prof.get("device_memory_bytes"):  # the profiled GPU's (a profile planned on another machine keeps it)
        return float(prof["device_memory_bytes"])
    if on_gpu(prof):
        import torch

        if torch.cuda.is_available():
            return float(torch.cuda.get_device_properties(0).total_memory)
    return None


def _f(x: Any, nd: int = 1) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:,.{nd}f}"


def _elsewhere(result: dict) -> str:
    """', from FILE (its device or host, date)' for a plan from ``--profile FILE``, else ''."""
    on = result.get("profiled_on")
    if not on:
        return ""
    return (f", from {result['profile_file']} ({on.get('device_name') or on.get('host') or on.get('device')}, "
            f"{on.get('date', '?')})")


def markdown(result: dict) -> str:
    """The ranked table and the recommendation (also printed)."""
    unit, rows = result["unit"], result["rows"]
    p = result["profile"]
    limit = result["device_memory_bytes"]
    cost_table = result["objective"] == "cost"  # the rate it ranks by: per device, a column of its own
    lines = [f"# paratrain plan — {result['config']} ({result['date']})", "",
             f"{_interconnect(result)}; device memory {'unlimited' if limit is None else f'{limit / 1e9:.1f} GB'}"
             f"{_host(result)}{_towers(result)}; "
             f"profiled on {p['device']} ({p['cores']} cores{_elsewhere(result)}): {p['tokens_per_step']:g} {unit} "
             f"per replica step, "
             f"{p['flops_per_unit'] / 1e6:.1f} MFLOP per {unit.rstrip('s')}, peak {p['peak_flops_source']}; "
             f"objective {result['objective']} ({unit}/s{' per device' if result['objective'] == 'cost' else ''}).",
             "",
             ("Strong scaling: the global batch is fixed at " + str(result["global_batch"]) if result["global_batch"]
              else "Weak scaling: each replica trains the recipe's batch (the command sets train.batch_size, the "
                   "global batch, to replicas x it; adjust the learning rate as your recipe does, train.lr_scaling)")
             + ".", "",
             "Step parts in ms: compute (forward + backward + data), exposed communication (with what the "
             "processes pay for meeting every step: sync BatchNorm, DDP's buffer broadcast, the wait for the last "
             "rank), pipeline bubble, "
             "optimizer. Memory: predicted peak per device (GB). Error: this strategy's largest measured step-time "
             f"error at this N (at an N not measured, its largest at any N) on "
             f"{'the profiled machine' if _elsewhere(result) else 'this machine'} (`--validate`); "
             "extrapolated: beyond what was measured.", "",
             f"| rank | layout | N | step ms | compute | comm | bubble | optimizer | {unit}/s | "
             + (f"{unit}/s per device | " if cost_table else "")
             + "speedup | efficiency | MFU | memory GB | fits | error | note |", "|" + "---|" * (16 + cost_table)]
    for i, r in enumerate(rows, 1):
        note = []
        if not r["synchronous"]:
            note.append(f"async: staleness ~{r['staleness']} version{'s' if r['staleness'] != 1 else ''}")
        if r["extrapolated"]:
            note.append("extrapolated")
        if r["reason"]:
            note.append(r["reason"])
        if r.get("unpriced"):
            note.append(f"unpriced: {r['unpriced']}")
        err = "-" if r["measured_error"] is None else f"{100 * r['measured_error']:.0f}%"
        lines.append(f"| {i} | {r['label']} | {r['n']} | {_f(1000 * r['step_s'])} | {_f(1000 * r['compute_s'])} | "
                     f"{_f(1000 * r['comm_s'])} | {_f(1000 * r['bubble_s'])} | {_f(1000 * r['optimizer_s'])} | "
                     f"{_f(r['units_per_s'], 0)} | "
                     + (f"{_f(r['units_per_s'] / r['n'], 0)} | " if cost_table else "")
                     + f"{_f(r['speedup'], 2)} | {_f(r['efficiency'], 2)} | "
                     f"{_f(r['mfu'], 3)} | {_f(r['memory']['total'] / 1e9, 3)} | {'yes' if r['feasible'] else 'no'} | "
                     f"{err} | {'; '.join(note)} |")
    best = result["recommended"]
    lines += [""]
    if result.get("refused"):
        lines += ["Not possible with this recipe (the strategy's own check):", ""]
        lines += [f"* {label}: {why}" for label, why in result["refused"].items()] + [""]
    if best:
        nodes = pl.machines_of(best["n"], result.get("machine_devices"))
        on_each = (f" On each of its {nodes} machines, with NODE_RANK that machine's rank (0 ... {nodes - 1}) and "
                   f"NODE0 the first one's address (README, \"Several machines\"):" if "--node-rank" in best["command"]
                   else "")
        lines += [f"Recommended: **{best['label']}** at N = {best['n']}: {_f(best['units_per_s'], 0)} {unit}/s "
                  f"predicted, {best['memory']['total'] / 1e9:.3f} GB per device.{on_each}", "", "```",
                  best["command"], "```", ""]
        close = [r for c in result.get("close_calls", []) for r in rows if (r["label"], r["n"]) == (c["label"], c["n"])]
        cost = result["objective"] == "cost"

        def per(r: dict) -> float:
            return pl.objective_value(r, result["objective"])

        if close:
            more = f", and {len(close) - 5} more (see the error column)" if len(close) > 5 else ""
            machine = "the profiled machine's" if _elsewhere(result) else "this machine's"
            lines += [f"Too close to call on {machine} measured step errors (`--validate`; a layout not run itself "
                      "carries its strategy's): "
                      + ", ".join(f"{r['label']} at N = {r['n']} ({_f(per(r), 0)} {unit}/s"
                                  f"{' per device' if cost else ''}, {100 * (per(r) / per(best) - 1):+.1f}%, error "
                                  f"{100 * r['measured_error']:.0f}%)" for r in close[:5])
                      + more + f" against the recommendation's error of {100 * best['measured_error']:.0f}%; "
                        "each may be as fast.", ""]
    else:
        lines += ["No synchronous layout fits; see the table.", ""]
    return "\n".join(lines)


def _interconnect(result: dict) -> str:
    """The header's words for the interconnect: one link, or a two-level cluster's two and the
    bandwidth a job over several machines all-reduces at (:class:`~.costmodel_cluster.Cluster`)."""
    one = result["link"]
    net = result.get("network")
    if not net:
        machines = ("; every device its own machine and NIC: NCCL's trees (all-reduce) and PAT (all-gather) "
                    "where faster"
                    if result["interconnect"] in NETWORK_PRESETS else "")
        return (f"Interconnect {result['interconnect']} (alpha {one['alpha_s'] * 1e6:.1f} us"
                f"{base_latency_words(one)}, {_bw(one)}{machines})")
    intra, inter = net["intra"], net["inter"]
    k, g, wire = net["nics_per_node"], result["devices_per_node"], net["link"]
    return (f"Interconnect {result['interconnect']}: {intra} inside a machine of {g} device{'s' if g != 1 else ''} "
            f"(alpha {one['alpha_s'] * 1e6:.1f} us{base_latency_words(one)}, {_bw(one)}), N <= {g}; {inter} between "
            f"machines (alpha {wire['alpha_s'] * 1e6:.1f} us{base_latency_words(wire)}, {_bw(wire)} a NIC, {k} "
            f"NIC{'s' if k != 1 else ''} a machine), N > {g}: "
            f"all-reduce at {_bw(net['all_reduce'])} a device (rings one per NIC, on full machines; NCCL's trees "
            f"where faster: {net['all_reduce']['tree_latency_s'] * 1e6:.0f} us on two machines; all-gathers on NCCL's "
            f"PAT where faster and a group has one rank a machine), sends between two machines on one NIC")


def _host(result: dict) -> str:
    host = result.get("host_memory_bytes")
    if not host:
        return ""
    process, shared = result.get("host_process_bytes"), result.get("host_shared_bytes")
    each = (f", each process {process / 1e9:.2f} GB beyond its tensors and {shared / 1e9:.2f} GB shared once"
            if process is not None and shared is not None
            else ", counting their tensors only: the profile has not measured a process' own (--reprofile does)")
    return f" (this host's {host / 1e9:.1f} GB hold every process of a row{each})"


def _towers_source(prof: dict) -> dict | None:
    """What the plan prices this machine's CPU towers from (:func:`~.plan._cpu_towers`): ``{"source": "the
    training loop" or "the profile's process", "n_at_least": the towers measured, one a core}`` (below
    it each tower has several threads, and a row is priced as N one-device forwards and backwards in
    turn); None where neither was measured (a GPU's profile, one core)."""
    looped, in_process = prof.get("loop_towers"), prof.get("towers_forward_threads")
    if not (looped or in_process):
        return None
    return {"source": "the training loop" if looped else "the profile's process",
            "n_at_least": int((looped or in_process)["towers"])}


def _towers(result: dict) -> str:
    """The header's words where this machine's CPU towers are priced from their timing in the profile's
    process, not their step in the training loop (a profile made before 2026-12-01, or whose towers' run
    in the loop failed)."""
    got = result.get("cpu_towers_step") or {}
    if got.get("source") != "the profile's process":
        return ""
    return (f"; CPU towers (N >= {got['n_at_least']}) priced from their forward and backward timed in the "
            "profile's process: the profile has no step of theirs in the training loop (--reprofile times one, "
            "unless its run fails)")


def _bw(link: dict) -> str:
    return f"{1 / link['beta_s_per_byte'] / 1e9:.2f} GB/s" if link["beta_s_per_byte"] else "inf GB/s"


def plots(result: dict, out: Path) -> list[Path]:
    """throughput.png and memory.png (one line per layout label, best over checkpointing; an
    infeasible row's point hollow)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[dict]] = {}
    for r in result["rows"]:
        series.setdefault(r["label"], []).append(r)
    paths = []
    for name, ylabel, value, limit in (
            ("throughput.png", f"predicted {result['unit']}/s", lambda r: r["units_per_s"], None),
            ("memory.png", "predicted peak memory per device (GB)", lambda r: r["memory"]["total"] / 1e9,
             result["device_memory_bytes"])):
        fig, ax = plt.subplots(figsize=(9, 5))
        for label, rs in sorted(series.items()):
            rs = sorted(rs, key=lambda r: r["n"])
            line, = ax.plot([r["n"] for r in rs], [value(r) for r in rs], marker="o", label=label,
                            linestyle="-" if rs[0]["synchronous"] else "--")
            bad = [r for r in rs if not r["feasible"]]
            if bad:  # infeasible (memory, or towers beyond one machine): hollow
                ax.plot([r["n"] for r in bad], [value(r) for r in bad], linestyle="none", marker="o",
                        markerfacecolor="white", markeredgecolor=line.get_color())
        if limit is not None:
            ax.axhline(limit / 1e9, color="red", linestyle=":", label="device memory")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("N (devices)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{result['config']}, {result['interconnect']}")
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        paths.append(out / name)
    return paths
