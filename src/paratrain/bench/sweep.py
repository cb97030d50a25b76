"""The scaling sweep behind ``paratrain bench``: plan the runs, run each as ``paratrain train``.

Weak scaling keeps the per-replica batch b fixed (global batch b x N); strong
scaling keeps the global batch B fixed (per-replica batch B / N). Both compare
with a *measured* single-device run: ``single`` at global batch b (weak) or B
(strong), so the baseline of weak scaling at batch b and of strong scaling at
B = b is the same run. Runs are deduplicated on (strategy, N, global batch,
threads) and repeated ``repeats`` times; each runs in its own process tree with
a timeout, warm-up steps are left out of every number (``train.timing_warmup_steps``).
"""
from __future__ import annotations

import functools
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UsageError
from ..strategies import DEFAULT, REFERENCE, modelled

SCALINGS = ("weak", "strong")
MODELLED = modelled("ring")[0]
"""The strategy ``--validate-model`` compares with the cost model's ring all-reduce (Hockney alpha-beta)."""


@dataclass(frozen=True, kw_only=True)
class BenchSpec:
    """What to sweep. ``batches``: per-replica batches (weak) and global batches (strong);
    empty = the recipe's ``train.batch_size``. ``steps``: optimizer steps per run, of which
    the first ``warmup_steps`` are not measured."""

    config: str
    strategies: tuple[str, ...] = (REFERENCE, DEFAULT)
    nprocs: tuple[int, ...] = (1, 2)
    batches: tuple[int, ...] = ()
    scaling: tuple[str, ...] = SCALINGS
    steps: int = 100
    warmup_steps: int = 20
    repeats: int = 1
    num_ps: int = 1
    overrides: tuple[str, ...] = ()
    timeout_s: float = 900.0
    data_dir: str | None = None
    validate_model: bool = False
    task: str | None = None  # task entry (default: the recipe's)

    def __post_init__(self) -> None:
        from ..strategies import STRATEGIES

        for s in self.strategies:
            if s not in STRATEGIES:
                raise UsageError(f"--strategies: unknown strategy {s!r}; choose from {', '.join(STRATEGIES)}")
        for name, values in (("--nproc", self.nprocs), ("--batch", self.batches)):
            if any(v < 1 for v in values):
                raise UsageError(f"{name} {','.join(map(str, values))}: every value must be 1 or more")
        for s in self.scaling:
            if s not in SCALINGS:
                raise UsageError(f"--scaling {s!r} is not known; use weak, strong or weak,strong")
        if self.warmup_steps < 1 or self.steps < 2 * self.warmup_steps:
            raise UsageError(f"--steps {self.steps} with --warmup {self.warmup_steps}: use --warmup 1 or more and "
                             f"--steps at least twice --warmup, so that most steps are measured")
        if self.repeats < 1:
            raise UsageError(f"--repeats {self.repeats}: use 1 or more")


@dataclass(frozen=True, kw_only=True)
class RunPlan:
    """One ``paratrain train`` run of the sweep. ``n``: replicas (processes; towers for
    replicate; workers for the parameter server). ``threads``: None = paratrain's default."""

    strategy: str
    n: int
    global_batch: int
    repeat: int = 0
    threads: int | None = None

    @property
    def key(self) -> tuple:
        return (self.strategy, self.n, self.global_batch, self.threads)

    @property
    def name(self) -> str:
        t = f"-t{self.threads}" if self.threads else ""
        return f"{self.strategy}-n{self.n}-b{self.global_batch}{t}-r{self.repeat}"


def plan_runs(spec: BenchSpec, recipe_batch: int) -> list[RunPlan]:
    """Every distinct run the sweep needs, each ``spec.repeats`` times, in a stable order
    (repeats outermost, so repeats of one point are spread over the sweep). Pure."""
    batches = spec.batches or (recipe_batch,)
    points: dict[tuple, RunPlan] = {}

    def add(p: RunPlan) -> None:
        points.setdefault(p.key, p)

    for b in batches:
        for scaling in spec.scaling:
            add(RunPlan(strategy=REFERENCE, n=1, global_batch=b))  # the measured baseline
            for s in spec.strategies:
                for n in spec.nprocs:
                    if s == REFERENCE and n != 1:
                        continue
                    if scaling == "weak":
                        add(RunPlan(strategy=s, n=n, global_batch=b * n))
                    elif b % n == 0:
                        add(RunPlan(strategy=s, n=n, global_batch=b))
        if spec.validate_model:
            add(RunPlan(strategy=REFERENCE, n=1, global_batch=b, threads=1))  # compute at one thread per process
            for n in (1, 2, 4):
                add(RunPlan(strategy=MODELLED, n=n, global_batch=b * n))
    return [RunPlan(strategy=p.strategy, n=p.n, global_batch=p.global_batch, threads=p.threads, repeat=r)
            for r in range(spec.repeats) for p in points.values()]


def train_command(spec: BenchSpec, plan: RunPlan, run_dir: Path) -> list[str]:
    """The ``paratrain train`` command line of one run (pure): ``plan.n`` replicas as the strategy
    asks for them (:meth:`~paratrain.strategies.base.Strategy.dist_for_replicas`)."""
    from ..config import _toml_value
    from ..strategies import STRATEGIES

    cls = STRATEGIES[plan.strategy]
    cmd = [sys.executable, "-m", "paratrain.cli", "train", spec.config, "--strategy", plan.strategy,
           "--run-dir", str(run_dir)]
    dist = dict(cls.dist_for_replicas(plan.n))
    if "num_ps" in cls.dist_keys:
        dist["num_ps"] = spec.num_ps
    for key, value in dist.items():
        cmd += ["--set", f"dist.{key}={_toml_value(value)}"]
    if spec.task:
        cmd += ["--task", spec.task]
    if plan.threads:
        cmd += ["--threads", str(plan.threads)]
    if spec.data_dir:
        cmd += ["--data-dir", spec.data_dir]
    sets = [f"train.batch_size={plan.global_batch}", f"train.max_steps={spec.steps}", "train.epochs=1000",
            f"train.timing_warmup_steps={spec.warmup_steps}", f"train.log_every={spec.warmup_steps}",
            "train.checkpoint_every=0", "train.eval_every=0", *short_evaluation(spec.config, spec.task),
            *spec.overrides]
    for s in sets:
        cmd += ["--set", s]
    return cmd


@functools.lru_cache(maxsize=8)
def short_evaluation(config: str, task: str | None = None) -> tuple[str, ...]:
    """Overrides that shorten a measurement run's evaluation where the task has such a key (the
    language models' ``data.eval_fraction``; a classifier's held-out sets are small already)."""
    from .. import config as configuration

    try:
        cfg = configuration.load(config, ["data.eval_fraction=0.01"], {"task": {"entry": task}} if task else None)
    except UsageError:
        return ()
    return ("data.eval_fraction=0.01",) if cfg else ()


@dataclass
class RunOutcome:
    """What one run left behind: exit code, its summary record and every rank's timing."""

    plan: RunPlan
    rc: int
    run_dir: Path
    summary: dict = field(default_factory=dict)
    ranks: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.rc == 0 and bool(self.summary) and bool(self.ranks)


def read_outcome(plan: RunPlan, rc: int, run_dir: Path) -> RunOutcome:
    """Read ``metrics.jsonl`` (last summary record) and ``timing/rank*.json`` of a finished run."""
    out = RunOutcome(plan, rc, run_dir)
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("kind") == "summary":
                out.summary = rec
    files = sorted((run_dir / "timing").glob("rank*.json"), key=lambda p: int(p.stem[4:])) \
        if (run_dir / "timing").is_dir() else []
    out.ranks = [json.loads(p.read_text()) for p in files]
    return out


def run_sweep(spec: BenchSpec, plans: list[RunPlan], out_dir: Path, progress: bool = True) -> list[RunOutcome]:
    """Run every plan (one at a time, each in its own process tree) with a tqdm bar over the sweep."""
    from tqdm import tqdm

    from .runner import run_cmd

    env = dict(os.environ)
    outcomes = []
    bar = tqdm(plans, desc="bench", unit="run", disable=not progress, dynamic_ncols=True)
    for plan in bar:
        bar.set_postfix_str(plan.name)
        run_dir = out_dir / "runs" / plan.name
        (out_dir / "logs").mkdir(parents=True, exist_ok=True)
        rc, _ = run_cmd(train_command(spec, plan, run_dir), out_dir / "logs" / f"{plan.name}.log", spec.timeout_s, env)
        o = read_outcome(plan, rc, run_dir)
        if not o.ok:
            bar.write(f"[bench] {plan.name} failed (exit {rc}); see {out_dir / 'logs' / (plan.name + '.log')}")
        outcomes.append(o)
    return outcomes


def finite(x: float | None) -> bool:
    return x is not None and isinstance(x, (int, float)) and math.isfinite(x)
