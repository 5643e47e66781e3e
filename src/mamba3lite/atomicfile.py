"""Atomic files: a crash leaves either the old file or the new one under a name, never half of one.

The protocol, used for every file the project writes that a later run trusts (dataset shards and
manifests, checkpoints, run records, resolved configs):

    1. write to a temp file in the same directory (`.NAME.XXXX.tmp`: same filesystem, so the rename
       is atomic; a reader globbing NAME never sees it),
    2. flush and fsync it (the bytes are on disk before the name points at them),
    3. rename it over NAME (`os.replace`: atomic on POSIX),
    4. fsync the directory (the rename itself survives a crash).

On any failure the temp file is removed and an existing NAME is untouched. Two writers implement it:
`atomic_write_bytes` for data already in memory, and `HashingAtomicFile`, a file object for data
streamed by a serialiser (torch.save, the safetensors writer) that also returns the sha256 of what
it committed. `sha256_file` hashes a file in constant memory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np

# Files are hashed in chunks of this many bytes: big enough to be fast, small enough that hashing a
# multi-GB file never needs more than a few MiB of memory.
HASH_CHUNK_BYTES = 1 << 24


def _rename(tmp: str | Path, path: str | Path) -> None:
    """`os.replace(tmp, path)`; a directory in the way at `path` is reported as `path` (the name the user
    knows), not as the temp file that could not be moved there."""
    try:
        os.replace(tmp, path)
    except IsADirectoryError as e:
        raise IsADirectoryError(e.errno, e.strerror, str(path)) from None


def fsync_dir(path: Path) -> None:
    """fsync a directory so that a rename inside it survives a crash (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return  # e.g. Windows cannot open directories; its renames are durable enough for us
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems (and Windows) refuse fsync on directories; nothing more we can do
    finally:
        os.close(fd)


def _temp_beside(path: Path) -> tuple[int, str]:
    """A temp file in `path`'s directory, readable like any other file (mkstemp creates 0600)."""
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.fchmod(fd, 0o644)
    return fd, tmp_name


def atomic_write_bytes(path: Path, data: bytes | memoryview | np.ndarray) -> None:
    """Write `data` to `path` atomically (the module's protocol). Parent directories are created. An
    ndarray is written as its raw (C-order) bytes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data)
    fd, tmp_name = _temp_beside(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        _rename(tmp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any) -> None:
    """Atomically write `obj` as JSON (indent=2, sorted keys, trailing newline)."""
    text = json.dumps(obj, indent=2, sort_keys=True) + "\n"
    atomic_write_bytes(path, text.encode("utf-8"))


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in chunks (constant memory)."""
    h = hashlib.sha256()
    buf = bytearray(HASH_CHUNK_BYTES)
    view = memoryview(buf)
    with open(path, "rb") as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


class HashingAtomicFile:
    """A write-only file object for big streamed files: bytes go to a temp file beside `path`;
    `commit()` flushes, then fsyncs on a worker thread WHILE reading the file back (page cache) into a
    sha256, then renames over `path` and fsyncs the directory. (`atomic_write_bytes` needs the whole
    file in memory: a 440M model's AdamW state would be one 3 GB bytes object.) Hashing during the
    fsync hides it behind the disk; the digest is of the bytes the file holds. (Measured: hashing
    beside each write() cost 2-3x more on a loaded 2-core machine, one thread hand-off per small
    write.) `abort()` removes the temp file; `path` is never touched before commit."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        fd, self._tmp = _temp_beside(self.path)
        self._f = os.fdopen(fd, "wb", buffering=8 << 20)
        self.size = 0
        self.error: OSError | None = None  # the first write error (disk full...), kept for the caller

    def write(self, data: Any) -> int:
        try:
            n = self._f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise
        self.size += n
        return n

    def flush(self) -> None:
        pass  # durability is commit()'s fsync

    def commit(self) -> str:
        """Make the file durable under its final name; returns its sha256."""
        self._f.flush()
        errors: list[BaseException] = []

        def sync() -> None:
            try:
                os.fsync(self._f.fileno())
            except BaseException as e:  # re-raised below, on the caller's thread
                errors.append(e)

        syncer = threading.Thread(target=sync)
        syncer.start()
        try:
            digest = sha256_file(Path(self._tmp))
        finally:
            syncer.join()
        if errors:
            raise errors[0]
        self._f.close()
        _rename(self._tmp, self.path)
        fsync_dir(self.path.parent)
        return digest

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self._f.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._tmp)
