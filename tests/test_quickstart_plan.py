"""The quickstart's planning, as pure functions: the training time left after calibration, the steps
expected in it (the cadence), the run's settings, the budget of a continued run, the split evaluated."""

from __future__ import annotations

import pytest

from mamba3lite.quickstart.budget import (
    MIN_TRAIN_S,
    PERIODIC_EVALS,
    STEP_CAP,
    Budget,
    Calibration,
    Plan,
    checkpoint_s,
    expected_steps,
    run_settings,
    training_minutes,
)
from mamba3lite.quickstart.dataset import eval_split
from mamba3lite.train.clock import progress_at, resume_start


def test_expected_steps_fill_the_time_and_are_at_least_one():
    assert expected_steps(0.5, 100.0) == Plan(200, 0.5)
    assert expected_steps(1.0, 0.0).n_steps == 1 and expected_steps(1.0, -50.0).n_steps == 1


def _cal(**kw) -> Calibration:
    return Calibration(**{"step_s": 1.0, "eval_s": 2.0, "sample_s": 3.0, "n_params": 0, "threads": "",
                          "start_eval": {}, **kw})  # fmt: skip


def test_budget_trains_until_the_deadline_less_what_comes_after_training():
    cal = _cal(n_params=150_000_000)
    assert checkpoint_s(150_000_000) == pytest.approx(13.0)
    b = Budget.after(cal, deadline=1000.0, minutes=10)
    assert b.reserve_s == pytest.approx(2.0 + 3.0 + 5.0 + 0.03 * 600)  # the "after" evaluation, sample
    assert b.after_s == pytest.approx(1.0 + 13.0)  # the trainer's final (half) evaluation and checkpoint
    assert b.periodic_s == pytest.approx(PERIODIC_EVALS * 1.0 + 2 * 13.0)  # inside the training time
    b = Budget(deadline=200.0, reserve_s=10.0, after_s=20.0, periodic_s=30.0)
    assert b.train_s(now=100.0) == 70.0
    assert b.expected(1.0, now=100.0) == Plan(40, 1.0)  # the periodic work takes its share
    assert b.train_s(now=500.0) == MIN_TRAIN_S  # no time left: still one step's worth


def test_run_settings_train_by_the_clock_with_a_cadence_for_the_expected_steps():
    main = run_settings(100, start_step=10, log_every=50, eval_batches=8, minutes=4.5)
    assert main == {"time_budget_minutes": 4.5, "max_steps": 10 + STEP_CAP, "eval_every": 34,
                    "eval_batches": 4, "save_every": 50, "log_every": 5}  # fmt: skip
    # periodic evaluations score at least half the before/after one's batches (21 of 168 windows by 8: 11)
    assert run_settings(9, start_step=0, log_every=1, eval_batches=21, minutes=1.0)["eval_batches"] == 11
    one = run_settings(1, start_step=0, log_every=50, eval_batches=8, minutes=1.0)
    assert one["eval_every"] == 1 and one["save_every"] == 1 and one["log_every"] == 1


@pytest.mark.parametrize(
    ("record", "start", "end"),
    [
        (None, 0.0, 1.0),  # a fresh run (or one trained by steps): the whole schedule in this run's time
        ({"budget_s": 300.0, "spent_s": 120.0, "progress": 0.4}, 0.4, 1.0),  # stopped early: goes on
        ({"budget_s": 300.0, "spent_s": 300.0, "progress": 1.0}, 300 / 540, 1.0),  # done: warm restart
    ],
)
def test_a_continued_quickstart_picks_its_schedule_up_and_ends_it_at_its_own_deadline(record, start, end):
    """The minutes the quickstart gives the trainer make the recorded schedule go on from where it
    stopped and end after this run's training time (train/clock.py's rule)."""
    train_s = 240.0
    budget_s = 60.0 * training_minutes(train_s, record)
    begin, spent = resume_start(record, budget_s)
    assert progress_at(0.0, start=begin, spent_s=spent, budget_s=budget_s) == pytest.approx(start)
    assert progress_at(0.99 * train_s, start=begin, spent_s=spent, budget_s=budget_s) < end
    assert progress_at(train_s, start=begin, spent_s=spent, budget_s=budget_s) == pytest.approx(end)


def test_a_damaged_clock_record_leaves_the_refusal_to_the_trainer():
    assert training_minutes(60.0, {"spent_s": "x", "progress": 0.5}) == 1.0


class _Manifest:
    def __init__(self, val_tokens: int) -> None:
        self.val_tokens = val_tokens

    def n_tokens(self, split: str) -> int:
        return self.val_tokens if split == "val" else 10**6


def test_eval_split_needs_more_than_one_window_of_val_tokens():
    assert eval_split(_Manifest(33), max_seq_len=32) == "val"
    assert eval_split(_Manifest(32), max_seq_len=32) == "train"
