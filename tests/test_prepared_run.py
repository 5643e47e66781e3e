"""train/entry.py's `PreparedRun`: a run checked once by `prepare_run`, that `training_session` and
`run_training` take without checking it again, and whose methods change only what the checks do not
read (or check again what they change)."""

from __future__ import annotations

import pytest
import torch

import mamba3lite.train.entry as entry
from mamba3lite.errors import ConfigError
from mamba3lite.train.entry import PreparedRun, TrainOptions, prepare_run, run_training
from userside_helpers import make_dataset, tiny_config


def test_a_prepared_run_trains_without_being_prepared_again(tmp_path, monkeypatch):
    prepared = prepare_run(tiny_config(tmp_path / "run", max_steps=1))
    assert isinstance(prepared, PreparedRun) and prepared.init_model is None
    calls = []
    monkeypatch.setattr(entry, "prepare_run", lambda *a: calls.append(a))
    result = run_training(prepared.with_training(max_steps=2, log_every=2))
    assert result.step == 2 and calls == []
    with pytest.raises(AssertionError, match="own options"):  # the options are the prepared run's own
        run_training(prepared, TrainOptions(resume="none"))


def test_with_training_changes_only_what_the_checks_do_not_read(tmp_path):
    prepared = prepare_run(tiny_config(tmp_path / "run"))
    longer = prepared.with_training(max_steps=7, eval_every=3)
    assert (longer.cfg.training.max_steps, longer.cfg.training.eval_every) == (7, 3)
    assert prepared.cfg.training.max_steps != 7  # a new object; the prepared run is unchanged
    with pytest.raises(AssertionError, match="checkpoint_dir"):  # what check_run_directory read
        prepared.with_training(checkpoint_dir=str(tmp_path / "elsewhere"))
    with pytest.raises(ConfigError, match="max_steps"):  # validated as a --set value is
        prepared.with_training(max_steps=-1)


def test_with_model_checks_the_datas_tokenizer_again(tmp_path):
    data = make_dataset(tmp_path / "data")  # GPT-2 tokens: 50,257 ids
    prepared = prepare_run(tiny_config(tmp_path / "run", data))
    assert prepared.with_model(d_state=16).cfg.model.d_state == 16
    with pytest.raises(ConfigError, match="which has 50257 tokens, and vocab_size is 300"):
        prepared.with_model(vocab_size=300, eos_id=0)


def test_in_scratch_dir_is_fresh_and_trains_a_copy_of_the_init_weights(tmp_path):
    cfg = tiny_config(tmp_path / "run")
    init = torch.nn.Linear(2, 2)
    scratch = PreparedRun(cfg, TrainOptions(), init).in_scratch_dir(tmp_path / "scratch")
    assert scratch.cfg.training.checkpoint_dir == str(tmp_path / "scratch") and scratch.opts.resume == "none"
    assert scratch.init_model is not init and torch.equal(scratch.init_model.weight, init.weight)
    with torch.no_grad():
        scratch.init_model.weight.add_(1.0)
    assert not torch.equal(scratch.init_model.weight, init.weight)
