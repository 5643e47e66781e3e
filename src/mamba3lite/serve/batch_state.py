"""Rows of the batched decode state: stack requests' states into one `ModelCache`, drop finished rows,
and flatten a one-row state to a tensor list (what the prefix cache stores)."""

from __future__ import annotations

import torch
from torch import Tensor

from mamba3lite.model.mamba3 import Mamba3Cache
from mamba3lite.model.transformer import ModelCache

_FIELDS = ("angle_BHS", "ssm_BHPN", "k_BRHN", "v_BHP")


def state_tensors(cache) -> list[Tensor]:
    """Every tensor of a `ModelCache` in a fixed order (layers' angle, ssm, k, v; then last_token)."""
    out: list[Tensor] = []
    for layer in cache.layers:
        out += [layer.angle_BHS, layer.ssm_BHPN, layer.k_BRHN, layer.v_BHP]
    out.append(cache.last_token_B)
    return out


def load_state(cache, tensors: list[Tensor]) -> None:
    """Copy `tensors` (from `state_tensors` of a one-row cache) into the one-row `cache`."""
    for dst, src in zip(state_tensors(cache), tensors, strict=True):
        dst.copy_(src)


def select_rows(cache, rows: Tensor):
    """A `ModelCache` of the rows `rows` (int64 indices) of `cache` (new tensors)."""
    layers = [
        Mamba3Cache(*(t.index_select(0, rows) for t in (c.angle_BHS, c.ssm_BHPN, c.k_BRHN, c.v_BHP)))
        for c in cache.layers
    ]
    return ModelCache(layers=layers, last_token_B=cache.last_token_B.index_select(0, rows))


def cat_caches(caches: list):
    """One `ModelCache` whose rows are the rows of `caches` in order (new tensors)."""
    n_layers = len(caches[0].layers)
    layers = []
    for i in range(n_layers):
        parts = [c.layers[i] for c in caches]
        layers.append(Mamba3Cache(*(torch.cat([getattr(p, name) for p in parts]) for name in _FIELDS)))
    return ModelCache(layers=layers, last_token_B=torch.cat([c.last_token_B for c in caches]))
