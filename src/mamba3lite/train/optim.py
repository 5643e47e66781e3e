"""The optimizer (AdamW, or Muon for the hidden matrices + AdamW for the rest) and the learning-rate
schedule as a pure function.

Weight decay (decoupled, AdamW) applies to the weight matrices of linear layers only. No decay for
(docs/model.md §1.2, §5, and common practice for LMs):
- parameters flagged `p._no_weight_decay = True` (the mixer's dt_bias and D),
- every parameter with fewer than 2 dimensions (norm weights, biases, B_bias/C_bias rows are 3-D but
  are biases: matched by name),
- norms, biases and embeddings by name (the tied LM head is the embedding, so it is not decayed either).
A tied parameter appears once (`named_parameters()` de-duplicates), so its moments are not doubled.

`training.optimizer: muon` (`MuonWithAdamW`): `torch.optim.Muon` for the 2-D hidden matrices (the
decayed matrices above except the LM head: the mixers' in_proj/out_proj, the MLP's fc1/fc2), AdamW as
above for everything else (embedding, head, norms, biases, the 1-D Mamba parameters), the split of the
modded-nanogpt speedrun. Under fsdp/hsdp each sharded matrix is gathered for its update
(`FullMatrixMuon`): Muon orthogonalises the whole matrix, as on one process. Muon runs with
`adjust_lr_fn="match_rms_adamw"` (each matrix's orthogonalised update is scaled by
0.2·sqrt(max(rows, cols)), so its RMS is AdamW's typical 0.2·lr: Moonshot, "Muon is Scalable for LLM
Training"), which lets one peak lr and one weight_decay serve both optimizers;
`training.muon_lr` sets Muon's peak apart. Muon's decay is decoupled like AdamW's: p ← p·(1 − lr·wd)
with the group's (unscaled) lr.

Schedule (`lr_at`, `training.lr_schedule`): linear warmup from 0 to `lr` over `warmup_steps`, then from
`lr` to `min_lr` at `max_steps` by a cosine, a straight line, or (wsd: warmup-stable-decay) a hold at
`lr` and a straight line over the last `decay_fraction` of the steps; then `min_lr`. It depends only on
its arguments: the trainer sets every group's lr from it before each optimizer step (`set_lr`: the Muon
groups get it times muon_lr / lr), so resuming needs nothing but the step number (and a resume whose
config names another schedule follows the new one from the saved step, as with a changed lr).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim._muon import muon

from mamba3lite.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    from mamba3lite.config import TrainingConfig

_NO_DECAY_NAME_PARTS = ("norm", "bias", "embed", "wte")
_HEAD_NAME_PARTS = ("lm_head",)  # an untied head is a decayed matrix, but the output layer: AdamW's


def wants_decay(name: str, p: torch.nn.Parameter) -> bool:
    """True for parameters that get weight decay (see the module docstring for the rule)."""
    if getattr(p, "_no_weight_decay", False) or p.ndim < 2:
        return False
    lname = name.lower()
    return not any(part in lname for part in _NO_DECAY_NAME_PARTS)


def is_hidden_matrix(name: str, p: torch.nn.Parameter) -> bool:
    """True for the parameters Muon optimizes: 2-D, decayed, and not the LM head."""
    return p.ndim == 2 and wants_decay(name, p) and not any(part in name.lower() for part in _HEAD_NAME_PARTS)


def param_groups(
    model: torch.nn.Module, weight_decay: float, *, exclude: frozenset[str] = frozenset()
) -> list[dict]:
    """Two AdamW groups: [decayed matrices, everything else (weight_decay 0)]. Frozen params and the
    names in `exclude` (Muon's) are skipped. Each group carries `names` (parameter names, in order) for
    logging and tests."""
    decay, no_decay, decay_names, no_decay_names = [], [], [], []
    for name, p in model.named_parameters():  # de-duplicated: a tied parameter appears once
        if not p.requires_grad or name in exclude:
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


def build_adamw(
    groups: list[dict], *, lr: float, betas: tuple[float, float], eps: float = 1e-8
) -> torch.optim.AdamW:
    """AdamW over `groups`; torch's fused kernel when every parameter is on one CUDA or CPU device (on CPU
    one fused pass instead of a dozen foreach passes: the tiny preset's optimizer step 34 -> 3.5 ms, 1
    thread), else the default implementation (also where this torch has no fused kernel)."""
    for g in groups:
        g.pop("names", None)  # AdamW keeps unknown group keys in its state_dict; names live in the model
    devices = {p.device.type for g in groups for p in g["params"]}
    if len(devices) == 1 and devices <= {"cuda", "cpu"}:
        try:
            return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)
        except (RuntimeError, ValueError):  # a build without the fused kernel for this device
            pass
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)


class FullMatrixMuon(torch.optim.Muon):
    """`torch.optim.Muon` that orthogonalises each WHOLE matrix when the parameters are sharded DTensors
    (fsdp/hsdp). Newton-Schulz on a shard would orthogonalise a block of rows, not the matrix; torch's
    Muon (2.13) runs its plain tensor ops on whatever it is given. Per sharded matrix this gathers the
    parameter, its gradient and its momentum (`full_tensor`, one matrix at a time), runs torch's own
    single-tensor Muon step on them (the spec, unchanged), and keeps this rank's shard of the new
    parameter and momentum: the result equals one process's Muon exactly. Plain tensors take torch's
    path. The state keeps torch's keys ("momentum_buffer", sharded like the parameter)."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        assert closure is None, "the trainer computes the loss itself"
        sharded = [[p for p in g["params"] if isinstance(p, DTensor)] for g in self.param_groups]
        if not any(sharded):
            super().step()
            return
        for group, group_sharded in zip(self.param_groups, sharded, strict=True):
            plain = [p for p in group["params"] if not isinstance(p, DTensor)]
            assert not plain, "a Muon group is either all sharded or all plain"
            for p in group_sharded:
                if p.grad is not None:
                    self._full_matrix_step(p, group)

    def _full_matrix_step(self, p: DTensor, group: dict) -> None:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad)
        buf = state["momentum_buffer"]
        full_p, full_g, full_buf = p.full_tensor(), p.grad.full_tensor(), buf.full_tensor()
        muon(
            [full_p], [full_g], [full_buf],
            lr=group["lr"], weight_decay=group["weight_decay"], momentum=group["momentum"],
            nesterov=group["nesterov"], ns_coefficients=group["ns_coefficients"], eps=group["eps"],
            ns_steps=group["ns_steps"], adjust_lr_fn=group["adjust_lr_fn"], has_complex=False,
        )  # fmt: skip
        for sharded, full in ((p, full_p), (buf, full_buf)):
            mine = distribute_tensor(full, sharded.device_mesh, sharded.placements, src_data_rank=None)
            sharded.to_local().copy_(mine.to_local())


class MuonWithAdamW:
    """Muon for the hidden matrices and AdamW for the rest, as one optimizer for the trainer: `step`,
    `zero_grad`, `param_groups` (AdamW's [decayed, not decayed], then Muon's one group: live dicts, so
    `set_lr` and `apply_optimizer_settings` change them), `state` (both, a merged read-only view),
    `state_dict`/`load_state_dict` in torch's index-keyed form over those groups in that order (so the
    checkpoint's by-name keying in optim_state.py applies unchanged). `lr_scales[i]` multiplies the
    schedule's lr for `param_groups[i]` (1 for AdamW's, muon_lr / lr for Muon's)."""

    kind = "muon"  # what the checkpoint records (optim_state.py); a plain AdamW is "adamw"

    def __init__(self, adamw: torch.optim.AdamW, muon: torch.optim.Muon, muon_lr_scale: float) -> None:
        self.adamw, self.muon = adamw, muon
        self.lr_scales = [1.0] * len(adamw.param_groups) + [muon_lr_scale] * len(muon.param_groups)

    @property
    def param_groups(self) -> list[dict]:
        return self.adamw.param_groups + self.muon.param_groups

    @property
    def state(self) -> dict:
        return {**self.adamw.state, **self.muon.state}

    def step(self, closure: Any = None) -> None:
        assert closure is None, "the trainer computes the loss itself"
        self.adamw.step()
        self.muon.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.adamw.zero_grad(set_to_none=set_to_none)
        self.muon.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        a, m = self.adamw.state_dict(), self.muon.state_dict()
        offset = sum(len(g["params"]) for g in a["param_groups"])  # Muon's indices follow AdamW's
        return {
            "state": {**a["state"], **{i + offset: s for i, s in m["state"].items()}},
            "param_groups": a["param_groups"]
            + [{**g, "params": [i + offset for i in g["params"]]} for g in m["param_groups"]],
        }

    def load_state_dict(self, state_dict: dict) -> None:
        groups, n = state_dict["param_groups"], len(self.adamw.param_groups)
        if len(groups) != n + len(self.muon.param_groups):
            raise CheckpointError(
                f"optimizer state of {len(groups)} parameter groups, Muon + AdamW has "
                f"{len(self.param_groups)}"
            )
        for part, part_groups in ((self.adamw, groups[:n]), (self.muon, groups[n:])):
            ids = {i for g in part_groups for i in g["params"]}
            state = {i: s for i, s in state_dict["state"].items() if i in ids}
            part.load_state_dict({"state": state, "param_groups": part_groups})


def build_optimizer(
    model: torch.nn.Module, training: TrainingConfig | None = None, **adamw: Any
) -> torch.optim.AdamW | MuonWithAdamW:
    """The optimizer `training.optimizer` names, over the model's trainable parameters: AdamW over
    `param_groups(model)`, or `MuonWithAdamW`. Without a config, `build_optimizer(model, lr=...,
    weight_decay=..., betas=..., eps=...)` is that AdamW (the form checkpoint tests and benchmarks use).
    ConfigError when muon is asked for and the model has no hidden matrix for it."""
    if training is None:
        wd = adamw.pop("weight_decay")
        return build_adamw(param_groups(model, wd), **adamw)
    kw = {"lr": training.lr, "betas": training.betas, "eps": training.eps}
    if training.optimizer == "adamw":
        return build_adamw(param_groups(model, training.weight_decay), **kw)
    hidden = [(n, p) for n, p in model.named_parameters() if p.requires_grad and is_hidden_matrix(n, p)]
    if not hidden:
        raise ConfigError(
            "training.optimizer is muon, but this model has no 2-D hidden matrix for Muon (only embedding, "
            "head, norms, biases); use --set training.optimizer=adamw"
        )
    muon_lr = training.lr if training.muon_lr is None else training.muon_lr
    muon = FullMatrixMuon(
        [p for _, p in hidden],
        lr=muon_lr,
        weight_decay=training.weight_decay,
        momentum=training.muon_momentum,
        nesterov=True,
        adjust_lr_fn="match_rms_adamw",
    )
    groups = param_groups(model, training.weight_decay, exclude=frozenset(n for n, _ in hidden))
    return MuonWithAdamW(build_adamw(groups, **kw), muon, muon_lr / training.lr)


def lr_at(
    step: int,
    *,
    lr: float,
    min_lr: float,
    warmup_steps: int,
    max_steps: int,
    schedule: str = "cosine",
    decay_fraction: float = 0.2,
) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, then `schedule` down to min_lr.

    warmup: lr·(step+1)/warmup_steps for step < warmup_steps (never 0, so the first step moves);
    decay from `start` to max_steps, t = (step − start)/(max_steps − start) ∈ [0, 1]:
        cosine  start = warmup_steps:  min_lr + ½(lr − min_lr)(1 + cos(π·t))
        linear  start = warmup_steps:  min_lr + (lr − min_lr)(1 − t)
        wsd     start = max(warmup_steps, max_steps − round(decay_fraction·max_steps)): lr until start
                (warmup-stable-decay), then linear as above; decay_fraction 1 is `linear`
    after max_steps: min_lr.
    """
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if step >= max_steps:
        return min_lr
    start = warmup_steps
    if schedule == "wsd":
        start = max(warmup_steps, max_steps - round(decay_fraction * max_steps))
        if step < start:
            return lr
    t = (step - start) / max(1, max_steps - start)
    if schedule == "cosine":
        return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * t))
    assert schedule in ("linear", "wsd"), f"unknown schedule {schedule!r}"
    return min_lr + (lr - min_lr) * (1.0 - t)


def set_lr(optimizer: Any, lr: float) -> None:
    """Set the schedule's `lr` (for training.lr's peak) on every group, times the group's own scale
    (`optimizer.lr_scales`: Muon's groups peak at muon_lr; a plain AdamW has none: lr on every group)."""
    scales = getattr(optimizer, "lr_scales", None) or [1.0] * len(optimizer.param_groups)
    for g, scale in zip(optimizer.param_groups, scales, strict=True):
        g["lr"] = lr * scale


def apply_optimizer_settings(optimizer: Any, training: TrainingConfig) -> list[str]:
    """Set the config's optimizer settings on every param group; returns the changes ("eps 1e-08 ->
    1e-06", "muon momentum 0.95 -> 0.9").

    Optimizers keep weight_decay, betas, eps (AdamW) and momentum (Muon) in their param groups, so loading
    a checkpoint's optimizer state brings back the settings it was saved with; the run's config (what
    config.yaml records) wins. AdamW's groups as `param_groups`: [decayed, not decayed]; Muon's one group
    is decayed. (lr is set every step from the schedule.)
    """
    adamw = getattr(optimizer, "adamw", optimizer)
    changed = []
    for i, g in enumerate(adamw.param_groups):
        want = {"weight_decay": training.weight_decay if i == 0 else 0.0, "betas": tuple(training.betas)}
        want["eps"] = training.eps
        for key, value in want.items():
            have = tuple(g[key]) if key == "betas" else g[key]
            if have != value:
                g[key] = value
                if i == 0 or key != "weight_decay":
                    changed.append(f"{key} {have} -> {value}")
    for g in getattr(getattr(optimizer, "muon", None), "param_groups", []):
        for key, value in (("weight_decay", training.weight_decay), ("momentum", training.muon_momentum)):
            if g[key] != value:
                changed.append(f"muon {key} {g[key]} -> {value}")
                g[key] = value
    return list(dict.fromkeys(changed))
