"""plan_resume and resume_warnings (checkpoint/resume.py): the resume policy without a trainer."""

from __future__ import annotations

import warnings

import pytest
from torch import nn

from mamba3lite.checkpoint import CheckpointManager
from mamba3lite.checkpoint.resume import ResumePlan, plan_resume, resume_warnings
from mamba3lite.errors import CheckpointError
from mamba3lite.rundir import checkpoint_files


def _run_dir(tmp_path, steps=(2, 4, 6)) -> CheckpointManager:
    ckpt = CheckpointManager(tmp_path)
    model = nn.Linear(3, 2)
    for s in steps:
        ckpt.save(s, model)
    return ckpt


def test_an_empty_directory_starts_afresh(tmp_path):
    assert plan_resume(CheckpointManager(tmp_path / "new"), "latest") == ResumePlan()
    assert plan_resume(CheckpointManager(tmp_path / "new"), "none") == ResumePlan()


def test_latest_is_the_newest_verified_step(tmp_path):
    ckpt = _run_dir(tmp_path)
    checkpoint_files(tmp_path, 6)["model"].write_bytes(b"torn")
    with pytest.warns(UserWarning, match="model_step_6"):
        plan = plan_resume(ckpt, "latest")
    # 6 finished its save (its meta is there), so it is kept aside rather than deleted
    assert (plan.target, plan.refusal, plan.torn, plan.newer) == (4, None, [], [6])


def test_an_explicit_older_step_sets_newer_ones_aside_and_torn_saves_for_deletion(tmp_path):
    ckpt = _run_dir(tmp_path)
    checkpoint_files(tmp_path, 8)["model"].write_bytes(b"a save killed before its meta")
    plan = plan_resume(ckpt, 2)
    assert (plan.target, plan.refusal, plan.torn, plan.newer) == (2, None, [8], [4, 6])


def test_refusals_name_the_fix(tmp_path):
    ckpt = _run_dir(tmp_path)
    assert "use --resume latest to continue" in plan_resume(ckpt, "none").refusal
    missing = plan_resume(ckpt, 5).refusal
    assert "there is no checkpoint of step 5" in missing and "Loadable steps: [2, 4, 6]" in missing
    checkpoint_files(tmp_path, 4)["model"].write_bytes(b"torn")
    assert "checkpoint step 4 in" in plan_resume(ckpt, 4).refusal


def test_latest_over_only_damaged_checkpoints_is_refused_not_a_fresh_start(tmp_path):
    ckpt = _run_dir(tmp_path, steps=(2,))
    checkpoint_files(tmp_path, 2)["model"].write_bytes(b"torn")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_resume(ckpt, "latest")
    assert (
        plan.target == -1
        and "none of the checkpoints" in plan.refusal
        and "nothing was changed" in plan.refusal
    )


def test_latest_over_only_unfinished_saves_is_a_fresh_start(tmp_path):
    ckpt = _run_dir(tmp_path, steps=(2,))
    checkpoint_files(tmp_path, 2)["meta"].unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert plan_resume(ckpt, "latest") == ResumePlan()


RUN = {
    "model": {"d_model": 8, "n_layers": 2},
    "data": {"tokenizer": "gpt2", "vocab_hash": "aa" * 32, "manifest_sha256": "11" * 32},
    "data_path": "data/x",
    "max_seq_len": 16,
    "run_dir": "RUN",
}


def _meta(**over) -> dict:
    meta = {"step": 4, "config": {"model": dict(RUN["model"]), "training": {"max_seq_len": 16}}}
    meta["data"] = dict(RUN["data"])
    meta.update(over)
    return meta


def test_a_matching_checkpoint_has_no_warnings():
    assert resume_warnings(_meta(), RUN) == []
    assert resume_warnings({"step": 4}, RUN) == []  # a seed-format meta records none of it


def test_another_model_or_tokenizer_is_refused():
    with pytest.raises(CheckpointError, match=r"differs in model\.d_model\); use its config"):
        resume_warnings(_meta(config={"model": {"d_model": 16, "n_layers": 2}}), RUN)
    other = {**RUN["data"], "vocab_hash": "bb" * 32, "tokenizer": "other"}
    with pytest.raises(CheckpointError, match=r"trained on tokenizer other \(vocab hash bbbb"):
        resume_warnings(_meta(data=other), RUN)


def test_a_model_config_recorded_before_a_field_existed_compares_at_its_default():
    """A meta written before hybrids has no attn_layer_idx / attn_cfg: its run trained a pure model, the
    fields' defaults. A pure model resumes it; a hybrid is refused, naming the field."""
    now = {**RUN, "model": {**RUN["model"], "attn_layer_idx": [], "attn_cfg": {}}}
    assert resume_warnings(_meta(), now) == []
    hybrid = {**RUN, "model": {**RUN["model"], "attn_layer_idx": [1], "attn_cfg": {"num_heads": 2}}}
    with pytest.raises(CheckpointError, match=r"differs in model\.attn_cfg, model\.attn_layer_idx\)"):
        resume_warnings(_meta(), hybrid)


def test_changed_data_and_window_length_are_warnings():
    grown = {**RUN["data"], "manifest_sha256": "22" * 32}
    (changed,) = resume_warnings(_meta(data=grown), RUN)
    assert "the training data at data/x changed since checkpoint step 4" in changed
    config = {"model": dict(RUN["model"]), "training": {"max_seq_len": 32}}
    (longer,) = resume_warnings(_meta(config=config), RUN)
    assert "training.max_seq_len changed from 32 (checkpoint step 4) to 16" in longer


def test_a_changed_global_batch_is_refused_with_both_ways_on():
    run = {**RUN, "global_batch_windows": 8, "global_batch_explicit": False}
    assert resume_warnings(_meta(global_batch_windows=8), run) == []
    with pytest.raises(CheckpointError) as e:
        resume_warnings(_meta(global_batch_windows=32), run)
    msg = str(e.value)
    assert "global batch of 32 windows" in msg and "this run's is 8" in msg
    assert "--set training.global_batch_size=32" in msg and "--set training.global_batch_size=8" in msg


def test_an_explicitly_set_global_batch_may_change_and_is_reported():
    run = {**RUN, "global_batch_windows": 64, "global_batch_explicit": True}
    (changed,) = resume_warnings(_meta(global_batch_windows=32), run)
    assert "training.global_batch_size changed from 32 (checkpoint step 4) to 64" in changed


def test_a_checkpoint_without_a_recorded_global_batch_compares_nothing():
    run = {**RUN, "global_batch_windows": 8, "global_batch_explicit": False}
    assert resume_warnings(_meta(), run) == []  # written before the field existed
    assert resume_warnings({"step": 4}, run) == []  # seed format
