"""The training loop and its parts: Pretrainer, optimizer/schedule, checkpoints, metrics, distributed.

`from mamba3lite.train import Pretrainer, CheckpointManager, TrainingLogger`. Imports are lazy so that
`mamba3lite.checkpoint` (used by eval/generate/inspect) does not pull in the trainer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mamba3lite.checkpoint import CheckpointManager
    from mamba3lite.train.metrics import TrainingLogger
    from mamba3lite.train.trainer import Pretrainer

__all__ = ["CheckpointManager", "Pretrainer", "TrainingLogger"]

_WHERE = {
    "CheckpointManager": "mamba3lite.checkpoint",
    "TrainingLogger": "mamba3lite.train.metrics",
    "Pretrainer": "mamba3lite.train.trainer",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'mamba3lite.train' has no attribute {name!r}")
