"""A cache of decode states after token prefixes (LRU, bounded in bytes).

A recurrent model's state after a prefix is a fixed few hundred kB whatever the prefix's length, so the
state after a long shared prefix (a system prompt, few-shot examples) can be kept for the price of one
state (a layer with a key/value cache adds what it holds; each entry counts its own `nbytes()`).
The engine prefills every prompt in segments that end on multiples of `boundary` tokens
(absolute positions), stores the state at each boundary and at the prompt's end, and on a new request
starts from the longest stored prefix: the full prompt, else the largest boundary inside it. Because the
segments are the same with or without a hit, a hit gives bit-for-bit the state a full prefill gives.

Keys are the sha256 of the prefix's token ids (int64 little-endian), so equal prefixes meet whatever
requests they came from. An entry holds a snapshot of the model's one-row state (model/decode_state.py:
every layer's, and the last token) and the logits after the prefix (to sample the first new token on a
full hit).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
from torch import Tensor

from mamba3lite.model.decode_state import DecodeState


@dataclass
class PrefixEntry:
    """The state after a prefix: `state` (a snapshot of one row, independent of the one it was taken
    from), `logits_V` after its last token, and the size in bytes the LRU counts."""

    state: DecodeState
    logits_V: Tensor

    @property
    def nbytes(self) -> int:
        return self.state.nbytes() + self.logits_V.numel() * self.logits_V.element_size()


def prefix_hashes(ids: list[int], ends: list[int]) -> dict[int, str]:
    """{end: sha256 of ids[:end]} for each end in `ends` (ascending), one pass over the ids."""
    h = hashlib.sha256()
    out: dict[int, str] = {}
    arr = np.asarray(ids, dtype="<i8")
    start = 0
    for end in ends:
        h.update(arr[start:end].tobytes())
        out[end] = h.copy().hexdigest()
        start = end
    return out


class PrefixCache:
    """LRU of `PrefixEntry` by prefix hash, at most `max_bytes` in all (0: disabled). Thread-safe.

    Counters for /metrics: hits, misses, tokens_saved (prompt tokens not prefilled thanks to a hit)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = int(max_bytes)
        self._entries: OrderedDict[str, PrefixEntry] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.tokens_saved = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> PrefixEntry | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def put(self, key: str, state: DecodeState, logits_V: Tensor) -> None:
        """Store a snapshot of `state` and a copy of `logits_V` under `key` (evicting least recently
        used entries)."""
        if not self.enabled:
            return
        entry = PrefixEntry(state.snapshot(), logits_V.detach().clone())
        if entry.nbytes > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= old.nbytes
            self._entries[key] = entry
            self.bytes += entry.nbytes
            while self.bytes > self.max_bytes:
                _, gone = self._entries.popitem(last=False)
                self.bytes -= gone.nbytes

    def lookup(self, hashes: dict[int, str]) -> tuple[int, PrefixEntry | None]:
        """(length, entry) of the longest prefix among `hashes` ({end: key}) that is stored; (0, None)
        when none is. Counts a hit or a miss."""
        for end in sorted(hashes, reverse=True):
            entry = self.get(hashes[end])
            if entry is not None:
                with self._lock:
                    self.hits += 1
                    self.tokens_saved += end
                return end, entry
        with self._lock:
            self.misses += 1
        return 0, None
