"""NonFiniteGuard (train/nonfinite.py) and FaultInjector (train/faults.py): the decisions alone,
without a model (the trainer's use of them is tested in test_trainer.py and reliability/)."""

from __future__ import annotations

import math

import pytest
import torch

from mamba3lite.errors import TrainingError
from mamba3lite.train.faults import FaultInjector
from mamba3lite.train.nonfinite import OK, ROLLBACK, SKIP, NonFiniteGuard


def test_consecutive_bad_losses_skip_then_roll_back_and_a_good_one_resets():
    g = NonFiniteGuard(max_consecutive=3, max_rollbacks=2)
    assert [g.on_loss(False), g.on_loss(False)] == [SKIP, SKIP]
    assert g.on_loss(True) == OK and g.nan_streak == 0
    assert [g.on_loss(False), g.on_loss(False), g.on_loss(False)] == [SKIP, SKIP, ROLLBACK]


def test_gradient_norm_streak_is_its_own_counter():
    g = NonFiniteGuard(max_consecutive=2, max_rollbacks=2)
    assert g.on_grad_norm(False) == SKIP
    assert g.on_loss(True) == OK  # finite losses of the next step do not reset the gradient streak
    assert g.on_grad_norm(False) == ROLLBACK and g.bad_grad_streak == 2
    assert g.on_grad_norm(True) == OK and g.bad_grad_streak == 0


def test_abandoned_work_is_reported_once_with_the_next_step():
    g = NonFiniteGuard(3, 2)
    g.on_abandoned_step(skipped=2, tokens=64)
    g.on_abandoned_step(skipped=1, tokens=64)
    assert g.take_pending() == (3, 128)
    assert g.take_pending() == (0, 0)


def test_rollbacks_without_progress_are_limited_and_a_newer_save_is_progress():
    g = NonFiniteGuard(3, max_rollbacks=2)
    with pytest.raises(TrainingError, match="no checkpoint in RUN to roll back to"):
        g.check_rollback(-1, "3 consecutive non-finite losses", 5, "RUN")
    for _ in range(2):
        g.check_rollback(4, "why", 5, "RUN")
        g.on_rolled_back(4)
    with pytest.raises(TrainingError, match=r"after 2 rollback\(s\) to step 4 without progress"):
        g.check_rollback(4, "why", 5, "RUN")
    g.on_saved(4)  # the step rolled back to again: not progress
    with pytest.raises(TrainingError):
        g.check_rollback(4, "why", 5, "RUN")
    g.on_saved(6)
    g.check_rollback(6, "why", 7, "RUN")  # allowed again
    assert g.rollbacks == 2


def test_a_rollback_clears_the_streaks_and_the_pending_work():
    g = NonFiniteGuard(2, 2)
    g.on_loss(False)
    g.on_grad_norm(False)
    g.on_abandoned_step(1, 10)
    g.on_rolled_back(0)
    assert (g.nan_streak, g.bad_grad_streak, g.take_pending()) == (0, 0, (0, 0))


def test_fault_injector_spoils_the_chosen_micro_steps_on_its_own_clock():
    f = FaultInjector({1, 2})
    losses = [f.apply(torch.tensor(1.0)) for _ in range(4)]
    assert [math.isfinite(float(x)) for x in losses] == [True, False, False, True]
    assert f.micro_count == 4


def test_fault_injector_reads_the_environment(monkeypatch):
    from mamba3lite.train.faults import INJECT_ENV

    monkeypatch.setenv(INJECT_ENV, "r1@0,3")
    assert FaultInjector.from_env(rank=0).bad_micro_steps == {3}
    assert FaultInjector.from_env(rank=1).bad_micro_steps == {0, 3}


def test_the_guard_is_stateful_and_a_resumed_run_goes_on_counting_its_rollbacks():
    g = NonFiniteGuard(max_consecutive=2, max_rollbacks=3)
    g.on_rolled_back(4)
    g.on_rolled_back(4)
    state = g.state_dict()
    assert state == {"rollbacks": 2}
    resumed = NonFiniteGuard(max_consecutive=2, max_rollbacks=3)
    resumed.load_state_dict(state)
    resumed.on_rolled_back(6)
    assert resumed.rollbacks == 3
    resumed.load_state_dict({"rollbacks": None})  # a meta without the field (seed format, import)
    assert resumed.rollbacks == 0
