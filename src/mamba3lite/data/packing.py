"""The dedup and pack stages' state: the digests already kept, each split's shard being filled, and
the shard-writing task.

A shard is described, never held, by the driver: a `ShardJob` lists its documents as pieces, (unit key,
first token, end token) ranges of the units' token files (consecutive documents of one unit that are
contiguous in its file make one piece). `write_shard_job` is the task that gathers those ranges, writes
the shard atomically and verifies it (`shards.write_shard`); it runs on a worker like a unit, so the
driver copies and hashes no token. A shard is a pure function of its job: a job lost with a node or a
killed driver is written again, to the same bytes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mamba3lite.data import shards, units
from mamba3lite.data.shards import ShardInfo


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
        self.add_all([digest])

    def duplicates(self, digests: Sequence[bytes]) -> list[int]:
        """The positions in `digests` (documents in mixing order) that repeat an earlier one: one kept
        before, or one earlier in `digests`."""
        batch = set(digests)
        repeated = self.seen.intersection(batch)  # set operations in C; a Python step only for suspects
        if len(batch) != len(digests):  # repeats within the batch (Counter counts in C)
            repeated.update(d for d, n in Counter(digests).items() if n > 1)
        if not repeated:
            return []
        seen, here, dups = self.seen, set(), []
        for k, d in enumerate(digests):
            if d not in repeated:
                continue
            if d in seen or d in here:
                dups.append(k)
            else:
                here.add(d)
        return dups

    def add_all(self, digests: Sequence[bytes]) -> None:
        """Remember kept documents' digests (none of them a duplicate)."""
        if self.candidates is not None:  # one that occurs once in the whole corpus is never looked up
            digests = [d for d in digests if d in self.candidates]
        self.seen.update(digests)
        self.unsaved.extend(digests)

    def saved(self) -> None:
        self.n_saved += len(self.unsaved)
        self.unsaved = []


@dataclass(frozen=True)
class ShardJob:
    """One shard to write: its path relative to the dataset, split, documents as pieces [unit key, first
    token, end token] of the units' token files, and its counts."""

    path: str
    split: str
    pieces: tuple[tuple[str, int, int], ...]
    n_docs: int
    n_bytes: int

    def to_dict(self) -> dict:
        return {**self.__dict__, "pieces": [list(p) for p in self.pieces]}

    @classmethod
    def from_dict(cls, d: dict) -> ShardJob:
        pieces = tuple((str(k), int(a), int(b)) for k, a, b in d["pieces"])
        return cls(str(d["path"]), str(d["split"]), pieces, int(d["n_docs"]), int(d["n_bytes"]))

    def unit_keys(self) -> set[str]:
        return {key for key, _, _ in self.pieces}


def write_shard_job(stage_dir: str, dtype: np.dtype, job: ShardJob) -> ShardInfo:
    """The task: gather the job's pieces from the units' token files (memory-mapped), write the shard
    into `stage_dir` atomically and verify it by reading it back. Returns its ShardInfo."""
    files: dict[str, np.ndarray] = {}
    parts = []
    for key, start, end in job.pieces:
        if key not in files:
            files[key] = units.map_tokens(stage_dir, key, dtype)
        parts.append(files[key][start:end])
    tokens = np.concatenate(parts) if parts else np.empty(0, dtype=dtype)
    counts = {"split": job.split, "n_docs": job.n_docs, "n_bytes": job.n_bytes}
    return shards.write_shard(Path(stage_dir), job.path, tokens, **counts, dtype=dtype)


@dataclass
class Packer:
    """Whole documents of one split waiting for their shard, as pieces of the units' token files;
    `next_index` numbers the split's shards."""

    split: str
    pieces: list[list] = field(default_factory=list)  # [unit key, first token, end token]
    n_tokens: int = 0
    n_docs: int = 0
    n_bytes: int = 0
    next_index: int = 0

    def fits(self, n_tokens: int, shard_tokens: int) -> bool:
        """Whether a document of `n_tokens` goes into the current shard: it does when the shard is empty
        (a document longer than a shard gets a shard of its own) or still has room."""
        return not self.n_tokens or self.n_tokens + n_tokens <= shard_tokens

    def room(self, sizes_cum: np.ndarray, shard_tokens: int) -> int:
        """How many of the next documents (`sizes_cum`: their sizes' running sum) go into the current
        shard, as `fits` decides one at a time."""
        n = int(np.searchsorted(sizes_cum, shard_tokens - self.n_tokens, side="right"))
        return max(n, 1) if not self.n_tokens else n

    def add(self, key: str, starts: np.ndarray, ends: np.ndarray, n_bytes: int) -> None:
        """Append documents of unit `key`, in order: their [start, end) token ranges in its file (EOS
        last in each) and their total UTF-8 size."""
        if not len(starts):
            return
        breaks = np.flatnonzero(starts[1:] != ends[:-1]) + 1  # where a document does not follow on
        firsts = np.concatenate(([0], breaks)).tolist()
        lasts = np.concatenate((breaks - 1, [len(starts) - 1])).tolist()
        runs = [[key, int(starts[a]), int(ends[b])] for a, b in zip(firsts, lasts)]
        last = self.pieces[-1] if self.pieces else None
        if last is not None and last[0] == key and last[2] == runs[0][1]:
            last[2] = runs.pop(0)[2]
        self.pieces.extend(runs)
        self.n_tokens += int((ends - starts).sum())
        self.n_docs += len(starts)
        self.n_bytes += n_bytes

    def job(self) -> ShardJob:
        """The current shard, to be written."""
        pieces = tuple((k, a, b) for k, a, b in self.pieces)
        return ShardJob(self.next_path(), self.split, pieces, self.n_docs, self.n_bytes)

    def next_path(self) -> str:
        """The relative path of the shard being filled."""
        return f"{self.split}/shard_{self.next_index:05d}.bin"

    def shard_written(self) -> None:
        """Start the next shard (the current one is on its way to disk)."""
        self.pieces, self.n_tokens, self.n_docs, self.n_bytes = [], 0, 0, 0
        self.next_index += 1

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, d: dict) -> Packer:
        pieces = [[str(k), int(a), int(b)] for k, a, b in d["pieces"]]
        counts = (int(d[k]) for k in ("n_tokens", "n_docs", "n_bytes", "next_index"))
        packer = cls(str(d["split"]), pieces, *counts)
        if sum(b - a for _, a, b in pieces) != packer.n_tokens:
            raise ValueError(f"the partly filled {packer.split} shard's pieces do not add up")
        return packer
