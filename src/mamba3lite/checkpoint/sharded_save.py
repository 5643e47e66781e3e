"""Sharded saves: every rank writes its own shards, rank 0 writes the meta once all are written.

A model whose parameters are DTensors (FSDP2/HSDP) is saved by EVERY rank, each writing its own shards
with torch.distributed.checkpoint into DIR/dcp_step_N/ (sharded.py), by default asynchronously: the call
returns once the state is copied, the files are written in the background. Rank 0 then writes the meta,
with the size and sha256 of every shard file, in a thread of its own once every rank's files are written
(or at `finish`, whichever first). One save is pending at a time; `finish` waits for it (the next save,
a rollback and the end of training call it through the manager), and a process killed first leaves the
step without a meta, which was never a checkpoint.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mamba3lite.atomicfile import sha256_file
from mamba3lite.checkpoint.collective import barrier, gather_objects, is_distributed, rank
from mamba3lite.checkpoint.lazy import sharded_files, sharded_state
from mamba3lite.checkpoint.optim_state import optimizer_kind
from mamba3lite.checkpoint.retention import delete_step, remove_stale_temp_files
from mamba3lite.checkpoint.run_state import RunState
from mamba3lite.checkpoint.verify import StepVerifier
from mamba3lite.checkpoint.writer import meta_record, pause_for_tests, write_meta
from mamba3lite.rundir import checkpoint_files, sharded_dir


@dataclass
class _PendingSave:
    """A sharded save whose files may still be being written: its DCP future (None: written already)
    and, on rank 0, the meta record waiting for the shards' hashes and the thread that will write it."""

    step: int
    future: Any = None
    record: dict | None = None
    optimizer: str | None = None  # the optimizer's kind (optim_state.optimizer_kind), when saved
    committer: threading.Thread | None = None
    error: BaseException | None = None


class ShardedSaves:
    """The sharded saves of one run directory (see the module docstring). `verifier` learns the hash of
    every shard file rank 0 hashes for the meta; `after_commit` runs on rank 0 after each meta (the
    manager's retention)."""

    def __init__(self, directory: Path, verifier: StepVerifier, after_commit: Callable[[], object]) -> None:
        self.dir = directory
        self._verifier = verifier
        self._after_commit = after_commit
        self._pending: _PendingSave | None = None  # a save not yet committed (its meta unwritten)
        self._background_group: Any = None  # the gloo group of async saves' collectives, made at the first

    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        state: RunState,
        async_save: bool,
    ) -> Path:
        """Every rank writes its shards of the model and optimizer state into DIR/dcp_step_N/ (no rank
        gathers the whole state); rank 0 writes the meta once every rank's files are written: at once
        when not `async_save`, else in a thread of its own when the background save completes (or at
        `finish`, whichever first). Collective: every rank calls it. Returns the meta path."""
        self.finish()  # one save at a time; the previous one's meta first
        if rank() == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            remove_stale_temp_files(self.dir)
            delete_step(
                self.dir, step
            )  # an older save of the same step (re-saved after a rollback), meta first
        rngs = gather_objects(state.rng)
        barrier()  # no rank writes into the directory before rank 0 has cleared it
        future = self._write_shards(step, model, optimizer, async_save)
        pending = _PendingSave(step, future)
        if rank() == 0:
            state = RunState(**{**vars(state), "rank_rngs": rngs})
            pending.record = meta_record(step, state, optimizer is not None)
            pending.optimizer = None if optimizer is None else optimizer_kind(optimizer)
            if future is not None:
                pending.committer = threading.Thread(
                    target=self._commit, args=(pending,), name=f"commit-step-{step}", daemon=True
                )
                pending.committer.start()
        self._pending = pending
        if future is None:
            self.finish()
            barrier()  # a synchronous save has its meta when it returns, on every rank
        return checkpoint_files(self.dir, step)["meta"]

    def _write_shards(
        self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, async_save: bool
    ) -> Any:
        """This rank's shards of the model (and optimizer) state, written by DCP: its future when
        `async_save`, else None once written."""
        dcp_state = sharded_state()
        content: dict[str, Any] = {"model": dcp_state.local_model_state(model)}
        if optimizer is not None:
            content["optim"] = dcp_state.local_optimizer_state(model, optimizer)
        return sharded_files().write_shards(
            sharded_dir(self.dir, step),
            content,
            async_save=async_save,
            process_group=self._async_group() if async_save else None,
            pause=pause_for_tests,
        )

    def _async_group(self) -> Any:
        """The gloo process group of the async saves' background collectives (torchtitan's choice): on the
        training's group they could interleave with its collectives. Made once, by every rank."""
        if self._background_group is None and is_distributed():
            self._background_group = dist.new_group(backend="gloo")
        return self._background_group

    def _commit(self, pending: _PendingSave) -> None:
        """Rank 0: wait for the shards, hash every file, write the meta (the commit marker), prune."""
        try:
            if pending.future is not None:
                pending.future.result()
            sdir = sharded_dir(self.dir, pending.step)
            files = {}
            for name in sharded_files().shard_file_names(sdir):
                path = sdir / name
                sha = sha256_file(path)
                files[name] = {"size": path.stat().st_size, "sha256": sha}
                self._verifier.remember(path, sha)
            record = dict(pending.record or {})
            record["shards"] = {"dir": sdir.name, "files": files}
            if pending.optimizer is not None:
                record["shards"]["optimizer"] = pending.optimizer
            write_meta(checkpoint_files(self.dir, pending.step)["meta"], record)
            self._after_commit()
        except BaseException as e:  # re-raised by finish, in the caller's thread
            pending.error = e

    def pending_step(self) -> int | None:
        """The step of a save not yet finished (see `finish`), or None."""
        return None if self._pending is None else self._pending.step

    def finish(self) -> None:
        """Finish the pending save, if any: wait for this rank's files and, on rank 0, for the meta
        (hashes of every shard, then the meta file). Raises what the save raised."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if pending.committer is not None:
            pending.committer.join()
        elif pending.record is not None:
            self._commit(pending)  # a synchronous save on rank 0
        elif pending.future is not None:
            pending.future.result()
        if pending.error is not None:
            raise pending.error
