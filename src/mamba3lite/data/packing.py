"""The dedup and pack stages' state: the digests already kept, and each split's shard being filled."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


class Dedup:
    """Exact-duplicate detection by cleaned-text digest, in mixing order. The digests kept since the last
    snapshot are `unsaved` (the snapshot appends them to its file and calls `saved`)."""

    def __init__(self, seen: set[bytes] | None = None, n_saved: int = 0) -> None:
        self.seen: set[bytes] = seen or set()
        self.unsaved: list[bytes] = []
        self.n_saved = n_saved  # digests in the snapshot's file
        # With the set partitioned by digest (`dedup_partition`): the digests that occur more than once
        # in the corpus; only those are remembered (any other is never a duplicate). None: all are.
        self.candidates: set[bytes] | None = None

    def __contains__(self, digest: bytes) -> bool:
        return digest in self.seen

    def add(self, digest: bytes) -> None:
        if self.candidates is not None and digest not in self.candidates:
            return  # occurs once in the whole corpus: never looked up again
        self.seen.add(digest)
        self.unsaved.append(digest)

    def saved(self) -> None:
        self.n_saved += len(self.unsaved)
        self.unsaved = []


@dataclass
class Packer:
    """Whole documents of one split waiting for their shard; `next_index` numbers the split's shards."""

    split: str
    parts: list[np.ndarray] = field(default_factory=list)
    n_tokens: int = 0
    n_docs: int = 0
    n_bytes: int = 0
    next_index: int = 0

    def fits(self, n_tokens: int, shard_tokens: int) -> bool:
        """Whether a document of `n_tokens` goes into the current shard: it does when the shard is empty
        (a document longer than a shard gets a shard of its own) or still has room."""
        return not self.n_tokens or self.n_tokens + n_tokens <= shard_tokens

    def add(self, tokens: np.ndarray, n_bytes: int) -> None:
        """Append one document (its tokens, EOS last; its UTF-8 size)."""
        self.parts.append(tokens)
        self.n_tokens += tokens.size
        self.n_docs += 1
        self.n_bytes += n_bytes

    def tokens(self) -> np.ndarray:
        return np.concatenate(self.parts) if self.parts else np.empty(0, dtype=np.uint32)

    def next_path(self) -> str:
        """The relative path of the shard being filled."""
        return f"{self.split}/shard_{self.next_index:05d}.bin"

    def shard_written(self) -> None:
        """Start the next shard (the current one is on disk)."""
        self.parts, self.n_tokens, self.n_docs, self.n_bytes = [], 0, 0, 0
        self.next_index += 1
