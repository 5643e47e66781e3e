"""The quickstart's compile decision: a pure function of the step times, the compile time and the time
left; and compiling the blocks keeps the model what it was (parameters, state_dict keys)."""

from __future__ import annotations

import pytest
import torch

from mamba3lite.config import load_config
from mamba3lite.model import Mamba3Transformer
from mamba3lite.quickstart.compile_choice import COMPILE_MARGIN, choose_compile, compile_blocks


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


def test_compile_blocks_keeps_the_parameters_and_state_dict():
    cfg = load_config("tiny").with_overrides(["model.vocab_size=64", "model.eos_id=0"])
    model = Mamba3Transformer(cfg.model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    compile_blocks(model)
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(before[k], after[k]) for k in before)
    # Each block is marked for compiling (the compile itself happens at its first call).
    assert all(block._compiled_call_impl is not None for block in model.layers)
