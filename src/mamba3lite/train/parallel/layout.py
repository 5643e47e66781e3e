"""Which strategy a run uses and the shape of its device mesh: a pure function of the config, the world
size and the memory estimate, checked at the border (one ConfigError per bad combination).

The mesh has named dimensions, outermost first: `dp_replicate` (replicas of the model), `dp_shard` (the
processes one copy of the model is sharded over) and, once context parallelism lands, `cp` (processes
that share each window; `training.context_parallel`, 1 for now). world = dp_replicate x dp_shard x cp;
the data-parallel size (what the sampler and the accumulation divide by) is dp_replicate x dp_shard.

    ddp   dp_replicate = world, dp_shard = 1: every process holds the whole model
    fsdp  dp_replicate = 1,     dp_shard = world: parameters, gradients, optimizer state sharded
    hsdp  dp_replicate = R,     dp_shard = world / R: sharded within a group, replicated across groups
    local one process: no mesh, the plain module
"""

from __future__ import annotations

from dataclasses import dataclass

from mamba3lite.errors import ConfigError

MESH_DIMS = ("dp_replicate", "dp_shard", "cp")


@dataclass(frozen=True)
class Layout:
    """A strategy's name and its mesh shape (see the module docstring)."""

    strategy: str  # local | ddp | fsdp | hsdp
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1

    @property
    def dp_size(self) -> int:
        """Data-parallel processes: the ones that read different windows."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.dp_size * self.cp

    @property
    def shards(self) -> int:
        """Processes one copy of the model state (weights, gradients, optimizer) is divided over."""
        return self.dp_shard

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return (self.dp_replicate, self.dp_shard, self.cp)


def plan_layout(tc, world_size: int, fits_replicated: bool = True) -> Layout:
    """The layout for `training.parallelism` (auto: fsdp when a replica does not fit, else ddp) on
    `world_size` processes; ConfigError when the settings cannot make a mesh of that size."""
    cp = tc.context_parallel
    if cp != 1:
        raise ConfigError(
            f"training.context_parallel is {cp}, but context parallelism is not available in this version; "
            "set training.context_parallel=1"
        )
    if world_size == 1:
        if tc.dp_replicate > 1:
            raise ConfigError(
                f"training.dp_replicate is {tc.dp_replicate} but this is one process; run it under torchrun "
                f"with a multiple of {tc.dp_replicate} processes, or set training.dp_replicate=1"
            )
        return Layout("local")
    name = tc.parallelism
    if name == "auto":
        name = "hsdp" if tc.dp_replicate > 1 else ("ddp" if fits_replicated else "fsdp")
    if world_size % tc.dp_replicate:
        raise ConfigError(
            f"training.dp_replicate {tc.dp_replicate} does not divide the {world_size} processes of this "
            "job; "
            f"choose a divisor of {world_size}"
        )
    if name != "ddp" and tc.eval_tasks:
        raise ConfigError(
            f"training.eval_tasks (in-loop benchmarks) cannot run under parallelism {name} yet: its ranks "
            "score different items, and a sharded model's forward is a collective; use "
            "training.parallelism=ddp, or evaluate the checkpoints with `mamba3lite eval`"
        )
    if name == "ddp":
        return Layout("ddp", dp_replicate=world_size)
    if name == "fsdp":
        return Layout("fsdp", dp_shard=world_size)
    assert name == "hsdp", name
    if tc.dp_replicate in (1, world_size):
        raise ConfigError(
            f"training.parallelism hsdp needs replicas that are each sharded: training.dp_replicate is "
            f"{tc.dp_replicate} of {world_size} processes (1 is fsdp, {world_size} is ddp); choose a "
            f"divisor of {world_size} between them, or parallelism fsdp/ddp"
        )
    return Layout("hsdp", dp_replicate=tc.dp_replicate, dp_shard=world_size // tc.dp_replicate)
