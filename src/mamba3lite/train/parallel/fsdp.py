"""The sharded strategy: FSDP2 over the mesh, for `training.parallelism` fsdp and hsdp (strategies.py
has the others and the interface). A module of its own because FSDP2 imports DTensor, ~0.35 s of a
command's start beside torch's own (`python -X importtime`): the seam (seam.py) imports it only for a
sharded layout, so one process and DDP never pay for it.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from mamba3lite.checkpoint.state import (
    local_model_state,
    local_optimizer_state,
    set_local_state,
    torch_optimizers,
)
from mamba3lite.train.parallel.layout import Layout


class Sharded:
    """FSDP2 on the ("dp_replicate", "dp_shard") mesh: every block, then the root, `fully_shard`ed.

    Gradients are reduce-scattered after every micro-step's backward (an unsharded gradient kept across
    micro-steps would hold the whole model's gradient on each process, what sharding saves); under hsdp
    the replicas all-reduce their shards on the last micro-step only. `param_dtype`: bf16 for the
    forward/backward on CUDA when training.dtype is bf16 (gradients reduced in fp32); None keeps the
    parameters' own dtype (fp32 on CPU)."""

    is_sharded = True

    def __init__(
        self, mesh: DeviceMesh, layout: Layout, reshard_after_forward: bool, param_dtype: torch.dtype | None
    ) -> None:
        self.mesh, self.layout = mesh, layout
        self.reshard_after_forward = reshard_after_forward
        self.param_dtype = param_dtype
        self.root: torch.nn.Module | None = None

    def wrap(self, model: torch.nn.Module, compile: bool) -> torch.nn.Module:
        if self.layout.cp > 1:  # shard over every rank of the window's group too (as torchtitan does)
            mesh = self.mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        elif self.layout.dp_replicate > 1:
            mesh = self.mesh["dp_replicate", "dp_shard"]
        else:
            mesh = self.mesh["dp_shard"]
        mp = MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=torch.float32)
        kw = {"mesh": mesh, "mp_policy": mp}
        for block in getattr(model, "layers", []):
            if compile:
                block.compile()  # in place: the state_dict keys stay the model's own
            fully_shard(block, reshard_after_forward=self.reshard_after_forward, **kw)
        # The root last: it owns what no block does (embedding = tied head, final norm); its parameters
        # stay gathered after the forward (the head's backward needs them at once).
        self.root = fully_shard(model, reshard_after_forward=False, **kw)
        return self.root

    def micro_step(self, last: bool) -> contextlib.AbstractContextManager:
        assert self.root is not None, "wrap first"
        if self.layout.dp_replicate > 1:
            self.root.set_requires_all_reduce(last)
        return contextlib.nullcontext()

    def live_state(self, model: torch.nn.Module, optimizer) -> dict:
        """This rank's shards of the model and optimizer state (by parameter name), as plain tensors: a
        DTensor carries its device mesh, which is this group's and means nothing to another."""
        local = local_optimizer_state(model, optimizer)
        return {"model": _to_local(local_model_state(model)), "optimizer": _to_local(local)}

    def load_live_state(self, model: torch.nn.Module, optimizer, state: dict) -> None:
        """The shards a peer's rank of the same place sent, made DTensors again on this group's mesh
        (laid out as this rank's own state, which `local_optimizer_state` creates when it is fresh)."""
        model_like = local_model_state(model)
        optim_like = local_optimizer_state(model, optimizer)
        set_local_state(
            model, optimizer, _like(state["model"], model_like), _like(state["optimizer"], optim_like)
        )
        # the settings of every group as sent, the empty ones too (their lr, which set_local_state keeps as
        # built: it is the schedule's, the same a step later, but the state must equal the sender's now)
        for name, part in torch_optimizers(optimizer).items():
            sent = state["optimizer"][name] if name else state["optimizer"]
            for group, theirs in zip(part.param_groups, sent["param_groups"], strict=True):
                group.update({k: v for k, v in theirs.items() if k != "params"})


def _to_local(x: Any) -> Any:
    """`x` with every DTensor replaced by its local shard (dicts and lists walked)."""
    if isinstance(x, DTensor):
        return x.to_local()
    if isinstance(x, dict):
        return {k: _to_local(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_local(v) for v in x)
    return x


def _like(x: Any, like: Any) -> Any:
    """`x` (from `_to_local`) with a DTensor wherever `like` has one, on its mesh and placements."""
    if isinstance(like, DTensor):
        return DTensor.from_local(x.to(like.device), like.device_mesh, like.placements, shape=like.shape,
                                  stride=like.stride())  # fmt: skip
    if isinstance(like, dict):
        return {k: _like(v, like[k]) if k in like else v for k, v in x.items()}
    if isinstance(like, (list, tuple)) and isinstance(x, (list, tuple)) and len(like) == len(x):
        return type(x)(_like(v, w) for v, w in zip(x, like, strict=True))
    return x
