"""The presets' memory per rank as a markdown table for the docs: for each preset its parameters, its
micro batch, and model/memory.py's estimate per rank on N processes replicated (ddp) and sharded
(fsdp), against a device of G GiB (of which USABLE_FRACTION may be planned for).

    python -m mamba3lite.report.memory_table                  # every preset, 8 processes, 80 GB
    python -m mamba3lite.report.memory_table --nproc 4 mamba3_1_5b mamba3_3b
    python -m mamba3lite.report.memory_table --long-context  # the longest trainable window per C

`longest_context_markdown` is the "Long context" table of docs/guides/context-parallelism.md: per preset,
the longest window (a power of two) that trains by the estimate at micro batch 1 on N processes of G GiB
with the model sharded (fsdp over all N ranks, the data-parallel x context-parallel mesh flattened, as
training shards it) and each window split over C = 1, 2, 4, 8 of them (activations per rank: T / C
tokens of one window).

The estimate measures each preset's layer on the CPU once (a few seconds; a minute for 7B), at the
compute dtype its `training.dtype` gives on such an accelerator, one with native bf16
(model/precision.py `planned_cuda_precision`): bf16 for auto and bf16, fp32 for fp32, whatever device
this machine has.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace

from mamba3lite.config import available_presets, load_config
from mamba3lite.model.flops import count_parameters
from mamba3lite.model.memory import USABLE_FRACTION, per_rank_memory, shard_count
from mamba3lite.model.precision import planned_cuda_precision


@dataclass(frozen=True)
class PresetMemory:
    """One row: a preset's estimate per rank, in bytes."""

    preset: str
    parameters: int
    micro_batch_size: int
    grad_checkpointing: bool
    ddp_bytes: float
    fsdp_bytes: float


def preset_memory(name: str, world_size: int = 8) -> PresetMemory:
    """The row of preset `name` (or a config path) on `world_size` processes, with its own micro
    batch, gradient checkpointing, optimizer and context parallelism."""
    cfg = load_config(name)
    t, dp = cfg.training, world_size // cfg.training.context_parallel
    compute = planned_cuda_precision(t.dtype).dtype
    return PresetMemory(
        preset=name,
        parameters=count_parameters(cfg.model),
        micro_batch_size=t.micro_batch_size,
        grad_checkpointing=t.grad_checkpointing,
        ddp_bytes=per_rank_memory(cfg.model, t, shards=shard_count("ddp", dp), compute=compute).total,
        fsdp_bytes=per_rank_memory(cfg.model, t, shards=shard_count("fsdp", dp), compute=compute).total,
    )


def memory_table_markdown(
    names: list[str] | None = None, world_size: int = 8, device_gib: float = 80.0
) -> str:
    """The markdown table of `names` (default: every packaged preset)."""
    usable = USABLE_FRACTION * device_gib * 2**30
    rows = [preset_memory(n, world_size) for n in (names or available_presets())]

    def cell(need: float) -> str:
        return f"{need / 2**30:,.1f}"

    def fits(need: float) -> str:
        return "yes" if need <= usable else "no"

    gb = f"{device_gib:g} GB"
    lines = [
        f"| preset | parameters | micro batch | GiB per rank, ddp x {world_size} | GiB per rank, fsdp x "
        f"{world_size} | fits {gb}: ddp / fsdp |",
        "|---|---:|---:|---:|---:|:---:|",
    ]
    for r in rows:
        micro = f"{r.micro_batch_size}" + (" (grad ckpt)" if r.grad_checkpointing else "")
        lines.append(
            f"| `{r.preset}` | {r.parameters / 1e6:,.0f}M | {micro} | {cell(r.ddp_bytes)} | "
            f"{cell(r.fsdp_bytes)} | {fits(r.ddp_bytes)} / {fits(r.fsdp_bytes)} |"
        )
    return "\n".join(lines) + "\n"


LONGEST_LOG2 = 30  # the search stops at windows of 2^30 tokens


def longest_seq_len(name: str, world_size: int, context_parallel: int, device_gib: float) -> int | None:
    """The longest window T = 2^k (k <= LONGEST_LOG2) whose training of preset `name` (or a config path)
    fits a rank by `per_rank_memory`: micro batch 1, the preset's gradient checkpointing and optimizer,
    the model state sharded over all `world_size` ranks, each window over `context_parallel` of them;
    None when not even the shortest (C tokens, one per rank) fits."""
    cfg = load_config(name)
    usable = USABLE_FRACTION * device_gib * 2**30
    compute = planned_cuda_precision(cfg.training.dtype).dtype
    best = None
    for k in range(max(context_parallel.bit_length() - 1, 0), LONGEST_LOG2 + 1):
        t = replace(cfg.training, micro_batch_size=1, max_seq_len=2**k, context_parallel=context_parallel)
        if per_rank_memory(cfg.model, t, shards=world_size, compute=compute).total > usable:
            break  # the estimate grows with T: no longer window fits either
        best = 2**k
    return best


def longest_context_markdown(
    names: list[str] | None = None,
    world_size: int = 8,
    device_gib: float = 80.0,
    context_parallel: tuple[int, ...] = (1, 2, 4, 8),
) -> str:
    """The "Long context" table of docs/guides/context-parallelism.md (the module docstring) of `names`
    (default: every preset)."""
    cps = [c for c in context_parallel if world_size % c == 0]

    def cell(seq_len: int | None) -> str:
        if seq_len is None:
            return "-"
        for unit, size in (("M", 2**20), ("K", 2**10)):
            if seq_len >= size:
                return f"{seq_len // size}{unit}"
        return str(seq_len)

    head = " | ".join(f"C = {c}" for c in cps)
    lines = [f"| preset | parameters | {head} |", "|---|---:|" + "---:|" * len(cps)]
    for name in names or available_presets():
        n = count_parameters(load_config(name).model)
        cells = " | ".join(cell(longest_seq_len(name, world_size, c, device_gib)) for c in cps)
        lines.append(f"| `{name}` | {n / 1e6:,.0f}M | {cells} |")
    caption = (
        f"Longest trainable window (tokens, a power of two) by the estimate: {world_size} x "
        f"{device_gib:g} GB, fsdp over all {world_size} ranks, micro batch 1, each window over C ranks."
    )
    return caption + "\n\n" + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("presets", nargs="*", help="preset names or config files (default: every preset)")
    parser.add_argument("--nproc", type=int, default=8, help="processes per run (default 8)")
    parser.add_argument("--device-gib", type=float, default=80.0, help="device memory (default 80)")
    parser.add_argument("--long-context", action="store_true", help="the longest window per C instead")
    args = parser.parse_args(argv)
    table = longest_context_markdown if args.long_context else memory_table_markdown
    print(table(args.presets or None, args.nproc, args.device_gib), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
