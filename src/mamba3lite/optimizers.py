"""The optimizers `training.optimizer` may name: one registry of what every layer knows of each.

An optimizer is an `OptimizerKind`, registered under its name in `KINDS`:

    name         what `training.optimizer` says and what a checkpoint records of the state it holds
    help         one line for the config reference
    state_bytes  bytes of optimizer state per element of a parameter, by its name and the parameter
                 (model/memory.py counts a model's parameters with it: the memory estimate)
    parts        attributes of the built optimizer that are torch optimizers, checkpointed one by one in
                 that order (checkpoint/state.py); () when the built object is one torch optimizer

    build        what builds it, as "module:attribute" (an entry point: this module sits below torch and
                 the model, which config.py, model/ and checkpoint/ read it without importing;
                 train/optim.py's `build_optimizer` imports it when a run builds one):
                 - a torch optimizer class (`torch.optim:SGD`): built over the parameter groups (decayed,
                   not decayed: `wants_decay`) with `training.lr` and `options`;
                 - or a function (model, training config) -> an optimizer with torch's interface, where
                   one run assembles several (`MuonWithAdamW`: Muon's matrices, AdamW's rest)
    options      keyword arguments for a class's constructor (momentum, say)

So an optimizer that torch (or an installed package) provides is one entry here and nothing else
(tests/test_optimizers.py registers SGD in a test alone, then trains, checkpoints, resumes and counts
it); one that needs its own assembly adds its function to train/optim.py beside AdamW's and Muon's.

A name the registry does not know is one error wherever it arrives: `lookup`. Which parameters get
weight decay, and which of them Muon takes, is written once here (`wants_decay`, `is_hidden_matrix`):
the optimizers' parameter groups (train/optim.py) and the memory estimate both follow it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mamba3lite.errors import ConfigError, Mamba3LiteError, did_you_mean_hint

_NO_DECAY_NAME_PARTS = ("norm", "bias", "embed", "wte")
_HEAD_NAME_PARTS = ("lm_head",)  # an untied head is a decayed matrix, but the output layer: AdamW's


def wants_decay(name: str, p: Any) -> bool:
    """True for parameters that get weight decay: matrices (2-D and up) of linear layers. Not: parameters
    flagged `p._no_weight_decay = True` (the mixer's dt_bias and D), anything of fewer than 2 dimensions,
    and norms, biases (B_bias/C_bias are 3-D) and embeddings by name (the tied LM head is the embedding).
    `p`: a parameter (anything with `ndim`; a meta-device one counts the same)."""
    if getattr(p, "_no_weight_decay", False) or p.ndim < 2:
        return False
    lname = name.lower()
    return not any(part in lname for part in _NO_DECAY_NAME_PARTS)


def is_hidden_matrix(name: str, p: Any) -> bool:
    """True for the parameters Muon optimizes: 2-D, decayed, and not the LM head (the mixers'
    in_proj/out_proj, the MLP's fc1/fc2)."""
    return p.ndim == 2 and wants_decay(name, p) and not any(part in name.lower() for part in _HEAD_NAME_PARTS)


@dataclass(frozen=True)
class OptimizerKind:
    """One optimizer, as the layers below its construction know it (see the module docstring)."""

    name: str
    help: str
    state_bytes: Callable[[str, Any], int]  # (parameter name, parameter) -> state bytes per element
    build: str  # "module:attribute": a torch optimizer class, or a function (model, training) -> optimizer
    parts: tuple[str, ...] = ()
    options: dict[str, Any] = field(default_factory=dict)


def _adamw_bytes(name: str, p: Any) -> int:
    return 8  # two fp32 moments


def _muon_bytes(name: str, p: Any) -> int:
    return 4 if is_hidden_matrix(name, p) else 8  # Muon's one fp32 momentum; AdamW's two moments


KINDS: dict[str, OptimizerKind] = {
    k.name: k
    for k in (
        OptimizerKind("adamw", "AdamW for every parameter", _adamw_bytes, "mamba3lite.train.optim:adamw"),
        OptimizerKind(
            "muon",
            "torch.optim.Muon for the 2-D hidden matrices (the mixers' in_proj/out_proj, the MLP's fc1/fc2) "
            "and AdamW for the embedding, the LM head, norms, biases and the 1-D Mamba parameters, as the "
            "modded-nanogpt speedrun; Muon's decay is weight_decay, decoupled like AdamW's "
            "(p -= lr x weight_decay x p)",
            _muon_bytes,
            "mamba3lite.train.optim:muon_with_adamw",
            parts=("adamw", "muon"),
        ),
    )
}


def lookup(
    name: str, where: str = "training.optimizer", error: type[Mamba3LiteError] = ConfigError
) -> OptimizerKind:
    """The registered optimizer `name`; else `error` (ConfigError: a config, an argument; CheckpointError:
    a checkpoint) naming `where`, the known names and the closest of them."""
    kind = KINDS.get(name) if isinstance(name, str) else None  # (a damaged record may hold anything)
    if kind is None:
        hint = did_you_mean_hint(name, KINDS) if isinstance(name, str) else ""
        raise error(f"{where} names the optimizer {name!r}, which is none of {', '.join(KINDS)}{hint}")
    return kind
