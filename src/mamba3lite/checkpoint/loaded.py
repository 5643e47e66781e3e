"""A verified step as a model: what `RunDir.load` gives every user of a trained run.

    got = RunDir("runs/tiny").load(None, torch.float32)   # generate, eval, serve (pretrained.py)
    got = RunDir("runs/tiny").load(400)                   # export: the stored dtypes, nothing rounded
    got.step, got.meta, got.config, got.model, got.notes, got.weights, got.stored_dtypes

The step has been verified once, by `RunDir.resolve` (the manager's `status`: every file against the
sizes and sha256 its meta records, the meta against its own digest). `load_verified` trusts that check:
it takes the meta the check parsed, rebuilds the config from it (an edited meta was refused before any
model is built from its shapes), builds `Mamba3Transformer(config.model)` and loads the weights through
the manager without checking them again, in either checkpoint format. The weights of a run that
averaged them (training.ema_decay) are the average (`weights` says so).

The sha256 proves the file is what training wrote, not that training wrote numbers: a step whose weights
hold NaN or inf (a run saved after it diverged) is refused here, for every user, with the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from mamba3lite.checkpoint.manager import CheckpointManager
from mamba3lite.checkpoint.verify import CheckpointStatus, has_average
from mamba3lite.config import Config
from mamba3lite.errors import CheckpointError, ConfigError
from mamba3lite.model import Mamba3Transformer
from mamba3lite.rundir import average_file, checkpoint_files, sharded_dir

# The dtypes a model is loaded at when none is asked for: the widest the step stores (none is rounded).
_WIDEST_FIRST = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


@dataclass
class LoadedStep:
    """One checkpoint step, loaded (see the module docstring).

    step: the optimizer step; meta: its parsed meta (verified); config: the run's resolved `Config`.
    model: `Mamba3Transformer` in eval mode on the CPU, its parameters at the dtype asked for.
    notes: one line each for what a user should know (a damaged newer step skipped, a step that a
    running training removed while it was being loaded).
    weights: "trained", or the averaged weights in words (`weights_description`).
    stored_dtypes: {state_dict name: dtype} of the tensors the loaded file stores (a tied head that is
    stored once is absent: it is the embedding).
    """

    step: int
    meta: dict
    config: Config
    model: torch.nn.Module
    notes: list[str]
    weights: str
    stored_dtypes: dict[str, torch.dtype]


def weights_description(meta: dict) -> str:
    """What the model of a checkpoint with `meta` is when loaded for use: "trained", or "averaged (EMA,
    decay D, N steps)" when the step holds averaged weights (the manager's `load(averaged=True)`)."""
    if not has_average(meta):
        return "trained"
    avg = meta.get("average") if isinstance(meta.get("average"), dict) else {}
    n = avg.get("updates", "?")
    return f"averaged weights (EMA, decay {avg.get('decay', '?')}, {n} step{'' if n == 1 else 's'})"


def load_verified(ckpt: CheckpointManager, status: CheckpointStatus, dtype: torch.dtype | None) -> LoadedStep:
    """The `LoadedStep` of the step `status` verified (loadable, its meta parsed), at `dtype` (None: the
    widest stored one). CheckpointError naming the file for anything wrong."""
    assert status.loadable and status.meta is not None, status
    step, meta = status.step, status.meta
    config = _config(meta, checkpoint_files(ckpt.dir, step)["meta"], step)
    stored = ckpt.stored_dtypes(status, averaged=True)
    if dtype is None:
        dtype = next((d for d in _WIDEST_FIRST if d in stored.values()), torch.float32)
    model = Mamba3Transformer(config.model).to(dtype)
    ckpt.load(step, model, None, map_location="cpu", averaged=True, verified=status)
    for name, t in model.state_dict().items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise CheckpointError(
                f"{_weights_path(ckpt.dir, status)} holds non-finite weights (NaN or inf, first in {name}): "
                "the run diverged before this step was saved; load an earlier step with --step N"
            )
    return LoadedStep(step, meta, config, model.eval(), [], weights_description(meta), stored)


def _weights_path(run: Path, status: CheckpointStatus) -> Path:
    """The file (or shard directory) the weights of the step of `status` were loaded from."""
    if status.sharded:
        return sharded_dir(run, status.step)
    if status.meta is not None and has_average(status.meta):
        return average_file(run, status.step)
    return checkpoint_files(run, status.step)["model"]


def _config(meta: dict, meta_path: Path, step: int) -> Config:
    """The Config a verified meta records: CheckpointError when it records none (a seed-format step) or
    one that no longer validates."""
    raw = meta.get("config")
    if not isinstance(raw, dict) or "model" not in raw:
        raise CheckpointError(
            f"{meta_path} records no model config (a seed-format checkpoint?); mamba3lite cannot rebuild "
            "its model"
        )
    try:
        return Config.from_dict(raw, source=str(meta_path))
    except ConfigError as e:
        raise CheckpointError(f"the config saved with step {step} does not validate: {e}") from None
