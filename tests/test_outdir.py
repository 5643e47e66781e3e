"""The one rule for "may this command write into that directory" (mamba3lite/outdir.py)."""

from __future__ import annotations

import pytest

from mamba3lite.config import RESOLVED_HEADER
from mamba3lite.errors import ConfigError
from mamba3lite.outdir import check_may_write, check_run_dir, is_run_dir


def test_new_empty_and_own_directories_may_be_written(tmp_path):
    check_run_dir(tmp_path / "new")
    (tmp_path / "empty").mkdir()
    check_run_dir(tmp_path / "empty")
    lock_only = tmp_path / "locked"
    lock_only.mkdir()
    (lock_only / ".lock").write_text("123")
    check_run_dir(lock_only)
    for name, text in (("run.json", "{}"), ("meta_step_2.json", "{}"), ("config.yaml", RESOLVED_HEADER)):
        run = tmp_path / f"run_{name}"
        run.mkdir()
        (run / name).write_text(text)
        (run / "notes.txt").write_text("x")
        assert is_run_dir(run)
        check_run_dir(run)


def test_a_directory_of_the_users_files_is_refused_naming_them(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.yaml").write_text("model: {}\n")  # the user's own config, not a run's record
    assert not is_run_dir(mine)
    with pytest.raises(ConfigError, match=r"--checkpoint-dir .*mine is not empty \(config.yaml\)"):
        check_run_dir(mine)


def test_a_file_or_broken_link_is_refused_saying_what_it_is(tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        check_run_dir(f)
    link = tmp_path / "dangling"
    link.symlink_to(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="broken symbolic link"):
        check_may_write(link, flag="--out", is_ours=lambda p: False, what="a dataset")


def test_the_run_directory_rule_knows_every_file_train_writes_by_their_one_names(tmp_path):
    # The names come from their homes (checkpoint files, rundir), not a second copy.
    from mamba3lite.rundir import METRICS_NAME, RUN_RECORD_NAME, checkpoint_files

    names = [p.name for p in checkpoint_files(tmp_path, 7).values()] + [RUN_RECORD_NAME, METRICS_NAME]
    for name in names:
        run = tmp_path / f"run_{name}"
        run.mkdir()
        (run / name).write_text("{}")
        assert is_run_dir(run), name
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "model_step_7.json").write_text("{}")  # a checkpoint kind with another kind's extension
    assert not is_run_dir(odd)
