"""The quickstart's compile decision: a pure function of the step times, the compile time and the time
left; the plan measures only when compiling could pay, and compiles only when the measured gain does."""

from __future__ import annotations

import pytest

from mamba3lite.config import load_config
from mamba3lite.quickstart.compile_choice import (
    COMPILE_MARGIN,
    COMPILE_S_FLOOR,
    EXPECTED_SPEEDUP,
    CompileTiming,
    choose_compile,
    plan_compile,
)


def test_compile_is_chosen_only_when_the_time_saved_beats_the_compile_time():
    # 0.5 -> 0.4 s/step saves a fifth of the time left; a 20 s compile pays over 300 s (60 s saved)
    # but not over 100 s (20 s saved, under the margin).
    long = choose_compile(0.5, 0.4, 20.0, 300.0)
    assert long.compile and "compiled" in long.reason and "1.25x" in long.reason
    short = choose_compile(0.5, 0.4, 20.0, 100.0)
    assert not short.compile and short.reason.endswith("eager")


def test_the_margin_is_the_boundary():
    compile_s = 10.0
    train_s = COMPILE_MARGIN * compile_s / 0.5  # a 2x speedup saves half: exactly the margin
    assert not choose_compile(1.0, 0.5, compile_s, train_s).compile
    assert choose_compile(1.0, 0.5, compile_s, train_s * 1.01).compile


def test_a_compiled_step_no_faster_or_a_failed_compile_means_eager():
    slower = choose_compile(0.4, 0.5, 1.0, 1e6)
    assert not slower.compile and "no faster" in slower.reason
    failed = choose_compile(0.5, 0.5, float("inf"), 1e6)
    assert not failed.compile and "failed" in failed.reason


@pytest.mark.parametrize("train_s", [0.0, 1.0, 60.0, 3600.0])
def test_the_reason_is_one_line(train_s):
    assert "\n" not in choose_compile(0.5, 0.3, 30.0, train_s).reason


def _cfg(**training):
    cfg = load_config("tiny").with_overrides(["model.vocab_size=64", "model.eos_id=0"])
    return cfg.replace("training", **training) if training else cfg


def test_a_short_budget_is_eager_without_measuring():
    least = COMPILE_S_FLOOR + COMPILE_MARGIN * COMPILE_S_FLOOR / (1 - 1 / EXPECTED_SPEEDUP)

    def measure(cfg):
        raise AssertionError("a budget compiling cannot repay must not pay for a compile to find out")

    choice = plan_compile(_cfg(), least, measure=measure)
    assert not choice.compile and "cannot repay" in choice.reason
    assert not plan_compile(_cfg(), 10 * 60.0, measure=measure).compile  # a 10-minute budget neither


def test_a_long_budget_measures_and_compiles_only_when_the_gain_repays_the_compile():
    seen = []

    def measure(gain: float, compile_s: float):
        def m(cfg):
            seen.append(cfg)
            return CompileTiming(1.0, 1.0 / gain, compile_s)

        return m

    # 3600 s at 1.25x saves 720 s: repays a 300 s compile (x1.5 = 450 s), not a 600 s one (900 s)
    assert plan_compile(_cfg(), 3600.0, measure=measure(1.25, 300.0)).compile
    assert not plan_compile(_cfg(), 3600.0, measure=measure(1.25, 600.0)).compile
    assert not plan_compile(_cfg(), 3600.0, measure=measure(0.9, 1.0)).compile  # slower compiled
    assert len(seen) == 3


def test_a_config_that_asks_for_compile_keeps_it():
    choice = plan_compile(_cfg(compile=True), 1.0, measure=None)
    assert choice.compile and "training.compile" in choice.reason
