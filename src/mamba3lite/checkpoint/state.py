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
model can write one. train/optim.py's `MuonWithAdamW` is two torch optimizers (AdamW's groups, then
Muon's); torch's state_dict API takes both together and keys their state by name, so the Muon + AdamW
state round-trips the same way.

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
from torch.distributed.tensor import DTensor

from mamba3lite.checkpoint.optim_state import OPTIM_FORMAT, optimizer_kind

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether the model's parameters are DTensors (fully_shard / HSDP): its checkpoints are sharded."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def torch_optimizers(optimizer: Any) -> tuple[torch.optim.Optimizer, ...]:
    """The torch optimizers behind the trainer's optimizer: itself, or MuonWithAdamW's AdamW and Muon
    (in that order, the order of its param_groups)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return (optimizer,)
    return (optimizer.adamw, optimizer.muon)


def local_model_state(model: torch.nn.Module) -> dict[str, Any]:
    """The model's state_dict as this rank holds it (DTensor shards for a sharded model)."""
    return get_model_state_dict(model)


def local_optimizer_state(model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    """The optimizer's state as this rank holds it, keyed by parameter name ({"state", "param_groups"}).
    A fresh optimizer's state is created first (a step of lr 0 over zero gradients), so a load into it
    has tensors of the right shapes to fill."""
    return get_optimizer_state_dict(model, torch_optimizers(optimizer))


def set_local_state(
    model: torch.nn.Module, optimizer: Any | None, model_state: dict | None, optim_state: dict | None
) -> None:
    """Inverse of `local_model_state` / `local_optimizer_state` (either part may be None: not set)."""
    if model_state is not None:
        set_model_state_dict(model, model_state)
    if optimizer is not None and optim_state is not None:
        set_optimizer_state_dict(model, torch_optimizers(optimizer), optim_state)


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Whole tensors on the CPU. For a sharded model a collective (every rank calls it) whose result is
    on rank 0 only (the others get {}); for a plain one the state_dict's own tensors."""
    if not is_sharded(model):
        return model.state_dict()
    return get_model_state_dict(model, options=_FULL)


def full_optimizer_state(model: torch.nn.Module, optimizer: Any) -> dict:
    """optim_state.py's by-name dict of whole tensors (a collective for a sharded model; rank 0 gets it,
    the others {"state": {}, ...})."""
    osd = get_optimizer_state_dict(model, torch_optimizers(optimizer), options=_FULL)
    return {
        "format": OPTIM_FORMAT,
        "optimizer": optimizer_kind(optimizer),
        "state": osd.get("state", {}),
        "param_groups": osd.get("param_groups", []),
    }


def set_full_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Whole tensors (every rank passes all of them) into a sharded model: each rank keeps its shards."""
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=True))


def set_full_optimizer_state(model: torch.nn.Module, optimizer: Any, saved: dict) -> None:
    """optim_state.py's by-name dict of whole tensors (every rank passes it) into the optimizer of a
    sharded model."""
    osd = {"state": saved["state"], "param_groups": saved["param_groups"]}
    set_optimizer_state_dict(
        model, torch_optimizers(optimizer), osd, options=StateDictOptions(full_state_dict=True)
    )
