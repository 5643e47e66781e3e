"""The atomic-file protocol's streaming writer (the in-memory one is tested in test_shards.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path

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


def test_every_writer_takes_the_protocol_from_atomicfile_itself():
    """One protocol, one home: every module imports the atomic writers from mamba3lite.atomicfile, none
    through a module that happens to import them (data.shards once re-exported them)."""
    import ast

    own = {n for n, v in vars(atomicfile).items() if getattr(v, "__module__", None) == atomicfile.__name__}
    names = {n for n in own if not n.startswith("_")} | {"HASH_CHUNK_BYTES"}
    src = Path(atomicfile.__file__).parent
    wrong = []
    for f in sorted(src.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module != "mamba3lite.atomicfile":
                wrong += [
                    f"{f.relative_to(src)}: {a.name} from {node.module}"
                    for a in node.names
                    if a.name in names
                ]
            if (
                isinstance(node, ast.Attribute)
                and node.attr in names
                and getattr(node.value, "id", "") != "atomicfile"
            ):
                wrong.append(f"{f.relative_to(src)}:{node.lineno}: {ast.unparse(node)}")
    assert not wrong, "atomic-file names taken from elsewhere than mamba3lite.atomicfile: " + ", ".join(wrong)


def test_every_public_checkpoint_name_is_importable_from_the_package():
    """Other modules import these from mamba3lite.checkpoint; the package resolves them lazily."""
    import mamba3lite.checkpoint as checkpoint

    for name in checkpoint.__all__:
        assert getattr(checkpoint, name) is not None, name
    with pytest.raises(AttributeError):
        checkpoint.no_such_name  # noqa: B018
