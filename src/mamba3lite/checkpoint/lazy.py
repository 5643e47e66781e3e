"""The sharded format's modules, imported where a sharded model or step is first met.

sharded.py (DCP's files) and state.py (torch's state_dict API over DTensors) import
torch.distributed.checkpoint and DTensor, ~0.4 s of a command's start beside torch's own (python -X
importtime), which a plain model in one process (generate, eval, serve, a one-process train) never
needs (docs/architecture.md §6 rule 19: a measured start-up cost). Saving, verifying and loading ask
here for them.
"""

from __future__ import annotations

from types import ModuleType


def sharded_files() -> ModuleType:
    """checkpoint/sharded.py: the sharded step format's files (write, read, check, stored dtypes)."""
    from mamba3lite.checkpoint import sharded

    return sharded


def sharded_state() -> ModuleType:
    """checkpoint/state.py: model and optimizer state of plain, DDP and FSDP2 models."""
    from mamba3lite.checkpoint import state

    return state
