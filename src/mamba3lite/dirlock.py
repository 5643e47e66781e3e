"""An exclusive, advisory lock on a directory: `fcntl.flock` on a file inside it, held for a whole job.

A second job on the same directory (two trainers on one run directory, two `prepare`s into one dataset)
fails at once with a clear error naming the holder, instead of interleaving writes with the first. The
kernel drops the lock when its process dies, so a killed job never leaves a stale lock behind.

The lock file either stays (a run directory's `.lock`) or is removed on release (`remove=True`: a
dataset directory keeps only the dataset). Removal is safe because `acquire` checks, after locking, that
the file it locked is still the one at the path: a job that opened the file just before the holder
removed it retries on the new file instead of holding a lock nobody else can see.

The lock file is truncated and written, so it must be a regular file that is not a symlink: a `.lock`
that links to a user's file would have that file overwritten with the holder's pid, and a FIFO, a
device or a directory under that name cannot be locked. Any of those is refused, naming the path,
before anything is opened for writing.

A forked child (a `prepare` tokenizer worker, a data-loader worker) closes its copies of the held lock
files at once: a flock belongs to the open file, so an inherited copy would keep the directory locked
for as long as the child lives, even after the holder was killed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
from pathlib import Path
from typing import Any

from mamba3lite.errors import Mamba3LiteError
from mamba3lite.intake import describe_mode

_HELD: set[int] = set()  # descriptors of the locks this process holds


def _close_inherited() -> None:
    # In a forked child: close (never unlock: that would free the parent's lock) every inherited copy.
    for fd in _HELD:
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_inherited)


class DirLock:
    """`DirLock(directory, name, what, hint, error)`: acquire() takes DIR/NAME or raises `error` with
    "DIR is in use by <what> (<holder>); <hint>"; the holder (pid, start time) is written into the file.
    `remove`: delete the file on release. Usable as a context manager."""

    def __init__(
        self, directory: str | Path, name: str, what: str, hint: str, error: type[Mamba3LiteError],
        remove: bool = False,
    ) -> None:  # fmt: skip
        self.path = Path(directory) / name
        self.what, self.hint, self.error, self.remove = what, hint, error, remove
        self._fd: int | None = None

    def acquire(self) -> DirLock:
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 200).decode("utf-8", "replace").strip() or "unknown"
                os.close(fd)
                raise self.error(
                    f"{self.path.parent} is in use by {self.what} ({holder}); {self.hint}"
                ) from None
            try:
                st = os.stat(self.path)
                mine = os.fstat(fd)
                if (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
                    break
            except FileNotFoundError:
                pass
            os.close(fd)  # the previous holder removed the file we opened: lock the one at the path now
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
        self._fd = fd
        _HELD.add(fd)
        return self

    def _open(self) -> int:
        """The lock file opened for writing (created when absent); `error` if the name holds anything but
        a regular file. lstat first, so that a device is never opened; O_NOFOLLOW and the fstat after
        the open close the window in which the name could be swapped."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            st = None
        if st is not None and not stat.S_ISREG(st.st_mode):
            self._refuse(st.st_mode)
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(self.path, flags, 0o644)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.EISDIR):
                self._refuse(os.lstat(self.path).st_mode)
            raise
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            self._refuse(mode)
        return fd

    def _refuse(self, mode: int) -> None:
        what = "a symbolic link" if stat.S_ISLNK(mode) else describe_mode(mode)
        raise self.error(
            f"{self.path} is {what}, but the lock file of {self.path.parent} must be a regular file "
            f"(mamba3lite creates it); remove {self.path} and run again"
        )

    def release(self) -> None:
        if self._fd is not None and self._fd not in _HELD:  # in a forked child: not ours to release
            self._fd = None
        if self._fd is not None:
            import fcntl

            _HELD.discard(self._fd)
            if self.remove:  # while still holding it: see the module docstring
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> DirLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()
