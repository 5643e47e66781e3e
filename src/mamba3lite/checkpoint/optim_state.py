"""Optimizer state keyed by PARAMETER NAME, so that a changed parameter order cannot silently put
AdamW moments on the wrong tensors (torch's own state_dict keys them by position).

The file also names the optimizer (`"optimizer"`: its name in the registry, mamba3lite/optimizers.py:
"adamw", or "muon" for train/optim.py's MuonWithAdamW, whose groups are AdamW's then Muon's and whose
state holds both): a resume that switches optimizer is one ConfigError naming both, a name the registry
does not know one CheckpointError. A file without the key predates Muon and is AdamW's.
"""

from __future__ import annotations

from typing import Any

import torch

from mamba3lite.errors import CheckpointError, ConfigError
from mamba3lite.optimizers import lookup

OPTIM_FORMAT = "mamba3lite-optim-v1"


def optimizer_kind(optimizer: Any) -> str:
    """The training.optimizer an optimizer object implements: its `kind`, else (torch's AdamW) adamw."""
    return getattr(optimizer, "kind", "adamw")


def param_names(model: torch.nn.Module) -> dict[int, str]:
    """id(parameter) -> its name; a tied parameter counts once, under the smallest of its names, so the
    key does not depend on the order in which modules were registered."""
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names[id(p)] = min(name, names.get(id(p), name))
    return names


def optimizer_state_by_name(optimizer: Any, model: torch.nn.Module) -> dict:
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
        "optimizer": optimizer_kind(optimizer),
        "state": {idx_to_name[i]: s for i, s in sd["state"].items()},
        "param_groups": [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [idx_to_name[i] for i in g["params"]]}
            for g in sd["param_groups"]
        ],
    }


def check_optimizer_kind(saved_kind: str, optimizer: Any, where: str) -> None:
    """ConfigError naming both when state saved by optimizer `saved_kind` is loaded into another one;
    CheckpointError when `saved_kind` is no optimizer of the registry (optimizers.py)."""
    lookup(saved_kind, where=f"{where} (the optimizer state's record)", error=CheckpointError)
    kind = optimizer_kind(optimizer)
    if saved_kind != kind:
        raise ConfigError(
            f"{where} holds the state of training.optimizer={saved_kind}, but this run's config says "
            f"training.optimizer={kind}: resume with --set training.optimizer={saved_kind}, or start a new "
            "run directory (--init-from this run keeps its weights, with a fresh optimizer)"
        )


def load_optimizer_state_by_name(optimizer: Any, model: torch.nn.Module, saved: dict, where: str) -> None:
    """Inverse of `optimizer_state_by_name`: map names onto this optimizer's parameters, checking that
    every parameter is present with the right shape (else CheckpointError naming it). State saved by
    another optimizer than this one: ConfigError naming both."""
    check_optimizer_kind(saved.get("optimizer", "adamw"), optimizer, where)
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
