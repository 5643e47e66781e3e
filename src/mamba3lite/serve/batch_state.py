"""The batched decode state: rows [0, n) of a preallocated model state, one row per running request.

A request joins by copying its one-row state into row n, and leaves by moving the last row into its
place (swap-remove): each change copies one row's state, never the batch's, however many rows run.
`view()` is the state of the live rows (views into the buffer, so `Mamba3Transformer.step` updates them
in place).

The buffer is `capacity` rows, each able to hold `length` tokens (a layer whose state grows with the
length, a key/value cache, gives every row the same room). Two ways to size it:
- no budget: rows grow by doubling up to the engine's batch limit, and a key/value cache grows by
  doubling with its longest row (`length` None), or holds the engine's `max_len`;
- a budget in bytes: each row reserves, when it joins, the tokens it may come to hold (its prompt and
  its max_tokens), and the buffer is laid out to hold the longest reservation in every row, with rows
  doubling as before but never past what the budget holds (`Mamba3Transformer.state_bytes` says what a
  layout costs; a pure Mamba-3 model's does not depend on the length). Nothing grows after a join, so
  the buffer's bytes stay within the budget while rows decode; a request joins only if a layout within
  the budget holds it with the rows already there (`layout_for`). While a new layout is filled, the old
  one is held too (one copy of the live rows).

Only the decode-state protocol (model/decode_state.py) is used: `rows`, `load_`, `nbytes`, so any layer
kind's state batches the same way.
"""

from __future__ import annotations

import functools

from mamba3lite.model.decode_state import DecodeState


class BatchState:
    """Rows [0, n) of a model state of `capacity` rows (module docstring), each able to hold `length`
    tokens (None: the model's state grows by doubling as rows need). `budget_bytes` (None: no limit)
    bounds the buffer's bytes."""

    def __init__(
        self, model, max_rows: int, initial_rows: int = 4, max_len: int | None = None,
        budget_bytes: int | None = None,
    ) -> None:  # fmt: skip
        assert max_rows >= 1 and initial_rows >= 1 and (budget_bytes is None or budget_bytes > 0)
        self.model, self.max_rows, self.max_len, self.budget_bytes = model, max_rows, max_len, budget_bytes
        self.initial_rows = min(initial_rows, max_rows)
        # Bytes of one row holding L tokens, asked once per length (the model answers on the meta device).
        self.row_bytes = functools.lru_cache(maxsize=4096)(lambda length: model.state_bytes(1, length))
        self.needs: list[int] = []  # per live row, the tokens it may come to hold (0: not said, no budget)
        if budget_bytes is None:
            self.capacity, self.length = self.initial_rows, max_len
        else:  # laid out at the first join, to its size
            self.capacity, self.length = 0, max_len or 1
        self.buf = model.allocate_cache(self.capacity, self.length)

    @property
    def n(self) -> int:
        """Live rows."""
        return len(self.needs)

    def view(self) -> DecodeState:
        return self.buf.rows(0, self.n)

    def fits_alone(self, need: int) -> bool:
        """Whether one row reserving `need` tokens fits the budget with no other row."""
        return self.budget_bytes is None or self.row_bytes(self.max_len or need) <= self.budget_bytes

    def layout_for(self, extra: list[int]) -> tuple[int, int | None] | None:
        """The (capacity, length) of a buffer that holds the live rows and rows reserving `extra` tokens
        more: the current one if it has room, else a new one (rows doubled up to `max_rows`, and with a
        budget: the longest reservation, rows cut to what the budget holds); None when none does."""
        rows = self.n + len(extra)
        if rows > self.max_rows:
            return None
        length = self.length
        if self.budget_bytes is not None and self.max_len is None:
            length = max([*self.needs, *extra], default=1)
        if rows <= self.capacity and (self.length is None or length <= self.length):
            return self.capacity, self.length
        capacity = max(self.capacity, self.initial_rows)
        while capacity < rows:
            capacity = min(2 * capacity, self.max_rows)
        if self.budget_bytes is not None:
            capacity = min(capacity, self.budget_bytes // self.row_bytes(length))
        return (capacity, length) if capacity >= rows else None

    def make_room(self, extra: list[int]) -> bool:
        """Lay the buffer out to hold rows reserving `extra` tokens more (`layout_for`); False (nothing
        changed) when no layout holds them."""
        layout = self.layout_for(extra)
        if layout is None:
            return False
        if layout != (self.capacity, self.length):
            self._relayout(*layout)
        return True

    def add(self, state_1: DecodeState, need: int | None = None) -> None:
        """Copy a one-row state into row n; `need`: the tokens the row may come to hold (required with a
        budget)."""
        assert self.budget_bytes is None or need is not None, "a budgeted batch needs each row's need"
        placed = self.make_room([need or 0])
        assert placed, "a row joined that its layout cannot hold: admit through layout_for"
        self.buf.rows(self.n, self.n + 1).load_(state_1)
        self.needs.append(need or 0)

    def remove(self, i: int) -> None:
        """Drop row i: the last row moves into its place."""
        assert 0 <= i < self.n
        last = self.n - 1
        if i != last:
            self.buf.rows(i, i + 1).load_(self.buf.rows(last, last + 1))
            self.needs[i] = self.needs[last]
        self.needs.pop()

    def clear(self) -> None:
        """Drop every row (the buffer stays)."""
        self.needs.clear()

    def nbytes(self) -> int:
        """Bytes the batch's state holds (its whole buffer, live rows or not)."""
        return self.buf.nbytes()

    def _relayout(self, capacity: int, length: int | None) -> None:
        bigger = self.model.allocate_cache(capacity, length)
        bigger.rows(0, self.n).load_(self.view())
        self.buf, self.capacity, self.length = bigger, capacity, length
