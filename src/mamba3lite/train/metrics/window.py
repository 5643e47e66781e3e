"""The window: the optimizer steps between two train rows, and the row that averages them.

Pure arithmetic (STYLE rule 12): `Window.add` records one step; `window_row(window, now, ...)` is the
train row when the window closes at clock time `now`:

    loss          mean of the window's step losses (steps whose every micro-step was skipped excluded)
    ppl           exp(window mean loss): exp after averaging (Jensen: <= the mean of per-step ppls)
    lr            the learning rate of the window's last step
    grad_norm     mean pre-clip global gradient norm over the window (grad_norm_max: its max)
    skipped       non-finite micro-steps skipped in the window (NaN guard)
    tokens_per_s  tokens actually processed in the window (micro-batch × seq × accumulation × world,
                  per step, skipped micro-steps included: they ran) / the window's wall time
    data_wait     the fraction of the window's wall time the training thread waited for its input
                  (0: the prefetcher always had the next step ready; with prefetch_batches 0, the time
                  spent reading the batches)
    window_steps, window_seconds   what the averages are over
    mfu           model FLOPs/token × tokens_per_s / peak FLOP/s (`mfu`; when the peak is known)
    peak_mem_mb   as measured by the caller (`memory.peak_memory_mb`)
    warmup_window true for the first window after start/resume/rollback: it includes start-up costs
                  (compile, data open, checkpoint load); only then present

A value the window does not have (no loss, no peak) is left out of the row, never written as null.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Window:
    """The steps since the last train row: what the row averages."""

    t0: float  # when the window started (clock seconds; moved forward by excluded time)
    warmup: bool  # the first window after a start, resume or rollback: start-up costs inside
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    tokens: int = 0  # processed in the window
    skipped: int = 0  # micro-steps skipped in the window
    steps: int = 0
    lr: float = float("nan")  # of the last step
    last_step: int | None = None
    tokens_total: int = 0  # cumulative, at the last step
    data_wait_s: float = 0.0  # seconds the training thread waited for input in the window

    def add(
        self,
        step: int,
        *,
        loss: float | None,
        lr: float,
        grad_norm: float | None,
        tokens_processed: int,
        tokens_total: int,
        skipped: int,
        data_wait_s: float = 0.0,
    ) -> None:
        """Record optimizer step `step` (loss None: every micro-step of it was skipped); `data_wait_s`:
        the seconds waited for its input (and for that of the abandoned steps before it)."""
        if loss is not None:
            assert math.isfinite(loss), "non-finite losses are skipped before they reach the logger"
            self.losses.append(float(loss))
        if grad_norm is not None and math.isfinite(grad_norm):
            self.grad_norms.append(float(grad_norm))
        self.tokens += int(tokens_processed)
        self.skipped += int(skipped)
        self.steps += 1
        self.lr = float(lr)
        self.last_step = step
        self.tokens_total = int(tokens_total)
        self.data_wait_s += max(0.0, float(data_wait_s))


def mfu(flops_per_token: float | None, tokens_per_s: float, peak_flops_per_s: float | None) -> float | None:
    """Model FLOPs utilisation: the fraction of the peak the model's FLOPs at this rate are; None
    without a FLOP count or a peak."""
    if not flops_per_token or not peak_flops_per_s:
        return None
    return flops_per_token * tokens_per_s / peak_flops_per_s


def window_row(
    w: Window,
    now: float,
    *,
    flops_per_token: float | None,
    peak_flops_per_s: float | None,
    peak_mem_mb: float | None,
) -> dict[str, Any]:
    """The train row of a non-empty window closed at `now` (see the module docstring)."""
    assert w.steps > 0, "an empty window has no row"
    elapsed = max(now - w.t0, 1e-9)
    tps = w.tokens / elapsed
    avg = sum(w.losses) / len(w.losses) if w.losses else None
    row: dict[str, Any] = {
        "kind": "train",
        "step": w.last_step,
        "time": now,
        "tokens": w.tokens_total,
        "loss": avg,
        "ppl": math.exp(min(avg, 700.0)) if avg is not None else None,
        "lr": w.lr,
        "grad_norm": sum(w.grad_norms) / len(w.grad_norms) if w.grad_norms else None,
        "grad_norm_max": max(w.grad_norms) if w.grad_norms else None,
        "tokens_per_s": tps,
        "data_wait": min(1.0, w.data_wait_s / elapsed),
        "window_steps": w.steps,
        "window_seconds": elapsed,
        "skipped": w.skipped,
        "mfu": mfu(flops_per_token, tps, peak_flops_per_s),
        "peak_mem_mb": peak_mem_mb,
    }
    if w.warmup:
        row["warmup_window"] = True
    return {k: v for k, v in row.items() if v is not None}
