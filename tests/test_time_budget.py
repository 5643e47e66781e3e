"""Training for a time budget (training.time_budget_minutes): the schedule follows the share of the
budget spent and training ends at the deadline, whatever the speed of the steps; a resume continues the
share its checkpoint recorded.

The clock is a fake one that the steps advance (no sleeping): a machine slow at first (where the old
quickstart's probe measured its steps), one busy for a spell mid-run, one that speeds up."""

from __future__ import annotations

import itertools
import math

import pytest

from mamba3lite.checkpoint import CheckpointManager, RunState
from mamba3lite.config import Config
from mamba3lite.errors import CheckpointError, ConfigError
from mamba3lite.train.clock import TrainClock, progress_at, resume_start
from mamba3lite.train.optim import lr_at
from mamba3lite.train.schedule import WARMUP_FLOOR, lr_at_progress
from mamba3lite.train.trainer import Pretrainer
from test_trainer import metrics, tiny_config

KW = dict(lr=1.0, min_lr=0.1)


# ------------------------------------------------------------------------------- the pure functions
@pytest.mark.parametrize("schedule", ["cosine", "linear", "wsd"])
def test_lr_at_progress_is_the_step_schedule_over_the_share_of_time(schedule):
    """After warmup, lr at progress s/N with warmup_fraction W/N is lr_at's at step s of N with W
    warmup steps: the same shapes, over time instead of steps."""
    n, w = 200, 10
    by_time = [lr_at_progress(s / n, warmup_fraction=w / n, schedule=schedule, decay_fraction=0.25, **KW)
               for s in range(w, n + 1)]  # fmt: skip
    by_step = [lr_at(s, warmup_steps=w, max_steps=n, schedule=schedule, decay_fraction=0.25, **KW)
               for s in range(w, n + 1)]  # fmt: skip
    assert by_time == pytest.approx(by_step, abs=1e-12)


def test_lr_at_progress_warms_up_from_above_zero_and_ends_at_min_lr():
    at = lambda p: lr_at_progress(p, warmup_fraction=0.1, **KW)  # noqa: E731
    assert at(0.0) == WARMUP_FLOOR  # the first step moves
    assert at(0.05) == pytest.approx(0.5) and at(0.1) == 1.0
    assert at(1.0) == at(1.5) == 0.1
    values = [at(p / 100) for p in range(10, 101)]
    assert all(a >= b for a, b in itertools.pairwise(values))
    assert at(0.55) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at_progress(0.0, warmup_fraction=0.0, **KW) == 1.0  # no warmup: the peak at once


def test_progress_continues_the_recorded_share_and_spreads_the_rest_over_a_new_budget():
    # the same budget: (spent + t) / budget, the run as if never stopped
    start, spent = resume_start({"budget_s": 100.0, "spent_s": 40.0, "progress": 0.4}, 100.0)
    assert progress_at(30.0, start=start, spent_s=spent, budget_s=100.0) == pytest.approx(0.7)
    assert progress_at(60.0, start=start, spent_s=spent, budget_s=100.0) == 1.0
    # another budget: from 0.4 (no jump of the lr), the rest over what is left of it
    start, spent = resume_start({"budget_s": 100.0, "spent_s": 40.0, "progress": 0.4}, 340.0)
    assert progress_at(0.0, start=start, spent_s=spent, budget_s=340.0) == pytest.approx(0.4)
    assert progress_at(150.0, start=start, spent_s=spent, budget_s=340.0) == pytest.approx(0.7)
    assert progress_at(300.0, start=start, spent_s=spent, budget_s=340.0) == 1.0
    # a finished run given a longer budget: a warm restart at spent / budget
    start, spent = resume_start({"budget_s": 100.0, "spent_s": 100.0, "progress": 1.0}, 400.0)
    assert start == 0.25 and progress_at(150.0, start=start, spent_s=spent, budget_s=400.0) == 0.625
    # ...and given no more time: nothing left
    start, spent = resume_start({"budget_s": 100.0, "spent_s": 100.0, "progress": 1.0}, 100.0)
    assert progress_at(0.0, start=start, spent_s=spent, budget_s=100.0) == 1.0
    assert resume_start(None, 50.0) == (0.0, 0.0)  # a fresh run, or one that trained by steps
    with pytest.raises(CheckpointError, match="clock record"):
        resume_start({"budget_s": 100.0, "spent_s": float("nan"), "progress": 0.4}, 100.0)


def test_train_clock_counts_from_start_and_records_its_share():
    now = FakeClock(1000.0)
    clock = TrainClock(10.0, now)
    clock.load_state_dict({"budget_s": 10.0, "spent_s": 2.0, "progress": 0.2})
    now.t += 50.0  # before the loop (building, loading): not training time
    clock.start()
    now.t += 3.0
    assert clock.progress() == pytest.approx(0.5) and clock.run_s == 3.0
    assert clock.state_dict() == {"budget_s": 10.0, "spent_s": 5.0, "progress": pytest.approx(0.5)}


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("time_budget_minutes", -1.0, "time_budget_minutes must be in"),
        ("time_budget_minutes", float("nan"), "time_budget_minutes must be in"),
        ("time_budget_minutes", float("inf"), "time_budget_minutes must be in"),
        ("warmup_fraction", 1.0, "warmup_fraction must be in"),
    ],
)
def test_impossible_budgets_are_config_errors(field, value, message):
    with pytest.raises(ConfigError, match=message):
        Config().replace("training", **{field: value})


# ---------------------------------------------------------------------------------- the trainer
class FakeClock:
    """A clock the test moves: `now()` is `t`."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def timed_trainer(run_dir, now: FakeClock, step_s, *, minutes: float, **training) -> tuple[Pretrainer, list]:
    """A trainer whose step `i` (0-based, this run) takes `step_s(i)` seconds of `now`; the list it
    returns gets (lr, seconds at the step's start) of every step."""
    cfg = tiny_config(run_dir, time_budget_minutes=minutes, warmup_fraction=0.1, **training)
    t = Pretrainer(cfg, now=now)
    real, seen = t.train_step, []

    def step() -> bool:
        seen.append((t.schedule.lr(t.step), now.t))
        now.t += step_s(len(seen) - 1)
        return real()

    t.train_step = step
    return t, seen


PROFILES = {
    # slow at first (where the old quickstart timed its probe and planned too few steps), then 4x faster
    "slow start": lambda i: 1.2 if i < 4 else 0.3,
    # a busy spell mid-run: 5x slower for 4 steps
    "busy spell": lambda i: 1.5 if 5 <= i < 9 else 0.3,
    # a machine that speeds up step after step
    "speeds up": lambda i: max(0.16, 0.9 - 0.05 * i),
}


def steps_within(step_s, budget_s: float) -> int:
    """Steps of durations step_s(0), step_s(1), ... until one ends at or after `budget_s`."""
    n, t = 0, 0.0
    while t < budget_s:
        t, n = t + step_s(n), n + 1
    return n


@pytest.mark.parametrize("profile", list(PROFILES))
def test_a_run_uses_its_budget_and_ends_its_schedule_at_the_deadline(tmp_path, profile):
    now = FakeClock(0.0)  # from 0: the seconds add up as in steps_within
    t, seen = timed_trainer(tmp_path, now, PROFILES[profile], minutes=0.15, max_steps=10_000)
    budget_s = t.schedule.clock.budget_s
    assert budget_s == pytest.approx(9.0)
    result = t.train()
    start = seen[0][1]
    # the whole budget trained: the last step started before the deadline and ended at or after it
    assert seen[-1][1] - start < budget_s <= now.t - start
    assert result.clock["progress"] == 1.0 and result.clock["spent_s"] >= 0.9 * budget_s
    # the steps are an outcome: as many as the profile's durations take to reach the deadline
    assert result.step == len(seen) == steps_within(PROFILES[profile], budget_s) and not result.stopped
    lrs = [lr for lr, _ in seen]
    assert lrs[0] == pytest.approx(1e-2 * WARMUP_FLOOR) and max(lrs) == pytest.approx(1e-2, rel=0.05)
    # the schedule's end at the deadline: the last step's lr within a step of min_lr, and the final
    # checkpoint records min_lr at progress 1
    assert lrs[-1] - 1e-3 < 0.01 * (1e-2 - 1e-3), lrs
    meta = CheckpointManager(tmp_path).read_meta(result.step)
    assert meta["scheduler"]["lr"] == 1e-3 and meta["clock"]["progress"] == 1.0
    ends = [r for r in metrics(tmp_path) if r.get("event") == "end"]
    assert len(ends) == 1 and "the time budget is spent" in ends[0]["message"]


def test_resume_mid_budget_continues_the_schedule(tmp_path):
    """Stopped at step 6 and resumed (on a clock that reads something else entirely), the run takes
    the same learning rates and losses as one that was not stopped."""
    step_s = lambda i: 1.25  # noqa: E731  (12 steps: the 15 s of 0.25 minutes)
    full, seen_full = timed_trainer(tmp_path / "a", FakeClock(), step_s, minutes=0.25, max_steps=100)
    r_full = full.train()
    assert r_full.step == 12

    first, seen1 = timed_trainer(tmp_path / "b", FakeClock(), step_s, minutes=0.25, max_steps=100)
    r1 = first.train(until_step=6)
    assert r1.step == 6 and r1.clock["progress"] == pytest.approx(0.5)
    state = RunState.from_meta(CheckpointManager(tmp_path / "b").read_meta(6))
    assert state.clock["spent_s"] == 7.5 and state.scheduler["progress"] == 0.5
    second, seen2 = timed_trainer(tmp_path / "b", FakeClock(7_000.0), step_s, minutes=0.25, max_steps=100)
    r2 = second.train()
    assert r2.step == 12 and r2.clock["run_s"] == 7.5
    assert [lr for lr, _ in seen1 + seen2] == pytest.approx([lr for lr, _ in seen_full], rel=1e-12)
    assert [loss for _, loss in r1.history + r2.history] == pytest.approx(
        [loss for _, loss in r_full.history], rel=1e-6
    )


def test_a_finished_budget_trains_nothing_and_says_so(tmp_path):
    t, _ = timed_trainer(tmp_path, FakeClock(), lambda i: 5.0, minutes=0.25)
    assert t.train().step == 3
    again, seen = timed_trainer(tmp_path, FakeClock(), lambda i: 5.0, minutes=0.25)
    assert again.train().step == 3 and not seen
    warnings = [r["message"] for r in metrics(tmp_path) if r.get("event") == "warning"]
    assert any("spent its time budget" in w and "time_budget_minutes" in w for w in warnings), warnings


def test_max_steps_caps_a_run_by_the_clock(tmp_path):
    t, _ = timed_trainer(tmp_path, FakeClock(), lambda i: 0.1, minutes=1.0, max_steps=5)
    result = t.train()
    assert result.step == 5 and result.clock["progress"] == pytest.approx(0.5 / 60)
    ends = [r["message"] for r in metrics(tmp_path) if r.get("event") == "end"]
    assert ends == ["reached step 5"]
