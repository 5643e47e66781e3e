"""Scenario 3: corrupted data. A truncated shard, flipped bytes, ids beyond the vocabulary, a manifest
that disagrees with the files, a manifest from another tokenizer: training refuses (or `inspect --verify`
fails) with one line naming the shard, never a traceback, and nothing is trained on the garbage."""

from __future__ import annotations

import json

import chaos_harness as H
import numpy as np

from mamba3lite.checkpoint import CheckpointManager
from mamba3lite.cli import main
from mamba3lite.data.shards import Manifest

SHARD = "train/shard_00001.bin"


def _cli(capsys, *argv) -> tuple[int, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out + out.err


def _train(capsys, tmp_path, data, *extra) -> tuple[int, str]:
    config = H.write_config(tmp_path / "c.yaml", data, tmp_path / "run", max_steps=4, eval_every=0)
    return _cli(capsys, "train", "--config", str(config), *extra)


def _edit_manifest(data, fn) -> None:
    """Rewrite manifest.json with `fn(dict)` applied, bypassing validation (a damaged/foreign manifest)."""
    path = data / "manifest.json"
    d = json.loads(path.read_text())
    fn(d)
    path.write_text(json.dumps(d))


def _shard_entry(d) -> dict:
    return next(s for s in d["shards"] if s["path"] == SHARD)


def _assert_refused(rc, text, tmp_path, *names):
    assert rc != 0, text
    assert "Traceback" not in text
    for name in names:
        assert name in text, text
    assert not CheckpointManager(tmp_path / "run").list_steps(), "a checkpoint was written from bad data"


def test_truncated_shard_is_refused_at_start(capsys, tmp_path, data_copy):
    p = data_copy / SHARD
    p.write_bytes(p.read_bytes()[:-7])  # not even a whole number of uint16 tokens
    rc, text = _train(capsys, tmp_path, data_copy)
    _assert_refused(rc, text, tmp_path, "shard_00001.bin")
    rc, text = _cli(capsys, "inspect", str(data_copy), "--verify")
    assert rc != 0 and "shard_00001.bin" in text and "Traceback" not in text


def test_shard_with_fewer_whole_tokens_is_refused_at_start(capsys, tmp_path, data_copy):
    p = data_copy / SHARD
    p.write_bytes(p.read_bytes()[:-200])
    _assert_refused(*_train(capsys, tmp_path, data_copy), tmp_path, "shard_00001.bin")


def test_flipped_bytes_fail_verification_naming_the_shard(capsys, tmp_path, data_copy):
    p = data_copy / SHARD
    data = bytearray(p.read_bytes())
    data[100] ^= 0x01  # low byte of a uint16 id: the id stays inside the vocabulary, only the hash sees it
    p.write_bytes(bytes(data))
    rc, text = _cli(capsys, "inspect", str(data_copy), "--verify")
    assert rc != 0 and "shard_00001.bin" in text and "sha256" in text and "Traceback" not in text


def test_ids_beyond_the_vocabulary_stop_training_naming_the_shard(capsys, tmp_path, data_copy):
    """Regression: manifest shards were trusted, so an id >= vocab_size in the bytes (the manifest still
    saying max_token_id 255) reached the embedding: `IndexError: index out of range` with a traceback in
    the middle of a run. Now the batch is refused with a DataError naming the shard."""
    p = data_copy / SHARD
    ids = np.fromfile(p, dtype="<u2")
    (ids + H.VOCAB).astype("<u2").tofile(p)  # every id of the second shard out of range, same size
    rc, text = _train(capsys, tmp_path, data_copy)
    assert rc != 0 and "Traceback" not in text, text
    assert "shard_00001.bin" in text and "outside the vocabulary" in text, text
    rc, text = _cli(capsys, "inspect", str(data_copy), "--verify")
    assert rc != 0 and "shard_00001.bin" in text and ">= vocab_size" in text


def test_manifest_that_admits_ids_beyond_the_vocabulary_is_refused(capsys, tmp_path, data_copy):
    _edit_manifest(data_copy, lambda d: _shard_entry(d).update(max_token_id=H.VOCAB + 5))
    _assert_refused(*_train(capsys, tmp_path, data_copy), tmp_path, "shard_00001.bin", "max_token_id")


def test_manifest_with_wrong_token_count_is_refused(capsys, tmp_path, data_copy):
    _edit_manifest(data_copy, lambda d: _shard_entry(d).update(n_tokens=_shard_entry(d)["n_tokens"] + 10))
    _assert_refused(*_train(capsys, tmp_path, data_copy), tmp_path, "shard_00001.bin")


def test_manifest_listing_a_missing_shard_is_refused(capsys, tmp_path, data_copy):
    (data_copy / SHARD).unlink()
    _assert_refused(*_train(capsys, tmp_path, data_copy), tmp_path, "shard_00001.bin", "missing")


def test_manifest_with_a_wrong_checksum_fails_verification(capsys, tmp_path, data_copy):
    _edit_manifest(data_copy, lambda d: _shard_entry(d).update(sha256="0" * 64))
    rc, text = _cli(capsys, "inspect", str(data_copy), "--verify")
    assert rc != 0 and "shard_00001.bin" in text and "sha256" in text


def test_manifest_that_is_not_json_is_refused(capsys, tmp_path, data_copy):
    path = data_copy / "manifest.json"
    path.write_bytes(path.read_bytes()[:-40])
    _assert_refused(*_train(capsys, tmp_path, data_copy), tmp_path, "manifest.json")


def test_manifest_from_another_vocabulary_is_refused(capsys, tmp_path, data_copy):
    _edit_manifest(data_copy, lambda d: d.update(vocab_size=50257, eos_id=50256))
    _assert_refused(*_train(capsys, tmp_path, data_copy), tmp_path, "manifest.json", "vocab_size")


def test_resume_on_data_from_another_tokenizer_is_refused(capsys, tmp_path, data_copy):
    """Same vocabulary size, another tokenizer: a fresh run cannot know, but resuming a checkpoint
    trained on the first tokenizer must refuse to continue on the second."""
    rc, text = _train(capsys, tmp_path, data_copy, "--max-steps", "2")
    assert rc == 0, text
    m = Manifest.load(data_copy)
    m.tokenizer = {"name": "other-bpe", "vocab_hash": "cd" * 32}
    m.save(data_copy)
    before = H.tree_hash(tmp_path / "run")
    metrics_before = (tmp_path / "run" / "metrics.jsonl").read_text()
    rc, text = _train(capsys, tmp_path, data_copy)
    assert rc != 0 and "Traceback" not in text
    assert "other-bpe" in text and "chaos-bytes" in text, text
    # Regression: config.yaml and run.json were rewritten before the resume's checks refused it, so the
    # run directory described a run that never happened. (.lock holds the pid of its last holder; the
    # metrics log may only grow: the refusal is recorded as an error event.)
    after = H.tree_hash(tmp_path / "run")
    keep = {".lock", "metrics.jsonl"}
    assert {k: v for k, v in after.items() if k not in keep} == {
        k: v for k, v in before.items() if k not in keep
    }
    assert (tmp_path / "run" / "metrics.jsonl").read_text().startswith(metrics_before)
