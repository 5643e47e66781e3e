"""The model a run trains, on its device: built (or injected), refused before it is built when it
cannot fit, its scan backend chosen for the device, gradient checkpointing set, then spread over the
processes (and compiled) by the parallelism seam (parallel/seam.py)."""

from __future__ import annotations

from typing import Any

import torch

from mamba3lite.train.parallel import DistInfo, Parallelism


def build_model(
    cfg, dist: DistInfo, par: Parallelism, model: torch.nn.Module | None = None
) -> tuple[torch.nn.Module, Any]:
    """(the raw model on `dist.device`, the model the training step runs: wrapped by `par`: DDP,
    FSDP2 or the plain module, compiled as `cfg.training` says). Under fsdp/hsdp the raw model is the
    sharded one (its parameters are DTensors). `model`: weights to start from (--init-from, tests),
    else a fresh `Mamba3Transformer(cfg.model)`."""
    tc = cfg.training
    if model is None:
        from mamba3lite.model import Mamba3Transformer
        from mamba3lite.model.memory import check_model_fits

        check_model_fits(cfg.model, dist.device, shards=par.layout.shards, optimizer=tc.optimizer)
        model = Mamba3Transformer(cfg.model)
    raw = model.to(dist.device)
    if hasattr(raw, "set_scan_impl"):
        # The scan backend is chosen here, where the device is known: a `triton` that cannot run on it
        # is one ConfigError now, before anything is written or compiled.
        raw.set_scan_impl(cfg.model.scan_impl, dist.device)
    if hasattr(raw, "grad_checkpointing"):
        raw.grad_checkpointing = tc.grad_checkpointing
    return raw, par.wrap(raw)
