"""The model a run trains, on its device: built (or injected), refused before it is built when it
cannot fit, its scan backend chosen for the device, gradient checkpointing set, DDP-wrapped and
compiled as configured."""

from __future__ import annotations

from typing import Any

import torch

from mamba3lite.train import distributed as D


def build_model(cfg, dist: D.DistInfo, model: torch.nn.Module | None = None) -> tuple[torch.nn.Module, Any]:
    """(the raw model on `dist.device`, the model the training step runs: DDP-wrapped and compiled as
    `cfg.training` says). `model`: weights to start from (--init-from, tests), else a fresh
    `Mamba3Transformer(cfg.model)`."""
    tc = cfg.training
    if model is None:
        from mamba3lite.model import Mamba3Transformer
        from mamba3lite.model.memory import check_model_fits

        check_model_fits(cfg.model, dist.device)
        model = Mamba3Transformer(cfg.model)
    raw = model.to(dist.device)
    if hasattr(raw, "set_scan_impl"):
        # The scan backend is chosen here, where the device is known: a `triton` that cannot run on it
        # is one ConfigError now, before anything is written or compiled.
        raw.set_scan_impl(cfg.model.scan_impl, dist.device)
    if hasattr(raw, "grad_checkpointing"):
        raw.grad_checkpointing = tc.grad_checkpointing
    wrapped = D.wrap_ddp(raw, dist)
    if tc.compile:
        wrapped = torch.compile(wrapped)
    return raw, wrapped
