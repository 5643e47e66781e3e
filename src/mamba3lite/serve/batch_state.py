"""The batched decode state: rows [0, n) of preallocated state tensors, one row per running request.

A request joins by copying its one-row state into row n, and leaves by moving the last row into its
place (swap-remove): each change copies one row's state, never the batch's, however many rows run. The
buffers grow by doubling up to the engine's batch limit. `view()` is the `ModelCache` of the live rows
(views into the buffers, so `Mamba3Transformer.step` updates them in place).

`state_tensors` flattens a one-row state to a tensor list (what the prefix cache stores).
"""

from __future__ import annotations

from torch import Tensor

from mamba3lite.model.mamba3 import Mamba3Cache
from mamba3lite.model.transformer import ModelCache


def state_tensors(cache: ModelCache) -> list[Tensor]:
    """Every tensor of a `ModelCache` in a fixed order (layers' angle, ssm, k, v; then last_token)."""
    out: list[Tensor] = []
    for layer in cache.layers:
        out += [layer.angle_BHS, layer.ssm_BHPN, layer.k_BRHN, layer.v_BHP]
    out.append(cache.last_token_B)
    return out


def load_state(cache: ModelCache, tensors: list[Tensor]) -> None:
    """Copy `tensors` (from `state_tensors` of a cache with as many rows) into `cache`."""
    for dst, src in zip(state_tensors(cache), tensors, strict=True):
        dst.copy_(src)


def _rows(cache: ModelCache, start: int, stop: int) -> ModelCache:
    layers = [
        Mamba3Cache(*(t[start:stop] for t in (c.angle_BHS, c.ssm_BHPN, c.k_BRHN, c.v_BHP)))
        for c in cache.layers
    ]
    return ModelCache(layers=layers, last_token_B=cache.last_token_B[start:stop])


class BatchState:
    """Rows [0, n) of a `ModelCache` of `capacity` rows (grown by doubling up to `max_rows`)."""

    def __init__(self, model, max_rows: int, initial_rows: int = 4) -> None:
        self.model, self.max_rows = model, max_rows
        self.capacity = min(initial_rows, max_rows)
        self.buf = model.allocate_cache(self.capacity)
        self.n = 0

    def view(self) -> ModelCache:
        return _rows(self.buf, 0, self.n)

    def add(self, cache_1: ModelCache) -> None:
        """Copy a one-row state into row n."""
        assert self.n < self.max_rows
        if self.n == self.capacity:
            self._grow()
        load_state(_rows(self.buf, self.n, self.n + 1), state_tensors(cache_1))
        self.n += 1

    def remove(self, i: int) -> None:
        """Drop row i: the last row moves into its place."""
        assert 0 <= i < self.n
        last = self.n - 1
        if i != last:
            load_state(_rows(self.buf, i, i + 1), state_tensors(_rows(self.buf, last, last + 1)))
        self.n -= 1

    def _grow(self) -> None:
        bigger = self.model.allocate_cache(min(2 * self.capacity, self.max_rows))
        load_state(_rows(bigger, 0, self.n), state_tensors(self.view()))
        self.buf, self.capacity = bigger, min(2 * self.capacity, self.max_rows)
