"""``paratrain predict``: a measured one-device step and an interconnect -> predicted step time,
words/s and scaling efficiency per N (the flags: :func:`~.commands.add_predict_parser`)."""
from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

from ..devices import resolve
from ..errors import UsageError
from ..strategies import REFERENCE, STRATEGIES, modelled, owners
from .commands import _load_config, _task, _units_per_step
from .costmodel import with_extra_step_s
from .costmodel_links import base_latency_words
from .strategy_model import SHARDED_OPTIMIZER, SHARDED_PARAMETERS, pays_sync_batchnorm
from .sweep import MODELLED, BenchSpec, plan_runs, run_sweep


def cmd_predict(args: argparse.Namespace) -> int:
    import dataclasses

    from .costmodel_cluster import cluster
    from .validate import model_gradient_bytes, workload_from_record

    preset = cluster(args.interconnect, 1, machines=False)  # a flat Link, or None: measured
    if args.nproc < 1:
        raise UsageError(f"--nproc {args.nproc}: use 1 or more")
    if args.num_ps < 1:
        raise UsageError(f"--num-ps {args.num_ps}: use 1 or more")
    if args.bucket_mb is not None and not args.bucket_mb > 0:
        raise UsageError(f"--bucket-mb {args.bucket_mb:g}: give DDP's bucket size in MiB, > 0 (or leave it out: the "
                         f"one predicted best)")
    if args.from_bench is None and args.steps < 2:
        raise UsageError(f"--steps {args.steps}: predict times the one-device step over --steps steps, a third of "
                         f"them warm-up; use 2 or more")
    cfg = _load_config(args.config, args.overrides, args.task)
    hook = args.comm_hook or cfg.dist.comm_hook
    if hook != "none" and args.algorithm == "ps":
        raise UsageError(f"--comm-hook {hook}: communication hooks compress all-reduce (ring, tree), not the "
                         f"parameter server; drop one of the two")
    cls = STRATEGIES[args.strategy]
    if cls.cost_model != "ring" and args.algorithm != "ring":
        raise UsageError(f"--algorithm {args.algorithm} applies to an all-reduce strategy "
                         f"({', '.join(modelled('ring'))}); {args.strategy} is modelled with ring collectives")
    if hook != "none" and "comm_hook" not in cls.dist_keys:
        raise UsageError(f"--comm-hook {hook}: communication hooks are DDP's ({', '.join(owners('comm_hook'))}), "
                         f"not {args.strategy}'s")
    ns = _points(args.nproc)
    if not _runnable(args, cfg, ns):
        stages = _stages(args, cfg)
        raise UsageError(f"--nproc {args.nproc}: a pipeline of {stages} stages runs on a multiple of {stages} "
                         f"processes, and predict's N ({', '.join(map(str, ns))}: the powers of 2 "
                         f"up to --nproc, and --nproc) hold none; give --nproc a multiple of {stages}")
    task = _task(cfg, args.data_dir)
    _check_pipeline(args, cfg, task)  # before the one-device measurement: a refusal costs nothing
    rec, source = _single_step(args, cfg)
    tokens = _units_per_step(rec)
    w = workload_from_record(rec, model_gradient_bytes(task, cfg.train.dtype), tokens)
    if args.interconnect == "measured":
        from .microbench import measured_link

        print("[predict] fitting the link: gloo all-reduce micro-benchmark (2 processes)", flush=True)
        link = measured_link(2)
    else:
        link = preset
    curve = _curve(args, cfg, task, link, ns)
    plain, hook_cost = None, None
    if (hook == "bf16" and args.interconnect == "measured" and args.algorithm == "ring"
            and resolve(cfg.dist.device).type == "cpu"
            and cfg.train.dtype == "float32"):  # the measurement's: float32 buckets, gloo's ring, this CPU
        from .microbench_hooks import measured_compress_hook

        print("[predict] dist.comm_hook bf16: timing torch's bf16_compress_hook between 2 gloo processes here "
              "(buckets of 1 KiB to 64 MiB: the casts and the bf16 payload's all-reduce)", flush=True)
        hook_cost = measured_compress_hook()
        print("[predict] dist.comm_hook bf16: each bucket priced by that measurement, moved to N ranks by its "
              "payload's ring all-reduce", flush=True)
        plain = curve(w)
    elif hook != "none":
        payload = _hook_payload(args, hook)
        ratio = min(1.0, payload / sum(w.param_bytes))
        print(f"[predict] dist.comm_hook {hook}: all-reduce payload {payload / 2**20:.3f} MiB per step for "
              f"{sum(w.param_bytes) / 2**20:.1f} MiB of gradients (ratio {ratio:.4f}, measured from the hook in a "
              f"2-process run); the hook's own compute is not modelled"
              + (" (a bf16 hook's is, with --interconnect measured and the ring on a CPU, float32)" if hook == "bf16"
                 else ""), flush=True)
        plain = curve(w)
        w = dataclasses.replace(w, payload_ratio=ratio)
    preds = curve(w, hook_cost)
    if cfg.model_value("sync_batchnorm", False) and pays_sync_batchnorm(cls):
        # added here once: predict_curve has no such term, and predict_strategy's inputs (strategy_inputs)
        # carry no sync_batchnorm_s for its sync_overhead_s
        extra = _sync_batchnorm_terms(args, cfg, link, [p.n for p in preds])
        preds = [with_extra_step_s(p, extra[p.n]) for p in preds]
        plain = plain and [with_extra_step_s(p, extra[p.n]) for p in plain]

    bw = f"{1 / link.beta_s_per_byte / 1e9:.2f} GB/s" if link.beta_s_per_byte else "inf"
    unit = getattr(task, "unit", "samples")
    print(f"[predict] {args.config}: per-replica batch {cfg.train.batch_size} = {tokens:g} "
          f"{unit}/step; one-device step {1000 * w.local_s():.1f} ms ({source}); gradients "
          f"{sum(w.param_bytes) / 2**20:.1f} MiB; link {link.name}: alpha {link.alpha_s * 1e6:.1f} us"
          f"{base_latency_words(link.terms())}, {bw}; "
          f"strategy {args.strategy}" + (f", algorithm {args.algorithm}" if cls.cost_model == "ring" else "")
          + "; weak scaling, each replica on a device like the measured one" + _machines(link, args.algorithm))
    if cls.cost_model in (SHARDED_OPTIMIZER, SHARDED_PARAMETERS):
        print(f"[predict] {args.strategy} steps the optimizer on 1/N of the parameters; what stepping it on DTensor "
              f"shards costs beyond that is not in this curve (paratrain plan measures and prices it), so its "
              f"efficiency can exceed 1")
    extra = f" {'uncompressed/s':>14} {'gain':>6}" if plain else ""
    print(f"{'N':>6} {'step ms':>10} {'comm ms':>9} {unit + '/s':>14} {'speedup':>9} {'efficiency':>10} "
          f"{'bucket MB':>9}{extra}")
    for i, p in enumerate(preds):
        more = f" {plain[i].words_per_s:>14,.0f} {p.words_per_s / plain[i].words_per_s:>6.2f}" if plain else ""
        bucket = f"{p.bucket_mb:g}" if p.n > 1 and "bucket_mb" in cls.dist_keys and args.algorithm != "ps" else "-"
        print(f"{p.n:>6} {1000 * p.step_s:>10.2f} {max(0.0, 1000 * p.exposed_comm_s):>9.2f} {p.words_per_s:>14,.0f} "
              f"{p.speedup:>9.2f} {p.efficiency:>10.3f} {bucket:>9}{more}")
    if args.algorithm != "ps" and cls.cost_model == "ring":
        print(f"[predict] bucket size it would pick at N = {preds[-1].n}: {preds[-1].bucket_mb:g} MB")
    if args.plot:
        _plot_curve(preds, args.plot, f"{link.name}, {args.strategy}", unit)
        print(f"[predict] wrote {args.plot}")
    return 0


def _points(nproc: int) -> list[int]:
    """The N predict predicts: the powers of 2 up to ``nproc``, and ``nproc``."""
    ns = [2 ** k for k in range(int(math.log2(nproc)) + 1)]
    return ns if ns[-1] == nproc else [*ns, nproc]


def _runnable(args: argparse.Namespace, cfg, ns: list[int]) -> list[int]:
    """The N of ``ns`` that ``--strategy`` runs on: every one, a pipeline's the multiples of its stages."""
    return [n for n in ns if n % _stages(args, cfg) == 0]


def _machines(link, algorithm: str) -> str:
    """The header's words for a flat network preset (ib400, eth25): every device its own machine and NIC,
    its all-reduces on NCCL's pick of rings and trees, its all-gathers of ring and PAT
    (:func:`~.costmodel_cluster.flat_links`), as
    ``paratrain plan`` prices it; nothing for any other link or for ``--algorithm`` tree and ps."""
    if _links(link, 2, 1, algorithm)[0] is link:  # priced on the preset as it is
        return ""
    return ("; every device its own machine and NIC: all-reduce on NCCL's rings and trees, all-gather on its ring "
            "and PAT, the faster per message, with its corrections by message size (as paratrain plan)")


def _stages(args: argparse.Namespace, cfg) -> int:
    """The stages S a replica of ``--strategy`` spans: the recipe's dist.pipeline_stages for a pipeline, else 1."""
    from .strategy_model import STAGES

    return cfg.dist.pipeline_stages if STRATEGIES[args.strategy].cost_model == STAGES else 1


def _links(link, n: int, stages: int, algorithm: str):
    """(the collective link, links placed apart) predict prices ``n`` ranks on: a flat preset's
    :func:`~.costmodel_cluster.flat_links`, as ``paratrain plan`` prices it, where ``algorithm`` is
    "ring" (NCCL's); the link itself for a binomial tree ("tree") or a parameter server ("ps")."""
    from .costmodel_cluster import flat_links

    return flat_links(link, n, stages) if algorithm == "ring" else (link, {})


def _sync_batchnorm_terms(args: argparse.Namespace, cfg, link, ns: list[int]) -> dict[int, float]:
    """{N: seconds per step that ``model.sync_batchnorm`` adds} (:func:`.plan_inputs.sync_batchnorm_s`): the
    task's BatchNorm input shapes; ``--interconnect measured``: their synchronisation measured between
    two processes here (plus the ring's growth beyond two), otherwise three ring all-reduces per layer
    (C + 1, C and 2 C numbers) on the preset link (:func:`_links`: a network preset's with ``--algorithm
    ring``, NCCL's rings and trees over the replicas)."""
    from .plan_inputs import sync_batchnorm_s
    from .profile import batchnorm_inputs_of

    from ..runs import build_task

    measured = args.interconnect == "measured"
    one = build_task(cfg, args.data_dir, world_size=1)  # a replica's batch is the recipe's batch (weak scaling)
    prof: dict = {"batchnorm_inputs": batchnorm_inputs_of(one, cfg)}
    if measured and prof["batchnorm_inputs"] and max(ns) > 1:
        from .microbench_meetings import measured_sync_batchnorm

        print(f"[predict] model.sync_batchnorm: measuring the synchronisation of "
              f"{len(prof['batchnorm_inputs'])} BatchNorm calls between 2 processes", flush=True)
        prof["sync_batchnorm_s"] = measured_sync_batchnorm(prof["batchnorm_inputs"])
    terms = {n: sync_batchnorm_s(prof, cfg, n, _links(link, n, _stages(args, cfg), args.algorithm)[0], measured)
             for n in ns}
    if max(ns) > 1:
        print(f"[predict] model.sync_batchnorm: {len(prof['batchnorm_inputs'])} BatchNorm calls a step, each "
              f"3 blocking all-reduces (C + 1, C and 2 C numbers): +{1000 * terms[max(ns)]:.2f} ms per step at "
              f"N = {max(ns)} "
              f"({'measured here' if measured else link.name}); in the step and comm columns", flush=True)
    return terms


def _curve(args: argparse.Namespace, cfg, task, link, ns: list[int]):
    """(workload, a bf16 hook's measured cost or None) -> predictions at each N of ``ns`` for
    ``--strategy`` (a pipeline: the N that are a multiple of its stages, :func:`_runnable`); with the hook's cost
    (:func:`~.microbench_hooks.measured_compress_hook`) each bucket is priced by it
    (:func:`~.costmodel_hooks.compress_hook_bucket_s` at that N). On a flat network preset (ib400, eth25)
    the collectives go on :func:`~.costmodel_cluster.flat_links`' links, as ``paratrain plan`` prices
    them: every device its own machine, NCCL's pick of rings and trees (``--algorithm ring``; ``tree``
    and ``ps`` on the preset as it is)."""
    from ..env import default_threads, intra_op_threads
    from .costmodel import predict
    from .costmodel_hooks import compress_hook_bucket_s
    from .strategy_model import STAGES, predict_strategy, strategy_inputs

    def bucket_s(n: int, measured: dict | None):
        return compress_hook_bucket_s(n, measured) if measured else None

    model = STRATEGIES[args.strategy].cost_model
    if model == "ring":  # the ring on a flat network preset: NCCL's pick of its rings and trees (as plan's)
        return lambda w, measured=None: [predict(w, n, _links(link, n, 1, args.algorithm)[0],
                                                 algorithm=args.algorithm, bucket_mb=args.bucket_mb,
                                                 num_ps=args.num_ps, bucket_s=bucket_s(n, measured)) for n in ns]
    # a CPU pipeline's stages timed at the threads each of its S processes gets here (as paratrain plan times
    # them); a GPU's recipe's on the GPU, at this process' threads
    device = resolve(cfg.dist.device)
    with intra_op_threads(default_threads(cfg.dist.pipeline_stages) if model == STAGES and device.type == "cpu"
                          else None):
        inputs = strategy_inputs(task, cfg, device)
    if model == STAGES and "activation_bytes" not in inputs:  # (_check_pipeline cut it; a safety net)
        raise UsageError(f"--strategy {args.strategy}: the model of task {cfg.task.entry!r} does not pipeline")
    if model == STAGES:
        shares = " / ".join(f"{f:.2f}" for f in inputs["stage_fractions"])
        mib = " / ".join(f"{b / 2**20:.1f}" for b in inputs["stage_param_bytes"])
        plan = cfg.dist.pipeline_split or "even"
        print(f"[predict] {cfg.dist.pipeline_stages} stages (dist.pipeline_split {plan!r}): share of a micro-batch's "
              f"forward + backward {shares}; parameters {mib} MiB; {cfg.dist.microbatches} micro-batches cost "
              f"{inputs['microbatch_factor']:.2f}x the whole batch (measured here)", flush=True)
    points, stages = _runnable(args, cfg, ns), _stages(args, cfg)

    def one(w, n: int, measured: dict | None):
        collective, placed = _links(link, n, stages, args.algorithm)
        return predict_strategy(args.strategy, w, n, collective, cfg,
                                {**inputs, "hook_bucket_s": bucket_s(n, measured)}, bucket_mb=args.bucket_mb,
                                links=placed)

    return lambda w, measured=None: [one(w, n, measured) for n in points]


def _check_pipeline(args: argparse.Namespace, cfg, task) -> None:
    """For a pipeline ``--strategy``: UsageError, one line, where the task's model does not cut into
    ``dist.pipeline_stages`` stages (:func:`~paratrain.strategies.stages.cut_stages`,
    :func:`~paratrain.strategies.stages.task_hooks`: why not, e.g. a model with BatchNorm); nothing otherwise.
    Builds the model on the meta device (its structure alone), runs nothing."""
    from ..strategies.stages import pipeline_refusal
    from .strategy_model import STAGES

    if STRATEGIES[args.strategy].cost_model != STAGES:
        return
    why = pipeline_refusal(task, cfg.dist.pipeline_stages, cfg.dist.pipeline_split)
    if why:
        raise UsageError(f"--strategy {args.strategy}: {why}")


def _hook_payload(args: argparse.Namespace, hook: str) -> float:
    """Bytes per step one rank hands to all-reduce under ``hook``: the hook's own count
    (``comm_bytes_per_step``) in a 2-process ``allreduce`` run of 4 steps (PowerSGD from step 2)."""
    overrides = (*args.overrides, f"dist.comm_hook={hook}", "dist.start_powerSGD_iter=2", "train.log_every=1")
    spec = BenchSpec(config=args.config, task=args.task, strategies=(MODELLED,), nprocs=(2,), scaling=("weak",),
                     steps=4, warmup_steps=1, overrides=overrides, data_dir=args.data_dir)
    cfg = _load_config(args.config, list(overrides), args.task)
    print(f"[predict] measuring the payload of dist.comm_hook {hook}: 4 steps of {MODELLED}, 2 processes", flush=True)
    with tempfile.TemporaryDirectory(prefix="paratrain-predict-") as tmp:
        plans = [p for p in plan_runs(spec, cfg.train.batch_size) if p.strategy == MODELLED]
        outcome = run_sweep(spec, plans, Path(tmp), progress=False)[0]
        payload = outcome.summary.get("comm_bytes_per_step") if outcome.ok else None
        if not payload:
            raise UsageError(f"the payload measurement of dist.comm_hook {hook} failed (exit {outcome.rc}); "
                             f"run paratrain train {args.config} --nproc 2 --set dist.comm_hook={hook} to see why")
        return float(payload)


def _single_step(args: argparse.Namespace, cfg) -> tuple[dict, str]:
    """The single-device run record to predict from: from a bench folder, or measured now."""
    import json

    from .report import median_run, run_record

    if args.from_bench:
        path = args.from_bench / "results.json"
        if not path.is_file():
            raise UsageError(f"--from-bench {args.from_bench}: no results.json there; give a paratrain bench folder")
        rec = median_run([r for r in json.loads(path.read_text())["runs"] if r["strategy"] == REFERENCE
                          and r["threads"] is None and r["global_batch"] == cfg.train.batch_size], "train_step_ms")
        if rec is None:
            raise UsageError(f"--from-bench {args.from_bench}: no single-device run at batch {cfg.train.batch_size}")
        return rec, f"median single-device run of {path}"
    warm = max(1, args.steps // 3)
    spec = BenchSpec(config=args.config, task=args.task, strategies=(REFERENCE,), nprocs=(1,), scaling=("weak",),
                     steps=args.steps,
                     warmup_steps=warm, overrides=tuple(args.overrides), data_dir=args.data_dir)
    print(f"[predict] measuring one device: {args.steps} steps of single", flush=True)
    with tempfile.TemporaryDirectory(prefix="paratrain-predict-") as tmp:
        outcome = run_sweep(spec, plan_runs(spec, cfg.train.batch_size), Path(tmp), progress=False)[0]
        if not outcome.ok:
            log = (Path(tmp) / "logs").glob("*.log")
            tail = "".join(p.read_text()[-600:] for p in log)
            raise UsageError(f"the single-device measurement failed (exit {outcome.rc}): {tail.strip()[-300:]}")
        return run_record(outcome), f"measured now, {args.steps} steps"


def _plot_curve(preds, path: Path, title: str, unit: str = "words") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    ns = [p.n for p in preds]
    a.plot(ns, [p.words_per_s for p in preds], marker="o", label="predicted")
    a.plot(ns, [preds[0].words_per_s * n for n in ns], linestyle=":", color="grey", label="linear")
    a.set_yscale("log")
    a.set_ylabel(f"{unit}/s")
    b.plot(ns, [p.efficiency for p in preds], marker="o")
    b.set_ylabel("scaling efficiency S(N)/N")
    b.set_ylim(0, max(1.05, 1.05 * max(p.efficiency for p in preds)))  # a sharded optimizer's can exceed 1
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("N (replicas)")
        ax.set_title(title)
    a.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)

