"""Which strategy a run uses and the shape of its device mesh: a pure function of the config, the world
size and the memory estimate, checked at the border (one ConfigError per bad combination).

The mesh has named dimensions, outermost first: `dp_replicate` (replicas of the model), `dp_shard` (the
processes one copy of the model is sharded over) and `cp` (the C processes that share each window,
each holding T/C contiguous tokens; `training.context_parallel`). world = dp_replicate x dp_shard x cp;
the data-parallel size (what the sampler and the accumulation divide by) is world / C.

With C > 1 the model is replicated (ddp) or sharded (fsdp/hsdp) over the flattened data-parallel x cp
ranks: each rank back-propagates the mean loss of its piece, so the average of the gradients over all of
them is the gradient of the windows' mean loss (the mean over C equal pieces).

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
        """Processes one copy of the model state (weights, gradients, optimizer) is divided over: a
        sharded strategy shards over dp_shard x cp (every rank of a window's group holds a shard)."""
        return self.dp_shard * self.cp if self.strategy in ("fsdp", "hsdp") else 1

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return (self.dp_replicate, self.dp_shard, self.cp)


def plan_layout(tc, world_size: int, fits_replicated: bool = True) -> Layout:
    """The layout for `training.parallelism` (auto: fsdp when a replica does not fit, else ddp) on
    `world_size` processes; ConfigError when the settings cannot make a mesh of that size."""
    cp = tc.context_parallel
    if cp > 1:
        check_context_parallel(tc, world_size)
    world_size //= cp  # from here on: the data-parallel processes
    if world_size * cp == 1:
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
        return cp_layout(tc, Layout("ddp", dp_replicate=world_size, cp=cp))
    if name == "fsdp":
        return cp_layout(tc, Layout("fsdp", dp_shard=world_size, cp=cp))
    assert name == "hsdp", name
    if tc.dp_replicate in (1, world_size):
        raise ConfigError(
            f"training.parallelism hsdp needs replicas that are each sharded: training.dp_replicate is "
            f"{tc.dp_replicate} of {world_size} processes (1 is fsdp, {world_size} is ddp); choose a "
            f"divisor of {world_size} between them, or parallelism fsdp/ddp"
        )
    return cp_layout(tc, Layout("hsdp", dp_replicate=tc.dp_replicate, dp_shard=world_size // tc.dp_replicate,
                                cp=cp))  # fmt: skip


def check_fault_tolerance(tc, layout: Layout) -> None:
    """ConfigError for `training.fault_tolerance` beside what it does not support (yet): replica groups
    replace the replicate dimension, and inside a group the model is the plain module or DDP."""
    if not tc.fault_tolerance.enabled:
        return
    fix = (
        "run each replica group as one process or with parallelism ddp, or turn training.fault_tolerance off"
    )
    if layout.strategy not in ("local", "ddp", "fsdp"):
        raise ConfigError(
            f"training.fault_tolerance is not supported with parallelism {layout.strategy} inside a replica "
            f"group: the replica groups are the replicate dimension; use fsdp inside each group; {fix}"
        )
    if layout.cp > 1:
        raise ConfigError(
            f"training.fault_tolerance is not supported with training.context_parallel > 1; {fix}"
        )
    if tc.time_budget_minutes:
        raise ConfigError(
            "training.fault_tolerance with training.time_budget_minutes: each group would end by its own "
            "clock at a different step; give the run training.max_steps (time_budget_minutes=0)"
        )
    if tc.eval_tasks:
        raise ConfigError("training.fault_tolerance with training.eval_tasks is not supported; evaluate the "
                          "checkpoints with `mamba3lite eval`")  # fmt: skip


def check_context_parallel(tc, world_size: int) -> None:
    """ConfigError for a `training.context_parallel` C > 1 that this job cannot run."""
    cp = tc.context_parallel
    if world_size == 1:
        raise ConfigError(
            f"training.context_parallel is {cp} but this is one process; run it under torchrun with a "
            f"multiple of {cp} processes, or set training.context_parallel=1"
        )
    if world_size % cp:
        raise ConfigError(
            f"training.context_parallel {cp} does not divide the {world_size} processes of this job; "
            f"choose a divisor of {world_size}"
        )
    if tc.max_seq_len % cp:
        raise ConfigError(
            f"training.context_parallel {cp} does not divide the window of {tc.max_seq_len} tokens "
            "(training.max_seq_len); choose a context_parallel that divides it"
        )
    if tc.eval_tasks:
        raise ConfigError(
            "training.eval_tasks (in-loop benchmarks) cannot run with training.context_parallel > 1: they "
            "decode and score whole items on one process; evaluate the checkpoints with `mamba3lite eval`"
        )


def cp_layout(tc, layout: Layout) -> Layout:
    """`layout` (already carrying C), after the checks that need the strategy."""
    if layout.cp > 1 and layout.dp_replicate > 1 and layout.dp_shard > 1:
        raise ConfigError(
            "training.context_parallel > 1 with parallelism hsdp is not supported; use fsdp or ddp"
        )
    return layout
