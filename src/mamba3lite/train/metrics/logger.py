"""TrainingLogger: one call per optimizer step, true window averages, one row fanned out to every sink.

The trainer calls `logger.log_step(step, ...)` after EVERY optimizer step; the logger adds it to the
current window (`window.py`) and, when `step % log_every == 0` (or on `flush()`), closes the window
into one "train" row (its fields: `window.py`'s docstring) and writes it to every sink. `log_eval` and
`event` write "eval" and "event" rows the same way. The sinks (`sink.Sink`) do not know each other;
which ones a run has is the builder's business (`build.py`, from `logging.sinks`), and "off" is a
sink that does nothing (`NullSink`), so nothing here asks whether a sink exists. Rank 0 only: the other
ranks use `TrainingLogger.disabled()`.

Timing: tokens/s is over the window's wall time less `exclude_time` (evaluations, saves). The first
window after a start, resume or rollback (`restart_window`) is marked `warmup_window` and left out of
`steady_tokens_per_s()`.

Differences from the seed's logger: a window averages every loss in it (the seed's held one), tokens/s
counts the tokens processed (the seed assumed a count), the first window after a start is marked, and
a W&B failure of any kind is a warning (the seed crashed on any but ImportError).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from mamba3lite.train.metrics.jsonl import JsonlSink
from mamba3lite.train.metrics.memory import peak_memory_mb
from mamba3lite.train.metrics.progress import ProgressBar
from mamba3lite.train.metrics.sink import NullSink, Sink
from mamba3lite.train.metrics.window import Window, window_row


class TrainingLogger:
    """Window accumulator + sinks. Call `log_step` after every optimizer step, `log_eval` after each
    evaluation and `event` for resume/rollback/NaN skips/stop.

    `jsonl`: the metrics.jsonl sink, written last and the one `supersede_after` rewrites; `progress`:
    the bar moved at every step (default: none shown). `wandb_run_id`: the `run_id` of the sink that
    has one (W&B), for the checkpoint (a resumed run continues its W&B run)."""

    def __init__(
        self,
        *,
        log_every: int,
        sinks: list[Sink] | None = None,
        jsonl: JsonlSink | None = None,
        flops_per_token: float | None = None,
        peak_flops_per_s: float | None = None,
        device: Any = None,
        progress: ProgressBar | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        assert log_every >= 1
        self.log_every = log_every
        self.jsonl = jsonl
        self.sinks: list[Sink] = list(sinks or []) + ([jsonl] if jsonl is not None else [])
        self.flops_per_token = flops_per_token
        self.peak_flops_per_s = peak_flops_per_s
        self.device = device
        self.progress = progress if progress is not None else ProgressBar.off()
        self.clock = clock
        self.last_row: dict | None = None
        self.wandb_run_id: str | None = next(
            (s.run_id for s in self.sinks if getattr(s, "run_id", None) is not None), None
        )
        self._steady_tokens = 0
        self._steady_seconds = 0.0
        self.restart_window()

    @classmethod
    def disabled(cls) -> TrainingLogger:
        return cls(log_every=1, sinks=[NullSink()])

    # ------------------------------------------------------------------ window state
    def restart_window(self, step: int | None = None) -> None:
        """Start a fresh window, marked as start-up (call at start, after resume and after rollback, with
        the step training continues from: the progress bar counts from there)."""
        if step is not None:
            self.progress.restart(step)
        self._window = Window(t0=self.clock(), warmup=True)

    def log_step(
        self,
        step: int,
        *,
        loss: float | None,
        lr: float,
        grad_norm: float | None,
        tokens_processed: int,
        tokens_total: int,
        skipped: int = 0,
        data_wait_s: float = 0.0,
    ) -> dict | None:
        """Record one optimizer step (`step` = steps completed). loss None: every micro-step of the step
        was skipped; `data_wait_s`: seconds the training thread waited for the step's input. Emits and
        returns the train row when the window closes, else None."""
        self._window.add(
            step,
            loss=loss,
            lr=lr,
            grad_norm=grad_norm,
            tokens_processed=tokens_processed,
            tokens_total=tokens_total,
            skipped=skipped,
            data_wait_s=data_wait_s,
        )
        self.progress.update(step, loss)
        if step % self.log_every == 0:
            return self.flush()
        return None

    def flush(self) -> dict | None:
        """Close the current window now (also used for a final partial window). None if it is empty."""
        w = self._window
        if w.steps == 0:
            return None
        now = self.clock()
        row = window_row(
            w,
            now,
            flops_per_token=self.flops_per_token,
            peak_flops_per_s=self.peak_flops_per_s,
            peak_mem_mb=peak_memory_mb(self.device),
        )
        if not w.warmup:
            self._steady_tokens += w.tokens
            self._steady_seconds += row["window_seconds"]
        self._write(row)
        self.last_row = row
        self._window = Window(t0=now, warmup=False)
        return row

    def exclude_time(self, seconds: float) -> None:
        """Leave `seconds` (an evaluation, a checkpoint save) out of the current window's wall time, so
        tokens/s measures training only."""
        self._window.t0 += max(0.0, seconds)

    def steady_tokens_per_s(self) -> float | None:
        """Tokens/s over all closed windows except start-up ones (None if there were none)."""
        return self._steady_tokens / self._steady_seconds if self._steady_seconds > 0 else None

    # ------------------------------------------------------------------ other rows
    def log_eval(self, step: int, tokens_total: int, values: dict) -> dict:
        row = {"kind": "eval", "step": step, "time": self.clock(), "tokens": tokens_total, **values}
        self._write(row)
        return row

    def event(
        self, step: int, event: str, message: str, tokens_total: int | None = None, **extra: Any
    ) -> dict:
        row = {
            "kind": "event",
            "step": step,
            "time": self.clock(),
            "event": event,
            "message": message,
            **({"tokens": tokens_total} if tokens_total is not None else {}),
            **extra,
        }
        self._write(row)
        return row

    def supersede_after(self, step: int) -> int:
        """Mark metrics rows past `step` as superseded (resume/rollback to `step`)."""
        return self.jsonl.supersede_after(step) if self.jsonl is not None else 0

    def _write(self, row: dict) -> None:
        for sink in self.sinks:
            sink.write(row)

    def close(self) -> None:
        self.progress.close()
        for sink in self.sinks:
            sink.close()
