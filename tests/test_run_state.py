"""RunState: the checkpoint meta's one record. Every field round-trips through a save and a load, the
meta's shape check is built from the fields, and a meta written by the code before RunState existed
(tests/data/run_v1_step2, a 2-step `train --dummy` run of that code) still loads and resumes."""

from __future__ import annotations

import dataclasses
import shutil
import typing
from pathlib import Path

import pytest
import torch

from mamba3lite.checkpoint import CheckpointManager, RunState
from mamba3lite.checkpoint.meta import _META_SCHEMA, schema_problem

OLD_RUN = Path(__file__).parent / "data" / "run_v1_step2"


def _value_for(name: str, hint) -> object:
    """A distinct, non-default JSON value of the field's type."""
    kinds = [k for k in typing.get_args(hint) or (hint,) if k is not type(None)]
    kind = kinds[0]
    values = {int: 3 + len(name), str: f"value-of-{name}", dict: {"field": name, "n": [1, 2]}}
    return {**values, list: [values[dict]]}[kind]


def test_every_field_round_trips_through_a_checkpoint(tmp_path):
    hints = typing.get_type_hints(RunState)
    values = {f.name: _value_for(f.name, hints[f.name]) for f in dataclasses.fields(RunState)}
    values["step"] = 5
    state = RunState(**values)
    model = torch.nn.Linear(2, 2)
    CheckpointManager(tmp_path).save(5, model, None, state)
    meta = CheckpointManager(tmp_path).load(5, torch.nn.Linear(2, 2))
    assert RunState.from_meta(meta) == state
    for f in dataclasses.fields(RunState):  # each field is its own key of the meta file
        assert meta[f.name] == values[f.name], f.name
    assert schema_problem(meta, tmp_path / "meta_step_5.json") is None


def test_absent_fields_are_left_out_and_take_their_default():
    meta = RunState(step=3, tokens_seen=9).to_meta()
    assert "sampler" not in meta and "imported_from" not in meta and "rng" not in meta
    assert meta["data"] is None and meta["last_eval"] is None  # written always, null included
    back = RunState.from_meta({**meta, "format": "x", "files": {}, "an_unknown_key": 1})
    assert back == RunState(step=3, tokens_seen=9)


def test_the_meta_schema_is_the_fields():
    for f in dataclasses.fields(RunState):
        assert f.name in _META_SCHEMA, f.name
    assert _META_SCHEMA["sampler"] is dict  # absent while None: never null in a file
    assert _META_SCHEMA["wandb_run_id"] == (str, type(None))
    assert schema_problem({"step": 1, "sampler": "not a dict"}, Path("m.json")) is not None


def test_a_meta_written_before_run_state_loads_and_resumes(tmp_path):
    from mamba3lite.config import load_config
    from mamba3lite.train.trainer import Pretrainer

    run = tmp_path / "run"
    shutil.copytree(OLD_RUN, run)
    meta = CheckpointManager(run).load(2)
    state = RunState.from_meta(meta)
    assert state.step == 2 and state.tokens_seen == 64 and state.sampler and state.rng
    assert state.config["model"]["d_model"] == 32 and state.imported_from is None
    cfg = load_config(str(run / "config.yaml"))
    cfg = cfg.replace("training", checkpoint_dir=str(run), max_steps=3, progress=False)
    result = Pretrainer(cfg, resume="latest").train()
    assert result.step == 3 and result.tokens_seen == 96
    new = CheckpointManager(run).read_meta(3)
    assert RunState.from_meta(new).sampler["consumed"] > state.sampler["consumed"]
    # its sampler state had no "order": the run goes on in the permutation it began with, and says so
    assert "order" not in state.sampler and RunState.from_meta(new).sampler["order"] == "pcg64-perm"


@pytest.mark.parametrize("bad", [{"tokens_seen": "64"}, {"rng": None}, {"world_size": 1.5}])
def test_a_meta_of_the_wrong_shape_is_refused(bad):
    meta = {**RunState(step=1, rng={}, world_size=1).to_meta(), **bad}
    assert schema_problem(meta, Path("meta_step_1.json")) is not None
