"""The dedup set partitioned by digest (`prepare --dedup-partitions P`), for a corpus whose set of kept
digests would not fit the driver (~90 bytes a kept document: prepare.py's docstring).

Exact dedup keeps the first occurrence, in mixing order, of each cleaned-text digest. A document whose
digest occurs once in the whole corpus is never a duplicate, so the driver only needs to remember the
digests that occur more than once. Those are found by P tasks after every unit is computed: task p reads
the digest column of every unit's index, keeps the digests of its 1/P of the digest space (the first two
bytes, modulo P), and writes the ones it sees more than once (`duplicate_digests`); its memory is 16 bytes
a document of its partition. The driver then loads their union as the dedup's candidates
(`packing.Dedup`), and its decisions, in mixing order, are the same as with the whole set: the output is
byte-identical. The candidates are a superset when the stage holds units of an earlier plan or units
past a --target-tokens (their digests count too), which costs memory, never a decision.

The price: every unit is computed before the first shard is written, also those a --target-tokens would
not have needed; use it when the set would not fit, not by default.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mamba3lite.data.clean import DIGEST_BYTES, KEPT
from mamba3lite.data.units import INDEX_DTYPE, units_dir, write_staged

DEDUP_DIRNAME = "dedup"
_PAIR = np.dtype([("hi", ">u8"), ("lo", ">u8")])  # a digest as two integers, for np.unique


def duplicate_digests(stage_dir: str, part: int, n_parts: int) -> int:
    """Task p: write the digests of partition `part` that occur more than once among the kept documents
    of every unit in the stage to dedup/dups.PART.bin (sorted); returns how many."""
    chunks = []
    for idx in sorted(units_dir(stage_dir).glob("*.idx")):
        index = np.fromfile(idx, dtype=INDEX_DTYPE)
        digests = index["digest"][index["status"] == KEPT]
        bucket = ((digests[:, 0].astype(np.uint32) << 8) | digests[:, 1]) % n_parts
        chunks.append(digests[bucket == part])
    found = np.concatenate(chunks) if chunks else np.empty((0, DIGEST_BYTES), np.uint8)
    pairs = np.ascontiguousarray(found).view(_PAIR).ravel()
    unique, counts = np.unique(pairs, return_counts=True)
    dups = unique[counts > 1]
    out = Path(stage_dir) / DEDUP_DIRNAME
    out.mkdir(parents=True, exist_ok=True)
    write_staged(out / f"dups.{part}.bin", dups.tobytes())
    return int(dups.size)


def load_candidates(stage_dir: str | Path, n_parts: int) -> set[bytes]:
    """The union of the partitions' duplicate digests (each 16 bytes)."""
    out: set[bytes] = set()
    for part in range(n_parts):
        blob = (Path(stage_dir) / DEDUP_DIRNAME / f"dups.{part}.bin").read_bytes()
        out.update(blob[i : i + DIGEST_BYTES] for i in range(0, len(blob), DIGEST_BYTES))
    return out
