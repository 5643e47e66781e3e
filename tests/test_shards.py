"""Token files and manifest (data/shards.py): format, atomic writes, validation, verification."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mamba3lite import atomicfile
from mamba3lite.data.shards import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    Manifest,
    ShardInfo,
    atomic_write_bytes,
    atomic_write_json,
    dataset_dir,
    dtype_for_vocab,
    has_manifest,
    open_tokens,
    sha256_file,
    verify_dataset,
    verify_shard,
    write_dataset,
    write_shard,
)
from mamba3lite.errors import DataError, DataNotFoundError

VOCAB = 1000
EOS = 999


def make_dataset(tmp_path: Path, sizes=(50, 30), val_sizes=(20,), vocab=VOCAB, eos=EOS, seed=0) -> Manifest:
    """A small dataset directory: documents of random ids < eos, each ended by EOS."""
    rng = np.random.default_rng(seed)
    dtype = dtype_for_vocab(vocab)
    infos = []
    for split, split_sizes in (("train", sizes), ("val", val_sizes)):
        for k, n in enumerate(split_sizes):
            toks = rng.integers(0, eos, n)
            doc_ends = np.arange(9, n, 10)  # one document every 10 tokens
            toks[doc_ends] = eos
            infos.append(
                write_shard(
                    tmp_path,
                    f"{split}/shard_{k:05d}.bin",
                    toks,
                    split=split,
                    n_docs=len(doc_ends),
                    n_bytes=3 * n,
                    dtype=dtype,
                )
            )
    m = Manifest(
        vocab_size=vocab,
        eos_id=eos,
        dtype=dtype.name,
        tokenizer={"name": "t", "vocab_hash": "h"},
        shards=infos,
    )
    m.save(tmp_path)
    return m


def test_dtype_for_vocab_boundaries():
    assert dtype_for_vocab(50_257) == np.dtype("<u2")
    assert dtype_for_vocab(65_536) == np.dtype("<u2")  # ids 0..65535 all fit
    assert dtype_for_vocab(65_537) == np.dtype("<u4")
    assert dtype_for_vocab(65_537).byteorder in "<="
    with pytest.raises(DataError):
        dtype_for_vocab(0)


def test_write_shard_is_raw_little_endian_and_reads_back(tmp_path):
    toks = np.array([0, 1, 258, 65_535, 7], dtype=np.int64)
    info = write_shard(tmp_path, "train/shard_00000.bin", toks, split="train", n_docs=1, dtype=np.uint16)
    raw = (tmp_path / "train/shard_00000.bin").read_bytes()
    assert raw == b"\x00\x00\x01\x00\x02\x01\xff\xff\x07\x00"  # no header, little-endian
    assert info == ShardInfo(
        path="train/shard_00000.bin",
        split="train",
        n_tokens=5,
        n_docs=1,
        max_token_id=65_535,
        sha256=hashlib.sha256(raw).hexdigest(),
        n_bytes=0,
    )
    mm = open_tokens(tmp_path / info.path, "uint16")
    assert isinstance(mm, np.memmap)
    np.testing.assert_array_equal(mm, toks)
    with pytest.raises(ValueError):
        mm[0] = 1  # read-only


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.integers(0, 2**32 - 1), max_size=300),
    st.sampled_from([np.uint16, np.uint32]),
)
def test_write_open_roundtrip_property(tmp_path_factory, ids, dtype):
    d = tmp_path_factory.mktemp("rt")
    ids = [i % (np.iinfo(dtype).max + 1) for i in ids]
    info = write_shard(d, "val/s.bin", np.array(ids, dtype=np.int64), split="val", n_docs=0, dtype=dtype)
    assert info.n_tokens == len(ids)
    assert info.max_token_id == (max(ids) if ids else -1)
    np.testing.assert_array_equal(open_tokens(d / "val/s.bin", dtype), np.array(ids, dtype=np.int64))
    assert info.sha256 == sha256_file(d / "val/s.bin")


@pytest.mark.parametrize("bad", [[70_000], [-1]])
def test_write_shard_refuses_ids_that_do_not_fit(tmp_path, bad):
    with pytest.raises(DataError, match="does not fit"):
        write_shard(tmp_path, "train/a.bin", np.array([1, *bad]), split="train", n_docs=0, dtype=np.uint16)
    assert not (tmp_path / "train/a.bin").exists()


def test_write_shard_rejects_bad_split_path_and_dtype(tmp_path):
    t = np.arange(4)
    with pytest.raises(DataError, match="split"):
        write_shard(tmp_path, "x.bin", t, split="test", n_docs=0, dtype=np.uint16)
    with pytest.raises(DataError, match="relative"):
        write_shard(tmp_path, "../x.bin", t, split="train", n_docs=0, dtype=np.uint16)
    with pytest.raises(DataError, match="uint16 or uint32"):
        write_shard(tmp_path, "x.bin", t, split="train", n_docs=0, dtype=np.int64)
    with pytest.raises(DataError, match="1-D integer"):
        write_shard(tmp_path, "x.bin", np.ones(3), split="train", n_docs=0, dtype=np.uint16)


def test_atomic_write_failure_keeps_old_file_and_leaves_no_temp(tmp_path, monkeypatch):
    target = tmp_path / "f.bin"
    atomic_write_bytes(target, b"old")

    def boom(fd):
        raise OSError("disk full")

    monkeypatch.setattr(atomicfile.os, "fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_bytes(target, b"new contents")
    monkeypatch.undo()
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]


def test_atomic_write_replaces_and_accepts_arrays(tmp_path):
    target = tmp_path / "sub" / "a.bin"
    atomic_write_bytes(target, np.arange(3, dtype="<u4"))
    assert target.read_bytes() == np.arange(3, dtype="<u4").tobytes()
    atomic_write_bytes(target, memoryview(b"xyz"))
    assert target.read_bytes() == b"xyz"
    assert oct(target.stat().st_mode & 0o777) == oct(0o644)


def test_atomic_write_json_sorted_indented(tmp_path):
    atomic_write_json(tmp_path / "m.json", {"b": 1, "a": [1, 2]})
    text = (tmp_path / "m.json").read_text()
    assert text == json.dumps({"a": [1, 2], "b": 1}, indent=2, sort_keys=True) + "\n"


def test_sha256_file_matches_hashlib(tmp_path, monkeypatch):
    data = os.urandom(10_000)
    (tmp_path / "x").write_bytes(data)
    monkeypatch.setattr(atomicfile, "HASH_CHUNK_BYTES", 64)  # exercise the chunk loop
    assert sha256_file(tmp_path / "x") == hashlib.sha256(data).hexdigest()


def test_open_tokens_errors_name_the_file(tmp_path):
    with pytest.raises(DataNotFoundError, match=r"nope\.bin") as e:
        open_tokens(tmp_path / "nope.bin", np.uint16)
    assert isinstance(e.value, FileNotFoundError)
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(DataError, match=r"odd\.bin.*not a multiple of 2"):
        open_tokens(tmp_path / "odd.bin", np.uint16)
    (tmp_path / "empty.bin").write_bytes(b"")
    assert open_tokens(tmp_path / "empty.bin", np.uint32).shape == (0,)


def test_manifest_roundtrip_and_queries(tmp_path):
    m = make_dataset(tmp_path)
    assert (tmp_path / MANIFEST_NAME).is_file()
    loaded = Manifest.load(tmp_path)
    assert loaded == m
    assert Manifest.load(tmp_path / MANIFEST_NAME) == m  # the file path works too
    assert loaded.format_version == FORMAT_VERSION
    assert [s.path for s in loaded.split_shards("train")] == [
        "train/shard_00000.bin",
        "train/shard_00001.bin",
    ]
    assert loaded.n_tokens("train") == 80 and loaded.n_tokens("val") == 20 and loaded.n_tokens() == 100
    assert loaded.n_bytes("train") == 240 and loaded.n_bytes() == 300
    assert loaded.np_dtype == np.dtype("<u2")
    on_disk = json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert on_disk["dtype"] == "uint16" and on_disk["shards"][0]["path"] == "train/shard_00000.bin"


def test_n_bytes_unknown_when_any_shard_lacks_it(tmp_path):
    m = make_dataset(tmp_path)
    m.shards[0].n_bytes = 0
    assert m.n_bytes("train") == 0 and m.n_bytes("val") == 60


def test_verify_clean_dataset(tmp_path):
    m = make_dataset(tmp_path)
    assert verify_dataset(tmp_path) == []
    assert all(verify_shard(tmp_path, s, m) is None for s in m.shards)


def _flip_byte(p: Path, at: int) -> None:
    b = bytearray(p.read_bytes())
    b[at] ^= 0x01
    p.write_bytes(bytes(b))


def test_verify_reports_each_problem_naming_the_shard(tmp_path):
    make_dataset(tmp_path, sizes=(50, 30, 40, 40), val_sizes=(20, 20))
    _flip_byte(tmp_path / "train/shard_00000.bin", 2)  # sha256 mismatch
    with open(tmp_path / "train/shard_00001.bin", "ab") as f:  # size mismatch
        f.write(b"\x00\x00")
    (tmp_path / "val/shard_00000.bin").unlink()  # missing
    d = json.loads((tmp_path / MANIFEST_NAME).read_text())
    d["shards"][2]["max_token_id"] -= 1  # manifest lies about max id
    d["shards"][3]["n_docs"] += 1  # more documents than EOS tokens
    atomic_write_json(tmp_path / MANIFEST_NAME, d)
    problems = verify_dataset(tmp_path)
    assert len(problems) == 5, problems
    joined = "\n".join(problems)
    assert "train/shard_00000.bin: sha256" in joined
    assert "train/shard_00001.bin: size" in joined
    assert "val/shard_00000.bin: missing" in joined
    assert "train/shard_00002.bin: max id" in joined and "max_token_id" in joined
    assert "train/shard_00003.bin: 4 EOS tokens" in joined and "n_docs 5" in joined
    assert all("\n" not in p for p in problems)


def test_verify_catches_ids_beyond_vocab(tmp_path):
    info = write_shard(tmp_path, "train/a.bin", np.array([1, 700, 5]), split="train", n_docs=0, dtype="<u2")
    info.max_token_id = 5  # a manifest that lies so that from_dict accepts it
    m = Manifest(
        vocab_size=600, eos_id=5, dtype="uint16", tokenizer={"name": "t", "vocab_hash": ""}, shards=[info]
    )
    m.save(tmp_path)
    (problem,) = verify_dataset(tmp_path)
    assert "train/a.bin" in problem and "max id 700 >= vocab_size 600" in problem


def test_verify_bad_or_missing_manifest_is_one_problem(tmp_path):
    assert "does not exist" in verify_dataset(tmp_path)[0]
    (tmp_path / MANIFEST_NAME).write_text("{not json")
    (problem,) = verify_dataset(tmp_path)
    assert MANIFEST_NAME in problem and "JSON" in problem


def test_manifest_load_errors_name_the_file(tmp_path):
    with pytest.raises(DataNotFoundError, match="prepare"):
        Manifest.load(tmp_path)
    (tmp_path / MANIFEST_NAME).write_text("[1, 2]")
    with pytest.raises(DataError, match=re.escape(str(tmp_path / MANIFEST_NAME))):
        Manifest.load(tmp_path)


def _good_dict() -> dict:
    return {
        "vocab_size": 1000,
        "eos_id": 999,
        "dtype": "uint16",
        "tokenizer": {"name": "gpt2", "vocab_hash": "ab"},
        "format_version": FORMAT_VERSION,
        "extra": {},
        "shards": [
            {
                "path": "train/shard_00000.bin",
                "split": "train",
                "n_tokens": 10,
                "n_docs": 1,
                "max_token_id": 999,
                "sha256": "0" * 64,
                "n_bytes": 40,
            }
        ],
    }


def _set(path, value):
    def mutate(d):
        *head, last = path
        for k in head:
            d = d[k]
        d[last] = value

    return mutate


def _delete(path):
    def mutate(d):
        *head, last = path
        for k in head:
            d = d[k]
        del d[last]

    return mutate


def _dup_shard(d):
    d["shards"].append(dict(d["shards"][0]))


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (_delete(["vocab_size"]), "missing vocab_size"),
        (_set(["surprise"], 1), "unknown keys surprise"),
        (_set(["vocab_size"], "1000"), "vocab_size must be int"),
        (_set(["vocab_size"], True), "vocab_size must be int"),
        (_set(["dtype"], "int64"), "dtype 'int64'"),
        (_set(["vocab_size"], 70_000), "does not fit dtype uint16"),
        (_set(["eos_id"], 1000), "eos_id 1000"),
        (_set(["format_version"], FORMAT_VERSION + 1), "upgrade mamba3lite"),
        (_set(["tokenizer"], {"name": "gpt2"}), "tokenizer must be"),
        (_set(["shards", 0, "path"], "../escape.bin"), "relative posix path"),
        (_set(["shards", 0, "path"], "/abs.bin"), "relative posix path"),
        (_set(["shards", 0, "split"], "test"), "split is 'test'"),
        (_set(["shards", 0, "n_tokens"], -1), "negative count"),
        (_set(["shards", 0, "n_docs"], 1.5), "n_docs must be int"),
        (_set(["shards", 0, "sha256"], "xyz"), "sha256 is not"),
        (_set(["shards", 0, "max_token_id"], 1000), "max_token_id 1000 >= vocab_size 1000"),
        (_delete(["shards", 0, "sha256"]), "lacks sha256"),
        (_set(["shards", 0, "bogus"], 1), "unknown keys bogus"),
        (_dup_shard, "listed twice"),
    ],
)
def test_manifest_from_dict_validation(mutate, message):
    d = _good_dict()
    Manifest.from_dict(d)  # the unmutated dict is valid
    mutate(d)
    with pytest.raises(DataError, match=message) as e:
        Manifest.from_dict(d, where="some/manifest.json")
    assert "some/manifest.json" in str(e.value)


def test_manifest_defaults_for_optional_fields():
    d = _good_dict()
    del d["extra"], d["shards"][0]["n_bytes"]
    m = Manifest.from_dict(d)
    assert m.extra == {} and m.shards[0].n_bytes == 0


def test_save_refuses_an_invalid_manifest(tmp_path):
    m = Manifest.from_dict(_good_dict())
    m.eos_id = 5000
    with pytest.raises(DataError, match="eos_id"):
        m.save(tmp_path)
    assert not (tmp_path / MANIFEST_NAME).exists()


def test_write_dataset_numbers_shards_per_split_and_writes_a_verified_manifest(tmp_path):
    a, b, v = np.array([1, 2, 999, 3, 999]), np.array([4, 5, 999]), np.array([7, 999])
    m = write_dataset(
        tmp_path,
        [("train", a, 2, 30), ("val", v, 1, 6), ("train", b, 1, 15)],
        vocab_size=VOCAB,
        eos_id=999,
        tokenizer={"name": "t", "vocab_hash": "ab" * 32},
    )
    assert [s.path for s in m.shards] == [
        "train/shard_00000.bin",
        "val/shard_00000.bin",
        "train/shard_00001.bin",
    ]
    assert Manifest.load(tmp_path).to_dict() == m.to_dict()
    assert verify_dataset(tmp_path) == []
    assert m.n_tokens("train") == 8 and m.n_bytes("val") == 6
    np.testing.assert_array_equal(open_tokens(tmp_path / "train/shard_00001.bin", m.dtype), b)
    with pytest.raises(DataError, match="split 'test'"):
        write_dataset(tmp_path / "x", [("test", a, 1, 0)], vocab_size=VOCAB, eos_id=0, tokenizer={})


def test_a_dataset_is_named_by_its_directory_or_its_manifest(tmp_path):
    m = make_dataset(tmp_path)
    assert dataset_dir(tmp_path / MANIFEST_NAME) == tmp_path
    assert has_manifest(tmp_path) and has_manifest(tmp_path / MANIFEST_NAME)
    assert Manifest.load(tmp_path / MANIFEST_NAME) == Manifest.load(tmp_path) == m
    seed_dir = tmp_path / "seed"
    seed_dir.mkdir()
    assert not has_manifest(seed_dir) and not has_manifest(seed_dir / MANIFEST_NAME)
    # A pipe named manifest.json still makes a prepared dataset, so that its reader names the problem.
    piped = tmp_path / "piped"
    piped.mkdir()
    os.mkfifo(piped / MANIFEST_NAME)
    assert has_manifest(piped)
    with pytest.raises(DataError, match="named pipe"):
        Manifest.load(piped)
    # A directory that happens to be called manifest.json names itself.
    (tmp_path / "odd" / MANIFEST_NAME).mkdir(parents=True)
    assert dataset_dir(tmp_path / "odd" / MANIFEST_NAME) == tmp_path / "odd" / MANIFEST_NAME
