"""The decode state, owned by the model: one protocol that every layer kind's state and the model's own
state implement, so that generation, serving, state reuse and the HF glue never name a layer's fields.

    state = model.allocate_cache(batch_size, max_len)   # the model's state: one per layer + last token
    state.rows(start, stop)     rows [start, stop) as views: writes through them reach `state`
    state.select(index_B)       a new state whose row b is a copy of row index_B[b] (any order, repeats)
    state.load_(src)            copy `src` (as many rows) into `state`, in place
    state.snapshot()            an independent copy (what a prefix cache keeps)
    state.nbytes()              bytes held (a preallocated buffer counts whole)

A mixer (model/layer_kinds.py) allocates its own kind of state (`allocate_state(batch_size, max_len=None,
device=None, dtype=None)`: a recurrent state ignores `max_len`; a key/value cache is sized by it) and
updates it in place in `forward(u_BTD, state, reset_BT)` and `step(u_BD, state, reset_B)`. Row b of every
tensor in a state belongs to sequence b, so "select rows" is written once, here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor


@runtime_checkable
class DecodeState(Protocol):
    """What every decode state offers (module docstring); row b is sequence b."""

    def rows(self, start: int, stop: int) -> DecodeState: ...

    def select(self, index_B: Tensor) -> DecodeState: ...

    def load_(self, src: DecodeState) -> None: ...

    def snapshot(self) -> DecodeState: ...

    def nbytes(self) -> int: ...


class RowTensors:
    """The protocol for a dataclass whose fields are tensors with the row (batch) dimension first
    (None: a part this configuration does not have). A layer's state subclasses it and keeps its own
    field names, which no module outside model/ reads."""

    def _tensors(self) -> dict[str, Tensor | None]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def _map(self, fn) -> RowTensors:
        return type(self)(**{k: None if t is None else fn(t) for k, t in self._tensors().items()})

    def rows(self, start: int, stop: int) -> RowTensors:
        return self._map(lambda t: t[start:stop])

    def select(self, index_B: Tensor) -> RowTensors:
        return self._map(lambda t: t.index_select(0, index_B.to(t.device)))

    def load_(self, src: RowTensors) -> None:
        assert type(src) is type(self), (type(src), type(self))
        for (name, dst), t in zip(self._tensors().items(), src._tensors().values(), strict=True):
            assert (dst is None) == (t is None), name
            if dst is not None:
                dst.copy_(t)

    def snapshot(self) -> RowTensors:
        return self._map(lambda t: t.detach().clone())

    def tensors(self) -> tuple[Tensor, ...]:
        """The parts this state has, in a fixed order: what a caller that keeps them in a store of its
        own (a serving engine's cache slots) holds, one tensor each, without naming them."""
        return tuple(t for t in self._tensors().values() if t is not None)

    def with_tensors(self, tensors: Iterable[Tensor]) -> RowTensors:
        """A state of this kind and layout holding `tensors` (in `tensors()`'s order) in place of its own."""
        given = iter(tensors)
        state = self._map(lambda _: next(given))
        assert next(given, None) is None, "more tensors than the state has parts"
        return state

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors().values() if t is not None)


@dataclass
class ModelCache:
    """Decode state of the whole model: one state per layer (its kind's), plus the last token fed (for
    resets at EOS; −1 before any token). `prefill` and `step` update it in place. The protocol over all
    of it: a row is one sequence in every layer."""

    layers: list
    last_token_B: Tensor

    def rows(self, start: int, stop: int) -> ModelCache:
        return ModelCache([s.rows(start, stop) for s in self.layers], self.last_token_B[start:stop])

    def select(self, index_B: Tensor) -> ModelCache:
        index_B = index_B.to(self.last_token_B.device)
        return ModelCache(
            [s.select(index_B) for s in self.layers], self.last_token_B.index_select(0, index_B)
        )

    def load_(self, src: ModelCache) -> None:
        assert len(src.layers) == len(self.layers)
        for dst, s in zip(self.layers, src.layers):
            dst.load_(s)
        self.last_token_B.copy_(src.last_token_B)

    def snapshot(self) -> ModelCache:
        return ModelCache([s.snapshot() for s in self.layers], self.last_token_B.clone())

    def nbytes(self) -> int:
        last = self.last_token_B.numel() * self.last_token_B.element_size()
        return sum(s.nbytes() for s in self.layers) + last

    @property
    def batch_size(self) -> int:
        """Rows (sequences) held."""
        return self.last_token_B.shape[0]


def fresh_last_tokens(batch_size: int, device: torch.device | str | None) -> Tensor:
    """The last-token record of a state that has seen nothing yet (−1: no token, so no reset)."""
    return torch.full((batch_size,), -1, dtype=torch.long, device=device)
