"""Reading `metrics.jsonl`, the source of truth of a run.

One JSON object per line, written by the trainer's JSONL sink: `kind` is "train", "eval" or "event";
every row has `step`, `time` (unix seconds) and `tokens` (cumulative tokens seen). After a resume or a
rollback to step S, rows of the abandoned timeline (step > S, written before) carry `"superseded": true`.
"""

from __future__ import annotations

import statistics
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from mamba3lite import intake
from mamba3lite.errors import DataError

METRICS_NAME = "metrics.jsonl"


@dataclass
class RunMetrics:
    """A run's rows split by kind, superseded rows kept apart. `bad_lines`: lines that were not valid
    rows (a torn last line after a crash, damaged bytes, a field of the wrong type); `first_problem`
    says what was wrong with the first of them."""

    train: list[dict] = field(default_factory=list)
    eval: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    superseded: list[dict] = field(default_factory=list)
    bad_lines: int = 0
    first_problem: str | None = None


# The fields the trainer's logger writes, by type. The logger drops a value it does not have (never
# writes null) and refuses NaN, so a null, a string or a non-finite number in one of them is damage.
# Counts are integers below 2**63; the others are finite numbers.
_COUNTS = ("step", "tokens", "window_steps", "skipped")
_NUMBERS = (
    "time", "loss", "ppl", "lr", "grad_norm", "grad_norm_max", "tokens_per_s", "window_seconds", "mfu",
    "peak_mem_mb", "val_loss", "val_ppl", "val_bpb",
)  # fmt: skip


# Losses, norms and rates come from float32 tensors or the clock: a magnitude beyond float32's is damage
# (and would overflow the plot's axis arithmetic). Perplexities are exp(loss) and may be larger.
_FLOAT32_MAX = 3.4028234663852886e38


def check_row(obj: object, where: str) -> dict:
    """A metrics row after its schema check (intake.METRICS's DataError naming `where` and the field):
    an object with a string `kind`, an integer `step`, and the logger's fields of their types."""
    row = intake.expect(obj, {"kind": str, "step": int}, where=where, kind=intake.METRICS)
    for key in _COUNTS:
        if key in row:
            intake.expect_type(row[key], int, where=where, kind=intake.METRICS, what=key)
            if not 0 <= row[key] < 2**63 or (key == "window_steps" and row[key] < 1):
                raise intake.METRICS.fail(f"{where} is not a valid metrics row: {key} is {row[key]}")
    for key in _NUMBERS:
        if key in row:
            intake.expect_type(row[key], float, where=where, kind=intake.METRICS, what=key)
            if key not in ("ppl", "val_ppl") and abs(row[key]) > _FLOAT32_MAX:
                raise intake.METRICS.fail(f"{where} is not a valid metrics row: {key} is {row[key]:.3g}")
    return row


def metrics_path(run_dir: str | Path) -> Path:
    """`run_dir/metrics.jsonl`, or the path itself when it is a metrics file."""
    p = Path(run_dir)
    return p if p.is_file() else p / METRICS_NAME


def read_metrics(run_dir: str | Path) -> RunMetrics:
    """Parse a run's metrics.jsonl through the border reader (a regular file, capped; each line strict
    UTF-8 JSON and a valid row). A line that is not a valid row is counted, not fatal: the log is
    append-only and a crash tears its last line; the first problem is kept and warned about once."""
    path = metrics_path(run_dir)
    if not path.exists():
        where = Path(run_dir)
        if where.is_dir():
            raise DataError(
                f"no {METRICS_NAME} in {where}: is it a run directory (the --checkpoint-dir of "
                "`mamba3lite train`)?"
            )
        if where.exists():  # a pipe, a device: named for what it is
            raise DataError(f"{where} is {intake.describe_mode(where.stat().st_mode)}, not a run directory")
        raise DataError(f"run directory not found: {where}")
    out = RunMetrics()
    for line in intake.iter_jsonl(path, intake.METRICS):
        row, problem = line.value, line.problem
        if problem is None:
            try:
                row = check_row(row, f"{path} line {line.lineno}")
            except DataError as e:
                problem = str(e)
        if problem is not None:
            out.bad_lines += 1
            out.first_problem = out.first_problem or problem
            continue
        if row.get("superseded"):
            out.superseded.append(row)
        elif row.get("kind") == "train":
            out.train.append(row)
        elif row.get("kind") == "eval":
            out.eval.append(row)
        elif row.get("kind") == "event":
            out.events.append(row)
    if out.first_problem is not None:
        more = f" ({out.bad_lines} in all)" if out.bad_lines > 1 else ""
        warnings.warn(f"skipped lines that are not valid rows{more}: {out.first_problem}", stacklevel=2)
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
