"""The quickstart's planning, as pure functions and one small timer object: steps for a budget, the
budget left after calibration, warmup and probe, the run's cadence, the split evaluated."""

from __future__ import annotations

import time

import pytest

from mamba3lite.quickstart.budget import (
    PERIODIC_EVALS,
    PLAN_FRACTION,
    Budget,
    BudgetTimer,
    Calibration,
    Plan,
    checkpoint_s,
    plan_steps,
    probe_steps,
    run_settings,
    warmup_for,
)
from mamba3lite.quickstart.dataset import eval_split


def test_plan_steps_plans_for_plan_fraction_of_the_budget_and_at_least_one_step():
    assert plan_steps(0.5, 100.0) == Plan(int(PLAN_FRACTION * 200), 0.5)
    assert plan_steps(2.0, 10.0).n_steps == int(PLAN_FRACTION * 5)
    assert plan_steps(1.0, 0.0).n_steps == 1 and plan_steps(1.0, -50.0).n_steps == 1  # no time: one step


def _cal(**kw) -> Calibration:
    return Calibration(**{"step_s": 1.0, "eval_s": 2.0, "sample_s": 3.0, "n_params": 0, "threads": "",
                          "start_eval": {}, **kw})  # fmt: skip


def test_budget_reserves_the_end_and_pays_for_evaluations_and_checkpoints():
    cal = _cal(n_params=150_000_000)
    assert checkpoint_s(150_000_000) == pytest.approx(13.0)
    b = Budget.after(cal, deadline=1000.0, minutes=10)
    assert b.reserve_s == pytest.approx(2.0 + 3.0 + 5.0 + 0.03 * 600)
    assert b.overhead_s == pytest.approx(PERIODIC_EVALS * 1.0 + 3 * 13.0)
    now = time.monotonic()
    b = Budget(deadline=now + 100.0, reserve_s=10.0, overhead_s=20.0)
    assert 89.0 < b.stop_in_s() <= 90.0
    # 70 s left for steps at 1 s/step, planned for PLAN_FRACTION of it (minus the time this line takes).
    assert int(PLAN_FRACTION * 69) <= b.steps_for(1.0).n_steps <= int(PLAN_FRACTION * 70)
    assert Budget(deadline=now - 5.0, reserve_s=1.0, overhead_s=0.0).stop_in_s() == 0.0


def test_warmup_and_probe():
    assert warmup_for(100, warmup_steps=50, start_step=0) == 20  # a fifth of a fresh run's plan
    assert warmup_for(3, warmup_steps=50, start_step=0) == 1
    assert warmup_for(100, warmup_steps=50, start_step=7) == 50  # a resumed run keeps the config's
    assert probe_steps(warmup=4, start_step=0, n_steps=16) == 4
    assert probe_steps(warmup=4, start_step=0, n_steps=15) == 0  # too short to be worth a probe
    assert probe_steps(warmup=4, start_step=3, n_steps=1000) == 0  # no probe when resuming


def test_run_settings_cadence():
    main = run_settings(100, probe=False, start_step=10, warmup=5, log_every=50, eval_batches=8)
    assert main == {"max_steps": 110, "warmup_steps": 5, "eval_every": 34, "eval_batches": 4,
                    "save_every": 50, "log_every": 5}  # fmt: skip
    probe = run_settings(100, probe=True, start_step=0, warmup=5, log_every=50, eval_batches=1)
    assert probe["eval_every"] == 0 and probe["log_every"] == 1 and probe["eval_batches"] == 1
    # periodic evaluations score at least half the before/after one's batches (21 of 168 windows by 8: 11)
    assert (
        run_settings(9, probe=False, start_step=0, warmup=1, log_every=1, eval_batches=21)["eval_batches"]
        == 11
    )
    one = run_settings(1, probe=False, start_step=0, warmup=1, log_every=50, eval_batches=8)
    assert one["eval_every"] == 1 and one["save_every"] == 1 and one["log_every"] == 1


def test_budget_timer_sets_the_shared_stop_flag_once_the_budget_is_spent():
    from mamba3lite.train.stop import StopFlag

    stop = StopFlag(announce=False)
    with BudgetTimer(0.0, stop) as timer:
        deadline = time.monotonic() + 10
        while not timer.fired and time.monotonic() < deadline:
            time.sleep(0.01)
        # every trainer of the quickstart shares the flag: one started now stops after its first step
        assert timer.fired and stop.is_set() and stop.reason == "the time budget"


def test_budget_timer_cancelled_never_fires():
    from mamba3lite.train.stop import StopFlag

    stop = StopFlag(announce=False)
    with BudgetTimer(0.2, stop) as timer:
        pass
    time.sleep(0.4)
    assert not timer.fired and not stop.is_set()


class _Manifest:
    def __init__(self, val_tokens: int) -> None:
        self.val_tokens = val_tokens

    def n_tokens(self, split: str) -> int:
        return self.val_tokens if split == "val" else 10**6


def test_eval_split_needs_more_than_one_window_of_val_tokens():
    assert eval_split(_Manifest(33), max_seq_len=32) == "val"
    assert eval_split(_Manifest(32), max_seq_len=32) == "train"
