"""DirLock: one holder per directory, a clear error for the second, and safe removal of the lock file."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from mamba3lite import dirlock
from mamba3lite.dirlock import DirLock
from mamba3lite.errors import DataError


def _lock(d, remove=False):
    return DirLock(d, ".l", "another job", "wait for it", DataError, remove=remove)


def test_second_holder_is_refused_with_the_first_ones_pid(tmp_path):
    where = re.escape(str(tmp_path))
    expected = rf"{where} is in use by another job \(pid {os.getpid()} since .*; wait for it"
    with _lock(tmp_path), pytest.raises(DataError, match=expected):
        _lock(tmp_path).acquire()
    _lock(tmp_path).acquire().release()  # free once released
    assert (tmp_path / ".l").exists()  # the default keeps the file


def test_remove_deletes_the_file_and_tolerates_it_being_gone(tmp_path):
    with _lock(tmp_path, remove=True):
        assert (tmp_path / ".l").exists()
    assert not (tmp_path / ".l").exists()
    with _lock(tmp_path / "sub", remove=True):  # creates the directory
        (tmp_path / "sub" / ".l").unlink()  # e.g. the job removed its own directory
    assert not (tmp_path / "sub" / ".l").exists()


def test_a_file_removed_by_the_previous_holder_is_not_taken_for_the_lock(tmp_path, monkeypatch):
    # The race `remove` must survive: a job opens the lock file, the holder removes it and releases, the
    # job's flock then succeeds on a file nobody else can see. acquire() must notice and lock the new one.
    stale = os.open(tmp_path / ".l", os.O_RDWR | os.O_CREAT)
    os.unlink(tmp_path / ".l")
    real_open, opened = os.open, []

    def open_stale_first(path, flags, mode=0o777):
        opened.append(path)
        return stale if len(opened) == 1 else real_open(path, flags, mode)

    monkeypatch.setattr(dirlock.os, "open", open_stale_first)
    held = _lock(tmp_path, remove=True).acquire()
    monkeypatch.undo()
    assert len(opened) == 2 and (tmp_path / ".l").exists()
    with pytest.raises(DataError, match="in use by another job"):  # the lock at the path is really held
        _lock(tmp_path).acquire()
    held.release()
    _lock(tmp_path).acquire().release()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_does_not_keep_the_lock_of_a_killed_holder(tmp_path):
    # A holder forks a long-lived child (as `prepare` forks its tokenizer workers), then is killed. A
    # flock belongs to the open file, so a child's inherited copy would keep the directory locked.
    script = f"""
import os, signal, time
from mamba3lite.dirlock import DirLock
from mamba3lite.errors import DataError
DirLock({str(tmp_path)!r}, ".l", "job", "wait", DataError).acquire()
child = os.fork()
if child == 0:
    time.sleep(60)
    os._exit(0)
open({str(tmp_path / "child")!r}, "w").write(str(child))
os.kill(os.getpid(), signal.SIGKILL)
"""
    with open(tmp_path / "stderr", "w") as err:  # not a pipe: the child would hold it open
        r = subprocess.run([sys.executable, "-c", script], stdout=subprocess.DEVNULL, stderr=err, timeout=60)
    assert r.returncode == -signal.SIGKILL, (tmp_path / "stderr").read_text()
    child = int((tmp_path / "child").read_text())
    try:
        os.kill(child, 0)  # the child still runs
        _lock(tmp_path).acquire().release()  # and the lock is free
    finally:
        os.kill(child, signal.SIGKILL)
