"""The quickstart's time budget: how many steps fit, and the timer that stops training when time is up.

The trainer runs to `training.max_steps`; its cosine schedule ends there, and a schedule that ends is
worth more than one cut short. So the quickstart measures what a training step costs on this machine
(`Calibration`) and sets max_steps so that training, its periodic evaluations and checkpoints, the final
evaluation, the sample and the plot fit in what is left (`Budget`, `plan_steps`). If the machine gets
slower during the run, `BudgetTimer` sets the run's stop flag when only the time for the final
evaluation, the sample and the plot is left (the step finishes, a checkpoint is written).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

# Steps are planned for 1.25x the time measured to be left: a step's cost measured in a few steps
# overestimated the run's by up to 2x on a busy machine, and ending early wastes the budget, while the
# timer's clean stop when time is up costs little: the last fifth of a cosine schedule is already near
# min_lr.
PLAN_FRACTION = 1.25
# The re-plan after the probe times the run's own first steps, which is what the rest costs: planned for
# the time left as it is, so the cosine schedule ends where the budget does (with 1.25x here, the timer
# stopped 5-minute runs at 70-85% of their schedule, its learning rate still at a fifth of the peak).
REPLAN_FRACTION = 1.0
PERIODIC_EVALS = 3  # validation rows the trainer writes during the run (for the plot), each half
# the windows of the before/after evaluation


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
    """How many optimizer steps to train, for a measured cost per step."""

    n_steps: int
    s_per_step: float


def plan_steps(measured_s_per_step: float, budget_s: float, fraction: float = PLAN_FRACTION) -> Plan:
    """Steps for `budget_s` seconds of training at `measured_s_per_step`: planned for `fraction` of the
    budget (the timer stops a run that still goes on when it is spent), and at least one step, even
    with no time left."""
    return Plan(max(1, int(fraction * budget_s / measured_s_per_step)), measured_s_per_step)


def checkpoint_s(n_params: int) -> float:
    """A rough cost of writing one checkpoint: ~12 bytes/parameter (weights + AdamW moments) at 150 MB/s."""
    return 1.0 + 12 * n_params / 150e6


@dataclass(frozen=True)
class Budget:
    """The time budget once calibrated: what remains before `deadline`, minus the final evaluation, the
    sample and the plot (`reserve_s`), pays for steps, the periodic evaluations and the checkpoints
    (`overhead_s`)."""

    deadline: float  # time.monotonic() by which the quickstart should be done
    reserve_s: float
    overhead_s: float

    @classmethod
    def after(cls, cal: Calibration, deadline: float, minutes: float) -> Budget:
        reserve = cal.eval_s + cal.sample_s + 5.0 + 0.03 * 60.0 * minutes
        return cls(deadline, reserve, PERIODIC_EVALS * cal.eval_s / 2 + 3 * checkpoint_s(cal.n_params))

    def steps_for(self, s_per_step: float, fraction: float = PLAN_FRACTION) -> Plan:
        """The plan for what is left of the budget now."""
        left = self.deadline - time.monotonic() - self.reserve_s - self.overhead_s
        return plan_steps(s_per_step, left, fraction)

    def stop_in_s(self) -> float:
        """Seconds until training must stop to leave `reserve_s`."""
        return max(0.0, self.deadline - self.reserve_s - time.monotonic())


def warmup_for(n_steps: int, warmup_steps: int, start_step: int) -> int:
    """A fresh run warms up for at most a fifth of its planned steps; a resumed one keeps the config's."""
    return min(warmup_steps, max(1, n_steps // 5)) if start_step == 0 else warmup_steps


def probe_steps(warmup: int, start_step: int, n_steps: int) -> int:
    """Steps of the probe (0: none). The throw-away trainer's steps can run slower (or faster) than the
    real run's, so a fresh run's first `warmup` steps (its learning rate there does not depend on
    max_steps) are timed to re-plan the rest, when the plan is long enough to be worth the extra
    checkpoint written and read back."""
    return warmup if start_step == 0 and n_steps >= 4 * warmup else 0


def run_settings(
    n_steps: int, *, probe: bool, start_step: int, warmup: int, log_every: int, eval_batches: int
):
    """The training fields of a run of `n_steps` more steps (the fields in CONTROLLED_FIELDS, warmup and
    log cadence): periodic evaluations at most PERIODIC_EVALS, each half the windows of the before/after
    one; a checkpoint halfway and at the end; a probe logs every step and does not evaluate."""
    return {
        "max_steps": start_step + n_steps,
        "warmup_steps": warmup,
        "eval_every": 0 if probe else max(1, math.ceil(n_steps / PERIODIC_EVALS)),
        "eval_batches": max(1, math.ceil(eval_batches / 2)),  # at least half, not one batch short
        "save_every": max(1, n_steps // 2),
        "log_every": 1 if probe else max(1, min(log_every, n_steps // 20 or 1)),
    }


class BudgetTimer:
    """Sets the quickstart's stop flag when the budget is spent (`StopFlag.request`: the trainer finishes
    its step and writes a checkpoint). Every trainer of the quickstart shares that flag, so one started
    after the timer fired stops after its first step. Its state: the flag and whether it fired."""

    REASON = "the time budget"

    def __init__(self, delay_s: float, stop) -> None:
        self.stop = stop
        self._timer = threading.Timer(delay_s, self._fire)
        self._timer.daemon = True
        self._fired = threading.Event()

    def _fire(self) -> None:
        self._fired.set()
        self.stop.request(self.REASON)

    @property
    def fired(self) -> bool:
        return self._fired.is_set()

    def __enter__(self) -> BudgetTimer:
        self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self._timer.cancel()
