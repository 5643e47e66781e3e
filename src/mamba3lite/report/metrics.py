"""Reading `metrics.jsonl`, the source of truth of a run.

One JSON object per line, written by the trainer's JSONL sink: `kind` is "train", "eval" or "event";
every row has `step`, `time` (unix seconds) and `tokens` (cumulative tokens seen). After a resume or a
rollback to step S, rows of the abandoned timeline (step > S, written before) carry `"superseded": true`.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from mamba3lite.errors import DataError

METRICS_NAME = "metrics.jsonl"


@dataclass
class RunMetrics:
    """A run's rows split by kind, superseded rows kept apart."""

    train: list[dict] = field(default_factory=list)
    eval: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    superseded: list[dict] = field(default_factory=list)
    bad_lines: int = 0


def metrics_path(run_dir: str | Path) -> Path:
    """`run_dir/metrics.jsonl`, or the path itself when it is a metrics file."""
    p = Path(run_dir)
    return p if p.is_file() else p / METRICS_NAME


def read_metrics(run_dir: str | Path) -> RunMetrics:
    """Parse a run's metrics.jsonl. A torn last line (a crash mid-write) is counted, not fatal."""
    path = metrics_path(run_dir)
    if not path.exists():
        where = Path(run_dir)
        raise DataError(
            f"no {METRICS_NAME} in {where}: is it a run directory (the --checkpoint-dir of "
            "`mamba3lite train`)?"
            if where.is_dir()
            else f"run directory not found: {where}"
        )
    out = RunMetrics()
    # errors="replace": a line of damaged bytes is a bad line like a torn one, not a UnicodeDecodeError
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                out.bad_lines += 1
                continue
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                out.bad_lines += 1
                continue
            if row.get("superseded"):
                out.superseded.append(row)
            elif row.get("kind") == "train":
                out.train.append(row)
            elif row.get("kind") == "eval":
                out.eval.append(row)
            elif row.get("kind") == "event":
                out.events.append(row)
    return out


def ema(values: list[float], alpha: float = 0.1, steps: list[float] | None = None) -> list[float]:
    """Exponential moving average, bias-corrected so the first points are not pulled toward 0.

    `steps`: how many training steps each value averages (rows' `window_steps`). A row then weighs by
    its steps, relative to the median row, which gets `alpha`: twenty one-step rows at the start of a
    run (the quickstart's probe) count as two ten-step rows, not as twenty."""
    typical = statistics.median(steps) if steps else 1.0
    out, m, w = [], 0.0, 0.0
    for i, v in enumerate(values):
        a = alpha if steps is None else 1 - (1 - alpha) ** (steps[i] / typical)
        m = (1 - a) * m + a * v
        w = (1 - a) * w + a
        out.append(m / w)
    return out
