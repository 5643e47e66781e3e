"""The one record of what token ids mean (data_identity.py): its two on-disk forms load as they are
written today (old datasets and runs included), a tokenizer file edited after the fact is one clear
error, and the compatibility check names what differs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mamba3lite.checkpoint.run_state import RunState
from mamba3lite.data.shards import Manifest, write_dataset
from mamba3lite.data_identity import TOKENIZER_NAME, DataIdentity, resolve_name, vocab_hash_of
from mamba3lite.errors import CheckpointError, DataError
from mamba3lite.tokenizer import load_tokenizer

OLD_RUN = Path(__file__).parent / "data" / "run_v1_step2"


def _tokenizer_file(path: Path) -> bytes:
    """A small Hugging Face tokenizer.json at `path` (ids a=0, b=1, [UNK]=2, </s>=3); its bytes."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    t = tokenizers.Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.add_special_tokens(["</s>"])
    path.parent.mkdir(parents=True, exist_ok=True)
    t.save(str(path))
    return path.read_bytes()


def test_the_meta_form_round_trips_and_resolves_a_relative_name_against_its_root(tmp_path):
    d = {"tokenizer": TOKENIZER_NAME, "vocab_hash": "ab" * 32, "vocab_size": 4, "eos_id": 3,
         "manifest_sha256": "11" * 32}  # fmt: skip
    ident = DataIdentity.from_dict(d, tmp_path)
    assert ident.tokenizer == str(tmp_path.resolve() / TOKENIZER_NAME)
    assert ident.tokenizer_file == tmp_path.resolve() / TOKENIZER_NAME
    assert (ident.vocab_hash, ident.vocab_size, ident.eos_id) == ("ab" * 32, 4, 3)
    assert ident.to_dict() == d
    gpt2 = {"tokenizer": "gpt2", "vocab_hash": "cd" * 32, "vocab_size": 50257, "eos_id": 50256,
            "manifest_sha256": None}  # fmt: skip
    assert DataIdentity.from_dict(gpt2, tmp_path).to_dict() == gpt2
    assert DataIdentity.from_dict(gpt2, tmp_path).tokenizer_file is None
    # the rule pretrained.recorded_tokenizer and Manifest.load share
    assert resolve_name(None, tmp_path) == resolve_name("gpt2", tmp_path) == "gpt2"
    assert resolve_name("/abs/tokenizer.json", tmp_path) == "/abs/tokenizer.json"
    assert resolve_name("sub/tok.json", tmp_path) == str(tmp_path.resolve() / "sub" / "tok.json")


def test_records_of_older_runs_load_and_a_damaged_one_is_named(tmp_path):
    # the checked-in run of an older version (dummy data): no identity, not an error
    meta = json.loads((OLD_RUN / "meta_step_2.json").read_text())
    assert RunState.from_meta(meta).data_identity(OLD_RUN) is None
    assert DataIdentity.from_dict(None, OLD_RUN) is None
    # a run trained before runs kept a copy of their tokenizer recorded its absolute path, no size or EOS
    old = DataIdentity.from_dict({"tokenizer": "/data/ds/tokenizer.json", "vocab_hash": "ab" * 32}, tmp_path)
    assert old.tokenizer == "/data/ds/tokenizer.json" and old.vocab_size is None and old.eos_id is None
    with pytest.raises(CheckpointError, match=r"meta_step_9.json: data.vocab_size must be int or null"):
        bad = {"tokenizer": "gpt2", "vocab_size": "4"}
        DataIdentity.from_dict(bad, tmp_path, where="meta_step_9.json", error=CheckpointError)
    with pytest.raises(DataError, match=r"data\.eos_id must be int"):
        DataIdentity.from_dict({"tokenizer": "gpt2", "eos_id": True}, tmp_path)


def test_a_manifest_as_earlier_versions_wrote_it_loads(tmp_path):
    # a dataset prepared with a tokenizer given by its absolute path, no shards yet read: the keys as
    # manifests have always held them
    (tmp_path / "manifest.json").write_text(json.dumps({
        "format_version": 1, "vocab_size": 300, "eos_id": 0, "dtype": "uint16",
        "tokenizer": {"name": "/elsewhere/tokenizer.json", "vocab_hash": "ef" * 32}, "shards": [],
    }))  # fmt: skip
    ident = Manifest.load(tmp_path).identity
    assert ident == DataIdentity("/elsewhere/tokenizer.json", "ef" * 32, 300, 0)
    assert ident.tokenizer_file == Path("/elsewhere/tokenizer.json")


def test_a_manifest_names_its_identity_in_the_keys_it_always_had(tmp_path):
    raw = _tokenizer_file(tmp_path / "ds" / TOKENIZER_NAME)
    parts = [("train", np.array([0, 1, 3, 1, 0, 3]), 2, 8)]
    tok = {"name": TOKENIZER_NAME, "vocab_hash": vocab_hash_of(raw)}
    write_dataset(tmp_path / "ds", parts, vocab_size=4, eos_id=3, tokenizer=tok)
    on_disk = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    assert on_disk["tokenizer"] == tok and (on_disk["vocab_size"], on_disk["eos_id"]) == (4, 3)
    ident = Manifest.load(tmp_path / "ds").identity
    assert ident == DataIdentity(str((tmp_path / "ds").resolve() / TOKENIZER_NAME), vocab_hash_of(raw), 4, 3)
    # the same hash the tokenizer itself reports: the one rule for a tokenizer.json's vocabulary hash
    assert load_tokenizer(ident.tokenizer).vocab_hash == ident.vocab_hash
    # a run records it beside its copy of the file, with the manifest's hash
    assert ident.with_manifest_sha256("11" * 32).to_dict() == {
        "tokenizer": TOKENIZER_NAME, "vocab_hash": vocab_hash_of(raw), "vocab_size": 4, "eos_id": 3,
        "manifest_sha256": "11" * 32,
    }  # fmt: skip


def test_verify_catches_an_edited_or_deleted_tokenizer_file(tmp_path):
    path = tmp_path / TOKENIZER_NAME
    raw = _tokenizer_file(path)
    ident = DataIdentity(str(path), vocab_hash_of(raw), 4, 3)
    assert ident.verify(what="the model was trained on it") == raw
    assert DataIdentity("gpt2", "ab" * 32, 50257, 50256).verify(what="x") is None  # nothing on disk
    path.write_bytes(raw.replace(b'"a"', b'"c"'))  # same size, another vocabulary
    with pytest.raises(CheckpointError) as e:
        ident.verify(what="the model was trained on it", fix="put it back", error=CheckpointError)
    assert str(e.value) == (
        f"the tokenizer file {path} changed since the model was trained on it (sha256 "
        f"{vocab_hash_of(path.read_bytes())[:12]}, recorded {ident.vocab_hash[:12]}): the token ids mean "
        "nothing under another vocabulary; put it back"
    )
    path.unlink()
    with pytest.raises(DataError, match=r"tokenizer.json is not there any more \(the dataset D was"):
        ident.verify(what="the dataset D was prepared with it")


def test_a_dataset_edited_tokenizer_is_refused_when_the_manifest_is_loaded(tmp_path):
    raw = _tokenizer_file(tmp_path / "ds" / TOKENIZER_NAME)
    parts = [("train", np.array([0, 1, 3]), 1, 4)]
    tok = {"name": TOKENIZER_NAME, "vocab_hash": vocab_hash_of(raw)}
    write_dataset(tmp_path / "ds", parts, vocab_size=4, eos_id=3, tokenizer=tok)
    (tmp_path / "ds" / TOKENIZER_NAME).write_bytes(raw + b" ")
    with pytest.raises(DataError, match=r"changed since the dataset .* was prepared with it"):
        Manifest.load(tmp_path / "ds")
    Manifest.load(tmp_path / "ds", check_tokenizer=False)  # asked not to check: loads


def test_compatible_with_names_what_differs():
    data = DataIdentity("gpt2", "ab" * 32, 50257, 50256)
    data.compatible_with(DataIdentity("gpt2", "ab" * 32, 50257, 50256))
    data.compatible_with(DataIdentity("", None, 50257, 50256))  # a hash not recorded is not compared
    with pytest.raises(DataError) as e:
        data.compatible_with(DataIdentity("/t/tokenizer.json", "cd" * 32, 50257, 50256))
    assert str(e.value) == (
        "the dataset was tokenized with gpt2 (vocab hash abababababab), the model with /t/tokenizer.json "
        "(cdcdcdcdcdcd); prepare the data with the model's tokenizer "
        "(`mamba3lite prepare --tokenizer /t/tokenizer.json`)"
    )
    with pytest.raises(DataError, match=r"the val data has vocab_size 50257, the model 300: they do not"):
        data.compatible_with(DataIdentity("gpt2", None, 300, 50256), where="the val data")
    with pytest.raises(DataError) as e:
        data.compatible_with(DataIdentity("gpt2", None, 50257, 0), eos_fix=": set model.eos_id=50256")
    assert str(e.value) == "the dataset uses EOS id 50256, the model 0: set model.eos_id=50256"
