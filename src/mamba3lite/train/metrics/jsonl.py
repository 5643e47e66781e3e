"""RUN/metrics.jsonl, the source of truth of a run: its row format, its writer and its reader.

One JSON object per line (`rundir.METRICS_NAME`): `kind` is "train", "eval" or "event"; every row has
`step` and `time` (unix seconds), train and eval rows `tokens` (cumulative tokens seen). After a resume
or a rollback to step S, rows of the abandoned timeline (step > S, written before) carry
`"superseded": true`. The writer never writes null or NaN: a value it does not have is left out.

- `JsonlSink(path)`: appends and flushes one line per row. On opening it cuts a torn last line (a
  crash mid-write leaves one without its newline, and the next row must not be glued onto it);
  `supersede_after(S)` marks the rows past S, rewriting the file atomically (`atomicfile`).
- `check_row(obj, where)`: a row's schema (the fields the logger writes, by type); `read_metrics(dir)`:
  every valid row by kind, the others counted as bad lines, never fatal (`plot`, `inspect`, the run
  record's pre-start check). Reading goes through the border reader (`intake`, kind METRICS).
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mamba3lite import intake
from mamba3lite.errors import DataError
from mamba3lite.rundir import METRICS_NAME


class JsonlSink:
    """DIR/metrics.jsonl: one JSON object per line, appended and flushed per row (the source of truth
    for `plot` and `inspect`)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _drop_torn_tail(self.path)
        self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (held open for the run)

    def write(self, row: dict) -> None:
        self._f.write(json.dumps(row, allow_nan=False, default=_json_default) + "\n")
        self._f.flush()

    def supersede_after(self, step: int) -> int:
        """Mark every row with step > `step` as superseded (an abandoned timeline after a resume or
        rollback to `step`); the file is rewritten atomically. Returns how many rows were marked."""
        from mamba3lite.atomicfile import atomic_write_bytes  # numpy: not for readers of the log

        self._f.close()
        # Through the border reader: a line of damaged bytes, a 5,000-digit number or deep nesting is a
        # bad line (dropped, like a torn last line from a crash), never a ValueError or RecursionError.
        lines = list(intake.iter_jsonl(self.path, intake.METRICS)) if self.path.exists() else []
        out, marked = [], 0
        for line in lines:
            row = line.value
            if line.problem is not None or not isinstance(row, dict) or not isinstance(row.get("step"), int):
                continue
            if row["step"] > step and not row.get("superseded"):
                row["superseded"] = True
                marked += 1
            out.append(json.dumps(row, default=_json_default))
        atomic_write_bytes(self.path, ("\n".join(out) + "\n" if out else "").encode("utf-8"))
        self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        return marked

    def close(self) -> None:
        self._f.close()


def _drop_torn_tail(path: Path) -> None:
    """Cut a last line that a crash left without its newline, so the next row is not glued onto it
    (which would make both unreadable). Complete rows are never touched."""
    if not path.exists():
        return
    size = intake.regular_file_size(path, intake.METRICS)  # a link to /dev/zero is never read
    with open(path, "rb+") as f:
        # Only the tail is read (a log of a long run is large): back from the end to the last newline.
        end, chunk = size, 1 << 16
        while end > 0:
            f.seek(max(end - chunk, 0))
            block = f.read(end - max(end - chunk, 0))
            if end == size and block.endswith(b"\n"):
                return  # the last line is whole
            if (i := block.rfind(b"\n")) >= 0:
                end = max(end - chunk, 0) + i + 1
                break
            end = max(end - chunk, 0)
        f.truncate(end)
        f.flush()
        os.fsync(f.fileno())


def _json_default(x: Any) -> Any:
    if hasattr(x, "item"):
        return x.item()
    return str(x)


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
    "data_wait", "peak_mem_mb", "val_loss", "val_ppl", "val_bpb",
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
        raise _missing_log(Path(run_dir))
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


def _missing_log(where: Path) -> DataError:
    """The error for a run directory (or path) without a metrics log, naming what `where` is."""
    if where.is_dir():
        return DataError(
            f"no {METRICS_NAME} in {where}: is it a run directory (the --checkpoint-dir of "
            "`mamba3lite train`)?"
        )
    if where.exists():  # a pipe, a device: named for what it is
        return DataError(f"{where} is {intake.describe_mode(where.stat().st_mode)}, not a run directory")
    return DataError(f"run directory not found: {where}")
