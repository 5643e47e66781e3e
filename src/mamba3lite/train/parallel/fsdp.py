"""The sharded strategy: FSDP2 over the mesh, for `training.parallelism` fsdp and hsdp (strategies.py
has the others and the interface). A module of its own because FSDP2 imports DTensor, ~0.35 s of a
command's start beside torch's own (`python -X importtime`): the seam (seam.py) imports it only for a
sharded layout, so one process and DDP never pay for it.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

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
