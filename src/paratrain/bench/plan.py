"""``paratrain plan``: profile the model once (cached), predict every registered strategy and layout at
every N on a cluster, mark what does not fit the device memory, rank, and recommend a command.

Layouts per strategy come from the registry (no strategy is named here): ``Strategy.cost_model``
picks the step formula (:func:`~.strategy_model.predict_model`, split into parts by :mod:`.plan_model`),
``dist_keys`` the variants: DDP's bucket (the best predicted) and a bf16 compression hook where
``comm_hook`` is a key; ZeRO-3 and ZeRO-2 where
``reshard_after_forward`` is; 2 and 4 stages (2 S micro-batches, 1F1B) where the model pipelines;
K = 1, 2, 4 servers where ``num_ps`` is; towers (one process over N devices; on a preset
interconnect infeasible beyond ``--devices-per-node``, since one process drives one machine's devices,
as torch's DataParallel does). Asynchronous strategies
are listed with their staleness and never recommended in place of a synchronous one (they train a
different model per step). A layout the recipe refuses (the strategy's own config check) is listed
with the reason (:func:`~.plan_model.refusal`) and not predicted.

Weak scaling by default (each replica the recipe's batch); ``--global-batch B`` fixes the global
batch: each replica gets B / replicas, and compute and activations scale linearly with it (the
one-rank term, the strategies' host work, does not: a GPU's, and a CPU's on a preset).
``--activation-checkpointing`` adds each layout with every block checkpointed: its memory
(:mod:`.plan_memory`) and its backward, which runs the blocks' forward again
(:func:`~.plan_inputs.recompute_fraction` of the forward; CPU towers: every tower's in turn), and
with ``model.sync_batchnorm`` each layer's two meetings of the forward again, waits included
(:func:`~.plan_inputs.sync_batchnorm_recompute_s`).
``--profile FILE`` plans from a profile measured on another machine (checked against the recipe:
:func:`~.plan_profile.read_profile`) instead of measuring here.
Predictions for this machine (``--interconnect measured``) give N processes their share of the
cores (:func:`~.validate.layout_cpu_share`: parameter servers take threads, not compute time); presets put
each device on its own like the profiled one. ``--interconnect INTRA+INTER`` (``nvlink+ib400``) is a
cluster of machines of ``--devices-per-node`` devices and ``--nics-per-node`` NICs: each layout's
collectives are priced on the link its ranks span (:class:`~.costmodel_cluster.Cluster`, :func:`cluster_links`).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path
from typing import Any

from ..errors import UsageError
from .costmodel import PRESETS, Link
from .costmodel_cluster import CHANNELS_PER_NIC, Cluster, cluster, flat_links
from .costmodel_hooks import measured_hook
from .plan_inputs import (buffer_broadcast_s, loop_towers_parts, meetings, memory_inputs,  # noqa: F401 (API)
                          recompute_fraction, stage_outputs, sync_batchnorm_recompute_s, sync_batchnorm_s,
                          tower_sync_batchnorm_s, towers_backward_s, towers_forward_s, workload)
from .plan_memory import memory_per_device
from .plan_model import Layout, best_bucket, layout_batch, refusal, step_parts  # noqa: F401 (refusal: API)
from .plan_command import NODE0, NODE_RANK, command_line, launch_refusal, machines_of  # noqa: F401 (API)
from .plan_ps import (loaded_exchange, loop_guard, loop_stolen, ps_busiest_share, ps_copy_fraction, ps_message_link,
                      ps_streams, slower)
from .plan_profile import TIMED_S
from .plan_rank import (CHECKPOINTED, TIE, close_calls, extrapolated, objective_value, pick,  # noqa: F401 (API)
                        rank, read_validation, recommendation, row_error, unpriced)
from .strategy_model import MODELS as STEP_MODELS
from .strategy_model import PS, RING, SHARDED_OPTIMIZER, STAGES, TOWERS

OBJECTIVES = ("words_per_s", "cost")
DEVICES_PER_NODE = 8  # an HGX/DGX H100 or H200 node's GPUs (NVIDIA DGX H100 datasheet)
MODELS = (*STEP_MODELS, PS)  # every Strategy.cost_model the plan predicts


def add_plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="profile once, predict every strategy at every N, recommend the fastest that fits",
                       description="Profile the model on this machine (cached in --out), predict step time, "
                                   "throughput, scaling efficiency and memory per device for every strategy and "
                                   "layout at each N, and recommend the best that fits; --validate measures "
                                   "N = 1, 2 here against the predictions.")
    p.add_argument("config", help="TOML recipe, e.g. configs/gpt_wt2.toml")
    p.add_argument("--task", help="task entry (default: the recipe's [task] entry)")
    p.add_argument("--nproc", help="device counts N, comma-separated (default 1,2,4,...,64 for a preset "
                                   "interconnect; 1,2,4 for this machine, where N > cores is oversubscribed)")
    p.add_argument("--interconnect", default="measured",
                   help=f"{' | '.join(PRESETS)} (every device on that link) | INTRA+INTER, e.g. nvlink+ib400 (INTRA "
                        f"inside a machine of --devices-per-node devices, INTER between machines) | measured (this "
                        f"machine's gloo, the default)")
    p.add_argument("--device-memory-gb", type=float, help="memory of one device in GB (10^9 bytes); layouts that "
                   "need more are infeasible (default: the GPU's, none on a CPU)")
    p.add_argument("--devices-per-node", type=int, default=DEVICES_PER_NODE,
                   help=f"devices of one machine on a preset interconnect (default {DEVICES_PER_NODE}, an HGX or DGX "
                        f"node's GPUs): towers, one process, are infeasible on more; INTRA+INTER prices N above it "
                        f"on the network")
    p.add_argument("--nics-per-node", type=int, help="network ports (NICs) of one machine, for --interconnect "
                   "INTRA+INTER (default: one per device, as an HGX or DGX H100's eight)")
    p.add_argument("--global-batch", type=int, help="fixed global batch (strong scaling; default: each replica the "
                   "recipe's train.batch_size)")
    p.add_argument("--objective", default="words_per_s", help="words_per_s (fastest) | cost (most per device)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="also plan with every block checkpointed (with --validate: also run each validated "
                   "layout so, twice the runs)")
    p.add_argument("--out", type=Path, help="folder for profile.json (the cache), plan.json, plan.md, plots "
                   "(default runs/plan-<config name>)")
    p.add_argument("--reprofile", action="store_true",
                   help="measure again even if the cached profile matches (it is replaced when the new one is whole; "
                   "a profile cut short resumes from DIR/profile.partial.json)")
    p.add_argument("--profile", type=Path, metavar="FILE",
                   help="plan from FILE, the profile.json of `paratrain plan --out DIR` on another machine (e.g. a "
                        "GPU), instead of profiling here: it must be this CONFIG's (same --set) and a version this "
                        "paratrain reads; nothing is measured; --interconnect measured means FILE's machine's links, "
                        "and the measured errors are those of FILE's folder's validation.json")
    p.add_argument("--profile-steps", type=int, default=30,
                   help="least steps of each one-device run of the profile (default 30; a third is warm-up; see "
                        "--timed-seconds)")
    p.add_argument("--timed-seconds", type=float, default=TIMED_S,
                   help=f"about how long the timed steps of each profile and validation run last: short steps run "
                        f"more than --profile-steps / --validate-steps (default {TIMED_S:g}; 0: exactly those)")
    p.add_argument("--profile-repeats", type=int, default=1,
                   help="rounds of the profile's one-device runs; per thread count the median is kept (default 1; "
                        "on a CPU the default-thread run goes once more after the one-rank runs and after the "
                        "loop's last runs)")
    p.add_argument("--validate", action="store_true",
                   help="run every strategy at N = 1, 2 here and compare with the predictions (minutes)")
    p.add_argument("--rescore", action="store_true", help="predict the layouts of --out's validation.json again "
                   "(the current profile and model) against its kept measurements; no runs")
    p.add_argument("--validate-steps", type=int, default=30, help="least steps per validation run (default 30; "
                   "see --timed-seconds)")
    p.add_argument("--validate-repeats", type=int, default=1, help="runs per validated layout; the median step "
                   "is compared (default 1)")
    p.add_argument("--validate-runoff", type=int, default=3, metavar="PAIRS",
                   help="where the recommendation at N = 2 is not the measured fastest, run the two again in PAIRS "
                        "pairs back to back, the order alternating, and judge the 5%% target on the median of the "
                        "pairs' ratios (default 3; 0: none)")
    p.add_argument("--validate-pace", choices=("run", "round"), default="run",
                   help="on a CPU, when --validate measures the machine's speed again (the profile's one-thread "
                        "runs side by side) to score each N > 1 run at that speed: run, just before each N > 1 run "
                        "of the rounds (default: it follows a speed that drifts within a round), or round, once "
                        "before each round of layouts (fewer runs)")
    p.add_argument("--validate-nproc", help="N to validate at (default 1,2; on a GPU's profile 1; 4 runs "
                   "oversubscribed on a 2-core machine)")
    p.add_argument("--data-dir", help="folder holding ptb/ and wikitext-2/ (default $PARATRAIN_DATA)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")


def _args(args: argparse.Namespace) -> tuple[list[int], Link | Cluster | None]:
    """Checked --nproc, --objective, --interconnect (None: measured; a flat preset's Link, or a
    two-level Cluster), --device-memory-gb, --devices-per-node, --nics-per-node."""
    from .commands import _ints

    default = "1,2,4" if args.interconnect == "measured" else "1,2,4,8,16,32,64"
    ns = sorted(set(_ints(default if args.nproc is None else args.nproc, "--nproc")))
    if not ns or ns[0] < 1:
        raise UsageError(f"--nproc {args.nproc!r}: give device counts >= 1, e.g. --nproc 1,2,4,8")
    if args.profile_steps < 6 or args.profile_repeats < 1:
        raise UsageError(f"--profile-steps {args.profile_steps} / --profile-repeats {args.profile_repeats}: use "
                         f"1 or more rounds of 6 or more steps (a third are warm-up)")
    if args.validate_runoff < 0:
        raise UsageError(f"--validate-runoff {args.validate_runoff}: give pairs >= 0 (0: no run-off)")
    if args.validate_repeats < 1 or args.validate_steps < 6:
        raise UsageError(f"--validate-repeats {args.validate_repeats} / --validate-steps {args.validate_steps}: use "
                         f"1 or more runs of 6 or more steps")
    if not args.timed_seconds >= 0:
        raise UsageError(f"--timed-seconds {args.timed_seconds}: give seconds >= 0 (0: the step counts as given)")
    if args.profile is not None and (args.validate or args.rescore or args.reprofile):
        raise UsageError("--profile plans from a profile measured elsewhere: leave out --validate, --rescore and "
                         "--reprofile (run those on the profile's machine)")
    if args.validate and args.rescore:
        raise UsageError("--validate measures and scores; --rescore scores the kept measurements again: give one")
    if args.objective not in OBJECTIVES:
        raise UsageError(f"--objective {args.objective!r}: use {' or '.join(OBJECTIVES)}")
    if args.device_memory_gb is not None and not args.device_memory_gb > 0:
        raise UsageError(f"--device-memory-gb {args.device_memory_gb}: give the memory of one device in GB, > 0")
    if args.devices_per_node < 1:
        raise UsageError(f"--devices-per-node {args.devices_per_node}: give the devices of one machine, >= 1")
    preset = cluster(args.interconnect, args.devices_per_node, args.nics_per_node)  # None: measured
    if args.global_batch is not None:
        if args.global_batch < 1:
            raise UsageError(f"--global-batch {args.global_batch}: give the samples of one step over every device, "
                             f">= 1 (e.g. {math.lcm(*ns)}, a multiple of every N)")
        bad = [n for n in ns if args.global_batch % n]
        if bad:
            raise UsageError(f"--global-batch {args.global_batch} does not divide among N = {bad or ns}; give a "
                             f"global batch that is a multiple of every N (e.g. {math.lcm(*ns)}) or other --nproc")
    return ns, preset


def layouts(n: int, prof: dict, cfg) -> list[Layout]:
    """Every layout of every registered, modelled strategy at n devices (see the module)."""
    from ..strategies import REFERENCE, STRATEGIES

    out = []
    for name, cls in STRATEGIES.items():
        model = cls.cost_model
        if name == REFERENCE:
            if n == 1:
                out.append(Layout(name, 1, {}, name))
            continue
        if model not in MODELS or n < 2:
            continue
        keys = cls.dist_keys
        if model == STAGES:
            for s, got in sorted(prof["strategy_inputs"].get("stage_profiles", {}).items()):
                if n % int(s) == 0:
                    out.append(Layout(name, n, {"pipeline_stages": int(s), "microbatches": 2 * int(s),
                                                "pipeline_schedule": "1f1b"}, f"{name} {n // int(s)}x{s}"))
            continue
        if model == PS:
            for k in (1, 2, 4):
                if k <= n:
                    out.append(Layout(name, n, {"num_ps": k}, f"{name} K={k}"))
            continue
        out.append(Layout(name, n, {}, f"{name} (towers)" if model == TOWERS else name))
        if "reshard_after_forward" in keys:
            out.append(Layout(name, n, {"reshard_after_forward": False}, f"{name} (no reshard, ZeRO-2)"))
        if "comm_hook" in keys:
            out.append(Layout(name, n, {"comm_hook": "bf16"}, f"{name} + bf16 hook"))
    return out


CHECKPOINTING_KEY = "model.activation_checkpointing=true"
"""The ``--set`` a checkpointed row's run and its recipe's refusal check add."""


def _cpu_towers(prof: dict, cfg, n: int, ratio: float, recompute_s: float, shared_cores: bool) -> dict[str, Any]:
    """The towers' inputs of :func:`~.strategy_model.predict_model` for n CPU towers on this machine's
    cores (none elsewhere): their step in the training loop where the profile has it
    (:func:`~.plan_inputs.loop_towers_parts`, since 2026-12-01: forward with the join and the loss,
    backward, data and optimizer), else their forward and backward timed in the profile's process
    (:func:`~.plan_inputs.towers_forward_s`, :func:`~.plan_inputs.towers_backward_s`; since version 26
    the forward with the join and the loss on it). ``recompute_s``: activation checkpointing's
    forwards again in the one backward (every tower's in turn)."""
    if not shared_cores:
        return {"towers_forward_s": None, "towers_backward_s": None, "towers_forward_joined": False}
    looped = loop_towers_parts(prof, cfg, n, ratio, recompute_s)
    if looped:
        return {"towers_forward_s": looped["forward_s"], "towers_backward_s": looped["backward_s"],
                "towers_forward_joined": True, "towers_data_s": looped["data_s"],
                "towers_optimizer_s": looped["optimizer_s"]}
    return {"towers_forward_s": towers_forward_s(prof, n, ratio),
            "towers_backward_s": towers_backward_s(prof, n, ratio, recompute_s),
            "towers_forward_joined": bool((prof.get("towers_forward_threads") or {}).get("joined"))}


def predict_layout(layout: Layout, prof: dict, cfg, link: Link | Cluster, *, on_this_machine: bool,
                   global_batch: int | None, checkpointing: bool = False) -> dict[str, Any] | None:
    """One plan row: the layout's predicted step parts, throughput, speedup and efficiency (against
    one device with the same global batch under --global-batch, else the same per-replica batch) and
    memory per device; None where the layout does not exist. ``link``: the interconnect; a two-level
    :class:`~.costmodel_cluster.Cluster` prices the layout's collectives on the link its ranks span
    (:func:`cluster_links`), a flat network preset (ib400, eth25) as machines of one device each
    (:func:`~.costmodel_cluster.flat_links`: NCCL's trees and channels, over the replicas, and
    over the S stages for a pipeline's tied parameters)."""
    from ..strategies import STRATEGIES
    from .validate import layout_cpu_share

    cls = STRATEGIES[layout.strategy]
    n = layout.n
    stages = layout.overrides.get("pipeline_stages", 1)
    replicas = n // stages
    b0 = prof["batch_size"]
    ratio = (global_batch / replicas / b0) if global_batch else 1.0
    servers = layout.overrides.get("num_ps", 0)
    threads, scale = (layout_cpu_share(n, servers, prof["cores"], in_process=cls.cost_model == TOWERS)
                      if on_this_machine else (None, 1.0))
    shared_cores = on_this_machine and prof["device"] == "cpu"  # towers on CPU virtual devices
    w = workload(prof, threads, ratio)
    # activation checkpointing runs the checkpointed blocks' forward again in the backward
    recompute = recompute_fraction(prof) * w.forward_s if checkpointing else 0.0
    w = dataclasses.replace(w, backward_s=w.backward_s + recompute)
    overrides = dict(layout.overrides)
    if isinstance(link, Cluster):
        link, placed = cluster_links(link, n, stages)
    else:  # a flat ib400: machines of one device; a pipeline's tied parameters all-reduce over its S stages
        link, placed = flat_links(link, n, stages)
    # this machine: the cores that compute also run gloo (no overlap), and each collective has its own link
    overlap = not (on_this_machine and prof["device"] == "cpu")
    measured = {k: Link(name=k, **v) for k, v in prof.get("links", {}).items()}
    links = dict(measured) if on_this_machine else placed
    broadcast = links.pop("broadcast", link)  # DDP's buffers (buffer_broadcast_s), not the step's formula's
    if "rpc" in measured and prof.get("ps_round_trip_s") and (prof.get("ps_update_s") or {}).get("async") is not None:
        exchange = ps_message_link(measured["rpc"], prof["ps_round_trip_s"], prof["ps_update_s"]["async"],
                                   sum(w.param_bytes))
        # a parameter server's messages go through the hosts' RPC (CPU tensors over TensorPipe) on any
        # cluster, not the devices' interconnect: the exchange measured on the profiled host bounds them
        links["rpc"] = exchange if on_this_machine else slower(links.get("rpc", link), exchange)
    # (a cluster's server link carries its messages in turn: streams 1, and the fraction moves nothing)
    copies = ps_copy_fraction(measured["rpc"], links["rpc"]) if shared_cores and "rpc" in links else 1.0
    hook_cost = measured_hook(prof, on_this_machine)  # the casts and gloo's bf16 reduction
    if cls.cost_model in (RING, SHARDED_OPTIMIZER) and n > 1:
        overrides.setdefault("bucket_mb", best_bucket(w, n, link, scale, overlap, overrides.get("comm_hook"),
                                                      hook_cost, cfg.train.dtype))
    inputs = {**prof["strategy_inputs"], "output_bytes": prof.get("output_bytes", 0.0) * ratio,
              "shared_cores": shared_cores, "memory_copy": prof.get("memory_copy") if shared_cores else None,
              # checkpointing runs each layer's two forward meetings again in the backward
              "sync_batchnorm_s": sync_batchnorm_s(prof, cfg, n, link, on_this_machine) + (
                  sync_batchnorm_recompute_s(prof, cfg, n, link, on_this_machine) if checkpointing else 0.0),
              "tower_sync_batchnorm_s": tower_sync_batchnorm_s(prof, cfg, n, on_this_machine),
              "buffer_broadcast_s": buffer_broadcast_s(prof, cfg, cls, n, broadcast, on_this_machine),
              "ps_update_s": prof.get("ps_update_s"),
              # an async worker's exchange while the others compute on the same cores (plan_ps.ps_exchange_wait_s)
              "ps_loaded": loaded_exchange(prof, n) if shared_cores else None,
              "ps_round_trip_s": prof.get("ps_round_trip_s"),
              # a synchronous server's messages moving their bytes side by side on these cores (plan_ps.ps_streams)
              "ps_streams": ps_streams(prof["cores"], servers) if shared_cores else 1,
              "ps_copy_fraction": copies,
              # a PS worker's compute beside the others' exchanges and the server, measured in the loop (loop_stolen)
              "ps_stolen_s": loop_stolen(prof, n, layout.strategy) if shared_cores else None,
              # a worker's norm (and clip) around its exchange, measured in the same job (plan_ps.loop_guard)
              "ps_guard_s": loop_guard(prof, n, layout.strategy) if shared_cores else None,
              "sharded_optimizer_s": prof.get("sharded_optimizer_s", 0.0),
              "sharded_norm_s": prof.get("sharded_norm_s", 0.0),
              "meetings": meetings(prof, n) if shared_cores else None,
              "fsdp_units": prof.get("fsdp_units") if shared_cores else None,
              "zero1_step_s": prof.get("zero1_step_s") if shared_cores else None,
              "bf16_hook": hook_cost,
              "fsdp_step_s": prof.get("fsdp_step_s") if shared_cores else None,
              # 2 processes: fsdp_units, zero1_step_s, fsdp_step_s
              "path_meetings": prof.get("meetings") if shared_cores else None,
              **_cpu_towers(prof, cfg, n, ratio, n * recompute, shared_cores),
              # the strategy's own work at one rank (any link: it is the device's): a GPU's at every N; a
              # CPU's on a preset (this machine's CPU rows price it between two processes: zero1_step_s, fsdp_units)
              "one_rank_s": (None if shared_cores else (prof.get("loop_one_rank_s") or {}).get(layout.strategy))}
    parts = step_parts(cls, Layout(layout.strategy, n, overrides, layout.label), w, link, cfg, inputs,
                       compute_scale=scale, overlap=overlap, links=links)
    if parts is None:
        return None
    base = workload(prof, None, (global_batch / b0) if global_batch else 1.0)
    one = base.tokens_per_step / base.local_s()
    pipe = prof["strategy_inputs"].get("stage_profiles", {}).get(str(stages), {})
    mem = memory_per_device(cls.cost_model or RING, n, memory_inputs(prof), synchronous_buckets=cls.synchronous,
                            checkpointing=checkpointing, stages=stages, microbatches=overrides.get("microbatches", 1),
                            stage_shares=pipe.get("stage_fractions"), stage_params=pipe.get("stage_param_bytes"),
                            stage_outputs=stage_outputs(prof, stages, ratio), stage_saved=pipe.get("stage_saved_bytes"),
                            schedule=overrides.get("pipeline_schedule", "1f1b"), num_ps=overrides.get("num_ps", 1),
                            batch_ratio=ratio, shared_cores=shared_cores,
                            reshard_after_forward=overrides.get("reshard_after_forward", True),
                            server_share=ps_busiest_share(w.param_bytes, servers) if servers else None)
    speedup = parts["units_per_s"] / one
    row = {"strategy": layout.strategy, "label": layout.label + (CHECKPOINTED if checkpointing else ""),
           "n": n, "link": link.name, "overrides": overrides, "synchronous": cls.synchronous,
           # the terms its collectives were priced on (NCCL's tree latency and channels where its ranks span
           # machines, its PAT latency where each machine holds one of them)
           "link_terms": link.terms(),
           "checkpointing": checkpointing,
           **parts, "speedup": speedup, "efficiency": speedup / n, "memory": mem,
           "per_replica_batch": (global_batch // replicas) if global_batch else b0,
           "staleness": (n - 1) if not cls.synchronous else 0,
           "unpriced": unpriced(cls.cost_model, prof, on_this_machine=on_this_machine,
                                comm_hook=overrides.get("comm_hook"))}
    flops = prof.get("flops_per_unit", math.nan) * parts["units_per_s"]
    row["mfu"] = flops / (n * prof["peak_flops"]) if prof.get("peak_flops") else math.nan
    return row


def cluster_links(c: Cluster, n: int, stages: int = 1) -> tuple[Link, dict[str, Link]]:
    """A layout's links on a two-level cluster, its ``n`` ranks placed in order (a pipeline's replica
    r on ranks r S .. r S + S - 1, as :class:`~paratrain.strategies.pipeline.Pipeline` numbers them):

    * the link of its ring collectives over all ranks (a pipeline's: its stage groups' all-reduces over
      the replicas, side by side on the machines' NICs, as many as a machine holds stages;
      :meth:`~.costmodel_cluster.Cluster.collective_link`);
    * ``"rpc"``, ``"broadcast"``: a parameter server's messages and a tree broadcast's hops, sends
      between two ranks: one NIC where the job spans machines (every round of the tree, also those
      inside a machine: an upper bound, of DDP's few buffers), else the intra-node link;
    * a pipeline's ``"p2p"``: the 2 (S-1) sends of its schedule, c of each S - 1 across machines in its
      replica with the most (c = 0 for stages on one machine), as one link whose alpha and beta are the
      hops' mean, so that its S - 1 sends cost the sum of theirs exactly; ``"stages"``: the tied
      parameters' all-reduce over the S stages of that replica, on M = c + 1 machines: ``intra`` where
      M = 1, else NCCL's latencies over S ranks on M machines
      (:meth:`~.costmodel_cluster.Cluster.latencies`) at one NIC's bandwidth, the ring's slowest hop."""
    g = c.devices_per_node
    link = c.collective_link(n, stages=stages)
    one = c.p2p_link(c.nodes(n) > 1)
    links = {"rpc": one, "broadcast": one}
    if stages == 1:
        return link, links
    crossing = max(sum((r * stages + s) // g != (r * stages + s + 1) // g for s in range(stages - 1))
                   for r in range(n // stages))
    hops = stages - 1
    mean = Link(name=f"{crossing} of {hops} sends across machines",
                alpha_s=(crossing * c.inter.alpha_s + (hops - crossing) * c.intra.alpha_s) / hops,
                beta_s_per_byte=(crossing * c.inter.beta_s_per_byte + (hops - crossing) * c.intra.beta_s_per_byte)
                / hops, gamma_s_per_byte=0.0)
    if not crossing:
        return link, {**links, "p2p": c.intra, "stages": c.intra}
    alpha, tree = c.latencies(stages, crossing + 1)
    tied = Link(name=f"{stages} stages on {crossing + 1} machines", alpha_s=alpha,
                beta_s_per_byte=c.inter.beta_s_per_byte, gamma_s_per_byte=c.intra.gamma_s_per_byte,
                tree_latency_s=tree, channels=CHANNELS_PER_NIC, base_latency_s=c.base_latency_s)
    return link, {**links, "p2p": mean, "stages": tied}
