"""How one model is spread over the processes of the mesh: three small strategies behind one interface.

    wrap(model, compile)   the module the training step calls (parameters broadcast or sharded)
    micro_step(last)       the context of one micro-step's forward and backward: whether its backward
                           finishes the step's gradient reduction (`last`) or only accumulates
    is_sharded             whether the parameters are DTensors (the checkpoint code saves those with
                           torch.distributed.checkpoint)
    live_state(model, opt) / load_live_state(model, opt, state)
                           this process's model and optimizer state as plain tensors, and its inverse:
                           what a healthy replica group sends to a joining one (replicas.py); the joiner's
                           process of the same rank has the same layout

Local: one process, the plain module. Replicated: DDP with PyTorch's reducer, which all-reduces the
gradients in buckets DURING the backward of the last micro-step (no_sync on the others), into the
gradients themselves (`gradient_as_bucket_view`). Sharded (fsdp.py, a module of its own): FSDP2
(`fully_shard` on every block, then on the root so the tied embedding/head stays one parameter), on a
1-D mesh (fsdp) or 2-D (hsdp: the same code; replicas all-reduce their shards on the last micro-step
only). FSDP2 imports DTensor, ~0.35 s of start-up beside torch's own (`python -X importtime`), so the
seam imports fsdp.py only for a sharded layout; DDP is in the torch that every run imports already.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel as DDP


class WholeState:
    """The live state of a model whose parameters are whole on every process (Local, Replicated): the
    module's and the optimizer's own state_dicts."""

    def live_state(self, model: torch.nn.Module, optimizer) -> dict:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

    def load_live_state(self, model: torch.nn.Module, optimizer, state: dict) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])


class Local(WholeState):
    """One process: the plain module (compiled whole when asked)."""

    is_sharded = False

    def wrap(self, model: torch.nn.Module, compile: bool) -> torch.nn.Module:
        return torch.compile(model) if compile else model

    def micro_step(self, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class Replicated(WholeState):
    """DDP over the mesh's `dp_replicate` dimension (flattened with `cp` under context parallelism: every
    rank's piece gradient is averaged): rank 0's weights broadcast at wrap, gradients averaged by the
    reducer's hooks while the last micro-step's backward runs."""

    is_sharded = False

    def __init__(self, mesh: DeviceMesh, device: torch.device) -> None:
        self.mesh, self.device = mesh, device
        self.ddp: torch.nn.Module | None = None

    def wrap(self, model: torch.nn.Module, compile: bool) -> torch.nn.Module:
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


def replicas_group(mesh: DeviceMesh):
    """The process group DDP averages gradients over: `dp_replicate`, or with a `cp` dimension of more
    than one rank the whole (dp_replicate x cp) mesh, flattened."""
    if mesh.size(mesh.mesh_dim_names.index("cp")) == 1:
        return mesh.get_group("dp_replicate")
    return mesh._flatten("dp_cp").get_group()
