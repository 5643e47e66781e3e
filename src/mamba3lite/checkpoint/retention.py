"""Retention: which steps a run keeps, and removing or moving aside the ones it does not.

Deleting removes a step's meta first, so a half-deleted step is never "verified"; pruning never touches
a step newer than the newest verified one (a save in progress elsewhere, or torn) and never the newest
verified step; moving aside (resuming an older step) deletes nothing: each abandoned timeline gets a
folder of its own. The manager (manager.py) decides when, from the steps it has verified.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import time
from pathlib import Path

from mamba3lite.atomicfile import fsync_dir
from mamba3lite.rundir import (
    average_file,
    checkpoint_files,
    finished_save,
    is_temp_file,
    sharded_dir,
    step_of,
)


def step_paths(directory: Path, step: int) -> list[Path]:
    """Every path a step may have, meta first: its meta, model, optimizer and average files, and its
    shard directory."""
    files = checkpoint_files(directory, step)
    return [
        files["meta"],
        files["model"],
        files["optim"],
        average_file(directory, step),
        sharded_dir(directory, step),
    ]


def delete_step(directory: Path, step: int) -> None:
    """Remove a step's files and shard directory, meta first."""
    *files, shards = step_paths(directory, step)
    for path in files:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    shutil.rmtree(shards, ignore_errors=True)


def steps_to_prune(verified: list[int], present: list[int], keep_last_n: int) -> list[int]:
    """The steps (of `present`, ascending) to delete so that the newest `keep_last_n` of the ascending
    `verified` steps remain (0 = keep all): every step older than the oldest kept one."""
    if keep_last_n == 0 or not verified:
        return []
    keep = set(verified[-keep_last_n:])
    oldest_kept = min(keep)
    return [s for s in present if s < oldest_kept and s not in keep]


def remove_stale_temp_files(directory: Path) -> list[str]:
    """Delete the temp files of saves that never finished: a process killed mid-write leaves
    `.model_step_N.safetensors.XXXX.tmp`, as big as the file it was becoming, and repeated
    preemptions would fill the disk; and the shard directories of sharded saves without a meta (a
    kill during an async save). Call only when no save can be running. Returns the removed names."""
    removed = []
    if directory.is_dir():
        for p in directory.iterdir():
            if is_temp_file(p.name):
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
                    removed.append(p.name)
            elif p.is_dir() and (s := step_of(p.name)) is not None and not finished_save(directory, s):
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p.name)
    return removed


def move_aside(directory: Path, steps: list[int], subdir: str, from_step: int | None) -> Path:
    """Move whole steps into a new folder of their own, DIR/subdir/<UTC time>-from-step-<from_step>/ (or
    ...-steps-<first>-<last>/ without `from_step`), and return it (a counter suffix if the name is
    taken: resuming the same older step twice keeps both abandoned timelines)."""
    assert steps, "nothing to move aside"
    parent = directory / subdir
    parent.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    what = f"from-step-{from_step}" if from_step is not None else f"steps-{min(steps)}-{max(steps)}"
    for n in itertools.count(1):
        target = parent / (f"{stamp}-{what}" if n == 1 else f"{stamp}-{what}-{n}")
        try:
            target.mkdir()  # exclusive: never shares a folder with an earlier timeline
            break
        except FileExistsError:
            continue
    for s in steps:
        for p in [
            *checkpoint_files(directory, s).values(),
            average_file(directory, s),
            sharded_dir(directory, s),
        ]:
            if p.exists():
                os.replace(p, target / p.name)
    fsync_dir(target)
    fsync_dir(parent)
    fsync_dir(directory)
    return target
