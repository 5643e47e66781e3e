"""Arithmetic over a run's metrics rows for the reports (`plot`).

The rows themselves (the metrics.jsonl format, its schema check `check_row` and its reader
`read_metrics`) live with their writer in `mamba3lite.train.metrics.jsonl`: report/ imports train/,
never the other way.
"""

from __future__ import annotations

import statistics


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
