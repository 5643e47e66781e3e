"""The quickstart's time budget: the clock is the budget.

The trainer trains for a time, not for a number of steps (`training.time_budget_minutes`,
train/schedule.py): warmup and decay follow the share of that time spent and training ends when it is
spent, however fast or slow the machine is meanwhile, so a busy spell costs steps, not the end of the
schedule. The quickstart gives it what is left of the minutes once the data, the recipe and the
calibration are done (`Budget.train_s`), less what comes after training: the trainer's final evaluation
and checkpoint (`after_s`), the "after" evaluation, the sample and the plot (`reserve_s`). What the
calibration measured (`Calibration`) sets only the cadence of the periodic evaluations and checkpoints
(`run_settings`, from the steps expected at that speed); their time is inside the training time.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

PERIODIC_EVALS = 3  # validation rows the trainer writes during the run (for the plot), each half
# the windows of the before/after evaluation
# The trainer's cap on steps: the clock ends the run long before (a step of the smallest model takes
# milliseconds; this is years of them).
STEP_CAP = 10**9
# At least this much training, even with no time left: a run of (at least) one step.
MIN_TRAIN_S = 1e-3


@dataclass(frozen=True)
class Calibration:
    """What the calibration measured on this machine, before training."""

    step_s: float  # seconds per optimizer step (see calibrate.time_steps)
    eval_s: float  # seconds for one before/after evaluation
    sample_s: float  # seconds the final sample will take
    n_params: int
    threads: str  # the thread count chosen on CPU and why, or ""
    start_eval: dict  # the "before" evaluation


@dataclass(frozen=True)
class Plan:
    """The optimizer steps expected in the training time at a measured cost per step: an estimate for
    the cadence and the plan line, not a length (the clock ends the run)."""

    n_steps: int
    s_per_step: float


def expected_steps(s_per_step: float, train_s: float) -> Plan:
    """Steps that `train_s` seconds of steps hold at `s_per_step`: at least one."""
    return Plan(max(1, int(train_s / s_per_step)), s_per_step)


def checkpoint_s(n_params: int) -> float:
    """A rough cost of writing one checkpoint: ~12 bytes/parameter (weights + AdamW moments) at 150 MB/s."""
    return 1.0 + 12 * n_params / 150e6


@dataclass(frozen=True)
class Budget:
    """The time budget once calibrated: training runs until `deadline` less `reserve_s` (the "after"
    evaluation, the sample, the plot, a margin) and `after_s` (the trainer's own final evaluation and
    checkpoint, after its clock ends); the periodic evaluations and checkpoints (`periodic_s`) are
    inside the training time."""

    deadline: float  # time.monotonic() by which the quickstart should be done
    reserve_s: float
    after_s: float
    periodic_s: float

    @classmethod
    def after(cls, cal: Calibration, deadline: float, minutes: float) -> Budget:
        reserve = cal.eval_s + cal.sample_s + 5.0 + 0.03 * 60.0 * minutes
        periodic = PERIODIC_EVALS * cal.eval_s / 2 + 2 * checkpoint_s(cal.n_params)
        return cls(deadline, reserve, cal.eval_s / 2 + checkpoint_s(cal.n_params), periodic)

    def train_s(self, now: float | None = None) -> float:
        """The training time left at `now` (default: the clock now), at least MIN_TRAIN_S."""
        now = time.monotonic() if now is None else now
        return max(MIN_TRAIN_S, self.deadline - self.reserve_s - self.after_s - now)

    def expected(self, s_per_step: float, now: float | None = None) -> Plan:
        """The steps expected in the training time left, at `s_per_step`."""
        return expected_steps(s_per_step, self.train_s(now) - self.periodic_s)


def run_settings(expected: int, *, start_step: int, log_every: int, eval_batches: int, minutes: float):
    """The training fields of a run by the clock (the fields in CONTROLLED_FIELDS and the log cadence):
    `minutes` of training (`training.time_budget_minutes`), max_steps only a cap; for the `expected`
    steps, periodic evaluations at most PERIODIC_EVALS, each half the windows of the before/after one,
    and a checkpoint halfway (and one at the end)."""
    return {
        "time_budget_minutes": minutes,
        "max_steps": start_step + STEP_CAP,
        "eval_every": max(1, math.ceil(expected / PERIODIC_EVALS)),
        "eval_batches": max(1, math.ceil(eval_batches / 2)),  # at least half, not one batch short
        "save_every": max(1, expected // 2),
        "log_every": max(1, min(log_every, expected // 20 or 1)),
    }


def training_minutes(train_s: float, recorded_clock: dict | None) -> float:
    """`training.time_budget_minutes` for `train_s` more seconds of a run whose newest checkpoint
    recorded `recorded_clock` (None: a fresh run, or one trained by steps): its seconds spent plus
    `train_s`, so that the schedule goes on from where it stopped and ends after `train_s` seconds
    (train/clock.py: the rest of the schedule over what is left of the budget; a finished schedule
    starts again part of the way, a warm restart)."""
    spent = (recorded_clock or {}).get("spent_s", 0.0)
    if not (isinstance(spent, (int, float)) and math.isfinite(spent) and spent >= 0):
        spent = 0.0  # a damaged record: the trainer's resume refuses it with its own message
    return (spent + train_s) / 60.0
