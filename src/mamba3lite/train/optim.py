"""The optimizer (AdamW, or Muon for the hidden matrices + AdamW for the rest) and the learning-rate
schedule as a pure function.

`training.optimizer` names one of the registry's optimizers (mamba3lite/optimizers.py: the names, their
state's bytes per parameter, their checkpointed parts, what builds each: a torch optimizer class, or
`adamw` and `muon_with_adamw` here). Weight decay
(decoupled, AdamW) applies to the weight matrices of linear layers only, by the registry's rule
(`wants_decay`: docs/model.md §1.2, §5, and common practice for LMs): not to parameters flagged
`p._no_weight_decay`, to anything of fewer than 2 dimensions, nor to norms, biases and embeddings by name.
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
with the group's (unscaled) lr. Its Newton-Schulz orthogonalisation (`newton_schulz`) runs in the
run's compute dtype on its device (model/precision.py): bf16, torch's own computation, where the device
has native bf16; fp32 elsewhere (torch hard-codes bf16, which an AVX2 CPU emulates ~100x slower).

Schedule (`lr_at`, `training.lr_schedule`): linear warmup from 0 to `lr` over `warmup_steps`, then from
`lr` to `min_lr` at `max_steps` by a cosine, a straight line, or (wsd: warmup-stable-decay) a hold at
`lr` and a straight line over the last `decay_fraction` of the steps; then `min_lr`. It depends only on
its arguments: the trainer sets every group's lr from it before each optimizer step (`set_lr`: the Muon
groups get it times muon_lr / lr), so resuming needs nothing but the step number (and a resume whose
config names another schedule follows the new one from the saved step, as with a changed lr).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.optim._muon import _adjust_lr

from mamba3lite.checkpoint.dtensor import is_dtensor
from mamba3lite.errors import CheckpointError, ConfigError
from mamba3lite.model.precision import resolve_precision
from mamba3lite.optimizers import OptimizerKind, is_hidden_matrix, lookup, wants_decay

if TYPE_CHECKING:
    from mamba3lite.config import TrainingConfig


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


def unnamed(groups: list[dict]) -> list[dict]:
    """`param_groups`' groups as a torch optimizer takes them: without `names` (torch keeps unknown group
    keys in its state_dict; the names live in the model)."""
    return [{k: v for k, v in g.items() if k != "names"} for g in groups]


def build_adamw(
    groups: list[dict], *, lr: float, betas: tuple[float, float], eps: float = 1e-8
) -> torch.optim.AdamW:
    """AdamW over `groups`; torch's fused kernel when every parameter is on one CUDA or CPU device (on CPU
    one fused pass instead of a dozen foreach passes: the tiny preset's optimizer step 34 -> 3.5 ms, 1
    thread), else the default implementation (also where this torch has no fused kernel)."""
    groups = unnamed(groups)
    devices = {p.device.type for g in groups for p in g["params"]}
    if len(devices) == 1 and devices <= {"cuda", "cpu"}:
        try:
            return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)
        except (RuntimeError, ValueError):  # a build without the fused kernel for this device
            pass
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)


def newton_schulz(G: Tensor, dtype: torch.dtype, coefficients: tuple[float, float, float], steps: int,
                  eps: float) -> Tensor:  # fmt: skip
    """An approximate orthogonalisation of the 2-D matrix `G` (≈ U·V^T of its SVD U·S·V^T), computed in
    `dtype`: torch.optim.Muon's quintic Newton-Schulz iteration (torch 2.13 `_zeropower_via_newtonschulz`,
    from Keller Jordan's Muon, kellerjordan.github.io/posts/muon), written once with its dtype as a
    parameter. With (a, b, c) = `coefficients` and X₀ = G / max(‖G‖_F, eps) (spectral norm ≤ 1),

        X_{k+1} = a·X_k + (b·A + c·A²)·X_k,   A = X_k·X_kᵀ,

    on the wide orientation (a tall G is transposed, so A is the smaller Gram matrix). torch's
    coefficients (3.4445, −4.7750, 2.0315) push every singular value towards ~[0.7, 1.2] in 5 steps
    rather than exactly 1, which is what Muon wants. dtype bf16 is torch's computation, op for op
    (bit-identical); fp32 is the same iteration without bf16's rounding, for devices that have no fast
    bf16 (an AVX2 CPU takes ~100x longer for a bf16 matmul). Returns a new tensor in `dtype`."""
    a, b, c = coefficients
    X = G.to(dtype, copy=True)  # a copy: the caller's G (Muon's momentum buffer, without nesterov) stays
    wide = G.size(0) <= G.size(1)
    if not wide:
        X = X.T
    X.div_(X.norm().clamp(min=eps))
    for _ in range(steps):
        A = X @ X.T
        B = torch.addmm(A, A, A, beta=b, alpha=c)  # b·A + c·A·A
        X = torch.addmm(X, B, X, beta=a)  # a·X + B·X
    return X if wide else X.T


def muon_update_(
    param: Tensor, grad: Tensor, momentum_buffer: Tensor, group: dict, ns_dtype: torch.dtype
) -> None:
    """One Muon step of one matrix, in place on `param` and `momentum_buffer`: torch.optim.Muon's
    `_single_tensor_muon` (torch 2.13), with the Newton-Schulz in `ns_dtype`. `group`: a Muon param group
    (lr a float; momentum, nesterov, weight_decay, ns_coefficients, ns_steps, eps, adjust_lr_fn)."""
    momentum, lr = group["momentum"], group["lr"]
    momentum_buffer.lerp_(grad, 1 - momentum)
    update = grad.lerp(momentum_buffer, momentum) if group["nesterov"] else momentum_buffer
    update = newton_schulz(update, ns_dtype, group["ns_coefficients"], group["ns_steps"], group["eps"])
    param.mul_(1 - lr * group["weight_decay"])  # decoupled decay with the group's (unscaled) lr
    param.add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], param.shape))


class FullMatrixMuon(torch.optim.Muon):
    """`torch.optim.Muon` with its Newton-Schulz in `ns_dtype`, orthogonalising each WHOLE matrix when the
    parameters are sharded DTensors (fsdp/hsdp).

    ns_dtype: torch.bfloat16 is torch's Muon exactly (parameters and momentum bit-identical); fp32 is for
    devices without native bf16 (`Precision.matmul_dtype`), where torch's hard-coded bf16 Newton-Schulz
    takes longer than the model's forward and backward. It is a property of the device, not of the run:
    it is not in the param groups, so the state_dict is torch's and a checkpoint moves between devices.

    Newton-Schulz on a shard would orthogonalise a block of rows, not the matrix; torch's Muon (2.13)
    runs its plain tensor ops on whatever it is given. Per sharded matrix this gathers the parameter, its
    gradient and its momentum (`full_tensor`, one matrix at a time), runs the same one-matrix step
    (`muon_update_`) on them, and keeps this rank's shard of the new parameter and momentum: the result
    equals one process's Muon exactly. The state keeps torch's keys ("momentum_buffer", sharded like the
    parameter)."""

    def __init__(self, params: Any, *, ns_dtype: torch.dtype = torch.bfloat16, **muon: Any) -> None:
        super().__init__(params, **muon)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        assert closure is None, "the trainer computes the loss itself"
        for group in self.param_groups:
            sharded = [is_dtensor(p) for p in group["params"]]
            assert all(sharded) or not any(sharded), "a Muon group is either all sharded or all plain"
            for p in group["params"]:
                if p.grad is None:
                    continue
                assert not p.grad.is_sparse and not torch.is_complex(p), "Muon takes real dense matrices"
                state = self.state[p]
                if "momentum_buffer" not in state:  # torch's key and initialisation
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                if is_dtensor(p):
                    self._full_matrix_step(p, state["momentum_buffer"], group)
                else:
                    muon_update_(p, p.grad, state["momentum_buffer"], group, self.ns_dtype)

    def _full_matrix_step(self, p: Tensor, buf: Tensor, group: dict) -> None:
        # p is a DTensor, so torch.distributed.tensor is imported already and this import is free; at the
        # top it would cost every one-process run ~0.35 s of start-up (checkpoint/dtensor.py)
        from torch.distributed.tensor import distribute_tensor

        full_p, full_g, full_buf = p.full_tensor(), p.grad.full_tensor(), buf.full_tensor()
        muon_update_(full_p, full_g, full_buf, group, self.ns_dtype)
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


def build_optimizer(model: torch.nn.Module, training: TrainingConfig | None = None, **adamw: Any) -> Any:
    """The optimizer `training.optimizer` names (the registry, optimizers.py, says what builds it),
    over the model's trainable parameters, with its name as `kind` (what a checkpoint records). Without
    a config, `build_optimizer(model, lr=..., weight_decay=..., betas=..., eps=...)` is AdamW over
    `param_groups(model)` (the form checkpoint tests and benchmarks use). An unknown name: ConfigError."""
    if training is None:
        wd = adamw.pop("weight_decay")
        return build_adamw(param_groups(model, wd), **adamw)
    kind = lookup(training.optimizer)
    optimizer = builder(kind)(model, training)
    optimizer.kind = kind.name
    return optimizer


def adamw(model: torch.nn.Module, training: TrainingConfig) -> torch.optim.AdamW:
    """AdamW over `param_groups(model)`."""
    kw = {"lr": training.lr, "betas": training.betas, "eps": training.eps}
    return build_adamw(param_groups(model, training.weight_decay), **kw)


def muon_with_adamw(model: torch.nn.Module, training: TrainingConfig) -> MuonWithAdamW:
    """`MuonWithAdamW`: Muon over the hidden matrices, AdamW over the rest. ConfigError when the model
    has no hidden matrix for Muon."""
    hidden = [(n, p) for n, p in model.named_parameters() if p.requires_grad and is_hidden_matrix(n, p)]
    if not hidden:
        raise ConfigError(
            "training.optimizer is muon, but this model has no 2-D hidden matrix for Muon (only embedding, "
            "head, norms, biases); use --set training.optimizer=adamw"
        )
    muon_lr = training.lr if training.muon_lr is None else training.muon_lr
    device = hidden[0][1].device  # the device the model trains on (a DTensor's too)
    muon = FullMatrixMuon(
        [p for _, p in hidden],
        ns_dtype=resolve_precision(training.dtype, device).matmul_dtype,
        lr=muon_lr,
        weight_decay=training.weight_decay,
        momentum=training.muon_momentum,
        nesterov=True,
        adjust_lr_fn="match_rms_adamw",
    )
    groups = param_groups(model, training.weight_decay, exclude=frozenset(n for n, _ in hidden))
    kw = {"lr": training.lr, "betas": training.betas, "eps": training.eps}
    return MuonWithAdamW(build_adamw(groups, **kw), muon, muon_lr / training.lr)


def builder(kind: OptimizerKind) -> Callable[[torch.nn.Module, TrainingConfig], Any]:
    """What builds the registered optimizer `kind` (its `build`, "module:attribute"): a function as it is;
    a torch optimizer class over `param_groups(model)` with the run's lr and the entry's options."""
    module, _, attribute = kind.build.partition(":")
    target = getattr(importlib.import_module(module), attribute)
    if not (isinstance(target, type) and issubclass(target, torch.optim.Optimizer)):
        return target

    def build(model: torch.nn.Module, training: TrainingConfig) -> torch.optim.Optimizer:
        return target(unnamed(param_groups(model, training.weight_decay)), lr=training.lr, **kind.options)

    return build


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
    return decayed_lr((step - start) / max(1, max_steps - start), lr=lr, min_lr=min_lr, schedule=schedule)


def decayed_lr(t: float, *, lr: float, min_lr: float, schedule: str) -> float:
    """The decay's learning rate at t ∈ [0, 1] of the way from its start to its end (`lr_at`'s and the
    time schedule's): cosine min_lr + ½(lr − min_lr)(1 + cos(π·t)); linear and wsd
    min_lr + (lr − min_lr)(1 − t)."""
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
    is decayed. Another registered optimizer's groups get the settings they have, AdamW's way. (lr is set
    every step from the schedule.)
    """
    adamw = getattr(optimizer, "adamw", optimizer)
    changed = []
    for i, g in enumerate(adamw.param_groups):
        want = {"weight_decay": training.weight_decay if i == 0 else 0.0, "betas": tuple(training.betas)}
        want["eps"] = training.eps
        for key, value in want.items():
            if key not in g:  # a registered optimizer without this setting (SGD has no betas)
                continue
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
