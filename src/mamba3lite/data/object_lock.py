"""An exclusive lock on a prefix of an object store: one lock object, written with a conditional PUT.

`prepare --out s3://bucket/ds/` holds `s3://bucket/ds/.prepare.lock` from before it looks at the prefix
until its upload ends, as a local `prepare` holds `OUT/.prepare.lock` (mamba3lite.dirlock): a second run
on the same URL fails at once with an error naming the holder instead of interleaving its uploads.

The lock is taken with `Store.create`: on S3 a PUT with `If-None-Match: *`, which the store answers for
exactly one of two concurrent writers (the other gets 412 Precondition Failed). The object records its
holder (host, pid, start time) and is deleted on release, whatever ends the run short of a kill.

**A stale lock.** A local flock dies with its process; an object does not, so a run killed with SIGKILL
(or whose machine died) leaves its lock behind. When the holder ran on this same machine, the lock says
whether it is stale: a holder pid that no longer exists is a dead run, and the lock is taken over (a
note says so). A holder on another machine cannot be checked from here, so the error says what to do:
make sure that run is gone, delete the lock object it names (`aws s3 rm URL`), and re-run. (The take-over
deletes and re-creates the object, so two runs on this machine that find the same dead lock at once
still end with one holder: only one of their creates succeeds.)
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from typing import Any

from mamba3lite.data.store import Store
from mamba3lite.errors import DataError, DataNotFoundError

LOCK_KEY = ".prepare.lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


class ObjectLock:
    """`ObjectLock(store, what, hint)`: acquire() creates the lock object under the store's root or
    raises DataError "URL is in use by <what> (<holder>); <hint>"; release() deletes it."""

    def __init__(self, store: Store, what: str, hint: str, key: str = LOCK_KEY) -> None:
        self.store, self.what, self.hint, self.key = store, what, hint, key
        self.url = store.url_of(key)
        self._held = False

    def _holder_record(self) -> bytes:
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": started}).encode()

    def _read_holder(self) -> dict | None:
        """The lock's record; None when it is gone (released meanwhile) or is not ours to read."""
        try:
            obj = self.store.stat(self.key)
            record = json.loads(self.store.read(obj, limit=4096))
        except DataNotFoundError:
            return None
        except (DataError, ValueError):
            return {}
        return record if isinstance(record, dict) else {}

    def acquire(self) -> ObjectLock:
        for _ in range(3):  # a lock released, or a stale one removed, between our create and our read
            if self.store.create(self.key, self._holder_record()):
                self._held = True
                return self
            holder = self._read_holder()
            if holder is None:
                continue
            if holder.get("host") == socket.gethostname() and not _alive(int(holder.get("pid", 0) or 0)):
                print(
                    f"note: {self.url} was left by a run on this machine that is gone (pid "
                    f"{holder.get('pid')}, since {holder.get('since')}); taking it over",
                    file=sys.stderr,
                )
                self.store.delete(self.key)
                continue
            who = (
                f"pid {holder.get('pid')} on {holder.get('host')} since {holder.get('since')}"
                if holder
                else "unknown"
            )
            raise DataError(
                f"{self.store.url} is in use by {self.what} ({who}); {self.hint}. If that run is gone "
                f"(killed, or its machine died), delete its lock {self.url} (aws s3 rm {self.url}) and "
                "re-run"
            )
        raise DataError(f"{self.url}: the lock keeps changing hands; re-run")

    def release(self) -> None:
        if self._held:
            self._held = False
            self.store.delete(self.key)

    def __enter__(self) -> ObjectLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()
