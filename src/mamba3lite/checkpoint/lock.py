"""The run directory's lock (DIR/.lock)."""

from __future__ import annotations

from pathlib import Path

from mamba3lite.dirlock import DirLock
from mamba3lite.errors import CheckpointError
from mamba3lite.rundir import LOCK_NAME


class RunLock(DirLock):
    """The run directory's lock (DIR/.lock), held by a trainer for a whole run: a second trainer on the
    same directory fails at once with a clear error instead of interleaving checkpoints with the first."""

    def __init__(self, directory: str | Path) -> None:
        super().__init__(
            directory, LOCK_NAME, "another trainer", "wait for it to finish or use another --checkpoint-dir",
            CheckpointError,
        )  # fmt: skip
