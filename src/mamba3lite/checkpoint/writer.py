"""Writing a step's files: the weights, the optimizer state and the meta, each atomically.

The data files are streamed through `HashingAtomicFile` (temp file, fsync, sha256 read back, rename), so
each comes back as {"size", "sha256"} for the meta to record; the meta (`meta_record` + `write_meta`) is
written last, with its own digest: it is the commit marker of both step formats.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from mamba3lite.atomicfile import HashingAtomicFile, atomic_write_json, fsync_dir
from mamba3lite.checkpoint.dtensor import is_sharded
from mamba3lite.checkpoint.lazy import sharded_state
from mamba3lite.checkpoint.meta import META_FORMAT, meta_digest
from mamba3lite.checkpoint.optim_state import OPTIM_FORMAT, optimizer_state_by_name
from mamba3lite.checkpoint.run_state import RunState
from mamba3lite.checkpoint.weights import write_safetensors

# Test-only fault injection: seconds to sleep after each data file of a save (before the meta), so that
# a test can kill or signal a process inside the save window reliably. Unset (the default): no pause.
SLOW_SAVE_ENV = "MAMBA3LITE_TEST_SLOW_SAVE"


def pause_for_tests() -> None:
    """Sleep SLOW_SAVE_ENV seconds when it is set (tests), else return at once."""
    delay = os.environ.get(SLOW_SAVE_ENV)
    if delay:
        time.sleep(float(delay))


def write_weights_file(path: Path, unique: dict[str, torch.Tensor], aliases: dict[str, str]) -> dict:
    """A safetensors file of `unique` (tied aliases in its header), atomically; returns {"size",
    "sha256"} of the file."""
    out = HashingAtomicFile(path)
    try:
        _write_weights(out, unique, aliases)
        return {"size": out.size, "sha256": out.commit()}
    except BaseException:
        out.abort()
        raise


def _write_weights(out: HashingAtomicFile, unique: dict[str, torch.Tensor], aliases: dict[str, str]) -> None:
    write_safetensors(out, unique, {"format": "pt", "mamba3lite_tied": json.dumps(aliases, sort_keys=True)})


def write_optimizer_file(path: Path, optim_state: dict) -> dict:
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


def write_data_files(
    paths: dict[str, Path], unique: dict[str, torch.Tensor], aliases: dict[str, str], optim_state: dict
) -> dict[str, dict]:
    """The weights and optimizer files, each atomically: {"model"/"optim": {"size", "sha256"}}. The
    model file's fsync + read-back hash runs on a worker while the optimizer file is written."""
    model_out = HashingAtomicFile(paths["model"])
    try:
        _write_weights(model_out, unique, aliases)
    except BaseException:
        model_out.abort()
        raise
    with ThreadPoolExecutor(max_workers=1) as pool:
        model_commit = pool.submit(model_out.commit)
        try:
            pause_for_tests()
            optim_file = write_optimizer_file(paths["optim"], optim_state)
            pause_for_tests()
        finally:
            try:
                model_digest = model_commit.result()
            except BaseException:
                model_out.abort()
                raise
    return {"model": {"size": model_out.size, "sha256": model_digest}, "optim": optim_file}


def meta_record(step: int, state: RunState, has_optimizer: bool) -> dict:
    """The meta of `step` but for its file fields ("tied", "files"; "shards" for a sharded step)."""
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


def write_meta(path: Path, record: dict) -> None:
    """Write the meta `record` atomically (and its directory's entry), with its own digest."""
    # The meta checks the other files; this checks the meta itself, so a flipped byte that still
    # parses (a digit of the sampler position, say) is detected instead of silently resumed.
    record["meta_sha256"] = meta_digest(record)
    atomic_write_json(path, record)
    fsync_dir(path.parent)


def state_to_save(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> tuple[dict[str, torch.Tensor], dict]:
    """(the model's state_dict, the optimizer state keyed by parameter name) of a three-file step. A
    sharded model's are its whole tensors, gathered to rank 0 (a collective: every rank calls it, the
    other ranks get empty ones). Without an optimizer: an empty optimizer state."""
    if is_sharded(model):
        weights = sharded_state().full_model_state(model)
        optim_state = None if optimizer is None else sharded_state().full_optimizer_state(model, optimizer)
    else:
        weights = model.state_dict()
        optim_state = None if optimizer is None else optimizer_state_by_name(optimizer, model)
    if optim_state is None:
        optim_state = {"format": OPTIM_FORMAT, "state": {}, "param_groups": []}
    return weights, optim_state
