"""The clock of a run with a time budget (`training.time_budget_minutes`): the share of it spent.

The budget is training time: the steps of `train()`'s loop with its periodic evaluations and checkpoints
(time a run cannot train in, but spends); building, loading and resuming are not counted. The learning
rate follows the share spent (schedule.py), so the schedule ends when the time does, however fast or
slow the steps were. A checkpoint records the position, `RunState.clock` = {"budget_s", "spent_s",
"progress"}, and a resumed run continues from it:

    progress(t) = start + (1 - start) * t / (budget_s - spent_s)        t: seconds of this run's loop
    start       = the recorded progress, when the run stopped before the end of its schedule;
                  spent_s / budget_s, when it had finished it and is given a longer budget (a warm
                  restart of the schedule, as raising max_steps is for a run of steps)

With the budget the record was written under this is (spent_s + t) / budget_s: the run as it would
have gone on without the stop. With another budget, the rest of the schedule is spread over what
remains of the new one, so the learning rate does not jump; the quickstart continues a stopped run
over its new minutes that way. A rollback (nonfinite.py) does not give time back: the clock runs on.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from mamba3lite.errors import CheckpointError


def resume_start(record: dict | None, budget_s: float) -> tuple[float, float]:
    """(start progress, seconds spent before this run) for `budget_s` from a checkpoint's clock record
    (None: a fresh run, or one that trained by steps: its schedule starts at 0)."""
    if record is None:
        return 0.0, 0.0
    spent, progress = record.get("spent_s"), record.get("progress")
    if not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in (spent, progress)):
        raise CheckpointError(
            f"the checkpoint's clock record {record} has no valid spent_s and progress (numbers >= 0); "
            "the meta file was edited or damaged: resume from another step (--resume N)"
        )
    if progress < 1.0:
        return float(progress), float(spent)
    return min(1.0, spent / budget_s), float(spent)


def progress_at(t_s: float, *, start: float, spent_s: float, budget_s: float) -> float:
    """The share of the budget spent after `t_s` seconds of this run (see the module docstring), in
    [0, 1]; 1 when nothing of `budget_s` is left after `spent_s`."""
    left = budget_s - spent_s
    if left <= 0 or start >= 1.0:
        return 1.0
    return min(1.0, start + (1.0 - start) * t_s / left)


class TrainClock:
    """The run's time budget as a stateful part: `start()` when the loop begins, `progress()` in [0, 1],
    `state_dict()` the checkpoint's record, `load_state_dict(record)` the resume. `now`: the clock
    (seconds; time.monotonic), injected by the tests to play slow and fast machines without sleeping."""

    def __init__(self, budget_s: float, now: Callable[[], float] = time.monotonic) -> None:
        assert budget_s > 0, budget_s
        self.budget_s, self.now = float(budget_s), now
        self.start_progress, self.spent_before_s = 0.0, 0.0
        self._t0: float | None = None

    def load_state_dict(self, record: dict | None) -> None:
        self.start_progress, self.spent_before_s = resume_start(record, self.budget_s)

    def start(self) -> None:
        """This run's training time starts now."""
        self._t0 = self.now()

    @property
    def run_s(self) -> float:
        """Seconds of this run's training so far (0 before `start`)."""
        return 0.0 if self._t0 is None else max(0.0, self.now() - self._t0)

    def progress(self, run_s: float | None = None) -> float:
        """The share spent now (or after `run_s` seconds of this run)."""
        t = self.run_s if run_s is None else run_s
        return progress_at(t, start=self.start_progress, spent_s=self.spent_before_s, budget_s=self.budget_s)

    def state_dict(self) -> dict:
        """The checkpoint's record (`RunState.clock`): the budget, the seconds spent, the share."""
        t = self.run_s  # one reading of the clock for both
        return {"budget_s": self.budget_s, "spent_s": self.spent_before_s + t, "progress": self.progress(t)}
