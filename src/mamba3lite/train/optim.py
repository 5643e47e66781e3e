"""AdamW with decay / no-decay parameter groups, and the learning-rate schedule as a pure function.

Weight decay (decoupled, AdamW) applies to the weight matrices of linear layers only. No decay for
(MAMBA3.md §1.2, §5, and common practice for LMs):
- parameters flagged `p._no_weight_decay = True` (the mixer's dt_bias and D),
- every parameter with fewer than 2 dimensions (norm weights, biases, B_bias/C_bias rows are 3-D but
  are biases: matched by name),
- norms, biases and embeddings by name (the tied LM head is the embedding, so it is not decayed either).
A tied parameter appears once (`named_parameters()` de-duplicates), so its moments are not doubled.

Schedule (`lr_at`): linear warmup from 0 to `lr` over `warmup_steps`, then cosine from `lr` to `min_lr`
at `max_steps`, then `min_lr`. It depends only on its arguments: the trainer sets every group's lr from
it before each optimizer step, so resuming needs nothing but the step number.
"""

from __future__ import annotations

import math

import torch

_NO_DECAY_NAME_PARTS = ("norm", "bias", "embed", "wte")


def wants_decay(name: str, p: torch.nn.Parameter) -> bool:
    """True for parameters that get weight decay (see the module docstring for the rule)."""
    if getattr(p, "_no_weight_decay", False) or p.ndim < 2:
        return False
    lname = name.lower()
    return not any(part in lname for part in _NO_DECAY_NAME_PARTS)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: [decayed matrices, everything else (weight_decay 0)]. Frozen params skipped.
    Each group carries `names` (parameter names, in order) for logging and tests."""
    decay, no_decay, decay_names, no_decay_names = [], [], [], []
    for name, p in model.named_parameters():  # de-duplicated: a tied parameter appears once
        if not p.requires_grad:
            continue
        if wants_decay(name, p):
            decay.append(p)
            decay_names.append(name)
        else:
            no_decay.append(p)
            no_decay_names.append(name)
    return [
        {"params": decay, "weight_decay": weight_decay, "names": decay_names},
        {"params": no_decay, "weight_decay": 0.0, "names": no_decay_names},
    ]


def build_optimizer(
    model: torch.nn.Module,
    *,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float = 1e-8,
) -> torch.optim.AdamW:
    """AdamW over `param_groups(model)`; torch's fused kernel when every parameter is on one CUDA or CPU
    device (on CPU one fused pass instead of a dozen foreach passes: the tiny preset's optimizer step
    34 -> 3.5 ms, 1 thread), else the default implementation (also where this torch has no fused kernel)."""
    groups = param_groups(model, weight_decay)
    for g in groups:
        g.pop("names")  # AdamW keeps unknown group keys in its state_dict; names live in the model
    devices = {p.device.type for g in groups for p in g["params"]}
    if len(devices) == 1 and devices <= {"cuda", "cpu"}:
        try:
            return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)
        except (RuntimeError, ValueError):  # a build without the fused kernel for this device
            pass
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, max_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, then cosine to min_lr.

    warmup: lr·(step+1)/warmup_steps for step < warmup_steps (never 0, so the first step moves);
    decay:  min_lr + ½(lr − min_lr)(1 + cos(π·t)), t = (step − warmup)/(max_steps − warmup) ∈ [0, 1];
    after max_steps: min_lr.
    """
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if step >= max_steps:
        return min_lr
    span = max(1, max_steps - warmup_steps)
    t = (step - warmup_steps) / span
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * t))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for g in optimizer.param_groups:
        g["lr"] = lr


def apply_optimizer_settings(
    optimizer: torch.optim.Optimizer, *, weight_decay: float, betas: tuple[float, float], eps: float
) -> list[str]:
    """Set the config's AdamW settings on every param group; returns the changes ("eps 1e-08 -> 1e-06").

    AdamW keeps weight_decay, betas and eps in its param groups, so loading a checkpoint's optimizer
    state brings back the settings it was saved with; the run's config (what config.yaml records)
    wins. Groups as `param_groups`: [decayed, not decayed]. (lr is set every step from the schedule.)
    """
    changed = []
    for i, g in enumerate(optimizer.param_groups):
        want = {"weight_decay": weight_decay if i == 0 else 0.0, "betas": tuple(betas), "eps": eps}
        for key, value in want.items():
            have = tuple(g[key]) if key == "betas" else g[key]
            if have != value:
                g[key] = value
                if i == 0 or key != "weight_decay":
                    changed.append(f"{key} {have} -> {value}")
    return list(dict.fromkeys(changed))
