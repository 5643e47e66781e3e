"""The former home of the process-group helpers, kept importable: they live in
train/parallel/process_group.py (the parallelism seam: train/parallel/)."""

from __future__ import annotations

from typing import Any

from mamba3lite.train.parallel import process_group as _pg
from mamba3lite.train.parallel.process_group import (  # noqa: F401
    DistInfo,
    any_rank,
    barrier,
    broadcast_int,
    held_on_rank0,
    init_distributed,
    lost_a_peer,
    mean_across,
    pick_device,
    sum_across,
    teardown,
)


def __getattr__(name: str) -> Any:  # `left_process_group` changes after import: read it live
    return getattr(_pg, name)
