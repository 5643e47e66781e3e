"""Whether a tensor or a model is sharded (DTensors: FSDP2/HSDP), asked without importing DTensor.

`torch.distributed.tensor` costs ~0.35 s of a command's start beside torch's own (`python -X importtime`,
on a 2-core machine), and a model in one process (generate, eval, serve, a one-process `train`) never
holds a DTensor. Its class is defined in that package, so while the package is not imported no tensor
can be one: the answer is False without importing it, and otherwise the question is the usual
`isinstance`. Every "is this sharded?" on the checkpoint and training paths asks here.
"""

from __future__ import annotations

import sys

import torch

_DTENSOR_PACKAGE = "torch.distributed.tensor"


def is_dtensor(t: object) -> bool:
    """Whether `t` is a DTensor (a sharded parameter, gradient or optimizer state)."""
    package = sys.modules.get(_DTENSOR_PACKAGE)
    return package is not None and isinstance(t, package.DTensor)


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether the model's parameters are DTensors (fully_shard / HSDP): its checkpoints are sharded."""
    return _DTENSOR_PACKAGE in sys.modules and any(is_dtensor(p) for p in model.parameters())
