"""The few collectives of saving a checkpoint, each a no-op (or the one process's answer) without a
process group, so that the same save code runs in one process and under torchrun."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def is_distributed() -> bool:
    """Whether a process group is up (torchrun), so that collectives are real."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank, 0 in one process."""
    return dist.get_rank() if is_distributed() else 0


def barrier() -> None:
    """Every rank waits for the others (nothing in one process)."""
    if is_distributed():
        dist.barrier()


def gather_objects(obj: Any) -> list[Any]:
    """[obj of rank 0, obj of rank 1, ...] (a collective), or [obj] in one process."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
