"""The batched decode state: rows [0, n) of a preallocated model state, one row per running request.

A request joins by copying its one-row state into row n, and leaves by moving the last row into its
place (swap-remove): each change copies one row's state, never the batch's, however many rows run. The
buffer grows by doubling up to the engine's batch limit. `view()` is the state of the live rows (views
into the buffer, so `Mamba3Transformer.step` updates them in place).

Only the decode-state protocol (model/decode_state.py) is used: `rows`, `load_`, `nbytes`, so any layer
kind's state batches the same way.
"""

from __future__ import annotations

from mamba3lite.model.decode_state import DecodeState


class BatchState:
    """Rows [0, n) of a model state of `capacity` rows (grown by doubling up to `max_rows`), each able
    to hold `max_len` tokens (None: the model's state does not grow with the length)."""

    def __init__(self, model, max_rows: int, initial_rows: int = 4, max_len: int | None = None) -> None:
        self.model, self.max_rows, self.max_len = model, max_rows, max_len
        self.capacity = min(initial_rows, max_rows)
        self.buf = model.allocate_cache(self.capacity, self.max_len)
        self.n = 0

    def view(self) -> DecodeState:
        return self.buf.rows(0, self.n)

    def add(self, state_1: DecodeState) -> None:
        """Copy a one-row state into row n."""
        assert self.n < self.max_rows
        if self.n == self.capacity:
            self._grow()
        self.buf.rows(self.n, self.n + 1).load_(state_1)
        self.n += 1

    def remove(self, i: int) -> None:
        """Drop row i: the last row moves into its place."""
        assert 0 <= i < self.n
        last = self.n - 1
        if i != last:
            self.buf.rows(i, i + 1).load_(self.buf.rows(last, last + 1))
        self.n -= 1

    def nbytes(self) -> int:
        """Bytes the batch's state holds (its whole buffer, live rows or not)."""
        return self.buf.nbytes()

    def _grow(self) -> None:
        bigger = self.model.allocate_cache(min(2 * self.capacity, self.max_rows), self.max_len)
        bigger.rows(0, self.n).load_(self.view())
        self.buf, self.capacity = bigger, min(2 * self.capacity, self.max_rows)
