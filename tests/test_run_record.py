"""The run record (train/run_record.py) and the shared data rules (data/splits.py, train/data.py)."""

from __future__ import annotations

import hashlib
import json

import pytest

from mamba3lite.config import Config
from mamba3lite.data.splits import dataset_dir, short_val_split, val_split_holds_window
from mamba3lite.errors import DataError
from mamba3lite.train.data import check_fits_global_batch
from mamba3lite.train.run_record import manifest_sha256, read_run_record, write_run_records


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


def test_run_json_appends_starts_and_replaces_a_foreign_file(tmp_path):
    cfg = Config().replace("data", dummy=True).replace("training", checkpoint_dir=str(tmp_path))
    (tmp_path / "run.json").write_text("[1, 2]")  # valid JSON, not ours
    assert read_run_record(tmp_path / "run.json") == {}
    version = write_run_records(cfg, tmp_path, {"world_size": 1, "resume": "latest", "device": "cpu"}, None)
    write_run_records(cfg, tmp_path, {"world_size": 2, "resume": 4, "device": "cpu"}, None)
    info = json.loads((tmp_path / "run.json").read_text())
    assert info["dummy"] is True and info["data_path"] is None and info["code_version"] == version
    assert [s["world_size"] for s in info["starts"]] == [1, 2] and info["starts"][1]["resume"] == 4
    assert (tmp_path / "config.yaml").is_file()
