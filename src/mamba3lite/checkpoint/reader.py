"""Reading a verified step's state into a model and an optimizer, in either step format.

The manager (manager.py) verifies the step first; these read what it verified. Weights go into a plain,
DDP or sharded model (a sharded model takes the whole tensors and keeps its own shards); a sharded step
into any of them at any world size (DCP reshards; in one process without a process group it reads every
shard). Loading uses weights_only=True throughout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mamba3lite import intake
from mamba3lite.checkpoint.dtensor import is_sharded
from mamba3lite.checkpoint.lazy import sharded_files, sharded_state
from mamba3lite.checkpoint.optim_state import OPTIM_FORMAT, check_optimizer_kind, load_optimizer_state_by_name
from mamba3lite.checkpoint.seed_format import load_seed_optimizer
from mamba3lite.checkpoint.weights import load_model_file, read_model_file
from mamba3lite.errors import CheckpointError


def load_weights(path: Path, model: torch.nn.Module, tied: dict[str, str]) -> None:
    """The weights file `path` (tied aliases `tied`) into `model`: whole tensors into a plain or DDP
    model, or read whole and kept as each rank's shards by a sharded one."""
    if is_sharded(model):
        sharded_state().set_full_model_state(model, read_model_file(path, tied))
    else:
        load_model_file(path, model, tied)


def load_sharded(
    sdir: Path, meta: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> None:
    """A sharded step's directory `sdir` (its meta `meta`) into `model` (plain, DDP's module or sharded,
    at any world size) and `optimizer`."""
    if optimizer is not None:
        if not meta.get("has_optimizer", True):
            raise CheckpointError(f"{sdir}: this checkpoint holds no optimizer state")
        check_optimizer_kind(meta["shards"].get("optimizer", "adamw"), optimizer, str(sdir))
    dcp_state = sharded_state()
    content: dict[str, Any] = {"model": dcp_state.local_model_state(model)}
    if optimizer is not None:
        content["optim"] = dcp_state.local_optimizer_state(model, optimizer)
    sharded_files().read_shards(sdir, content)
    dcp_state.set_local_state(model, optimizer, content["model"], content.get("optim"))


def load_optimizer_file(
    optimizer: torch.optim.Optimizer,
    model: torch.nn.Module,
    meta: dict,
    path: Path,
    map_location: str | torch.device,
) -> None:
    """The optimizer file `path` of a step (its meta `meta`) into `optimizer`, matched to `model`'s
    parameters by name (index-keyed for a seed-format file)."""
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
        sharded_state().set_full_optimizer_state(model, optimizer, saved)
        return
    load_optimizer_state_by_name(optimizer, model, saved, str(path))
