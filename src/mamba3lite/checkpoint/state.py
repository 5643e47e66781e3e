"""Model and optimizer state through torch.distributed.checkpoint.state_dict: one code path for a plain
module, the module inside DDP and an FSDP2/HSDP module whose parameters are DTensor shards.

Two forms, both keyed by parameter name (fully qualified name, FQN):

    local   each rank's own shards (DTensors for a sharded model): what the sharded format (sharded.py)
            hands to torch.distributed.checkpoint, which writes every rank's shards and reshards on load
    full    whole tensors (a collective for a sharded model; `cpu_offload` keeps them on rank 0 only):
            what the three-file format (weights.py, optim_state.py) stores

The full optimizer form is optim_state.py's by-name dict ({"format", "optimizer", "state": {name: ...},
"param_groups": [{..., "params": [names]}]}), which is torch's FQN-keyed optimizer state_dict plus the
format and the optimizer's kind; so a three-file checkpoint loads into a sharded model and a sharded
model can write one. An optimizer is the torch optimizers its registry entry names (`parts`,
mamba3lite/optimizers.py): train/optim.py's `MuonWithAdamW` is two (AdamW's groups, then Muon's).
torch's state_dict API refuses several optimizers at once when a group is empty (AdamW's decayed group is,
beside Muon, for a model with a tied head), so each part goes through it alone: the local form nests them
({"adamw": ..., "muon": ...}), the full form concatenates their groups in that order and merges their states
(names are unique: a parameter is in one part only).

Everything here imports torch.distributed.checkpoint (and DTensor): the manager reaches this module only
for a sharded model or step, so a plain model in one process never pays for it (manager.py `_sharded`).
The plain path (one process, three files) needs none of it: `model.state_dict()` and optim_state.py.

A tied parameter (the LM head that is the embedding) is named by its first name in `named_parameters()`
(here `embed.weight`, also the smallest, as optim_state.param_names chooses).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from mamba3lite.checkpoint.dtensor import is_sharded
from mamba3lite.checkpoint.optim_state import OPTIM_FORMAT, optimizer_kind
from mamba3lite.optimizers import lookup

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def torch_optimizers(optimizer: Any) -> dict[str, torch.optim.Optimizer]:
    """The torch optimizers behind the trainer's optimizer, by name: its registered `parts` (optimizers.py;
    MuonWithAdamW's {"adamw": ..., "muon": ...}, in the order of its param_groups), or {"": itself} for
    an optimizer registered without parts."""
    parts = lookup(optimizer_kind(optimizer), where="the optimizer to checkpoint").parts
    if not parts:
        return {"": optimizer}
    return {name: getattr(optimizer, name) for name in parts}


def local_model_state(model: torch.nn.Module) -> dict[str, Any]:
    """The model's state_dict as this rank holds it (DTensor shards for a sharded model)."""
    return get_model_state_dict(model)


def local_optimizer_state(model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    """The optimizer's state as this rank holds it, keyed by parameter name ({"state", "param_groups"}).
    A fresh optimizer's state is created first (a step of lr 0 over zero gradients), so a load into it
    has tensors of the right shapes to fill. MuonWithAdamW's: {"adamw": ..., "muon": ...}."""
    parts = torch_optimizers(optimizer)
    if "" in parts:
        return get_optimizer_state_dict(model, parts[""])
    return {name: get_optimizer_state_dict(model, part) for name, part in parts.items()}


def set_local_state(
    model: torch.nn.Module, optimizer: Any | None, model_state: dict | None, optim_state: dict | None
) -> None:
    """Inverse of `local_model_state` / `local_optimizer_state` (either part may be None: not set)."""
    if model_state is not None:
        set_model_state_dict(model, model_state)
    if optimizer is not None and optim_state is not None:
        for name, part in torch_optimizers(optimizer).items():
            _set_part(model, part, optim_state[name] if name else optim_state)


def _set_part(
    model: torch.nn.Module, part: torch.optim.Optimizer, osd: dict, options: StateDictOptions | None = None
) -> None:
    # DCP stores a group's settings under its parameters' names, so an empty group (AdamW's decayed
    # one beside Muon) comes back without lr, betas, eps, weight_decay and with defaults for the rest
    # (fused None): it keeps its own, the optimizer's as built.
    before = [dict(g) for g in part.param_groups]
    set_optimizer_state_dict(model, part, osd, options=options)
    for group, old in zip(part.param_groups, before, strict=True):
        if not group["params"]:
            group.update(old)


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Whole tensors on the CPU. For a sharded model a collective (every rank calls it) whose result is
    on rank 0 only (the others get {}); for a plain one the state_dict's own tensors."""
    if not is_sharded(model):
        return model.state_dict()
    return get_model_state_dict(model, options=_FULL)


def full_optimizer_state(model: torch.nn.Module, optimizer: Any) -> dict:
    """optim_state.py's by-name dict of whole tensors (a collective for a sharded model; rank 0 gets it,
    the others {"state": {}, ...})."""
    state: dict = {}
    groups: list = []
    for part in torch_optimizers(optimizer).values():
        osd = get_optimizer_state_dict(model, part, options=_FULL)
        state.update(osd.get("state", {}))
        groups += osd.get("param_groups", [])
    return {
        "format": OPTIM_FORMAT,
        "optimizer": optimizer_kind(optimizer),
        "state": state,
        "param_groups": groups,
    }


def set_full_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Whole tensors (every rank passes all of them) into a sharded model: each rank keeps its shards."""
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=True))


def set_full_optimizer_state(model: torch.nn.Module, optimizer: Any, saved: dict) -> None:
    """optim_state.py's by-name dict of whole tensors (every rank passes it) into the optimizer of a
    sharded model (its kind checked by the caller: the groups are split by the parts' group counts)."""
    groups = list(saved["param_groups"])
    for part in torch_optimizers(optimizer).values():
        mine, groups = groups[: len(part.param_groups)], groups[len(part.param_groups) :]
        names = {n for g in mine for n in g["params"]}
        osd = {"state": {n: s for n, s in saved["state"].items() if n in names}, "param_groups": mine}
        _set_part(model, part, osd, StateDictOptions(full_state_dict=True))
