"""`train --plan`: what each rank of a run would hold, by model/memory.py's estimate, before anything is
built: the strategy and the mesh for a world size, the global batch's split, the compute dtype the run
will use there (`training.dtype` resolved for the device: model/precision.py `planned_precision`), and
per rank the weights, gradients, optimizer state, gathered blocks and activations (at that dtype: fp32
ones take about twice the bytes of bf16 ones) against the device's memory.

    print(memory_plan(cfg, world_size=8))    # `mamba3lite train --config mamba3_7b --plan --nproc 8`

`parallelism: auto` is resolved by the rule the run applies: fsdp when one whole copy of the model does
not fit the device (`replicated_fits`), else ddp; one process needs no strategy.
"""

from __future__ import annotations

import torch

from mamba3lite.errors import ConfigError
from mamba3lite.model.flops import count_parameters
from mamba3lite.model.memory import (
    USABLE_FRACTION,
    per_rank_memory,
    physical_memory_bytes,
    replicated_fits,
    shard_count,
)
from mamba3lite.model.precision import planned_precision


def plan_device(preference: str) -> torch.device:
    """The device a rank of the run would train on, for its memory: like the trainer's choice, but a
    CUDA device asked for on a machine without one (a plan made on a login node) is still planned for."""
    if preference == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    return torch.device("cuda:0" if preference == "cuda" else preference)


def planned_strategy(
    cfg,
    world_size: int,
    device: torch.device,
    device_bytes: float | None = None,
    *,
    compute: torch.dtype | None,
) -> str:
    """The parallelism the run uses on `world_size` processes ("one process" for a single
    data-parallel one); auto resolved as the module docstring says, for `device` or, given, a device of
    `device_bytes`, with activations at the run's compute dtype `compute` (bf16, or None: fp32)."""
    if world_size <= 1:
        return "one process"
    if cfg.training.parallelism != "auto":
        return cfg.training.parallelism
    if device_bytes is not None:
        need = per_rank_memory(cfg.model, cfg.training, compute=compute).total
        return "ddp" if need <= USABLE_FRACTION * device_bytes else "fsdp"
    return "ddp" if replicated_fits(cfg.model, cfg.training, device, compute) else "fsdp"


def memory_plan(
    cfg, world_size: int = 1, device: torch.device | None = None, device_bytes: float | None = None
) -> str:
    """The plan's lines for `cfg` on `world_size` processes; ConfigError when the world size does not
    split into context-parallel groups or hsdp replicas, or the global batch into micro batches.
    `device_bytes`: the memory of the device planned for (default: that of `device`, the run's)."""
    t = cfg.training
    if world_size < 1 or world_size % t.context_parallel:
        raise ConfigError(
            f"a world size of {world_size} does not split into groups of training.context_parallel "
            f"{t.context_parallel}; use a multiple of it"
        )
    device = plan_device(t.device) if device is None else device
    precision = planned_precision(t.dtype, device)
    dp = world_size // t.context_parallel
    strategy = planned_strategy(cfg, world_size, device, device_bytes, compute=precision.dtype)
    if strategy == "hsdp" and dp % t.dp_replicate:
        raise ConfigError(
            f"hsdp: the data-parallel size {dp} does not split into training.dp_replicate {t.dp_replicate} "
            "replicas"
        )
    shards = 1  # fsdp shards over the data-parallel x context-parallel ranks (as training does)
    if strategy in ("fsdp", "hsdp"):
        shards = shard_count(strategy, dp, t.dp_replicate) * t.context_parallel
    accumulation = t.accumulation(dp)  # ConfigError when the global batch does not split
    est = per_rank_memory(
        cfg.model, t, shards=shards, context_parallel=t.context_parallel, compute=precision.dtype
    )
    parts = " | ".join(f"{k} {v:,.2f}" for k, v in est.parts_gib().items())
    have = physical_memory_bytes(device) if device_bytes is None else device_bytes
    if have is None:
        verdict = f"{device}: memory unknown on this machine (--device-memory-gib G plans for one)"
    else:
        usable = USABLE_FRACTION * have
        fits = "fits" if est.total <= usable else "does NOT fit"
        where = str(device) if device_bytes is None else "planned for"
        verdict = f"{where}: {have / 2**30:,.1f} GiB ({usable / 2**30:,.1f} usable): {fits}"
    mesh = f"{dp} data-parallel x {t.context_parallel} context-parallel"
    if strategy == "hsdp":
        mesh += f" (dp_replicate {t.dp_replicate} x dp_shard {dp // t.dp_replicate})"
    return "\n".join(
        [
            f"plan: {count_parameters(cfg.model) / 1e6:,.1f}M parameters on {world_size} process(es), "
            f"{strategy}: {mesh}; model state in {shards} shard(s)",
            f"global batch: {t.global_windows} windows x {t.max_seq_len} tokens = "
            f"{t.global_windows * t.max_seq_len:,} tokens per step; micro batch {t.micro_batch_size}, "
            f"{accumulation} accumulated per data-parallel process"
            + (", gradient checkpointing" if t.grad_checkpointing else ""),
            f"compute: {precision.reason}",
            f"per rank (GiB): {parts}",
            f"device {verdict}",
        ]
    )
