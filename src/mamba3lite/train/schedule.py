"""The run's learning-rate schedule and its end: by steps, or by the clock.

    StepSchedule   lr = lr_at(step) (optim.py), a pure function of the step; the run ends at max_steps
    TimeSchedule   lr = lr_at_progress(share of training.time_budget_minutes spent) (clock.py); the run
                   ends when the budget is spent (or at max_steps, a cap): steps are an outcome

`build_schedule(tc, target)` chooses once; the loop asks `lr(step)` before each step and `done(step)`
after it, and never branches on which. `record(step)` is what a checkpoint's meta says of it
(`RunState.scheduler`), `clock` the stateful part a checkpoint keeps (None for steps).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from mamba3lite.train.clock import TrainClock
from mamba3lite.train.optim import decayed_lr, lr_at

# A time schedule's warmup starts above 0 so that the first step moves (as lr_at's lr / warmup_steps):
# 1% of the peak, where a 100-step warmup starts.
WARMUP_FLOOR = 0.01


def lr_at_progress(
    progress: float,
    *,
    lr: float,
    min_lr: float,
    warmup_fraction: float,
    schedule: str = "cosine",
    decay_fraction: float = 0.2,
) -> float:
    """Learning rate at `progress` in [0, 1], the share of the time budget spent: the shapes of `lr_at`
    over time instead of steps.

    warmup: lr·max(progress / warmup_fraction, WARMUP_FLOOR) for progress < warmup_fraction;
    decay from `start` to 1, t = (progress − start)/(1 − start):
        cosine  start = warmup_fraction:  min_lr + ½(lr − min_lr)(1 + cos(π·t))
        linear  start = warmup_fraction:  min_lr + (lr − min_lr)(1 − t)
        wsd     start = max(warmup_fraction, 1 − decay_fraction): lr until start, then linear
    at 1 (the budget spent): min_lr.
    """
    assert 0.0 <= warmup_fraction < 1.0 and 0.0 < decay_fraction <= 1.0
    if progress < warmup_fraction:
        return lr * max(progress / warmup_fraction, WARMUP_FLOOR)
    if progress >= 1.0:
        return min_lr
    start = warmup_fraction
    if schedule == "wsd":
        start = max(warmup_fraction, 1.0 - decay_fraction)
        if progress < start:
            return lr
    return decayed_lr((progress - start) / (1.0 - start), lr=lr, min_lr=min_lr, schedule=schedule)


class StepSchedule:
    """The schedule of `training.max_steps` (or of `target`, a pause before it)."""

    clock = None

    def __init__(self, tc, target: int) -> None:
        self.tc, self.target = tc, target

    def lr(self, step: int) -> float:
        tc = self.tc
        return lr_at(step, lr=tc.lr, min_lr=tc.min_lr, warmup_steps=tc.warmup_steps, max_steps=tc.max_steps,
                     schedule=tc.lr_schedule, decay_fraction=tc.decay_fraction)  # fmt: skip

    def start(self) -> None:
        """The loop begins (nothing to do: a step schedule has no clock)."""

    def done(self, step: int) -> bool:
        return step >= self.target

    def goal(self, step: int) -> str:
        """Where the run goes, for its "start" event."""
        return f"step {self.target}"

    def nothing_left(self, step: int) -> str | None:
        """Why there is nothing to train (the run's end already reached), else None."""
        if step < self.tc.max_steps:
            return None
        return (
            f"the run is at step {step}, not before training.max_steps {self.tc.max_steps}: nothing to "
            "train; raise --max-steps to continue it"
        )

    def record(self, step: int) -> dict:
        """The meta's record of the schedule: its kind ("warmup_" + training.lr_schedule), the step and
        the lr of the last step taken (wsd: also its decay_fraction). Informational: the lr is a pure
        function of the step and the config, so a resume follows its own config's schedule."""
        state = {"kind": f"warmup_{self.tc.lr_schedule}", "step": step, "lr": self.lr(max(step - 1, 0))}
        if self.tc.lr_schedule == "wsd":
            state["decay_fraction"] = self.tc.decay_fraction
        return state


class TimeSchedule:
    """The schedule of `training.time_budget_minutes`: lr and end follow the share of the budget spent
    (the clock, a `TrainClock`); `target` (max_steps, or a pause before it) caps the steps."""

    def __init__(self, tc, target: int, clock: TrainClock) -> None:
        self.tc, self.target, self.clock = tc, target, clock

    def lr(self, step: int) -> float:
        tc = self.tc
        return lr_at_progress(self.clock.progress(), lr=tc.lr, min_lr=tc.min_lr,
                              warmup_fraction=tc.warmup_fraction, schedule=tc.lr_schedule,
                              decay_fraction=tc.decay_fraction)  # fmt: skip

    def start(self) -> None:
        self.clock.start()

    def done(self, step: int) -> bool:
        return step >= self.target or self.clock.progress() >= 1.0

    def goal(self, step: int) -> str:
        c = self.clock
        left_min = max(0.0, c.budget_s - c.spent_before_s) / 60.0
        return (
            f"the end of the time budget ({left_min:.2f} of {c.budget_s / 60:.2f} min left, schedule at "
            f"{c.start_progress:.0%}; max_steps {self.target} caps it)"
        )

    def nothing_left(self, step: int) -> str | None:
        if self.clock.progress() < 1.0:
            return StepSchedule(self.tc, self.target).nothing_left(step)
        return (
            f"the run has spent its time budget ({self.clock.spent_before_s / 60:.2f} of "
            f"{self.tc.time_budget_minutes:g} minutes): nothing to train; raise "
            "training.time_budget_minutes to continue it"
        )

    def record(self, step: int) -> dict:
        state = {"kind": f"warmup_{self.tc.lr_schedule}_by_time", "step": step, "lr": self.lr(step),
                 "progress": self.clock.progress()}  # fmt: skip
        if self.tc.lr_schedule == "wsd":
            state["decay_fraction"] = self.tc.decay_fraction
        return state


def build_schedule(tc, target: int, now: Callable[[], float] = time.monotonic) -> StepSchedule | TimeSchedule:
    """The run's schedule: by the clock when `tc.time_budget_minutes` is set, else by steps. `now`: the
    clock (tests inject a fake one)."""
    if tc.time_budget_minutes:
        return TimeSchedule(tc, target, TrainClock(60.0 * tc.time_budget_minutes, now))
    return StepSchedule(tc, target)
