"""CheckpointManager: the seed's three files per step, written atomically and verified on load.

    DIR/model_step_N.safetensors   weights; tied tensors stored ONCE (aliases listed in meta and in the
                                   safetensors header), re-tied on load
    DIR/optim_step_N.pt            optimizer state keyed by PARAMETER NAME (torch.save, weights_only load)
    DIR/meta_step_N.json           written LAST: step, config, counters, scheduler/sampler/RNG states,
                                   dataset identity, last metrics, W&B run id, and the size and sha256
                                   of the other two files

Fixes of the seed's defects (its "Checkpointing" section):
- Every file is written atomically (temp file, fsync, rename, directory fsync): the meta through
  `shards.atomic_write_json`, the two big files streamed through `HashingAtomicFile` (sha256 read back
  during the fsync, no in-memory copy of the state); the seed only claimed it ("Honesty check").
- A step counts only when its meta parses and both other files match the recorded sizes and hashes,
  so a torn-but-complete triple (Pitfall 1) is detected, and the meta carries the sha256 of its own
  content (`meta_sha256`), so an edit that still parses is detected too; `latest_step()` skips it
  with a warning naming the bad file and returns the newest VERIFIED step.
- The tied embedding is written once, not twice (Pitfall 2); seed-format files with both copies load.
- Optimizer moments are keyed by parameter name, so a changed parameter order cannot silently put
  moments on the wrong tensors (Pitfall 4). Loading uses weights_only=True throughout.
- `load(N)` loads exactly N or raises `CheckpointError` naming the file (Pitfall 6 is the trainer's).

Seed-format checkpoints (a meta with none of our keys "format", "files", "meta_sha256"; no hashes, both
tied copies, index-keyed optimizer state) are accepted as "unverified": they load when all three files
are present, the meta parses, the weights file's header covers the file and the optimizer file is a whole
zip archive (its central directory, at the end, is readable), so a truncated seed save is skipped too.
A meta with any of our keys but an unknown "format" value is not loadable (a flipped bit must not
switch verification off).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mamba3lite.data.shards import atomic_write_json, fsync_dir, sha256_file
from mamba3lite.dirlock import DirLock
from mamba3lite.errors import CheckpointError

META_FORMAT = "mamba3lite-checkpoint-v1"
OPTIM_FORMAT = "mamba3lite-optim-v1"
LOCK_NAME = ".lock"
# Test-only fault injection: seconds to sleep after each data file of a save (before the meta), so that
# a test can kill or signal a process inside the save window reliably. Unset (the default): no pause.
SLOW_SAVE_ENV = "MAMBA3LITE_TEST_SLOW_SAVE"
_NAME_RE = re.compile(r"^(model|optim|meta)_step_(\d+)\.(safetensors|pt|json)$")
_EXT = {"model": "safetensors", "optim": "pt", "meta": "json"}
# Temp files of the atomic writers (mkstemp prefix ".NAME.", suffix ".tmp") for checkpoint files.
_TEMP_RE = re.compile(r"^\.(model|optim|meta)_step_\d+\.(safetensors|pt|json)\..+\.tmp$")
# Keys that only our metas have: a meta with none of them is the seed's (unverified) format; one with any of
# them is ours and must pass every check, whatever its "format" value has become.
_PROJECT_META_KEYS = ("format", "files", "meta_sha256")
# Types of our metas' fields (absent ones are not checked).
_META_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "tokens_seen": int,
    "files": dict,
    "config": dict,
    "data": (dict, type(None)),
    "metrics": (dict, type(None)),
    "last_eval": (dict, type(None)),
    "sampler": dict,
    "rng": dict,
    "tied": dict,
    "has_optimizer": bool,
    "wandb_run_id": (str, type(None)),
}


def checkpoint_files(directory: Path, step: int) -> dict[str, Path]:
    """The three paths of one step: {"model": ..., "optim": ..., "meta": ...}."""
    return {kind: Path(directory) / f"{kind}_step_{step}.{ext}" for kind, ext in _EXT.items()}


def _sha256(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()  # releases the GIL on big buffers: runs beside the writes


def _meta_digest(record: dict) -> str:
    """sha256 of a meta record without its own `meta_sha256`, over a canonical JSON form (round-tripped
    first, so int dict keys and tuples hash as they will read back)."""
    body = json.loads(json.dumps({k: v for k, v in record.items() if k != "meta_sha256"}))
    return _sha256(json.dumps(body, sort_keys=True).encode("utf-8"))


def _test_pause() -> None:
    delay = os.environ.get(SLOW_SAVE_ENV)
    if delay:
        time.sleep(float(delay))


def _safetensors_problem(path: Path) -> str | None:
    """None if `path` is a whole safetensors file (its header parses and covers the file), else why not."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except Exception as e:  # safetensors raises its own error types on truncated/corrupt files
        return f"{path}: unreadable ({e})"
    return None


def _zip_problem(path: Path) -> str | None:
    """None if `path` is a whole torch.save archive, else why not. Cheap: reads the zip's central
    directory (at the END of the file, so any truncation loses it) and the small pickle entry (CRC-checked),
    not the tensor data."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as z:
            pickles = [n for n in z.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
            if not pickles:
                return f"{path}: not a torch.save archive (no data.pkl)"
            z.read(pickles[0])
    except Exception as e:  # BadZipFile, OSError, EOFError, a bad CRC...: status() never raises
        return f"{path}: not a whole torch.save archive, truncated or corrupt ({e})"
    return None


@dataclass
class CheckpointStatus:
    """What is on disk for one step and whether it can be trusted."""

    step: int
    verified: bool  # meta parses and both other files match their recorded size and sha256
    loadable: bool  # verified, or a whole seed-format triple (no checksums to check)
    format: str | None  # META_FORMAT, "seed", or None when the meta is missing/unreadable/of unknown format
    problems: list[str] = field(default_factory=list)  # one line per bad/missing file, naming it
    sizes: dict[str, int | None] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------
# Model weights: tied tensors stored once
# ---------------------------------------------------------------------------------------------------


def _alias_key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def split_tied(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Drop every tensor that is the same view of the same storage as an earlier one.

    Returns (unique tensors, {alias_name: source_name}). For a tied LM head this keeps `embed.weight`
    and records {"lm_head.weight": "embed.weight"}: the embedding is written once.
    """
    first: dict[tuple, str] = {}
    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name, t in state.items():
        key = _alias_key(t)
        if key in first:
            aliases[name] = first[key]
        else:
            first[key] = name
            unique[name] = t
    return unique, aliases


_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class HashingAtomicFile:
    """A write-only file object for the big checkpoint files: bytes go to a temp file beside `path`;
    `commit()` flushes, then fsyncs on a worker thread WHILE reading the file back (page cache) into a
    sha256, then renames over `path` and fsyncs the directory (the protocol of shards.atomic_write_bytes,
    which needs the whole file in memory: a 440M model's AdamW state would be one 3 GB bytes object).
    Hashing during the fsync hides it behind the disk; the digest is of the bytes the file holds.
    (Measured: hashing beside each write() cost 2-3x more on a loaded 2-core machine, one thread
    hand-off per small write.) `abort()` removes the temp file; `path` is never touched before commit."""

    def __init__(self, path: Path) -> None:
        import tempfile

        self.path = Path(path)
        fd, self._tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
        os.fchmod(fd, 0o644)
        self._f = os.fdopen(fd, "wb", buffering=8 << 20)
        self.size = 0
        self.error: OSError | None = None  # the first write error (disk full...), kept for save()

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
        import threading

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
        os.replace(self._tmp, self.path)
        fsync_dir(self.path.parent)
        return digest

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self._f.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._tmp)


def write_safetensors(
    f: HashingAtomicFile, tensors: dict[str, torch.Tensor], metadata: dict[str, str]
) -> None:
    """Stream tensors in the safetensors format (8-byte header length, JSON header, raw little-endian
    data in header order) straight from their memory: no serialised copy of the model is built."""
    import struct
    import sys

    assert sys.byteorder == "little", "safetensors data is little-endian"
    header: dict[str, Any] = {}
    offset = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": _ST_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as the reference writer does
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    for t in tensors.values():
        if t.numel():
            f.write(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())


def load_model_file(path: Path, model: torch.nn.Module, aliases: dict[str, str] | None = None) -> None:
    """Load weights from a safetensors file into `model` (strict), re-creating tied aliases.

    Tied tensors stored once are filled from their source; files with both copies (the seed's) load
    as they are. `load_state_dict` copies in place (assign=False), so the model's own tying survives.
    """
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            header = f.metadata() or {}
            state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    except Exception as e:  # safetensors raises its own error types on truncated/corrupt files
        raise CheckpointError(f"{path}: cannot read weights ({e})") from None
    if aliases is None:
        aliases = json.loads(header.get("mamba3lite_tied", "{}"))
    for alias, source in aliases.items():
        if alias not in state and source in state:
            state[alias] = state[source]
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        first = str(e).strip().splitlines()
        raise CheckpointError(
            f"{path}: the weights do not fit this model ({' '.join(first[:3])[:400]}); "
            "is the model config the one this checkpoint was trained with?"
        ) from None


# ---------------------------------------------------------------------------------------------------
# Optimizer state keyed by parameter name
# ---------------------------------------------------------------------------------------------------


def param_names(model: torch.nn.Module) -> dict[int, str]:
    """id(parameter) -> its name; a tied parameter counts once, under the smallest of its names, so the
    key does not depend on the order in which modules were registered."""
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names[id(p)] = min(name, names.get(id(p), name))
    return names


def optimizer_state_by_name(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> dict:
    """The optimizer's state_dict with integer parameter ids replaced by parameter names."""
    names = param_names(model)
    sd = optimizer.state_dict()
    idx_to_name: dict[int, str] = {}
    for g_sd, group in zip(sd["param_groups"], optimizer.param_groups):
        for idx, p in zip(g_sd["params"], group["params"]):
            assert id(p) in names, "optimizer holds a parameter that is not in the model"
            idx_to_name[idx] = names[id(p)]
    return {
        "format": OPTIM_FORMAT,
        "state": {idx_to_name[i]: s for i, s in sd["state"].items()},
        "param_groups": [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [idx_to_name[i] for i in g["params"]]}
            for g in sd["param_groups"]
        ],
    }


def load_optimizer_state_by_name(
    optimizer: torch.optim.Optimizer, model: torch.nn.Module, saved: dict, where: str
) -> None:
    """Inverse of `optimizer_state_by_name`: map names onto this optimizer's parameters, checking that
    every parameter is present with the right shape (else CheckpointError naming it)."""
    names = param_names(model)
    current_groups = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    saved_groups = saved.get("param_groups", [])
    if len(saved_groups) != len(current_groups):
        raise CheckpointError(
            f"{where}: {len(saved_groups)} parameter groups saved, the optimizer has {len(current_groups)}"
        )
    by_name = {n: p for n, p in model.named_parameters(remove_duplicate=False)}
    state: dict[int, Any] = {}
    groups = []
    idx = 0
    for gi, (cur, old) in enumerate(zip(current_groups, saved_groups)):
        if set(cur) != set(old["params"]):
            missing = sorted(set(cur) - set(old["params"]))[:3]
            extra = sorted(set(old["params"]) - set(cur))[:3]
            raise CheckpointError(
                f"{where}: parameter group {gi} differs (not saved: {missing}, unknown: {extra}); "
                "the checkpoint was made for another model"
            )
        ids = []
        for name in cur:
            if name in saved["state"]:
                s = saved["state"][name]
                for k, v in s.items():
                    if torch.is_tensor(v) and v.dim() > 0 and v.shape != by_name[name].shape:
                        raise CheckpointError(
                            f"{where}: optimizer {k} of {name} has shape {tuple(v.shape)}, the parameter "
                            f"{tuple(by_name[name].shape)}"
                        )
                state[idx] = s
            ids.append(idx)
            idx += 1
        groups.append({**{k: v for k, v in old.items() if k != "params"}, "params": ids})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


# ---------------------------------------------------------------------------------------------------
# Run-directory lock
# ---------------------------------------------------------------------------------------------------


class RunLock(DirLock):
    """The run directory's lock (DIR/.lock), held by a trainer for a whole run: a second trainer on the
    same directory fails at once with a clear error instead of interleaving checkpoints with the first."""

    def __init__(self, directory: str | Path) -> None:
        super().__init__(
            directory, LOCK_NAME, "another trainer", "wait for it to finish or use another --checkpoint-dir",
            CheckpointError,
        )  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# The manager
# ---------------------------------------------------------------------------------------------------


class CheckpointManager:
    """Saves, verifies, finds, loads and prunes the checkpoints of one run directory."""

    def __init__(self, directory: str | Path, keep_last_n: int = 0) -> None:
        """keep_last_n: verified checkpoints kept after each save (0 = keep all)."""
        assert keep_last_n >= 0
        self.dir = Path(directory)
        self.keep_last_n = keep_last_n
        # (path, size, mtime_ns) -> sha256: latest_step() then load() hashes each file once.
        self._hash_cache: dict[tuple[str, int, int], str] = {}

    # ----------------------------------------------------------------------------------- writing
    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        meta: dict | None = None,
    ) -> Path:
        """Write the triple for `step` (model, optimizer, then meta last), each atomically; then apply
        retention. `meta` must be JSON-serialisable (no tensors): it is merged into the meta file.
        Returns the meta path."""

        assert step >= 0
        self.dir.mkdir(parents=True, exist_ok=True)
        self.remove_stale_temp_files()
        paths = checkpoint_files(self.dir, step)
        # An older triple of the same step (re-saved after a rollback) stops counting before anything
        # of the new one is written.
        with contextlib.suppress(FileNotFoundError):
            paths["meta"].unlink()
        unique, aliases = split_tied(model.state_dict())
        if optimizer is not None:
            optim_state = optimizer_state_by_name(optimizer, model)
        else:
            optim_state = {"format": OPTIM_FORMAT, "state": {}, "param_groups": []}
        # The model file's fsync + read-back hash runs on a worker while the optimizer file is written.
        digests: dict[str, str] = {}
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
                optim_out = HashingAtomicFile(paths["optim"])
                try:
                    torch.save(optim_state, optim_out)
                    digests["optim"] = optim_out.commit()
                except BaseException as e:
                    optim_out.abort()
                    if optim_out.error is not None and not isinstance(e, OSError):
                        # torch.save's zip writer turns a failed write (disk full) into RuntimeError
                        # "unexpected pos": re-raise the OSError, which names the cause.
                        raise optim_out.error from None
                    raise
                _test_pause()
            finally:
                try:
                    digests["model"] = model_commit.result()
                except BaseException:
                    model_out.abort()
                    raise
        sizes = {"model": model_out.size, "optim": optim_out.size}
        record = {
            **(meta or {}),
            "format": META_FORMAT,
            "step": step,
            "saved_at": time.time(),
            "tied": aliases,
            "has_optimizer": optimizer is not None,
            "files": {
                k: {"name": paths[k].name, "size": sizes[k], "sha256": digests[k]} for k in ("model", "optim")
            },
        }
        try:
            json.dumps(record)
        except TypeError as e:
            raise AssertionError(f"checkpoint meta must be JSON-serialisable: {e}") from None
        # The meta checks the other two files; this checks the meta itself, so a flipped byte that
        # still parses (a digit of the sampler position, say) is detected instead of silently resumed.
        record["meta_sha256"] = _meta_digest(record)
        atomic_write_json(paths["meta"], record)
        fsync_dir(self.dir)
        for kind in ("model", "optim"):  # what we just wrote needs no re-hash when loaded
            st = paths[kind].stat()
            self._hash_cache[(str(paths[kind]), st.st_size, st.st_mtime_ns)] = digests[kind]
        self.prune()
        return paths["meta"]

    def remove_stale_temp_files(self) -> list[str]:
        """Delete the temp files of saves that never finished: a process killed mid-write leaves
        `.model_step_N.safetensors.XXXX.tmp`, as big as the file it was becoming, and repeated
        preemptions would fill the disk. Call only when no save can be running (the trainer holds the
        run lock; `save` calls it first). Returns the removed names."""
        removed = []
        if self.dir.is_dir():
            for p in self.dir.iterdir():
                if _TEMP_RE.match(p.name):
                    with contextlib.suppress(FileNotFoundError):
                        p.unlink()
                        removed.append(p.name)
        return removed

    # ---------------------------------------------------------------------------------- discovery
    def list_steps(self) -> list[int]:
        """Every step with at least one of its files in the directory, ascending."""
        if not self.dir.is_dir():
            return []
        steps = set()
        for p in self.dir.iterdir():
            m = _NAME_RE.match(p.name)
            if m and _EXT[m.group(1)] == m.group(3):
                steps.add(int(m.group(2)))
        return sorted(steps)

    def read_meta(self, step: int) -> dict:
        """The parsed meta of a step (CheckpointError naming the file if missing or unreadable)."""
        path = checkpoint_files(self.dir, step)["meta"]
        try:
            meta = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise CheckpointError(f"{path} is missing (the save of step {step} did not finish)") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: unreadable ({e})") from None
        if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
            raise CheckpointError(f"{path}: not a checkpoint meta file (no integer `step`)")
        if meta["step"] != step:
            raise CheckpointError(f"{path}: records step {meta['step']}, not {step}")
        return meta

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
        deleted to save space still counts."""
        paths = checkpoint_files(self.dir, step)
        kinds = ("model", "optim") if need_optimizer else ("model",)
        sizes = {k: (p.stat().st_size if p.exists() else None) for k, p in paths.items()}
        problems: list[str] = []
        try:
            meta = self.read_meta(step)
        except CheckpointError as e:
            problems.append(str(e))
            for kind in kinds:
                if sizes[kind] is None:
                    problems.append(f"{paths[kind]} is missing")
            return CheckpointStatus(step, False, False, None, problems, sizes)
        digest_ok = "meta_sha256" not in meta or meta["meta_sha256"] == _meta_digest(meta)  # absent: older v1
        if not any(k in meta for k in _PROJECT_META_KEYS):
            # The seed's meta: no hashes to check, so check that both files are whole archives (their
            # structure, not every tensor): the seed's non-atomic save could leave them truncated.
            for kind in kinds:
                if sizes[kind] is None:
                    problems.append(f"{paths[kind]} is missing")
            if not problems:
                problems += [p for p in [_safetensors_problem(paths["model"])] if p]
                if need_optimizer and (bad := _zip_problem(paths["optim"])):
                    problems.append(bad)
            return CheckpointStatus(step, False, not problems, "seed", problems, sizes)
        if meta.get("format") != META_FORMAT:
            # One of our metas with a format we do not know: a damaged value (a flipped bit must not turn
            # verification off by making the step look like a seed-format one) or another version's file.
            why = "corrupt or edited" if not digest_ok else "written by another version of mamba3lite?"
            problems.append(
                f"{paths['meta']}: unknown checkpoint format {meta.get('format')!r}, "
                f"expected {META_FORMAT!r} ({why})"
            )
            return CheckpointStatus(step, False, False, None, problems, sizes)
        if not digest_ok:
            problems.append(f"{paths['meta']}: content differs from its meta_sha256 (corrupt or edited)")
        # An older meta has no digest to catch an edit: its fields' types are checked, as every reader
        # (trainer, eval, generate, inspect) relies on them.
        bad = [k for k, types in _META_FIELD_TYPES.items() if k in meta and not isinstance(meta[k], types)]
        if bad:
            problems.append(
                f"{paths['meta']}: field(s) {', '.join(bad)} of the wrong type (corrupt or edited)"
            )
        if problems:  # an edited or damaged meta: its other fields cannot be trusted to have any shape
            return CheckpointStatus(step, False, False, META_FORMAT, problems, sizes)
        for kind in kinds:
            want = meta.get("files", {}).get(kind)
            if not isinstance(want, dict):
                want = {}
            path = paths[kind]
            if sizes[kind] is None:
                problems.append(f"{path} is missing")
            elif sizes[kind] != want.get("size"):
                problems.append(f"{path} has {sizes[kind]} bytes, its meta records {want.get('size')}")
            elif self._cached_sha(path) != want.get("sha256"):
                problems.append(f"{path}: sha256 differs from its meta (corrupt file)")
        ok = not problems
        return CheckpointStatus(step, ok, ok, META_FORMAT, problems, sizes)

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
        steps = self.list_steps()
        for i, step in reversed(list(enumerate(steps))):
            st = self.status(step, need_optimizer=need_optimizer)
            if st.loadable:
                return step
            then = "trying an older one" if i else "and there is no older one"
            warnings.warn(
                f"checkpoint step {step} is not usable, {then}: {'; '.join(st.problems)}", stacklevel=2
            )
        return None

    # ----------------------------------------------------------------------------------- loading
    def load(
        self,
        step: int,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        map_location: str | torch.device = "cpu",
    ) -> dict:
        """Verify step `step`, load its weights into `model` and its state into `optimizer` (either may
        be None), and return the meta dict. CheckpointError naming the file if anything is wrong. The
        optimizer file is checked only when `optimizer` is given."""
        need_optimizer = optimizer is not None
        st = self.status(step, need_optimizer=need_optimizer)
        if not st.loadable:
            available = self.verified_steps(need_optimizer=need_optimizer)
            raise CheckpointError(
                f"checkpoint step {step} in {self.dir} cannot be loaded: {'; '.join(st.problems)}. "
                f"Loadable steps: {available or 'none'}"
            )
        meta = self.read_meta(step)
        paths = checkpoint_files(self.dir, step)
        if model is not None:
            load_model_file(paths["model"], model, meta.get("tied") if st.format == META_FORMAT else {})
        if optimizer is not None:
            if model is None:
                raise AssertionError("loading optimizer state needs the model (names -> parameters)")
            try:
                saved = torch.load(paths["optim"], map_location=map_location, weights_only=True)
            except Exception as e:
                raise CheckpointError(f"{paths['optim']}: cannot read optimizer state ({e})") from None
            if isinstance(saved, dict) and saved.get("format") == OPTIM_FORMAT:
                if not meta.get("has_optimizer", True):
                    raise CheckpointError(f"{paths['optim']}: this checkpoint holds no optimizer state")
                load_optimizer_state_by_name(optimizer, model, saved, str(paths["optim"]))
            else:
                self._load_seed_optimizer(optimizer, model, saved, paths["optim"])
        return meta

    @staticmethod
    def _load_seed_optimizer(
        optimizer: torch.optim.Optimizer, model: torch.nn.Module, saved: Any, path: Path
    ) -> None:
        """The seed's index-keyed state. The seed builds AdamW over `model.parameters()` (the tied
        embedding once) in ONE group, so saved index i is the i-th parameter of the model; that is mapped
        to its name and loaded by name into this optimizer's groups. (A file whose groups are shaped as
        this optimizer's is taken position by position.) Every moment's shape is checked: the order is
        assumed, so at least check what can be checked."""
        if not isinstance(saved, dict) or "state" not in saved or "param_groups" not in saved:
            raise CheckpointError(f"{path}: not an optimizer state file")
        saved_ids = [i for g in saved["param_groups"] for i in g["params"]]
        model_params = list(model.parameters())
        if len(saved["param_groups"]) == 1 and len(saved_ids) == len(model_params):
            names = param_names(model)
            by_name = {
                "state": {
                    names[id(p)]: saved["state"][i]
                    for i, p in zip(saved_ids, model_params)
                    if i in saved["state"]
                },
                "param_groups": [
                    {
                        **{k: v for k, v in g.items() if k != "params"},
                        "params": [names[id(p)] for p in g["params"]],
                    }
                    for g in optimizer.param_groups
                ],
            }
            load_optimizer_state_by_name(optimizer, model, by_name, f"{path} (seed format)")
            warnings.warn(
                f"{path}: seed-format (index-keyed) optimizer state, mapped by model order; shapes checked",
                stacklevel=3,
            )
            return
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if len(saved_ids) != len(params):
            raise CheckpointError(
                f"{path}: {len(saved_ids)} parameters saved, the optimizer has {len(params)}"
            )
        for i, p in zip(saved_ids, params):
            for k, v in saved["state"].get(i, {}).items():
                if torch.is_tensor(v) and v.dim() > 0 and v.shape != p.shape:
                    raise CheckpointError(
                        f"{path}: seed-format optimizer state {k}[{i}] has shape {tuple(v.shape)}, "
                        f"parameter {i} has {tuple(p.shape)}: parameter order changed"
                    )
        warnings.warn(f"{path}: seed-format (index-keyed) optimizer state; shapes checked", stacklevel=3)
        optimizer.load_state_dict(saved)

    # --------------------------------------------------------------------------------- retention
    def delete(self, step: int) -> None:
        """Remove a step's files, meta first (so a half-deleted triple is never 'verified')."""
        paths = checkpoint_files(self.dir, step)
        for kind in ("meta", "model", "optim"):
            with contextlib.suppress(FileNotFoundError):
                paths[kind].unlink()

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
        self, steps: list[int], subdir: str = "superseded", *, from_step: int | None = None
    ) -> Path:
        """Move whole triples into a new folder of their own, DIR/subdir/<UTC time>-from-step-<from_step>/
        (or ...-steps-<first>-<last>/ when `from_step`, the step resumed from, is not given), and return
        it. Used when resuming an older step: the newer ones would otherwise be resumed after a crash.
        Nothing is deleted or overwritten: each abandoned timeline gets its own folder (a counter suffix
        if the name is taken), so resuming the same older step twice keeps both abandoned timelines."""
        import itertools

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
            for p in checkpoint_files(self.dir, s).values():
                if p.exists():
                    os.replace(p, target / p.name)
        fsync_dir(target)
        fsync_dir(parent)
        fsync_dir(self.dir)
        return target

    def __iter__(self) -> Iterator[int]:
        return iter(self.list_steps())


# ---------------------------------------------------------------------------------------------------
# RNG states as JSON
# ---------------------------------------------------------------------------------------------------


def capture_rng_state() -> dict:
    """Python, numpy, torch (CPU) and CUDA RNG states as JSON-safe values (byte states in base64)."""
    import base64
    import random

    import numpy as np

    py = random.getstate()
    np_state = np.random.get_state()
    out = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode("ascii"),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [
            base64.b64encode(s.numpy().tobytes()).decode("ascii") for s in torch.cuda.get_rng_state_all()
        ]
    return out


def restore_rng_state(state: dict) -> None:
    """Inverse of `capture_rng_state` (a missing entry leaves that generator as it is)."""
    import base64
    import random

    import numpy as np

    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "torch" in state:
        raw = np.frombuffer(base64.b64decode(state["torch"]), dtype=np.uint8).copy()
        torch.set_rng_state(torch.from_numpy(raw))
    if "cuda" in state and torch.cuda.is_available():
        cuda = [
            torch.from_numpy(np.frombuffer(base64.b64decode(s), dtype=np.uint8).copy()) for s in state["cuda"]
        ]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
