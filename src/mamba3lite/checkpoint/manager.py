"""CheckpointManager: saves, verifies, finds, loads and prunes the checkpoints of one run directory.

Two step formats, one meta (written last: the commit marker):
- three files (model, optimizer, meta), written by rank 0 alone: single-process and DDP runs
  (writer.py);
- sharded (sharded_save.py, sharded.py): a model whose parameters are DTensors (FSDP2/HSDP) is saved by
  EVERY rank, each writing its own shards with torch.distributed.checkpoint into DIR/dcp_step_N/, by
  default asynchronously (`save(..., async_save=True)`: the call returns once the state is copied, the
  files are written in the background); rank 0 writes the meta, with the size and sha256 of every shard
  file, once every rank's files are written. `finish_pending()` waits for that (the next save, a
  rollback and the end of training call it).

A step counts only when its meta parses and every file it records matches its size and hash (verify.py),
so a torn-but-complete step is detected; `latest_step()` skips a bad step with a warning naming the bad
file and returns the newest VERIFIED step. `load(N)` loads exactly N, in either format, into a plain, DDP
or sharded model at any world size (reader.py), or raises `CheckpointError` naming the file; given the
status that just verified N (`verified=`), it loads without checking again. Retention (retention.py)
keeps the newest `keep_last_n` verified steps.

This class is the one face of those modules: callers ask it, and each concept has its own module.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from mamba3lite.checkpoint import retention
from mamba3lite.checkpoint.collective import barrier, rank
from mamba3lite.checkpoint.dtensor import is_sharded
from mamba3lite.checkpoint.lazy import sharded_files
from mamba3lite.checkpoint.meta import META_FORMAT, read_meta_file
from mamba3lite.checkpoint.reader import load_optimizer_file, load_sharded, load_weights
from mamba3lite.checkpoint.run_state import RunState
from mamba3lite.checkpoint.sharded_save import ShardedSaves
from mamba3lite.checkpoint.verify import CheckpointStatus, StepVerifier, has_average
from mamba3lite.checkpoint.weights import read_model_file, split_tied, tensor_dtypes
from mamba3lite.checkpoint.writer import (
    SLOW_SAVE_ENV,
    meta_record,
    state_to_save,
    write_data_files,
    write_meta,
    write_weights_file,
)
from mamba3lite.errors import CheckpointError
from mamba3lite.rundir import SUPERSEDED_DIRNAME, average_file, checkpoint_files, sharded_dir, steps_in

__all__ = ["SLOW_SAVE_ENV", "CheckpointManager", "CheckpointStatus", "has_average"]


class CheckpointManager:
    """Saves, verifies, finds, loads and prunes the checkpoints of one run directory."""

    def __init__(self, directory: str | Path, keep_last_n: int = 0) -> None:
        """keep_last_n: verified checkpoints kept after each save (0 = keep all)."""
        assert keep_last_n >= 0
        self.dir = Path(directory)
        self.keep_last_n = keep_last_n
        self._verifier = StepVerifier(self.dir)  # latest_step() then load() hashes each file once
        self._sharded = ShardedSaves(self.dir, self._verifier, after_commit=self.prune)

    @staticmethod
    def saves_sharded(model: torch.nn.Module, sharded: bool | None = None) -> bool:
        """Whether `save` writes the sharded format for `model`: `sharded` when given (the parallelism
        seam knows), else whether its parameters are DTensors."""
        return is_sharded(model) if sharded is None else sharded

    @staticmethod
    def every_rank_saves(model: torch.nn.Module) -> bool:
        """Whether every rank calls `save` for `model`: for a sharded model either format is a collective
        (its own shards, or whole tensors gathered to rank 0); a plain model's checkpoint is rank 0's
        alone, the other ranks wait."""
        return is_sharded(model)

    # ----------------------------------------------------------------------------------- writing
    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        state: RunState | None = None,
        *,
        sharded: bool | None = None,
        async_save: bool = False,
        average: dict[str, torch.Tensor] | None = None,
    ) -> Path:
        """Write the checkpoint of `step`; then apply retention. The meta is `state.to_meta()` (default:
        a RunState of only the step) with the manager's file-integrity fields. Returns the meta path.

        Three-file format (rank 0 alone; for a sharded model with `sharded=False` every rank calls it,
        the whole tensors are gathered to rank 0, which writes): model, optimizer, then meta last, each
        atomically. Sharded (`saves_sharded(model, sharded)`; every rank calls it, each with its own
        `state`, whose RNG states are gathered into the meta): sharded_save.py; `async_save` returns
        before the files are written, and the meta path it returns exists only after `finish_pending()`.

        `average`: the averaged weights (train/averaging.py: a state_dict of the model's keys), written to
        a fourth file, average_step_N.safetensors, recorded in the meta's files as "average" (three-file
        format only: sharded runs do not average)."""
        assert step >= 0
        state = RunState(step=step) if state is None else state
        assert state.step == step, f"the run state is of step {state.step}, saved as step {step}"
        if self.saves_sharded(model, sharded):
            assert average is None, "weight averaging is refused for sharded runs (config.py)"
            return self._sharded.save(step, model, optimizer, state, async_save)
        self.finish_pending()
        paths = checkpoint_files(self.dir, step)
        gathered = is_sharded(model)  # whole tensors, gathered to rank 0 (a collective)
        weights, optim_state = state_to_save(model, optimizer)
        if gathered and rank() != 0:
            barrier()  # until rank 0 has written them
            return paths["meta"]
        self.dir.mkdir(parents=True, exist_ok=True)
        self.remove_stale_temp_files()
        # An older triple of the same step (re-saved after a rollback) stops counting before anything
        # of the new one is written.
        with contextlib.suppress(FileNotFoundError):
            paths["meta"].unlink()
        unique, aliases = split_tied(weights)
        files = write_data_files(paths, unique, aliases, optim_state)
        if average is not None:  # written before the meta: the meta vouches for it too
            paths = {**paths, "average": average_file(self.dir, step)}
            files["average"] = write_weights_file(paths["average"], split_tied(average)[0], aliases)
        record = meta_record(step, state, optimizer is not None)
        record["tied"] = aliases
        record["files"] = {k: {"name": paths[k].name, **files[k]} for k in files}
        write_meta(paths["meta"], record)
        for kind in files:  # what we just wrote needs no re-hash when loaded
            self._verifier.remember(paths[kind], files[kind]["sha256"])
        self.prune()
        if gathered:
            barrier()
        return paths["meta"]

    def pending_step(self) -> int | None:
        """The step of a sharded save not yet finished (see `finish_pending`), or None."""
        return self._sharded.pending_step()

    def finish_pending(self) -> None:
        """Finish the pending sharded save, if any: wait for this rank's files and, on rank 0, for the
        meta (hashes of every shard, then the meta file). Call it before the next save, before a rollback
        and before the process exits; a process killed first leaves the step without a meta, which was
        never a checkpoint (the next start deletes its files). Raises what the save raised."""
        self._sharded.finish()

    # ---------------------------------------------------------------------------------- discovery
    def list_steps(self) -> list[int]:
        """Every step with at least one of its files in the directory, ascending."""
        return steps_in(self.dir)

    def read_meta(self, step: int) -> dict:
        """The parsed meta of a step (CheckpointError naming the file if missing or unreadable)."""
        return read_meta_file(checkpoint_files(self.dir, step)["meta"], step)

    def forget_hashes(self) -> None:
        """Hash every file again from now on: corruption after a save changes neither size nor mtime,
        so a manager that hashed (or wrote) a file long ago must not vouch for it now (a rollback)."""
        self._verifier.forget()

    def status(self, step: int, *, need_optimizer: bool = True) -> CheckpointStatus:
        """Check one step's files against its meta (sizes, then hashes). Never raises for bad files.
        `need_optimizer=False`: the weights alone (generate, eval), so a step whose optimizer file was
        deleted to save space still counts. A sharded step: every file its meta records in its shard
        directory (weights and optimizer state share files), whatever `need_optimizer` says."""
        return self._verifier.status(step, need_optimizer=need_optimizer)

    def verified_steps(self, *, warn: bool = False, need_optimizer: bool = True) -> list[int]:
        """Steps that can be loaded (verified, or complete seed-format), ascending."""
        good = []
        for step in self.list_steps():
            st = self.status(step, need_optimizer=need_optimizer)
            if st.loadable:
                good.append(step)
            elif warn:
                warnings.warn(f"skipping checkpoint step {step}: {'; '.join(st.problems)}", stacklevel=2)
        return good

    def latest_step(self, *, need_optimizer: bool = True) -> int | None:
        """The newest loadable step, or None. Each newer bad step is skipped with a warning naming the
        bad file(s); older steps are not checked once a good one is found."""
        st = self.latest_status(need_optimizer=need_optimizer)
        return None if st is None else st.step

    def latest_status(self, *, need_optimizer: bool = True) -> CheckpointStatus | None:
        """`latest_step`'s choice as the status that verified it (each step checked once), or None."""
        steps = self.list_steps()
        for i, step in reversed(list(enumerate(steps))):
            st = self.status(step, need_optimizer=need_optimizer)
            if st.loadable:
                return st
            then = "trying an older one" if i else "and there is no older one"
            warnings.warn(
                f"checkpoint step {step} is not usable, {then}: {'; '.join(st.problems)}", stacklevel=3
            )
        return None

    # ----------------------------------------------------------------------------------- loading
    def load(
        self,
        step: int,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        map_location: str | torch.device = "cpu",
        *,
        averaged: bool = False,
        verified: CheckpointStatus | None = None,
    ) -> dict:
        """Verify step `step`, load its weights into `model` and its state into `optimizer` (either may
        be None), and return the meta dict. CheckpointError naming the file if anything is wrong. The
        optimizer file is checked only when `optimizer` is given. `averaged`: the model gets the step's
        averaged weights when it has them (`has_average(meta)`), else its weights (what users of a
        trained model read); training resumes from the weights (the default). `verified`: the step's
        loadable status from a check just made (`RunDir.load`), which is not made again."""
        st = self._loadable_status(step, optimizer is not None, verified)
        meta = st.meta if st.meta is not None else self.read_meta(step)
        paths = checkpoint_files(self.dir, step)
        if optimizer is not None and model is None:
            raise AssertionError("loading optimizer state needs the model (names -> parameters)")
        if st.sharded:
            if model is not None:
                load_sharded(sharded_dir(self.dir, step), meta, model, optimizer)
            return meta
        if model is not None:
            tied = meta.get("tied") if st.format == META_FORMAT else {}
            use_average = averaged and has_average(meta)
            load_weights(average_file(self.dir, step) if use_average else paths["model"], model, tied)
        if optimizer is not None:
            load_optimizer_file(optimizer, model, meta, paths["optim"], map_location)
        return meta

    def _loadable_status(
        self, step: int, need_optimizer: bool, verified: CheckpointStatus | None
    ) -> CheckpointStatus:
        """`verified` (a check just made, of the weights alone), else the step checked now; the
        CheckpointError `load` raises, listing the loadable steps, when it cannot be loaded."""
        if verified is not None:
            assert verified.step == step and verified.loadable and not need_optimizer, verified
            return verified
        st = self.status(step, need_optimizer=need_optimizer)
        if not st.loadable:
            available = self.verified_steps(need_optimizer=need_optimizer)
            raise CheckpointError(
                f"checkpoint step {step} in {self.dir} cannot be loaded: {'; '.join(st.problems)}. "
                f"Loadable steps: {available or 'none'}"
            )
        return st

    def read_average(self, step: int) -> dict[str, torch.Tensor] | None:
        """The averaged weights of step `step` (a state_dict, tied aliases filled), or None when it has
        none. Call after `load` of the same step, which verified them."""
        meta = self.read_meta(step)
        if not has_average(meta):
            return None
        return read_model_file(average_file(self.dir, step), meta.get("tied") or {})

    def stored_dtypes(self, verified: CheckpointStatus, *, averaged: bool = False) -> dict[str, torch.dtype]:
        """{state_dict name: dtype} of the weights a loadable step stores, in either format: what
        `load(..., averaged=averaged)` reads (a tied alias is absent when the file holds it once)."""
        assert verified.loadable and verified.meta is not None, verified
        step = verified.step
        if verified.sharded:
            return sharded_files().stored_dtypes(sharded_dir(self.dir, step))
        use_average = averaged and has_average(verified.meta)
        path = average_file(self.dir, step) if use_average else checkpoint_files(self.dir, step)["model"]
        return tensor_dtypes(path)

    # --------------------------------------------------------------------------------- retention
    def delete(self, step: int) -> None:
        """Remove a step's files and shard directory, meta first (so a half-deleted step is never
        'verified')."""
        retention.delete_step(self.dir, step)

    def prune(self) -> list[int]:
        """Keep the newest keep_last_n verified steps; delete older steps (verified or not). Steps newer
        than the newest verified one (a save in progress elsewhere, or torn) are never touched, and the
        newest verified step is never deleted. Returns the deleted steps."""
        if self.keep_last_n == 0:
            return []
        deleted = retention.steps_to_prune(self.verified_steps(), self.list_steps(), self.keep_last_n)
        for s in deleted:
            self.delete(s)
        return deleted

    def remove_stale_temp_files(self) -> list[str]:
        """Delete the temp files and meta-less shard directories of saves that never finished
        (retention.py). Call only when no save can be running (the trainer holds the run lock; `save`
        calls it first, after finishing its own pending save). Returns the removed names."""
        return retention.remove_stale_temp_files(self.dir)

    def move_aside(
        self, steps: list[int], subdir: str = SUPERSEDED_DIRNAME, *, from_step: int | None = None
    ) -> Path:
        """Move whole steps (triples, or a shard directory and its meta) into a new folder of their own,
        DIR/subdir/<UTC time>-from-step-<from_step>/ (or ...-steps-<first>-<last>/ when `from_step`, the
        step resumed from, is not given), and return it. Used when resuming an older step: the newer ones
        would otherwise be resumed after a crash. Nothing is deleted or overwritten: each abandoned
        timeline gets its own folder (a counter suffix if the name is taken), so resuming the same older
        step twice keeps both abandoned timelines."""
        return retention.move_aside(self.dir, steps, subdir, from_step)

    def __iter__(self) -> Iterator[int]:
        return iter(self.list_steps())
