"""How one model is spread over the processes of the mesh: three small strategies behind one interface.

    wrap(model, compile)   the module the training step calls (parameters broadcast or sharded)
    micro_step(last)       the context of one micro-step's forward and backward: whether its backward
                           finishes the step's gradient reduction (`last`) or only accumulates
    is_sharded             whether the parameters are DTensors (the checkpoint code saves those with
                           torch.distributed.checkpoint)

Local: one process, the plain module. Replicated: DDP with PyTorch's reducer, which all-reduces the
gradients in buckets DURING the backward of the last micro-step (no_sync on the others), into the
gradients themselves (`gradient_as_bucket_view`). Sharded: FSDP2 (`fully_shard` on every block, then on
the root so the tied embedding/head stays one parameter), on a 1-D mesh (fsdp) or 2-D (hsdp: the same
code; replicas all-reduce their shards on the last micro-step only).
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.device_mesh import DeviceMesh

from mamba3lite.train.parallel.layout import Layout


class Local:
    """One process: the plain module (compiled whole when asked)."""

    is_sharded = False

    def wrap(self, model: torch.nn.Module, compile: bool) -> torch.nn.Module:
        return torch.compile(model) if compile else model

    def micro_step(self, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class Replicated:
    """DDP over the mesh's `dp_replicate` dimension (flattened with `cp` under context parallelism: every
    rank's piece gradient is averaged): rank 0's weights broadcast at wrap, gradients averaged by the
    reducer's hooks while the last micro-step's backward runs."""

    is_sharded = False

    def __init__(self, mesh: DeviceMesh, device: torch.device) -> None:
        self.mesh, self.device = mesh, device
        self.ddp: torch.nn.Module | None = None

    def wrap(self, model: torch.nn.Module, compile: bool) -> torch.nn.Module:
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [self.device.index] if self.device.type == "cuda" else None
        self.ddp = DDP(
            model,
            device_ids=ids,
            process_group=replicas_group(self.mesh),
            gradient_as_bucket_view=True,
        )
        return torch.compile(self.ddp) if compile else self.ddp

    def micro_step(self, last: bool) -> contextlib.AbstractContextManager:
        assert self.ddp is not None, "wrap first"
        return contextlib.nullcontext() if last else self.ddp.no_sync()


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
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

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


def replicas_group(mesh: DeviceMesh):
    """The process group DDP averages gradients over: `dp_replicate`, or with a `cp` dimension of more
    than one rank the whole (dp_replicate x cp) mesh, flattened."""
    if mesh.size(mesh.mesh_dim_names.index("cp")) == 1:
        return mesh.get_group("dp_replicate")
    return mesh._flatten("dp_cp").get_group()
