"""The quickstart's recipe: the shape rule is a pure function of what was measured, and the measured
shapes are real models of the family."""

from __future__ import annotations

import pytest

from mamba3lite.quickstart.recipe import (
    SHAPES,
    TOKENS_PER_PARAM,
    Measured,
    Shape,
    choose_shape,
    non_embedding_parameters,
    recipe_overrides,
    time_shape,
)


def _measured(*rows) -> list[Measured]:
    return [Measured(Shape(d, n), params, tps) for d, n, params, tps in rows]


def test_the_largest_shape_that_reads_enough_tokens_per_parameter_is_chosen():
    rows = _measured((128, 2, 1_000, 10.0), (256, 4, 4_000, 5.0), (384, 6, 20_000, 2.0))
    # 100 s: 1000, 125, 10 tokens per parameter x TOKENS_PER_PARAM-scaled -> the middle one fits
    train_s = TOKENS_PER_PARAM * 4_000 / 5.0 * 1.01
    shape, why = choose_shape(rows, train_s)
    assert shape == Shape(256, 4) and "256x4 is the largest" in why and "384x6" in why
    # more time: the largest fits
    assert choose_shape(rows, train_s * 100)[0] == Shape(384, 6)


def test_no_shape_fits_the_smallest_is_taken_and_said():
    rows = _measured((128, 2, 10**9, 1.0), (256, 4, 10**10, 1.0))
    shape, why = choose_shape(rows, 60.0)
    assert shape == Shape(128, 2) and "none reads" in why and "the smallest" in why


def test_shapes_grow_and_are_valid_models():
    from mamba3lite.config import load_config

    cfg = load_config("tiny", ["model.vocab_size=300", "model.eos_id=0"])
    sizes = []
    for shape in SHAPES:
        shaped = cfg.with_overrides(shape.overrides())  # validates: heads of 64 divide d_inner
        assert shaped.model.d_model == shape.d_model and shaped.model.n_layers == shape.n_layers
        sizes.append(non_embedding_parameters(shaped.model))
    assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes)


def test_time_shape_measures_a_real_step():
    from mamba3lite.config import load_config

    cfg = load_config("tiny", ["model.vocab_size=300", "model.eos_id=0", *recipe_overrides(),
                               *Shape(128, 2).overrides(), "training.max_seq_len=16",
                               "training.micro_batch_size=2"])  # fmt: skip
    assert cfg.training.optimizer == "muon"
    tps = time_shape(cfg, steps=1)
    assert 0 < tps < float("inf")


@pytest.mark.parametrize("train_s", [0.0, 1e-9])
def test_no_time_left_still_picks_a_shape(train_s):
    rows = _measured((128, 2, 1_000, 10.0))
    assert choose_shape(rows, train_s)[0] == Shape(128, 2)
