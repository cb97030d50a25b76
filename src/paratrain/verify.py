"""``paratrain verify``: does N-way training compute what one device computes?

For the configured model and a strategy, run k optimizer steps N-way and 1-way
(``single``) with the same global batch, on CPU in float64 with dropout off, and
compare per parameter: the merged gradient of every step (what the optimizer sees)
and the parameters after k steps. For a synchronous strategy they agree to
rounding (DESIGN.md: the core test). When they do not, the recorded *local*
gradients (each rank's gradient of its own shard before merging, computed on a
copy of the model) tell the likely cause:

* merged = N x mean(local): gradients summed over ranks, not averaged;
* mean(local) = c x single with c = N or 1/N (or K, 1/K with accumulation): the loss
  is summed instead of averaged (or the reverse), or accumulation is not scaled;
* every rank's local gradient is the same: the shards overlap (each rank got the
  same samples: a sampler without rank/world_size);
* otherwise mean(local) != single: shards overlap or drop samples;
* a model with BatchNorm and ``model.sync_batchnorm`` off: batch statistics are per rank;
* dropout > 0 and every rank's RNG state the same when a step's masks are drawn: all ranks drop
  the same units (the comparison itself runs with dropout disabled in the modules, p = 0, so
  that it is exact, while the loop still seeds each step as configured).

Worker entry (under torchrun, or in-process for one-process strategies):
``python -m paratrain.verify RUN_DIR [--bug sum-loss|overlap-shards] [--data-dir D]``;
each rank writes ``RUN_DIR/verify/rank<R>.pt``.
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import math
import os
import sys
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

BUGS = ("sum-loss", "overlap-shards", "same-dropout")
TOLERANCE = 1e-9  # float64 relative difference allowed ("beyond rounding" fails)


# ---- worker side -------------------------------------------------------------------------------
def record_run(run_dir: Path, bug: str = "", data_dir: str | None = None) -> None:
    """Train the run in ``run_dir`` for its max_steps recording local and merged gradients and the
    final parameters into ``run_dir/verify/rank<R>.pt`` (training ranks). Every process of the job
    must call it."""
    from .worker import train_worker

    train_worker(run_dir, False, data_dir, run=lambda trainer: _record(trainer, run_dir, bug), verbose=False)


def _plain_batchnorm(module: nn.Module) -> bool:
    """BatchNorm layers that normalise with this replica's statistics only."""
    from .strategies.sync_batchnorm import SyncBatchNorm

    return any(isinstance(m, nn.modules.batchnorm._BatchNorm)
               and not (isinstance(m, SyncBatchNorm) and m.reducer is not None) for m in module.modules())


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) gradient all-gathered (every rank calls it in the same order); others as they are."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _local_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose BatchNorm layers use this replica's statistics (the local gradient)."""
    from .strategies.sync_batchnorm import SyncBatchNorm

    reducers = {m: m.reducer for m in module.modules() if isinstance(m, SyncBatchNorm)}
    for m in reducers:
        m.reducer = None
    try:
        return copy.deepcopy(module)
    finally:
        for m, r in reducers.items():
            m.reducer = r


def _no_dropout(module: nn.Module) -> None:
    """Exact comparison: no unit dropped (the loop still seeds every step as configured)."""
    for m in module.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p = 0.0
        elif isinstance(m, nn.RNNBase):
            m.dropout = 0.0


def _record(trainer, run_dir: Path, bug: str) -> dict:
    """Instrument ``trainer``'s strategy (local gradients on a copy of the model before each step,
    merged gradients before each update), train its max_steps, save what was recorded."""
    import dataclasses

    from . import tasks

    cfg, env, s = trainer.cfg, trainer.env, trainer.strategy
    names = [n for n, _ in s.module.named_parameters()]
    local: list[dict] = []
    merged: list[dict] = []
    rng: list[str] = []
    if bug == "overlap-shards":  # every rank reads rank 0's shard
        trainer.task = tasks.build(cfg.task.entry, cfg.task_section(), dataclasses.replace(trainer.task_env, rank=0))
    if bug == "same-dropout":  # the dropout seed forgets the rank
        from .train.loop import stream_seed

        trainer.dropout_seed = lambda step: stream_seed(cfg.train.seed, 0, step)
    _no_dropout(s.module)
    task = trainer.task
    if bug == "sum-loss":  # each replica's loss multiplied by the replicas: summed, not averaged
        plain = task.loss
        task.loss = lambda model, mb: (lambda out: (out[0] * s.num_replicas, out[1]))(plain(model, mb))
    step_fn, update_fn = s.train_step, s.optimizer_step

    def train_step(micro, loss_fn, clip):
        rng.append(hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest())  # dropout masks come next
        saved = task.state_dict(lambda t: t)  # the carried state, to run the step again from it
        if s.collective_forward:  # fsdp: each rank holds shards; the replica is whole
            replica = task.build_model().to(trainer.task_env.dtype)
            replica.load_state_dict(s.state_dict())  # all-gathered (every rank is here)
            _no_dropout(replica)
        else:
            s.gather_whole()  # (pipeline: the other stages' parameters, for the copy)
            replica = _local_copy(s.module)
        total = sum(loss_fn(replica, mb) for mb in micro)
        grads = torch.autograd.grad(total, list(replica.parameters()), allow_unused=True)
        local.append({n: (g if g is not None else torch.zeros(())).detach().clone() for n, g in zip(names, grads)})
        task.load_state_dict(saved)
        return step_fn(micro, loss_fn, clip)

    def optimizer_step(optimizer, base_step, closure=None):
        if s.merged_before_step:  # what the update sees (a parameter server merges on its servers)
            merged.append({n: _whole(p.grad).detach().clone() for n, p in s.module.named_parameters()
                           if p.grad is not None})
        return update_fn(optimizer, base_step, closure)

    s.train_step, s.optimizer_step = train_step, optimizer_step
    trainer.run_epoch(None)
    s.gather_whole()
    record = {"share": s.data_share()[0], "local": local, "merged": merged, "world_size": env.world_size,
              "num_replicas": s.num_replicas, "rng": rng, "dropout": _has_dropout(cfg),
              "params": {k: v.detach().cpu().clone() for k, v in s.state_dict().items()},
              "batchnorm": _plain_batchnorm(s.module)}
    out = run_dir / "verify"
    out.mkdir(exist_ok=True)
    torch.save(record, out / f"rank{env.rank}.pt")
    return {}


def _has_dropout(cfg) -> float:
    """The configured dropout probability (``model.dropout``; 0 when the task has none)."""
    value = cfg.model_value("dropout", 0.0)
    return float(value) if isinstance(value, (int, float)) else 0.0


# ---- comparison (pure) ---------------------------------------------------------------------------
def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0 when both are 0)."""
    scale = float(b.abs().max()) if b.numel() else 0.0
    d = float((a - b).abs().max()) if a.numel() else 0.0
    return d / scale if scale > 0 else d


def compare(n_way: dict, single: dict) -> dict[str, dict[str, float]]:
    """Per parameter: the largest relative difference of the merged gradients over the steps
    (``grad``; NaN when the strategy does not expose them, e.g. the parameter server) and of the
    final parameters (``param``)."""
    out = {}
    for name, ref in single["params"].items():
        g = [rel_diff(a[name], b[name]) for a, b in zip(n_way["merged"], single["merged"]) if name in a and name in b]
        out[name] = {"grad": max(g) if g else math.nan, "param": rel_diff(n_way["params"][name], ref)}
    return out


def _uniform_ratio(a: dict, b: dict) -> float | None:
    """c when a = c x b for every tensor (to 1e-6), else None."""
    num = sum(float((x * b[k]).sum()) for k, x in a.items())
    den = sum(float((b[k] * b[k]).sum()) for k in a)
    if den == 0:
        return None
    c = num / den
    ok = all(rel_diff(x, c * b[k]) < 1e-6 for k, x in a.items())
    return c if ok else None


def diagnose(single: dict, ranks: Sequence[dict], accumulation: int) -> str:
    """The likely cause of a mismatch, from the first step's gradients (see the module docstring)."""
    w = len(ranks)
    s1 = single["merged"][0]
    locals_ = [r["local"][0] for r in ranks]
    mean_local = {k: sum(lc[k] for lc in locals_) / ranks[0]["num_replicas"] for k in s1}  # what merging gives
    if ranks[0]["batchnorm"]:
        return ("the model has BatchNorm: each rank normalises with its own batch statistics "
                "(set model.sync_batchnorm = true)")
    if ranks[0]["merged"]:
        m = ranks[0]["merged"][0]
        c = _uniform_ratio({k: m[k] for k in s1}, mean_local)
        if c is not None and abs(c - w) < 1e-3 and w > 1:
            return (f"gradients are summed over the {w} ranks instead of averaged "
                    f"(merged = {w} x the mean local gradient)")
    if w > 1 and all(all(rel_diff(lc[k], locals_[0][k]) < 1e-12 for k in s1) for lc in locals_[1:]):
        return (f"shards overlap: all {w} ranks computed the same local gradient, so they trained on the same "
                f"samples (a sampler or stream without rank/world_size)")
    c = _uniform_ratio(mean_local, s1)
    if c is not None:
        for factor, cause in ((w, f"the loss is summed over the {w} replicas instead of averaged "
                                  f"(N-way gradient = {w} x single)"),
                              (1 / w, f"the loss is averaged twice (divided by world_size {w} again): "
                                      f"N-way gradient = single / {w}"),
                              (accumulation, f"gradient accumulation is not scaled by 1/{accumulation}"),
                              (1 / accumulation, f"gradient accumulation is scaled by 1/{accumulation} twice")):
            if factor != 1 and abs(c - factor) < 1e-3 * max(1.0, factor):
                return cause
    return "the ranks' shards do not add up to the single-device batch: samples overlap or are dropped"


# ---- command ---------------------------------------------------------------------------------------
def add_parser(sub) -> None:
    from .strategies import DEFAULT, REFERENCE, STRATEGIES

    choices = [n for n, cls in STRATEGIES.items() if cls.synchronous and n != REFERENCE]
    v = sub.add_parser("verify", help="check that N-way training equals one device (float64, k steps)",
                       description="Run k steps N-way and 1-way with the same global batch on CPU in float64 and "
                                   "compare gradients and parameters per parameter; exit 1 with a diagnosis when "
                                   "they differ beyond rounding.")
    v.add_argument("config", help="TOML recipe")
    v.add_argument("--task", help="task entry (default: the recipe's [task] entry)")
    v.add_argument("--strategy", default=DEFAULT, choices=choices, help=f"a synchronous strategy (default {DEFAULT})")
    v.add_argument("--nproc", type=int, default=2,
                   help="replicas: processes (towers for replicate; workers for ps-sync)")
    v.add_argument("--steps", type=int, default=3, help="optimizer steps compared (default 3)")
    v.add_argument("--num-ps", type=int, default=1, help="parameter-server strategies: servers")
    v.add_argument("--inject-bug", choices=BUGS, help="break the N-way run on purpose to see the diagnosis")
    v.add_argument("--data-dir", help="folder holding ptb/ and wikitext-2/ (default $PARATRAIN_DATA)")
    v.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")


def _prepare(args, tmp: Path, strategy: str, nproc: int) -> tuple:
    from . import config
    from .errors import UsageError
    from .strategies import STRATEGIES

    if args.steps < 1:
        raise UsageError(f"--steps {args.steps}: use 1 or more")
    if nproc < 1:
        raise UsageError(f"--nproc {nproc}: use 1 or more")
    forced = [f"train.max_steps={args.steps}", "train.epochs=1000", 'train.dtype="float64"', 'dist.device="cpu"',
              f"train.log_every={args.steps}", "train.checkpoint_every=0", "train.eval_every=0",
              f'dist.strategy="{strategy}"']
    cls = STRATEGIES[strategy]
    extra: dict = {"dist": dict(cls.dist_for_replicas(nproc))}
    if "num_ps" in cls.dist_keys:
        extra["dist"]["num_ps"] = args.num_ps
    if args.task:
        extra["task"] = {"entry": args.task}
    # a key of another strategy (``--set dist.reshard_after_forward=false`` for fsdp) is not the reference's
    others = {k for c in STRATEGIES.values() for k in c.dist_keys} - set(cls.dist_keys)
    overrides = [o for o in args.overrides if o.split("=", 1)[0].strip() not in {f"dist.{k}" for k in others}]
    cfg = config.load(args.config, [*overrides, *forced], extra)
    cfg.check_world()
    if cfg.dist.comm_hook != "none":
        raise UsageError(f"dist.comm_hook = {cfg.dist.comm_hook!r} compresses gradients (lossy), and verify checks "
                         f"that the strategy computes exactly what one device computes; verify without it")
    run_dir = tmp / f"{strategy}-{nproc}"
    run_dir.mkdir(parents=True)
    (run_dir / "config.toml").write_text(config.to_toml(cfg))
    return cfg, run_dir


def _run(cfg, run_dir: Path, bug: str, data_dir: str | None) -> list[dict]:
    from . import launch
    from .errors import UsageError
    from .strategies import STRATEGIES

    cls = STRATEGIES[cfg.dist.strategy]
    if cls.in_process:
        record_run(run_dir, bug, data_dir)
    else:
        target = ["paratrain.verify", str(run_dir)] + (["--bug", bug] if bug else [])
        target += ["--data-dir", data_dir] if data_dir else []
        for key, value in cls.launch_env.items():
            os.environ.setdefault(key, value)
        spec = launch.LaunchSpec(nproc=cls.processes_per_node(cfg.dist), target=target, module=True)
        if launch.run(launch.build_command(spec)):
            raise UsageError(f"the {cfg.dist.strategy} run failed (see the lines above)")
    files = sorted((run_dir / "verify").glob("rank*.pt"), key=lambda p: int(p.stem[4:]))
    return [torch.load(f, weights_only=True) for f in files]


def _replicas(ranks: list[dict]) -> list[dict]:
    """One record per data-parallel replica (the first rank of each data share), its merged gradients
    the union of its ranks' (pipeline: each stage records its own parameters')."""
    out: dict[int, dict] = {}
    for r in ranks:
        share = r.get("share", len(out))
        if share not in out:
            out[share] = {**r, "merged": [dict(m) for m in r["merged"]]}
        else:
            for mine, theirs in zip(out[share]["merged"], r["merged"]):
                for k, v in theirs.items():
                    mine.setdefault(k, v)
    return list(out.values())


def cmd_verify(args: argparse.Namespace) -> int:
    import tempfile

    from .runs import build_task
    from .strategies import REFERENCE

    data_dir = str(Path(args.data_dir).resolve()) if args.data_dir else None
    with tempfile.TemporaryDirectory(prefix="paratrain-verify-") as tmp:
        cfg_n, dir_n = _prepare(args, Path(tmp), args.strategy, args.nproc)
        build_task(cfg_n, data_dir)  # task and data errors: one line, exit 2, before any process starts
        cfg_1, dir_1 = _prepare(args, Path(tmp), REFERENCE, 1)
        print(f"[verify] {args.strategy} x {args.nproc} vs single, global batch {cfg_n.train.batch_size}, "
              f"{args.steps} step(s), float64 on CPU, dropout modules at p = 0" + (f", injected bug {args.inject_bug}"
                                                                      if args.inject_bug else ""), flush=True)
        ranks = _replicas([r for r in _run(cfg_n, dir_n, args.inject_bug or "", data_dir) if r["local"]])
        single = _run(cfg_1, dir_1, "", data_dir)[0]
    table = compare(ranks[0], single)
    width = max(len(n) for n in table)
    print(f"{'parameter':<{width}}  {'grad rel diff':>13}  {'param rel diff':>14}")
    for name, d in table.items():
        print(f"{name:<{width}}  {d['grad']:>13.2e}  {d['param']:>14.2e}")
    worst = max(max((v for v in d.values() if not math.isnan(v)), default=0.0) for d in table.values())
    same_masks = len(ranks) > 1 and ranks[0]["dropout"] > 0 and all(r["rng"] == ranks[0]["rng"] for r in ranks)
    if same_masks:
        print(f"[verify] MISMATCH: dropout RNG identical across ranks: all {len(ranks)} ranks start every step "
              f"from the same RNG state, so they drop the same units (seed dropout with the rank)",
              file=sys.stderr)
        return 1
    if worst <= TOLERANCE:
        print(f"[verify] OK: {args.strategy} x {args.nproc} equals single to {worst:.1e} (tolerance {TOLERANCE:g})")
        return 0
    cause = diagnose(single, ranks, cfg_n.train.accumulation)
    print(f"[verify] MISMATCH: largest relative difference {worst:.2e} > {TOLERANCE:g}; likely cause: {cause}",
          file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="paratrain.verify")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--bug", default="", choices=["", *BUGS])
    p.add_argument("--data-dir", default=None)
    a = p.parse_args(argv)
    record_run(a.run_dir, a.bug, a.data_dir)
    return 0


if __name__ == "__main__":
    from .child import exit_after

    exit_after(main)
