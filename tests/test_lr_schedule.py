"""The learning-rate schedules (`training.lr_schedule`: cosine, linear, wsd): lr_at's values at the
boundaries of each, the config's checks, what a checkpoint records of the schedule, and a resume whose
config names another schedule (it follows the new one from the saved step, as a changed lr does)."""

from __future__ import annotations

import json
import math

import pytest

from mamba3lite.config import Config, TrainingConfig
from mamba3lite.errors import ConfigError
from mamba3lite.rundir import checkpoint_files
from mamba3lite.train.optim import lr_at
from mamba3lite.train.trainer import Pretrainer
from tiny_shapes import TINY_MODEL_SHAPE

KW = dict(lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=110)


def test_linear_decays_in_a_straight_line_from_the_end_of_warmup():
    at = lambda s: lr_at(s, schedule="linear", **KW)  # noqa: E731
    assert at(0) == pytest.approx(0.1) and at(9) == pytest.approx(1.0)  # the warmup is shared
    assert at(10) == pytest.approx(1.0)
    assert at(60) == pytest.approx(0.55)  # half way: the mean of lr and min_lr
    assert at(109) == pytest.approx(0.1 + 0.9 / 100)
    assert at(110) == pytest.approx(0.1) and at(5_000) == pytest.approx(0.1)
    steps = [at(s) - at(s + 1) for s in range(10, 110)]
    assert steps == pytest.approx([0.009] * 100)  # equal steps down


def test_wsd_holds_lr_then_decays_over_the_last_fraction():
    at = lambda s, f=0.2: lr_at(s, schedule="wsd", decay_fraction=f, **KW)  # noqa: E731
    assert at(0) == pytest.approx(0.1) and at(9) == pytest.approx(1.0)
    # the decay is the last round(0.2 * 110) = 22 steps: 88..110
    assert [at(s) for s in (10, 50, 87, 88)] == pytest.approx([1.0] * 4)
    assert at(99) == pytest.approx(0.1 + 0.9 * (1 - 11 / 22))
    assert at(109) == pytest.approx(0.1 + 0.9 / 22)
    assert at(110) == pytest.approx(0.1)
    # the whole run as decay is `linear`; a decay longer than what follows warmup starts at warmup's end
    assert [at(s, 1.0) for s in range(120)] == [lr_at(s, schedule="linear", **KW) for s in range(120)]
    assert at(10, 0.99) == pytest.approx(1.0) and at(60, 0.99) == pytest.approx(0.55)


def test_cosine_is_the_default_and_unchanged():
    assert lr_at(60, **KW) == lr_at(60, schedule="cosine", **KW)
    assert lr_at(60, **KW) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert TrainingConfig().lr_schedule == "cosine"


def test_config_checks_the_schedule_and_its_decay_fraction():
    with pytest.raises(
        ConfigError, match=r"training.lr_schedule must be one of .*got 'wds'.*did you mean.*wsd"
    ):
        TrainingConfig(lr_schedule="wds")
    for bad in (0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ConfigError, match=r"training.decay_fraction must be in \(0, 1\]"):
            TrainingConfig(decay_fraction=bad)
    cfg = Config().with_overrides(["training.lr_schedule=wsd", "training.decay_fraction=1"])
    assert (cfg.training.lr_schedule, cfg.training.decay_fraction) == ("wsd", 1.0)


def tiny(run_dir, **training) -> Config:
    cfg = Config().replace("model", vocab_size=64, eos_id=0, **TINY_MODEL_SHAPE).replace("data", dummy=True)
    base = dict(max_seq_len=16, micro_batch_size=2, gradient_accumulation_steps=1, max_steps=8,
                warmup_steps=2, lr=1e-2, min_lr=1e-3, log_every=1, save_every=1000, eval_every=0,
                dtype="fp32", device="cpu", checkpoint_dir=str(run_dir), keep_last_n=0,
                progress=False)  # fmt: skip
    return cfg.replace("training", **{**base, **training})


def rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_trainer_follows_the_schedule_and_a_resume_follows_the_configs(tmp_path):
    run = tmp_path / "run"
    Pretrainer(tiny(run, lr_schedule="wsd", decay_fraction=0.5)).train(until_step=4)
    meta = json.loads(checkpoint_files(run, 4)["meta"].read_text())
    assert meta["scheduler"] == {"kind": "warmup_wsd", "step": 4, "lr": 1e-2, "decay_fraction": 0.5}
    # resumed with another schedule: from step 4 on the lr is the new schedule's (as with a changed lr)
    Pretrainer(tiny(run, lr_schedule="linear")).train()
    lrs = {r["step"]: r["lr"] for r in rows(run) if r["kind"] == "train" and not r.get("superseded")}
    kw = dict(lr=1e-2, min_lr=1e-3, warmup_steps=2, max_steps=8)
    want = [lr_at(s, schedule="wsd", decay_fraction=0.5, **kw) for s in range(4)]
    want += [lr_at(s, schedule="linear", **kw) for s in range(4, 8)]
    assert [lrs[s] for s in range(1, 9)] == pytest.approx(want)
    assert want[3] == pytest.approx(1e-2) and want[4] != pytest.approx(1e-2)  # the change shows
    meta = json.loads(checkpoint_files(run, 8)["meta"].read_text())
    assert meta["scheduler"]["kind"] == "warmup_linear" and "decay_fraction" not in meta["scheduler"]
