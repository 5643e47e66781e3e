"""CheckpointManager: saves, verifies, finds, loads and prunes the checkpoints of one run directory.

Two step formats, one meta (written last: the commit marker):
- three files (model, optimizer, meta), written by rank 0 alone: single-process and DDP runs;
- sharded (sharded.py): a model whose parameters are DTensors (FSDP2/HSDP) is saved by EVERY rank, each
  writing its own shards with torch.distributed.checkpoint into DIR/dcp_step_N/, by default
  asynchronously (`save(..., async_save=True)`: the call returns once the state is copied, the files
  are written in the background); rank 0 writes the meta, with the size and sha256 of every shard file,
  once every rank's files are written. `finish_pending()` waits for that (the next save, a rollback and
  the end of training call it).

A step counts only when its meta parses and every file it records matches its size and hash, so a
torn-but-complete step is detected; `latest_step()` skips a bad step with a warning naming the bad file
and returns the newest VERIFIED step. `load(N)` loads exactly N, in either format, into a plain, DDP or
sharded model at any world size (or raises `CheckpointError` naming the file). Loading uses
weights_only=True throughout.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import threading
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mamba3lite import intake
from mamba3lite.atomicfile import HashingAtomicFile, atomic_write_json, fsync_dir, sha256_file
from mamba3lite.checkpoint.dtensor import is_sharded
from mamba3lite.checkpoint.meta import META_FORMAT, meta_digest, meta_problems, read_meta_file
from mamba3lite.checkpoint.optim_state import (
    OPTIM_FORMAT,
    check_optimizer_kind,
    load_optimizer_state_by_name,
    optimizer_kind,
    optimizer_state_by_name,
)
from mamba3lite.checkpoint.run_state import RunState
from mamba3lite.checkpoint.seed_format import is_seed_meta, load_seed_optimizer, seed_file_problems
from mamba3lite.checkpoint.weights import (
    load_model_file,
    read_model_file,
    split_tied,
    tensor_dtypes,
    write_safetensors,
)
from mamba3lite.errors import CheckpointError
from mamba3lite.rundir import (
    SUPERSEDED_DIRNAME,
    average_file,
    checkpoint_files,
    finished_save,
    is_temp_file,
    sharded_dir,
    step_of,
    steps_in,
)

# Test-only fault injection: seconds to sleep after each data file of a save (before the meta), so that
# a test can kill or signal a process inside the save window reliably. Unset (the default): no pause.
SLOW_SAVE_ENV = "MAMBA3LITE_TEST_SLOW_SAVE"


def _test_pause() -> None:
    delay = os.environ.get(SLOW_SAVE_ENV)
    if delay:
        time.sleep(float(delay))


# The sharded format's modules: sharded.py (DCP's files) and state.py (torch's state_dict API over
# DTensors). They import torch.distributed.checkpoint and DTensor, ~0.4 s of a command's start beside
# torch's own (python -X importtime), which a plain model in one process (generate, eval, serve, a
# one-process train) never needs: they are imported where a sharded model or step is first met
# (docs/architecture.md §6 rule 19: a measured start-up cost).
def _sharded_files():
    from mamba3lite.checkpoint import sharded

    return sharded


def _sharded_state():
    from mamba3lite.checkpoint import state

    return state


@dataclass
class CheckpointStatus:
    """What is on disk for one step and whether it can be trusted."""

    step: int
    verified: bool  # meta parses and both other files match their recorded size and sha256
    loadable: bool  # verified, or a whole seed-format triple (no checksums to check)
    format: str | None  # META_FORMAT, "seed", or None when the meta is missing/unreadable/of unknown format
    problems: list[str] = field(default_factory=list)  # one line per bad/missing file, naming it
    sizes: dict[str, int | None] = field(default_factory=dict)
    sharded: bool = False  # a sharded step (its shard directory is on disk)
    meta: dict | None = None  # the parsed meta (None when missing or unreadable): trusted when `loadable`


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


def has_average(meta: dict) -> bool:
    """Whether the step of `meta` holds averaged weights (average_step_N.safetensors, in its files)."""
    return "average" in (meta.get("files") or {})


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _gather_objects(obj: Any) -> list[Any]:
    """[obj of rank 0, obj of rank 1, ...] (a collective), or [obj] in one process."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _write_weights_file(path: Path, unique: dict[str, torch.Tensor], aliases: dict[str, str]) -> dict:
    """A safetensors file of `unique` (tied aliases in its header, as the model file), atomically;
    returns {"size", "sha256"} of the file."""
    out = HashingAtomicFile(path)
    try:
        write_safetensors(
            out, unique, {"format": "pt", "mamba3lite_tied": json.dumps(aliases, sort_keys=True)}
        )
        return {"size": out.size, "sha256": out.commit()}
    except BaseException:
        out.abort()
        raise


def _write_optimizer_file(path: Path, optim_state: dict) -> dict:
    """torch.save the optimizer state atomically; returns {"size", "sha256"} of the file."""
    out = HashingAtomicFile(path)
    try:
        torch.save(optim_state, out)
        return {"size": out.size, "sha256": out.commit()}
    except BaseException as e:
        out.abort()
        if out.error is not None and not isinstance(e, OSError):
            # torch.save's zip writer turns a failed write (disk full) into RuntimeError
            # "unexpected pos": re-raise the OSError, which names the cause.
            raise out.error from None
        raise


class CheckpointManager:
    """Saves, verifies, finds, loads and prunes the checkpoints of one run directory."""

    def __init__(self, directory: str | Path, keep_last_n: int = 0) -> None:
        """keep_last_n: verified checkpoints kept after each save (0 = keep all)."""
        assert keep_last_n >= 0
        self.dir = Path(directory)
        self.keep_last_n = keep_last_n
        # (path, size, mtime_ns) -> sha256: latest_step() then load() hashes each file once.
        self._hash_cache: dict[tuple[str, int, int], str] = {}
        self._pending: _PendingSave | None = None  # a sharded save not yet committed (its meta unwritten)
        self._background_group: Any = None  # the gloo group of async saves' collectives, made at the first

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
        atomically. Sharded
        (`saves_sharded(model, sharded)`; every rank calls it, each with its own `state`, whose RNG
        states are gathered into the meta): see `_save_sharded`; `async_save` returns before the files
        are written, and the meta path it returns exists only after `finish_pending()`.

        `average`: the averaged weights (train/averaging.py: a state_dict of the model's keys), written to
        a fourth file, average_step_N.safetensors, recorded in the meta's files as "average" (three-file
        format only: sharded runs do not average)."""
        assert step >= 0
        state = RunState(step=step) if state is None else state
        assert state.step == step, f"the run state is of step {state.step}, saved as step {step}"
        if self.saves_sharded(model, sharded):
            assert average is None, "weight averaging is refused for sharded runs (config.py)"
            return self._save_sharded(step, model, optimizer, state, async_save)
        self.finish_pending()
        paths = checkpoint_files(self.dir, step)
        gathered = is_sharded(model)
        if gathered:  # whole tensors, gathered to rank 0 (a collective; the other ranks get none)
            whole = _sharded_state().full_model_state(model)
            whole_optim = (
                None if optimizer is None else _sharded_state().full_optimizer_state(model, optimizer)
            )
            if _rank() != 0:
                _barrier()  # until rank 0 has written them
                return paths["meta"]
        self.dir.mkdir(parents=True, exist_ok=True)
        self.remove_stale_temp_files()
        # An older triple of the same step (re-saved after a rollback) stops counting before anything
        # of the new one is written.
        with contextlib.suppress(FileNotFoundError):
            paths["meta"].unlink()
        unique, aliases = split_tied(whole if gathered else model.state_dict())
        if optimizer is not None:
            optim_state = whole_optim if gathered else optimizer_state_by_name(optimizer, model)
        else:
            optim_state = {"format": OPTIM_FORMAT, "state": {}, "param_groups": []}
        files = self._write_data_files(paths, unique, aliases, optim_state)
        if average is not None:  # written before the meta: the meta vouches for it too
            paths = {**paths, "average": average_file(self.dir, step)}
            files["average"] = _write_weights_file(paths["average"], split_tied(average)[0], aliases)
        record = self._record(step, state, optimizer is not None)
        record["tied"] = aliases
        record["files"] = {k: {"name": paths[k].name, **files[k]} for k in files}
        self._write_meta(paths["meta"], record)
        for kind in files:  # what we just wrote needs no re-hash when loaded
            self._remember_sha(paths[kind], files[kind]["sha256"])
        self.prune()
        if gathered:
            _barrier()
        return paths["meta"]

    @staticmethod
    def _record(step: int, state: RunState, has_optimizer: bool) -> dict:
        """The meta of `step` but for its file fields."""
        record = {
            **state.to_meta(),
            "format": META_FORMAT,
            "step": step,
            "saved_at": time.time(),
            "tied": {},
            "has_optimizer": has_optimizer,
            "files": {},
        }
        try:
            json.dumps(record)
        except TypeError as e:
            raise AssertionError(f"checkpoint meta must be JSON-serialisable: {e}") from None
        return record

    def _write_meta(self, path: Path, record: dict) -> None:
        # The meta checks the other files; this checks the meta itself, so a flipped byte that still
        # parses (a digit of the sampler position, say) is detected instead of silently resumed.
        record["meta_sha256"] = meta_digest(record)
        atomic_write_json(path, record)
        fsync_dir(self.dir)

    def _remember_sha(self, path: Path, sha: str) -> None:
        st = path.stat()
        self._hash_cache[(str(path), st.st_size, st.st_mtime_ns)] = sha

    # ------------------------------------------------------------------------------ sharded saves
    def _save_sharded(
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
        `finish_pending`, whichever first). Collective: every rank calls it."""
        self.finish_pending()  # one save at a time; the previous one's meta first
        paths = checkpoint_files(self.dir, step)
        if _rank() == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            self.remove_stale_temp_files()
            self.delete(step)  # an older save of the same step (re-saved after a rollback), meta first
        rngs = _gather_objects(state.rng)
        _barrier()  # no rank writes into the directory before rank 0 has cleared it
        dcp_state = _sharded_state()
        content: dict[str, Any] = {"model": dcp_state.local_model_state(model)}
        if optimizer is not None:
            content["optim"] = dcp_state.local_optimizer_state(model, optimizer)
        group = self._async_group() if async_save else None
        future = _sharded_files().write_shards(
            sharded_dir(self.dir, step),
            content,
            async_save=async_save,
            process_group=group,
            pause=_test_pause,
        )
        pending = _PendingSave(step, future)
        if _rank() == 0:
            state = RunState(**{**vars(state), "rank_rngs": rngs})
            pending.record = self._record(step, state, optimizer is not None)
            pending.optimizer = None if optimizer is None else optimizer_kind(optimizer)
            if future is not None:
                pending.committer = threading.Thread(
                    target=self._commit, args=(pending,), name=f"commit-step-{step}", daemon=True
                )
                pending.committer.start()
        self._pending = pending
        if future is None:
            self.finish_pending()
            _barrier()  # a synchronous save has its meta when it returns, on every rank
        return paths["meta"]

    def _async_group(self) -> Any:
        """The gloo process group of the async saves' background collectives (torchtitan's choice): on the
        training's group they could interleave with its collectives. Made once, by every rank."""
        if self._background_group is None and dist.is_available() and dist.is_initialized():
            self._background_group = dist.new_group(backend="gloo")
        return self._background_group

    def _commit(self, pending: _PendingSave) -> None:
        """Rank 0: wait for the shards, hash every file, write the meta (the commit marker), prune."""
        try:
            if pending.future is not None:
                pending.future.result()
            sdir = sharded_dir(self.dir, pending.step)
            files = {}
            for name in _sharded_files().shard_file_names(sdir):
                path = sdir / name
                sha = sha256_file(path)
                files[name] = {"size": path.stat().st_size, "sha256": sha}
                self._remember_sha(path, sha)
            record = dict(pending.record or {})
            record["shards"] = {"dir": sdir.name, "files": files}
            if pending.optimizer is not None:
                record["shards"]["optimizer"] = pending.optimizer
            self._write_meta(checkpoint_files(self.dir, pending.step)["meta"], record)
            self.prune()
        except BaseException as e:  # re-raised by finish_pending, in the caller's thread
            pending.error = e

    def pending_step(self) -> int | None:
        """The step of a sharded save not yet finished (see `finish_pending`), or None."""
        return None if self._pending is None else self._pending.step

    def finish_pending(self) -> None:
        """Finish the pending sharded save, if any: wait for this rank's files and, on rank 0, for the
        meta (hashes of every shard, then the meta file). Call it before the next save, before a rollback
        and before the process exits; a process killed first leaves the step without a meta, which was
        never a checkpoint (the next start deletes its files). Raises what the save raised."""
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

    @staticmethod
    def _write_data_files(
        paths: dict[str, Path], unique: dict[str, torch.Tensor], aliases: dict[str, str], optim_state: dict
    ) -> dict[str, dict]:
        """The weights and optimizer files, each atomically: {"model"/"optim": {"size", "sha256"}}. The
        model file's fsync + read-back hash runs on a worker while the optimizer file is written."""
        model_out = HashingAtomicFile(paths["model"])
        try:
            tied = json.dumps(aliases, sort_keys=True)
            write_safetensors(model_out, unique, {"format": "pt", "mamba3lite_tied": tied})
        except BaseException:
            model_out.abort()
            raise
        with ThreadPoolExecutor(max_workers=1) as pool:
            model_commit = pool.submit(model_out.commit)
            try:
                _test_pause()
                optim_file = _write_optimizer_file(paths["optim"], optim_state)
                _test_pause()
            finally:
                try:
                    model_digest = model_commit.result()
                except BaseException:
                    model_out.abort()
                    raise
        return {
            "model": {"size": model_out.size, "sha256": model_digest},
            "optim": optim_file,
        }

    def remove_stale_temp_files(self) -> list[str]:
        """Delete the temp files of saves that never finished: a process killed mid-write leaves
        `.model_step_N.safetensors.XXXX.tmp`, as big as the file it was becoming, and repeated
        preemptions would fill the disk; and the shard directories of sharded saves without a meta (a
        kill during an async save). Call only when no save can be running (the trainer holds the run
        lock; `save` calls it first, after finishing its own pending save). Returns the removed names."""
        removed = []
        if self.dir.is_dir():
            for p in self.dir.iterdir():
                if is_temp_file(p.name):
                    with contextlib.suppress(FileNotFoundError):
                        p.unlink()
                        removed.append(p.name)
                elif p.is_dir() and (s := step_of(p.name)) is not None and not finished_save(self.dir, s):
                    shutil.rmtree(p, ignore_errors=True)
                    removed.append(p.name)
        return removed

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
        self._hash_cache.clear()

    def _cached_sha(self, path: Path) -> str:
        st = path.stat()
        key = (str(path), st.st_size, st.st_mtime_ns)
        if key not in self._hash_cache:
            self._hash_cache[key] = sha256_file(path)
        return self._hash_cache[key]

    def status(self, step: int, *, need_optimizer: bool = True) -> CheckpointStatus:
        """Check one step's files against its meta (sizes, then hashes). Never raises for bad files.
        `need_optimizer=False`: the weights alone (generate, eval), so a step whose optimizer file was
        deleted to save space still counts. A sharded step: every file its meta records in its shard
        directory (weights and optimizer state share files), whatever `need_optimizer` says."""
        paths = checkpoint_files(self.dir, step)
        sdir = sharded_dir(self.dir, step)
        kinds = ("model", "optim") if need_optimizer else ("model",)
        sizes = {k: (p.stat().st_size if p.exists() else None) for k, p in paths.items()}
        has_shards = sdir.is_dir()
        if has_shards:  # for `inspect`: the shards' bytes in all
            sizes["shards"] = sum(f.stat().st_size for f in sdir.iterdir() if f.is_file())
        try:
            meta = self.read_meta(step)
        except CheckpointError as e:
            if has_shards:  # a sharded save killed before its meta
                problems = [str(e), f"{sdir} holds the shards of a save that did not finish"]
            else:
                problems = [str(e), *(f"{paths[kind]} is missing" for kind in kinds if sizes[kind] is None)]
            return CheckpointStatus(step, False, False, None, problems, sizes, has_shards)
        if is_seed_meta(meta):
            problems = seed_file_problems(paths, kinds)
            return CheckpointStatus(step, False, not problems, "seed", problems, sizes, meta=meta)
        fmt, problems = meta_problems(meta, paths["meta"])
        sharded = isinstance(meta.get("shards"), dict)
        if not problems:  # an edited or damaged meta: its other fields cannot be trusted to have any shape
            if sharded:
                problems = _sharded_files().shard_problems(meta["shards"], sdir, self._cached_sha)
            else:
                if "average" in meta.get("files", {}):  # every user of the step may read the average
                    kinds, paths = (*kinds, "average"), {**paths, "average": average_file(self.dir, step)}
                    sizes["average"] = paths["average"].stat().st_size if paths["average"].exists() else None
                problems = self._data_file_problems(meta, paths, sizes, kinds)
        ok = not problems
        return CheckpointStatus(step, ok, ok, fmt, problems, sizes, sharded, meta)

    def _data_file_problems(
        self, meta: dict, paths: dict[str, Path], sizes: dict[str, int | None], kinds: tuple[str, ...]
    ) -> list[str]:
        """Each data file `kinds` against the size and sha256 its (trusted) meta records."""
        problems = []
        for kind in kinds:
            want = meta.get("files", {}).get(kind)
            want = want if isinstance(want, dict) else {}
            path = paths[kind]
            if sizes[kind] is None:
                problems.append(f"{path} is missing")
            elif sizes[kind] != want.get("size"):
                problems.append(f"{path} has {sizes[kind]} bytes, its meta records {want.get('size')}")
            elif self._cached_sha(path) != want.get("sha256"):
                problems.append(f"{path}: sha256 differs from its meta (corrupt file)")
        return problems

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
        need_optimizer = optimizer is not None
        if verified is None:
            st = self.status(step, need_optimizer=need_optimizer)
        else:
            assert verified.step == step and verified.loadable and not need_optimizer, verified
            st = verified
        if not st.loadable:
            available = self.verified_steps(need_optimizer=need_optimizer)
            raise CheckpointError(
                f"checkpoint step {step} in {self.dir} cannot be loaded: {'; '.join(st.problems)}. "
                f"Loadable steps: {available or 'none'}"
            )
        meta = st.meta if st.meta is not None else self.read_meta(step)
        paths = checkpoint_files(self.dir, step)
        if optimizer is not None and model is None:
            raise AssertionError("loading optimizer state needs the model (names -> parameters)")
        if st.sharded:
            if model is not None:
                self._load_sharded(step, meta, model, optimizer)
            return meta
        if model is not None:
            tied = meta.get("tied") if st.format == META_FORMAT else {}
            if averaged and has_average(meta):
                paths = {**paths, "model": average_file(self.dir, step)}
            if is_sharded(model):  # whole tensors from the file, each rank keeps its shards
                _sharded_state().set_full_model_state(model, read_model_file(paths["model"], tied))
            else:
                load_model_file(paths["model"], model, tied)
        if optimizer is not None:
            self._load_optimizer(optimizer, model, meta, paths["optim"], map_location)
        return meta

    def read_average(self, step: int) -> dict[str, torch.Tensor] | None:
        """The averaged weights of step `step` (a state_dict, tied aliases filled), or None when it has
        none. Call after `load` of the same step, which verified them."""
        meta = self.read_meta(step)
        if not has_average(meta):
            return None
        return read_model_file(average_file(self.dir, step), meta.get("tied") or {})

    def _load_sharded(
        self, step: int, meta: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
    ) -> None:
        """A sharded step into `model` (plain, DDP's module or sharded, at any world size: DCP reshards;
        in one process without a process group it reads every shard) and `optimizer`."""
        sdir = sharded_dir(self.dir, step)
        if optimizer is not None:
            if not meta.get("has_optimizer", True):
                raise CheckpointError(f"{sdir}: this checkpoint holds no optimizer state")
            check_optimizer_kind(meta["shards"].get("optimizer", "adamw"), optimizer, str(sdir))
        dcp_state = _sharded_state()
        content: dict[str, Any] = {"model": dcp_state.local_model_state(model)}
        if optimizer is not None:
            content["optim"] = dcp_state.local_optimizer_state(model, optimizer)
        _sharded_files().read_shards(sdir, content)
        dcp_state.set_local_state(model, optimizer, content["model"], content.get("optim"))

    @staticmethod
    def _load_optimizer(
        optimizer: torch.optim.Optimizer,
        model: torch.nn.Module,
        meta: dict,
        path: Path,
        map_location: str | torch.device,
    ) -> None:
        intake.regular_file_size(path, intake.OPTIMIZER_STATE)  # torch.load would block on a FIFO
        try:
            saved = torch.load(path, map_location=map_location, weights_only=True)
        except Exception as e:
            raise CheckpointError(
                f"{path}: cannot read optimizer state ({intake.torch_load_refusal(e)})"
            ) from None
        if not (isinstance(saved, dict) and saved.get("format") == OPTIM_FORMAT):
            load_seed_optimizer(optimizer, model, saved, path)
            return
        if not meta.get("has_optimizer", True):
            raise CheckpointError(f"{path}: this checkpoint holds no optimizer state")
        if is_sharded(model):
            check_optimizer_kind(saved.get("optimizer", "adamw"), optimizer, str(path))
            _sharded_state().set_full_optimizer_state(model, optimizer, saved)
            return
        load_optimizer_state_by_name(optimizer, model, saved, str(path))

    def stored_dtypes(self, verified: CheckpointStatus, *, averaged: bool = False) -> dict[str, torch.dtype]:
        """{state_dict name: dtype} of the weights a loadable step stores, in either format: what
        `load(..., averaged=averaged)` reads (a tied alias is absent when the file holds it once)."""
        assert verified.loadable and verified.meta is not None, verified
        step = verified.step
        if verified.sharded:
            return _sharded_files().stored_dtypes(sharded_dir(self.dir, step))
        use_average = averaged and has_average(verified.meta)
        path = average_file(self.dir, step) if use_average else checkpoint_files(self.dir, step)["model"]
        return tensor_dtypes(path)

    # --------------------------------------------------------------------------------- retention
    def delete(self, step: int) -> None:
        """Remove a step's files and shard directory, meta first (so a half-deleted step is never
        'verified')."""
        paths = checkpoint_files(self.dir, step)
        for path in (paths["meta"], paths["model"], paths["optim"], average_file(self.dir, step)):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        shutil.rmtree(sharded_dir(self.dir, step), ignore_errors=True)

    def prune(self) -> list[int]:
        """Keep the newest keep_last_n verified steps; delete older steps (verified or not). Steps newer
        than the newest verified one (a save in progress elsewhere, or torn) are never touched, and the
        newest verified step is never deleted. Returns the deleted steps."""
        if self.keep_last_n == 0:
            return []
        good = self.verified_steps()
        if not good:
            return []
        keep = set(good[-self.keep_last_n :])
        oldest_kept = min(keep)
        deleted = [s for s in self.list_steps() if s < oldest_kept and s not in keep]
        for s in deleted:
            self.delete(s)
        return deleted

    def move_aside(
        self, steps: list[int], subdir: str = SUPERSEDED_DIRNAME, *, from_step: int | None = None
    ) -> Path:
        """Move whole steps (triples, or a shard directory and its meta) into a new folder of their own,
        DIR/subdir/<UTC time>-from-step-<from_step>/ (or ...-steps-<first>-<last>/ when `from_step`, the
        step resumed from, is not given), and return it. Used when resuming an older step: the newer ones
        would otherwise be resumed after a crash. Nothing is deleted or overwritten: each abandoned
        timeline gets its own folder (a counter suffix if the name is taken), so resuming the same older
        step twice keeps both abandoned timelines."""
        assert steps, "nothing to move aside"
        parent = self.dir / subdir
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
                *checkpoint_files(self.dir, s).values(),
                average_file(self.dir, s),
                sharded_dir(self.dir, s),
            ]:
                if p.exists():
                    os.replace(p, target / p.name)
        fsync_dir(target)
        fsync_dir(parent)
        fsync_dir(self.dir)
        return target

    def __iter__(self) -> Iterator[int]:
        return iter(self.list_steps())
