"""RunDir (checkpoint/run_dir.py): the one reader of a run directory, and that no module has a second."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from mamba3lite.checkpoint import CheckpointManager, RunState
from mamba3lite.checkpoint.resume import plan_resume
from mamba3lite.checkpoint.run_dir import RunDir
from mamba3lite.commands.inspect import CHECKPOINT, detect_kind
from mamba3lite.config import RESOLVED_HEADER
from mamba3lite.errors import CheckpointError, ConfigError
from mamba3lite.outdir import is_run_dir
from mamba3lite.rundir import checkpoint_files

MODEL_CFG = {"d_model": 8, "n_layers": 1}  # what resumed_checkpoint hands back (any dict of the meta's)


def _saved(path: Path, steps=(2, 4)) -> RunDir:
    """A run directory with a verified checkpoint (weights, optimizer, meta) of each step."""
    ckpt = CheckpointManager(path)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in steps:
        ckpt.save(s, model, opt, RunState(step=s, config={"model": MODEL_CFG}, tokens_seen=10 * s))
    return RunDir(path)


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))


def test_an_empty_or_missing_directory_or_a_file_is_not_a_run(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "afile").write_text("x")
    for path in (empty, tmp_path / "missing", tmp_path / "afile"):
        assert not RunDir(path).is_run(), path
    with pytest.raises(CheckpointError, match=r"empty holds no checkpoints .* not a run directory"):
        RunDir(empty).check()
    with pytest.raises(CheckpointError, match=r"checkpoint directory .*missing does not exist"):
        RunDir(tmp_path / "missing").check()
    with pytest.raises(CheckpointError, match=r"afile is a file, not a checkpoint directory"):
        RunDir(tmp_path / "afile").check()


def test_a_dataset_directory_is_not_a_run(tmp_path):
    from userside_helpers import make_dataset

    ds = make_dataset(tmp_path / "ds", repeats=1)
    assert not RunDir(ds).is_run() and not is_run_dir(ds)
    with pytest.raises(CheckpointError, match="is not a run directory"):
        RunDir(ds).check()


def test_a_run_with_only_its_config_is_a_run_without_checkpoints(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(RESOLVED_HEADER + "model: {}\n")
    assert RunDir(run).is_run() and RunDir(run).steps() == []
    with pytest.raises(CheckpointError, match=r"run holds no checkpoints yet .*train first"):
        RunDir(run).check()
    # a config.yaml of the user's own (not train's resolved record) does not make a run
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.yaml").write_text("model: {}\n")
    assert not RunDir(mine).is_run()


def test_a_torn_save_is_a_step_but_never_the_chosen_one(tmp_path):
    run = _saved(tmp_path)
    # a save killed after its weights, before its meta (written last)
    checkpoint_files(tmp_path, 6)["model"].write_bytes(b"the start of the weights")
    assert run.steps() == [2, 4, 6] and run.loadable_steps() == [2, 4]
    pick = run.resolve(None)
    assert pick.step == 4 and len(pick.notes) == 1 and "meta_step_6.json is missing" in pick.notes[0]
    with pytest.raises(CheckpointError, match=r"checkpoint step 6 in .* cannot be loaded: .*meta_step_6"):
        run.resolve(6)
    assert run.resume_step("latest") == 4
    # a directory holding only the temp file of a first save is a run (what train writes), with no step
    first = tmp_path / "first"
    first.mkdir()
    (first / ".model_step_2.safetensors.abcd.tmp").write_bytes(b"x")
    assert RunDir(first).is_run() and RunDir(first).steps() == []


def test_a_corrupted_newest_step_falls_back_with_a_note_naming_the_file(tmp_path):
    run = _saved(tmp_path)
    _corrupt(checkpoint_files(tmp_path, 4)["model"])
    pick = run.resolve(None)
    assert pick.step == 2
    assert len(pick.notes) == 1 and "model_step_4.safetensors" in pick.notes[0] and "sha256" in pick.notes[0]
    assert run.resume_step("latest") == 2
    with pytest.raises(CheckpointError, match=r"step 4 .* cannot be loaded: .*sha256.*loadable steps: \[2\]"):
        run.resolve(4)
    # with every step damaged: one line naming each bad file, never a fresh start over them
    _corrupt(checkpoint_files(tmp_path, 2)["model"])
    with pytest.raises(CheckpointError, match=r"no checkpoint in .* verifies: .*model_step_2.*model_step_4"):
        run.resolve(None)
    with pytest.raises(CheckpointError, match=r"none of the checkpoints in .* verifies"):
        run.resume_step("latest")


def test_an_explicit_step_is_exactly_that_step_or_one_error_line(tmp_path):
    run = _saved(tmp_path)
    assert run.resolve(2).step == 2 and run.resolve(2).notes == []
    with pytest.raises(CheckpointError, match=r"no checkpoint of step 3 in .*; loadable steps: \[2, 4\]"):
        run.resolve(3)
    with pytest.raises(CheckpointError, match="--step must be >= 0"):
        run.resolve(-1)
    with pytest.raises(CheckpointError, match=r"no checkpoint of step 3 in .*Loadable steps: \[2, 4\]"):
        run.resume_step(3)
    assert run.resume_step(2) == 2


def test_the_weights_alone_count_for_reading_and_not_for_resuming(tmp_path):
    """A step whose optimizer file was deleted (to save space) is generate's and eval's newest step;
    training resumes from the step before it."""
    run = _saved(tmp_path)
    checkpoint_files(tmp_path, 4)["optim"].unlink()
    assert run.resolve(None).step == 4 and run.resolve(None).notes == []
    assert run.resolve(None, need_optimizer=True).step == 2
    assert run.resume_step("latest") == 2


def test_a_steps_run_state_and_meta(tmp_path):
    run = _saved(tmp_path)
    state = run.run_state(4)
    assert state == RunState(step=4, config={"model": MODEL_CFG}, tokens_seen=40)
    assert run.read_meta(4)["files"]["model"]["name"] == "model_step_4.safetensors"
    with pytest.raises(CheckpointError, match=r"meta_step_3\.json is missing"):
        run.run_state(3)


def test_a_seed_format_run_is_read_as_unverified_but_loadable(tmp_path):
    from test_checkpoint import _save_seed_format, _trained

    model, opt = _trained()
    _save_seed_format(tmp_path, 5, model, opt)
    run = RunDir(tmp_path)
    assert run.is_run() and run.check() is run
    assert run.resolve(None).step == 5 and run.resume_step("latest") == 5
    state = run.run_state(5)
    assert state.step == 5 and state.config == {} and state.sampler is None


def test_resuming_is_decided_once_the_entry_asks_plan_resume(tmp_path):
    """What `train --init-from` and the quickstart ask before the trainer (entry.resumed_checkpoint) is
    the trainer's own plan: the same step in every case, or the same refusal."""
    from mamba3lite.train.entry import resumed_checkpoint
    from userside_helpers import tiny_config

    cases = {
        "fresh": lambda p: None,
        "verified": lambda p: _saved(p),
        "newest corrupt": lambda p: (_saved(p), _corrupt(checkpoint_files(p, 4)["optim"])),
        "newest torn": lambda p: (_saved(p), checkpoint_files(p, 4)["meta"].unlink()),
        "all corrupt": lambda p: (_saved(p, (2,)), _corrupt(checkpoint_files(p, 2)["model"])),
    }
    for name, make in cases.items():
        path = tmp_path / name.replace(" ", "_")
        make(path)
        cfg = tiny_config(path)
        for resume in ("latest", "none", 2, 3):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the skipped damaged steps: tested above
                plan = plan_resume(CheckpointManager(path), resume)
            if plan.refusal is not None:
                with pytest.raises(CheckpointError) as e:
                    resumed_checkpoint(cfg, resume)
                assert str(e.value) == plan.refusal, (name, resume)
            elif plan.target < 0:
                assert resumed_checkpoint(cfg, resume) is None, (name, resume)
            else:
                assert resumed_checkpoint(cfg, resume) == (plan.target, MODEL_CFG), (name, resume)


def test_every_command_recognises_a_run_by_the_same_rule(tmp_path):
    """train's write check (outdir), inspect and RunDir agree on each kind of directory."""
    from userside_helpers import make_dataset

    kinds = {}
    kinds["checkpoints"] = _saved(tmp_path / "checkpoints").path
    for name, text in (("run.json", "{}"), ("metrics.jsonl", ""), ("config.yaml", RESOLVED_HEADER)):
        kinds[name] = tmp_path / f"only_{name}"
        kinds[name].mkdir()
        (kinds[name] / name).write_text(text)
    kinds["user config"] = tmp_path / "user"
    kinds["user config"].mkdir()
    (kinds["user config"] / "config.yaml").write_text("model: {}\n")
    kinds["official"] = tmp_path / "official"
    kinds["official"].mkdir()
    (kinds["official"] / "model.safetensors").write_bytes(b"")
    (kinds["official"] / "config.json").write_text("{}")
    kinds["odd name"] = tmp_path / "odd"
    kinds["odd name"].mkdir()
    (kinds["odd name"] / "model_step_7.json").write_text("{}")  # one kind with another's extension
    kinds["dataset"] = make_dataset(tmp_path / "ds", repeats=1)
    runs = {"checkpoints", "run.json", "metrics.jsonl", "config.yaml"}
    for name, path in kinds.items():
        expect = name in runs
        assert RunDir(path).is_run() is expect and is_run_dir(path) is expect, name
        if name == "dataset":
            continue
        if expect:
            assert detect_kind(path) == CHECKPOINT, name
        else:
            with pytest.raises(ConfigError, match="holds no checkpoint files"):
                detect_kind(path)


# The rule and the pickers live in checkpoint/ and rundir.py; every other module asks RunDir. A module
# that matched checkpoint names itself, or picked a step with the manager, would be a second rule that a
# new checkpoint format (added to the manager) silently bypasses.
_SRC = Path(__file__).resolve().parents[1] / "src" / "mamba3lite"
_RULE = re.compile(
    r"_step_\*|_step_\{|\b(finished_save|step_of|steps_in|looks_like_checkpoint_file|is_temp_file)\b"
)
_PICKER = re.compile(r"\.(latest_step|list_steps|verified_steps)\(")
# The trainer's own manager: its non-finite rollback goes back to the newest verified step it wrote.
_PICKER_ALLOWED = {"train/trainer.py"}


def test_no_module_outside_the_checkpoint_package_recognises_runs_or_picks_steps_itself():
    offenders = []
    for path in sorted(_SRC.rglob("*.py")):
        rel = path.relative_to(_SRC).as_posix()
        if rel.startswith("checkpoint/") or rel == "rundir.py":
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if _RULE.search(line) or (_PICKER.search(line) and rel not in _PICKER_ALLOWED):
                offenders.append(f"{rel}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
    # the check itself finds what it looks for
    assert _RULE.search("parent.glob('*_step_*')") and _PICKER.search(
        "ckpt.latest_step(need_optimizer=False)"
    )
