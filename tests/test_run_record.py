"""The run record (train/run_record.py) and the shared data rules (data/splits.py, train/data.py)."""

from __future__ import annotations

import hashlib
import json
import re

import pytest

from mamba3lite.config import Config
from mamba3lite.data.shards import dataset_dir
from mamba3lite.data.splits import short_val_split, val_split_holds_window
from mamba3lite.errors import CheckpointError, DataError
from mamba3lite.train.data import check_fits_global_batch
from mamba3lite.train.run_record import (
    manifest_sha256,
    read_run_record,
    run_records_problem,
    write_run_records,
)


def test_a_path_to_manifest_json_names_its_dataset_directory(tmp_path):
    (tmp_path / "manifest.json").write_text("{}")
    assert dataset_dir(tmp_path / "manifest.json") == tmp_path
    assert dataset_dir(tmp_path) == tmp_path
    assert dataset_dir(tmp_path / "tokens.bin") == tmp_path / "tokens.bin"


class _Manifest:
    def __init__(self, n_val: int) -> None:
        self.n_val = n_val

    def n_tokens(self, split: str) -> int:
        return self.n_val if split == "val" else 10_000


def test_the_val_split_counts_when_it_holds_one_window():
    assert not val_split_holds_window(_Manifest(16), max_seq_len=16)  # a window is 17 tokens
    assert val_split_holds_window(_Manifest(17), max_seq_len=16)
    assert "(16 tokens) is too short for one window of max_seq_len + 1 = 17" in short_val_split(16, 16)


def test_data_smaller_than_a_global_batch_is_refused():
    check_fits_global_batch(8, 8, 16)
    with pytest.raises(DataError, match=r"7 windows of 16 tokens, fewer than one global batch \(8 windows"):
        check_fits_global_batch(7, 8, 16)


def test_manifest_hash_of_a_directory_or_its_manifest_and_none_without_one(tmp_path):
    (tmp_path / "manifest.json").write_bytes(b'{"a": 1}')
    digest = hashlib.sha256(b'{"a": 1}').hexdigest()
    assert manifest_sha256(str(tmp_path)) == manifest_sha256(str(tmp_path / "manifest.json")) == digest
    assert manifest_sha256(None) is None and manifest_sha256(str(tmp_path / "none")) is None


def test_run_json_appends_starts(tmp_path):
    cfg = Config().replace("data", dummy=True).replace("training", checkpoint_dir=str(tmp_path))
    assert read_run_record(tmp_path / "run.json") == {}
    version = write_run_records(cfg, tmp_path, {"world_size": 1, "resume": "latest", "device": "cpu"}, None)
    write_run_records(cfg, tmp_path, {"world_size": 2, "resume": 4, "device": "cpu"}, None)
    info = json.loads((tmp_path / "run.json").read_text())
    assert info["dummy"] is True and info["data_path"] is None and info["code_version"] == version
    assert [s["world_size"] for s in info["starts"]] == [1, 2] and info["starts"][1]["resume"] == 4
    assert (tmp_path / "config.yaml").is_file()


@pytest.mark.parametrize(
    "content, problem",
    [
        ("[1, 2]", "its top level must be an object"),  # valid JSON, not ours
        ('{"starts": "often"}', "starts must be a list"),
        ('{"starts": [1]}', "starts[0] must be an object"),
        ('{"dummy": "yes"}', "dummy must be true or false"),
        ('{"starts": [], "x": ' + "9" * 5000 + "}", "5,000 digits"),
    ],
)
def test_a_run_json_that_is_not_ours_is_refused_and_kept(tmp_path, content, problem):
    """A damaged or foreign run.json is the user's to look at: refused (naming it), never replaced."""
    (tmp_path / "run.json").write_text(content)
    with pytest.raises(CheckpointError, match=re.escape(problem)):
        read_run_record(tmp_path / "run.json")
    assert run_records_problem(tmp_path) is not None
    assert (tmp_path / "run.json").read_text() == content


def test_metrics_rows_are_checked_before_a_start_and_a_torn_last_line_is_allowed(tmp_path):
    good = '{"kind": "train", "step": 1, "loss": 2.5}\n'
    (tmp_path / "metrics.jsonl").write_text(good + '{"kind": "train", "st')  # a crash tore the last row
    assert run_records_problem(tmp_path) is None
    (tmp_path / "metrics.jsonl").write_text(good + '{"kind": "train", "step": 2, "loss": null}\n' + good)
    problem = run_records_problem(tmp_path)
    assert problem is not None and "metrics.jsonl line 2" in problem and "loss must be a number" in problem
    (tmp_path / "metrics.jsonl").write_text(good + '{"kind": "train", "step": 2, "loss": 1}\n{"kind"\n')
    assert "line 3" in run_records_problem(tmp_path)  # a whole bad line at the end is not a torn one
