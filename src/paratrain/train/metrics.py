"""Metric sinks of rank 0: JSON-lines file, TensorBoard scalars, progress bar, summary.

Each JSON line is one record with a ``kind`` (``train``, ``valid``, ``test``,
``summary``, ``resume``, ``nonfinite``) and numbers with units in their names:
``<unit>_per_s`` (the task's unit: ``words_per_s`` for the language models,
``samples_per_s``), ``time_s``; ``loss`` is the task's mean loss per unit (cross-entropy
per token in nats for a language model, whose records add ``ppl`` = exp(loss)).
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any


class MetricsLog:
    """Writes records to ``<run_dir>/metrics.jsonl`` and TensorBoard (``<run_dir>/tb``)."""

    def __init__(self, run_dir: Path, tensorboard: bool = True) -> None:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        self.path = Path(run_dir) / "metrics.jsonl"
        self.f = open(self.path, "a", encoding="utf-8")
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(Path(run_dir) / "tb"))

    def write(self, kind: str, step: int, **values: Any) -> None:
        rec = {"kind": kind, "step": step, "wall_time": round(time.time(), 3), **values}
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()
        if self.tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                    self.tb.add_scalar(f"{kind}/{k}", v, step)

    def close(self) -> None:
        self.f.close()
        if self.tb is not None:
            self.tb.close()


def _cell(v: Any) -> str:
    """Floats with 2 decimals, or 4 significant ones below 1 (an accuracy of 0.9933 stays readable)."""
    if not isinstance(v, float):
        return str(v)
    return f"{v:.4f}" if 0 < abs(v) < 1 else f"{v:,.2f}"


def format_summary(rows: list[tuple[str, Any]]) -> str:
    """A boxed two-column summary table."""
    cells = [(k, _cell(v)) for k, v in rows]
    w1 = max(len(k) for k, _ in cells)
    w2 = max(len(v) for _, v in cells)
    line = "+" + "-" * (w1 + 2) + "+" + "-" * (w2 + 2) + "+"
    body = [f"| {k:<{w1}} | {v:>{w2}} |" for k, v in cells]
    return "\n".join([line, *body, line])
