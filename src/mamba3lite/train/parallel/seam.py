"""The parallelism seam: one object, built once from the config and torchrun's environment, that owns
how the model is spread over the processes and everything in a step that depends on it.

    par = Parallelism.from_config(cfg, info)       # layout (layout.py), mesh, strategy (strategies.py)
    model = par.wrap(raw_model)                    # DDP / FSDP2 / HSDP / the plain module, compiled
    micro_batches = [par.cut(x, y) for x, y in windows]   # context parallel: this rank's piece
    tally = par.tally()                            # one step's device-side account (tally.py)
    for i, batch in enumerate(micro_batches):
        with par.micro_step(last=i == accum - 1):
            tally.admit(loss).div(accum).backward()
    norm = par.reduce_and_clip(params, tally, max_norm)   # rescale for skipped micro-steps, clip
    outcome = tally.settle(norm, stop, damaged)    # one all-reduce, one host read

With `training.fault_tolerance` the job is one of several torchft replica groups (replicas.py,
`par.replicas`): the sampler's data-parallel size and rank span all groups (each reads its slot of the
global batch), `reduce_and_clip` averages the gradients over the groups of the step's quorum, and the loop
asks `par.replicas` for the quorum before a step and the commit before the optimizer step (one group alone:
`SingleReplica`, which does nothing and always commits).

The loop never asks which strategy runs. What the checkpoint code needs is here too: `mesh`,
`is_sharded` (DTensor parameters), `dp_size`/`dp_rank` (the sampler's: all cp ranks of a group read
the same windows). Under context parallelism (`training.context_parallel` C > 1) `wrap` sets the model's
group (the mesh's "cp" dimension), `cut` gives each rank its T/C piece of every window, the tally's loss
is the mean over every rank (so over the C pieces of each window), and `whole_windows()` is the context
in which the model runs on whole windows, alone (validation, anything that decodes).

The state dicts themselves are the checkpoint package's (checkpoint/state.py, on
torch.distributed.checkpoint.state_dict): its manager reads the strategy off the model (DTensor
parameters: every rank writes its shards with DCP; else rank 0 writes the three files) and loads either
format into any strategy at any world size.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from mamba3lite.checkpoint.dtensor import is_dtensor
from mamba3lite.model.context_parallel import cut_window
from mamba3lite.model.memory import replicated_fits
from mamba3lite.model.precision import resolve_precision
from mamba3lite.train.parallel.layout import MESH_DIMS, Layout, check_fault_tolerance, plan_layout
from mamba3lite.train.parallel.process_group import DistInfo
from mamba3lite.train.parallel.replicas import ReplicaGroups, SingleReplica, build_replicas
from mamba3lite.train.parallel.strategies import Local, Replicated
from mamba3lite.train.parallel.tally import StepTally

if TYPE_CHECKING:
    from mamba3lite.train.parallel.fsdp import Sharded


class Parallelism:
    """See the module docstring. Built by `from_config`; `Parallelism.local(device)` is one process."""

    def __init__(self, layout: Layout, info: DistInfo, *, reshard_after_forward: bool = True,
                 param_dtype: torch.dtype | None = None, compile: bool = False,
                 replicas: SingleReplica | ReplicaGroups | None = None) -> None:  # fmt: skip
        assert layout.world_size == info.world_size, (layout, info.world_size)
        self.layout, self.info, self.compile = layout, info, compile
        # torchft replica groups (replicas.py): this job is one of them, or (off) the whole job
        self.replicas = replicas or SingleReplica()
        self.mesh: DeviceMesh | None = None
        if layout.strategy == "local":
            self.strategy: Local | Replicated | Sharded = Local()
            return
        device_type = "cuda" if info.device.type == "cuda" else "cpu"
        self.mesh = init_device_mesh(device_type, layout.mesh_shape, mesh_dim_names=MESH_DIMS)
        if layout.strategy == "ddp":
            self.strategy = Replicated(self.mesh, info.device)
        else:  # chosen here: FSDP2 imports DTensor (fsdp.py), which no other layout needs
            from mamba3lite.train.parallel.fsdp import Sharded

            self.strategy = Sharded(self.mesh, layout, reshard_after_forward, param_dtype)

    @classmethod
    def from_config(cls, cfg, info: DistInfo) -> Parallelism:
        """The seam for `cfg.training` on this job (ConfigError for settings that make no mesh)."""
        tc = cfg.training
        compute = resolve_precision(tc.dtype, info.device).dtype
        fits = True
        if info.distributed and tc.parallelism == "auto" and tc.dp_replicate == 1:
            fits = replicated_fits(cfg.model, tc, info.device, compute)  # activations at the run's dtype
        layout = plan_layout(tc, info.world_size, fits)
        check_fault_tolerance(tc, layout)
        # bf16 parameters for the sharded forward/backward on an accelerator that computes in bf16; the
        # CPU keeps fp32 ones (autocast still computes in bf16 where the resolved dtype is bf16)
        param_dtype = compute if info.device.type == "cuda" else None
        return cls(layout, info, reshard_after_forward=tc.reshard_after_forward, param_dtype=param_dtype,
                   compile=tc.compile, replicas=build_replicas(cfg, info.rank, info.world_size))  # fmt: skip

    @classmethod
    def local(cls, device: torch.device, compile: bool = False) -> Parallelism:
        return cls(Layout("local"), DistInfo(device=device), compile=compile)

    # ---------------------------------------------------------------------- what others read
    @property
    def name(self) -> str:
        return self.layout.strategy

    def describe(self) -> str:
        """The mesh in words, e.g. "dp_replicate 2 x dp_shard 2"."""
        dims = zip(MESH_DIMS, self.layout.mesh_shape, strict=True)
        return " x ".join(f"{name} {size}" for name, size in dims if size > 1) or "one process"

    @property
    def is_sharded(self) -> bool:
        """The parameters are DTensors (fsdp/hsdp)."""
        return self.strategy.is_sharded

    @property
    def dp_size(self) -> int:
        """Data-parallel processes (they read different windows): the sampler's world size. With replica
        groups, those of every group at full strength: each group reads its own slot of the global batch."""
        return self.layout.dp_size * self.replicas.groups

    @property
    def dp_rank(self) -> int:
        """This process's index among the data-parallel ones: the sampler's rank."""
        inner = 0
        if self.mesh is not None:
            replica, shard, _cp = self.mesh.get_coordinate() or (0, 0, 0)
            inner = replica * self.layout.dp_shard + shard
        return self.replicas.group_id * self.layout.dp_size + inner

    @property
    def cp_rank(self) -> int:
        """This process's piece of each window (0 without context parallelism)."""
        if self.mesh is None:
            return 0
        return (self.mesh.get_coordinate() or (0, 0, 0))[2]

    # ---------------------------------------------------------------------------- the step
    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module the training step calls (the raw `model` is changed in place where the strategy
        shards it: its parameters become DTensors). Under context parallelism the model exchanges its
        recurrent states over the mesh's "cp" group from here on."""
        self.raw_model = model
        if self.layout.cp > 1:
            assert self.mesh is not None
            model.set_context_parallel(self.mesh["cp"].get_group())
        return self.strategy.wrap(model, self.compile)

    def cut(self, x_BT: torch.Tensor, y_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of a micro-batch of windows: all of it, or under context parallelism its
        contiguous piece (B, T/C) of every window."""
        if self.layout.cp == 1:
            return x_BT, y_BT
        x_BT, y_BT = cut_window(x_BT, y_BT, self.cp_rank, self.layout.cp)
        return x_BT.contiguous(), y_BT.contiguous()

    @contextlib.contextmanager
    def whole_windows(self):
        """The model (the raw one given to `wrap`) runs on whole windows on this process inside: the
        context-parallel group is unset, then set again (nothing to do without context parallelism)."""
        if self.layout.cp == 1:
            yield
            return
        assert self.mesh is not None
        self.raw_model.set_context_parallel(None)
        try:
            yield
        finally:
            self.raw_model.set_context_parallel(self.mesh["cp"].get_group())

    def live_state(self, optimizer) -> dict:
        """This process's model and optimizer state as plain tensors (what a healthy replica group sends a
        joining one): the strategy's (whole state dicts, or this rank's shards)."""
        return self.strategy.live_state(self.raw_model, optimizer)

    def load_live_state(self, optimizer, state: dict) -> None:
        """Inverse of `live_state`, on the joiner's process of the same rank."""
        self.strategy.load_live_state(self.raw_model, optimizer, state)

    def micro_step(self, last: bool) -> contextlib.AbstractContextManager:
        """The context of one micro-step's forward AND backward; `last`: its backward completes the
        step's gradient reduction."""
        return self.strategy.micro_step(last)

    def tally(self) -> StepTally:
        """A new step's account; every process of the job agrees on each micro-step. Its loss is the mean
        over every process: over the data-parallel ranks and, within each, the C pieces of the windows
        (each piece's mean loss; equal pieces, so their mean is the windows' mean loss)."""
        group = dist.group.WORLD if self.info.distributed else None
        return StepTally(self.info.device, group, self.layout.world_size)

    def reduce_and_clip(self, params: list[torch.nn.Parameter], tally: StepTally, max_norm: float,
                        accum: int) -> torch.Tensor:  # fmt: skip
        """After the last backward (the strategy has reduced the gradients): rescale them to the mean
        over the good micro-steps (accum / good; x1.0 when none was skipped, which changes no bit), with
        replica groups average them over the groups taking part (torchft's all-reduce), clip
        their global L2 norm to `max_norm` (inf: no clipping) and return the pre-clip norm, a plain
        tensor on the device (not read here)."""
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return torch.zeros((), device=self.info.device)
        scale = accum / tally.good_count().clamp(min=1)
        for g in grads:
            (g.to_local() if is_dtensor(g) else g).mul_(scale.to(g.dtype))
        self.replicas.average(grads)  # replica groups: the mean over the groups of the step's quorum
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        # over DTensor gradients the norm is a DTensor too (its shards' partial sums): the global value
        return norm.full_tensor() if is_dtensor(norm) else norm
