"""Metric sinks of rank 0: JSON-lines file, TensorBoard scalars, progress bar, summary.

Each JSON line is one record with a ``kind`` (``train``, ``valid``, ``test``,
``summary``) and numbers with units in their names: ``words_per_s``,
``time_s``; ``loss`` is mean cross-entropy per token (nats), ``ppl`` = exp(loss).
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any


def perplexity(loss: float) -> float:
    """exp(mean cross-entropy in nats); inf on overflow."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


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


def format_summary(rows: list[tuple[str, Any]]) -> str:
    """A boxed two-column summary table."""
    cells = [(k, f"{v:,.2f}" if isinstance(v, float) else str(v)) for k, v in rows]
    w1 = max(len(k) for k, _ in cells)
    w2 = max(len(v) for _, v in cells)
    line = "+" + "-" * (w1 + 2) + "+" + "-" * (w2 + 2) + "+"
    body = [f"| {k:<{w1}} | {v:>{w2}} |" for k, v in cells]
    return "\n".join([line, *body, line])
