"""Checkpoints written by the seed system, accepted as "unverified".

A seed meta has none of our keys ("format", "files", "meta_sha256"): no hashes, both tied copies in
the weights file, index-keyed optimizer state. Such a step is loadable when all its files are present,
the meta parses, the weights file's header covers the file and the optimizer file is a whole zip
archive (its central directory, at the end, is readable), so a truncated seed save is skipped too. A
meta with any of our keys but an unknown "format" value is ours and is not loadable (a flipped bit
must not switch verification off): see meta.py.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from mamba3lite import intake
from mamba3lite.checkpoint.optim_state import load_optimizer_state_by_name, param_names
from mamba3lite.checkpoint.weights import safetensors_problem
from mamba3lite.errors import CheckpointError

# Keys that only our metas have: a meta with none of them is the seed's (unverified) format; one with
# any of them is ours and must pass every check, whatever its "format" value has become.
PROJECT_META_KEYS = ("format", "files", "meta_sha256")


def is_seed_meta(meta: dict) -> bool:
    return not any(k in meta for k in PROJECT_META_KEYS)


def zip_problem(path: Path) -> str | None:
    """None if `path` is a whole torch.save archive, else why not. Cheap: reads the zip's central
    directory (at the END of the file, so any truncation loses it) and the small pickle entry
    (CRC-checked), not the tensor data."""
    import zipfile

    try:
        intake.regular_file_size(path, intake.OPTIMIZER_STATE)  # opening a FIFO would block
        with zipfile.ZipFile(path) as z:
            pickles = [n for n in z.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
            if not pickles:
                return f"{path}: not a torch.save archive (no data.pkl)"
            z.read(pickles[0])
    except Exception as e:  # BadZipFile, OSError, EOFError, a bad CRC...: status() never raises
        return f"{path}: not a whole torch.save archive, truncated or corrupt ({e})"
    return None


def seed_file_problems(paths: dict[str, Path], kinds: tuple[str, ...]) -> list[str]:
    """What is wrong with a seed-format step's data files `kinds` (no hashes to check, so their
    structure, not every tensor: the seed's non-atomic save could leave them truncated)."""
    missing = [f"{paths[kind]} is missing" for kind in kinds if not paths[kind].exists()]
    if missing:
        return missing
    problems = [p for p in [safetensors_problem(paths["model"])] if p]
    if "optim" in kinds and (bad := zip_problem(paths["optim"])):
        problems.append(bad)
    return problems


def load_seed_optimizer(
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
            stacklevel=4,
        )
        return
    _load_by_position(optimizer, saved, saved_ids, path)


def _load_by_position(optimizer: torch.optim.Optimizer, saved: dict, saved_ids: list, path: Path) -> None:
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if len(saved_ids) != len(params):
        raise CheckpointError(f"{path}: {len(saved_ids)} parameters saved, the optimizer has {len(params)}")
    for i, p in zip(saved_ids, params):
        for k, v in saved["state"].get(i, {}).items():
            if torch.is_tensor(v) and v.dim() > 0 and v.shape != p.shape:
                raise CheckpointError(
                    f"{path}: seed-format optimizer state {k}[{i}] has shape {tuple(v.shape)}, "
                    f"parameter {i} has {tuple(p.shape)}: parameter order changed"
                )
    warnings.warn(f"{path}: seed-format (index-keyed) optimizer state; shapes checked", stacklevel=5)
    optimizer.load_state_dict(saved)
