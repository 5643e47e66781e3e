"""The data layer: token files (shards), the packed-window dataset and the resumable sampler.

`from mamba3lite.data import PretrainDataset, WindowSampler`. The two are imported lazily, so that
`mamba3lite.data.shards` (used by `prepare` and its worker processes) does not pull in torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mamba3lite.data.dataset import PretrainDataset
    from mamba3lite.data.sampler import WindowSampler

__all__ = ["PretrainDataset", "WindowSampler"]


def __getattr__(name: str) -> Any:
    if name == "PretrainDataset":
        from mamba3lite.data.dataset import PretrainDataset

        return PretrainDataset
    if name == "WindowSampler":
        from mamba3lite.data.sampler import WindowSampler

        return WindowSampler
    raise AttributeError(f"module 'mamba3lite.data' has no attribute {name!r}")
