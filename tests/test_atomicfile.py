"""The atomic-file protocol's streaming writer (the in-memory one is tested in test_shards.py)."""

from __future__ import annotations

import hashlib

import pytest

from mamba3lite import atomicfile
from mamba3lite.atomicfile import HashingAtomicFile, atomic_write_bytes, sha256_file


def test_hashing_file_commits_under_its_name_with_the_hash_of_its_bytes(tmp_path):
    target = tmp_path / "big.pt"
    f = HashingAtomicFile(target)
    assert not target.exists()  # nothing under the final name before commit
    f.write(b"abc")
    f.write(memoryview(b"defg"))
    digest = f.commit()
    assert target.read_bytes() == b"abcdefg"
    assert f.size == 7
    assert digest == hashlib.sha256(b"abcdefg").hexdigest() == sha256_file(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.pt"]  # no temp file left
    assert oct(target.stat().st_mode & 0o777) == oct(0o644)


def test_hashing_file_abort_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    target = tmp_path / "big.pt"
    atomic_write_bytes(target, b"old")
    f = HashingAtomicFile(target)
    f.write(b"half of a new one")
    f.abort()
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.pt"]


def test_hashing_file_fsync_failure_is_raised_and_the_name_untouched(tmp_path, monkeypatch):
    target = tmp_path / "big.pt"
    atomic_write_bytes(target, b"old")
    f = HashingAtomicFile(target)
    f.write(b"new")

    def boom(fd):
        raise OSError("disk full")

    monkeypatch.setattr(atomicfile.os, "fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        f.commit()
    monkeypatch.undo()
    f.abort()
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.pt"]


def test_one_protocol_for_shards_and_checkpoints():
    """Datasets and checkpoints write through the same functions, not two copies of the protocol."""
    from mamba3lite.data import shards
    from mamba3lite.train import checkpoint

    assert shards.atomic_write_bytes is atomicfile.atomic_write_bytes
    assert shards.atomic_write_json is atomicfile.atomic_write_json
    assert checkpoint.HashingAtomicFile is atomicfile.HashingAtomicFile


def test_every_public_checkpoint_name_is_importable_from_the_package():
    """Other modules import these from mamba3lite.train.checkpoint; the package resolves them lazily."""
    import mamba3lite.train.checkpoint as checkpoint

    for name in checkpoint.__all__:
        assert getattr(checkpoint, name) is not None, name
    with pytest.raises(AttributeError):
        checkpoint.no_such_name  # noqa: B018
