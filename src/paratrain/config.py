"""Frozen, validated configuration: TOML recipes plus ``--set section.key=value``.

A config has the sections ``task``, ``data``, ``model``, ``train`` and ``dist``.
``[task] entry`` names the task (default ``lstm-lm``; see :mod:`paratrain.tasks`);
``[data]`` and ``[model]`` belong to the task: validated by the dataclasses its
factory declares (``config_sections``), plain tables otherwise; other ``[task]``
keys are the task's own options. ``train`` and ``dist`` (:mod:`.dist_config`) are
frozen keyword-only dataclasses validated in ``__post_init__``; ``dist`` learns the
strategies and the keys each owns from the registry. Every bad value raises
:class:`~paratrain.errors.UsageError` naming the key, the value and what is
allowed. Units are in the names (``timeout_s``).

Learning rate and clipping conventions: recipes state ``train.lr`` and
``train.clip`` in the convention of their paper. ``train.convention =
"sum_over_time"`` (Zaremba et al. 2014: loss summed over the T unrolled steps,
averaged over the batch) or ``"mean_over_tokens"`` (the loss paratrain
minimises). See :func:`paratrain.train.optim.effective_lr_clip`.
"""
from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .checks import check_at_least, check_choice, key_hint, section_table, update_section
from .dist_config import DistConfig
from .errors import UsageError


@dataclass(frozen=True, kw_only=True)
class TaskConfig:
    """``[task]``: ``entry`` names the task (a built-in name, module:factory or path/to/file.py:factory);
    ``options`` holds the table's other keys (the task's own)."""

    entry: str = "lstm-lm"
    options: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Optimisation. ``batch_size`` is the *global* batch (streams or sentences
    per optimizer step, over all ranks and micro-steps)."""

    epochs: int = 1
    max_steps: int = 0  # > 0: stop after this many optimizer steps (overrides epochs)
    seed: int = 0
    batch_size: int = 20
    ref_batch_size: int = 0  # the recipe's reference global batch for lr_scaling; 0 = batch_size
    lr_scaling: str = "none"  # none | linear | sqrt (Goyal et al. 2017)
    warmup_steps: int = 0
    optimizer: str = "sgd"  # sgd | adam
    lr: float = 1.0
    momentum: float = 0.0
    weight_decay: float = 0.0
    clip: float = 0.0  # global-norm clip in the recipe's convention; 0 = off
    convention: str = "sum_over_time"  # sum_over_time | mean_over_tokens
    schedule: str = "step"  # step | plateau | constant
    decay: float = 0.5
    decay_start_epoch: int = 4  # step schedule: lr *= decay ** max(epoch - decay_start_epoch, 0)
    plateau_patience: int = 0
    accumulation: int = 1  # micro-steps per optimizer step (no_sync on all but the last)
    dtype: str = "float32"  # float32 | float64: the parameters (master weights) and the data
    precision: str = "fp32"  # fp32 | bf16 | fp16: forward and loss under torch.autocast (fp16 adds a GradScaler)
    timeout_s: float = 600.0  # process-group timeout for every collective
    checkpoint_every: int = 0  # steps; 0 = only at epoch end
    keep_checkpoints: int = 3  # newest checkpoints kept in the run dir
    log_every: int = 50  # steps between metric records
    eval_every: int = 0  # steps between validations; 0 = only at epoch end
    timing_warmup_steps: int = 5  # steps left out of the step-time breakdown in the summary
    on_nonfinite: str = "skip"  # NaN/Inf loss or gradient: skip the step (counted) | stop the run
    max_nonfinite_steps: int = 10  # consecutive skipped steps after which the run stops (it cannot recover)
    track_memory_step: int = 0  # > 0: that step runs under torch's MemTracker; summary: tracked_peak_memory_mb

    def __post_init__(self) -> None:
        for key in ("epochs", "batch_size", "accumulation", "log_every", "keep_checkpoints", "max_nonfinite_steps"):
            check_at_least("train", key, getattr(self, key), 1)
        for key in ("max_steps", "warmup_steps", "ref_batch_size", "checkpoint_every",
                    "decay_start_epoch", "plateau_patience", "eval_every", "timing_warmup_steps", "track_memory_step"):
            check_at_least("train", key, getattr(self, key), 0)
        check_choice("train", "lr_scaling", self.lr_scaling, ("none", "linear", "sqrt"))
        check_choice("train", "optimizer", self.optimizer, ("sgd", "adam"))
        check_choice("train", "convention", self.convention, ("sum_over_time", "mean_over_tokens"))
        check_choice("train", "schedule", self.schedule, ("step", "plateau", "constant"))
        check_choice("train", "dtype", self.dtype, ("float32", "float64"))
        check_choice("train", "precision", self.precision, ("fp32", "bf16", "fp16"))
        if self.precision != "fp32" and self.dtype != "float32":
            raise UsageError(f"train.precision = {self.precision!r} keeps float32 master weights; set "
                             f"train.dtype = \"float32\" (or train.precision = \"fp32\" for {self.dtype})")
        check_choice("train", "on_nonfinite", self.on_nonfinite, ("skip", "stop"))
        check_at_least("train", "lr", self.lr, 0, strict=True)
        for key in ("momentum", "weight_decay", "clip"):
            check_at_least("train", key, getattr(self, key), 0)
        if not 0 < self.decay <= 1:
            raise UsageError(f"train.decay = {self.decay!r} is out of range; use a value in (0, 1]")
        check_at_least("train", "timeout_s", self.timeout_s, 0, strict=True)
        if self.batch_size % self.accumulation:
            raise UsageError(
                f"train.batch_size {self.batch_size} is not divisible by train.accumulation "
                f"{self.accumulation}; use a multiple of {self.accumulation}"
            )


def _default_section(name: str) -> Any:
    from . import tasks

    cls = tasks.config_sections(tasks.DEFAULT).get(name)
    return cls() if cls is not None else {}


@dataclass(frozen=True, kw_only=True)
class Config:
    """A whole run: ``task``, ``data``, ``model``, ``train``, ``dist``; ``name`` labels run dirs.
    ``data`` and ``model`` are the task's sections (its dataclasses, or dicts)."""

    name: str = "run"
    task: TaskConfig = field(default_factory=TaskConfig)
    data: Any = field(default_factory=lambda: _default_section("data"))
    model: Any = field(default_factory=lambda: _default_section("model"))
    train: TrainConfig = field(default_factory=TrainConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    placement: tuple[tuple[str, str], ...] = ()  # [placement] module pattern -> device (model parallel)

    @property
    def world_size(self) -> int:
        """Data-parallel ranks (workers; parameter servers are not counted)."""
        return self.dist.nproc * self.dist.nnodes

    def task_section(self) -> dict[str, Any]:
        """What the task factory receives: the ``[task]`` options plus ``data`` and ``model``."""
        return {**dict(self.task.options), "data": self.data, "model": self.model}

    def model_value(self, key: str, default: Any = None) -> Any:
        """``[model] key`` of any task (dataclass or table)."""
        return self.model.get(key, default) if isinstance(self.model, dict) else getattr(self.model, key, default)

    def __post_init__(self) -> None:
        from .strategies import STRATEGIES

        STRATEGIES[self.dist.strategy].check_config(self)

    def check_world(self) -> None:
        """Raise UsageError if the global batch cannot be split over the ranks."""
        from .strategies import STRATEGIES

        b, k = self.train.batch_size, self.train.accumulation * max(1, self.dist.towers)
        w = STRATEGIES[self.dist.strategy].data_parallel_ranks(self.dist)
        if w > b:
            raise UsageError(
                f"{w} worker processes for a global batch of {b}; use --nproc <= {b} "
                f"or a larger train.batch_size"
            )
        if b % (w * k):
            unit = w * k
            raise UsageError(
                f"global batch {b} is not divisible by world_size {w} x accumulation x towers {k}; "
                f"use a multiple of {unit} for train.batch_size"
            )
        STRATEGIES[self.dist.strategy].check_global_batch(self)


SECTIONS = {"train": TrainConfig, "dist": DistConfig}
TASK_SECTIONS = ("data", "model")


def _task(raw: dict, base: Config) -> tuple[TaskConfig, dict]:
    """The ``[task]`` table on top of ``base.task`` and the task's section dataclasses."""
    from . import tasks

    table = dict(section_table("task", raw.get("task", {})))
    entry = table.pop("entry", base.task.entry)
    if not isinstance(entry, str) or not entry:
        raise UsageError(f"task.entry = {entry!r} must be a task name, module:factory or path/to/file.py:factory")
    options = dict(base.task.options) if entry == base.task.entry else {}
    options.update(table)
    return TaskConfig(entry=entry, options=tuple(sorted(options.items()))), tasks.config_sections(entry)


def from_dict(raw: dict[str, Any], base: Config | None = None) -> Config:
    """Build a Config from nested dicts (TOML tables), on top of ``base``.

    Raises UsageError for unknown sections or keys, wrong types and bad values, and for a
    task entry that cannot be resolved.
    """
    base = base or Config()
    known = [*SECTIONS, "task", *TASK_SECTIONS, "name", "placement"]
    for sec in raw:
        if sec not in known:
            raise UsageError(f"unknown config section {sec!r}{key_hint(sec, known)}")
    task, schemas = _task(raw, base)
    kwargs: dict[str, Any] = {"task": task}
    same_task = task.entry == base.task.entry
    for sec in TASK_SECTIONS:
        start = getattr(base, sec) if same_task else (schemas[sec]() if sec in schemas else {})
        kwargs[sec] = update_section(sec, start, section_table(sec, raw.get(sec, {})))
    for sec, value in raw.items():
        if sec == "placement":
            if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
                raise UsageError('config section [placement] must map module patterns to device strings, '
                                 'e.g. "rnn.layers.1" = "cuda:1"')
            kwargs["placement"] = tuple(sorted(value.items()))
        elif sec == "name":
            if not isinstance(value, str) or not value:
                raise UsageError(f"name = {value!r} must be a non-empty string")
            kwargs["name"] = value
        elif sec in SECTIONS:
            kwargs[sec] = update_section(sec, getattr(base, sec), section_table(sec, value))
    return replace(base, **kwargs)


def parse_override(text: str) -> tuple[str, str, Any]:
    """Parse ``section.key=value``; the value is read as a TOML literal, else a string."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise UsageError(f"--set {text!r} is malformed; write --set section.key=value, e.g. --set train.lr=0.5")
    lhs, rhs = text.split("=", 1)
    sec, key = lhs.strip().split(".", 1)
    try:
        value = tomllib.loads(f"v = {rhs.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = rhs.strip()
    return sec, key, value


def load(path: str | Path | None, overrides: list[str] = (), extra: dict | None = None) -> Config:
    """Load a TOML recipe, apply ``extra`` (nested dict, e.g. from CLI flags) and ``--set`` overrides.

    Raises UsageError for a missing or malformed file and for any bad key or value.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise UsageError(f"config file {str(p)!r} does not exist; "
                             f"give the path of a TOML recipe such as configs/ptb_small.toml")
        try:
            raw = tomllib.loads(p.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            raise UsageError(f"config file {str(p)!r} is not UTF-8 text; give a TOML recipe") from None
        except tomllib.TOMLDecodeError as e:
            raise UsageError(f"config file {str(p)!r} is not valid TOML: {e}") from None
        raw.setdefault("name", p.stem)
    merged = _merge(raw, extra or {})
    for text in overrides:
        sec, key, value = parse_override(text)
        merged = _merge(merged, {sec: {key: value}})
    return from_dict(merged)


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def to_dict(cfg: Config) -> dict[str, Any]:
    """The config as nested dicts (the TOML tables)."""
    out: dict[str, Any] = {"name": cfg.name, "task": {"entry": cfg.task.entry, **dict(cfg.task.options)}}
    for sec in (*TASK_SECTIONS, *SECTIONS):
        value = getattr(cfg, sec)
        out[sec] = dict(value) if isinstance(value, dict) else dataclasses.asdict(value)
    out["placement"] = dict(cfg.placement)
    return out


def to_toml(cfg: Config) -> str:
    """Serialise a Config as TOML (scalars only), loadable by :func:`load`."""
    d = to_dict(cfg)
    placement = d.pop("placement")
    lines = [f"name = {_toml_value(d.pop('name'))}"]
    for sec, values in d.items():
        lines.append(f"\n[{sec}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in values.items()]
    if placement:
        lines.append("\n[placement]")
        lines += [f"{_toml_value(k)} = {_toml_value(v)}" for k, v in placement.items()]
    return "\n".join(lines) + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    import json

    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"

    return json.dumps(str(v))
