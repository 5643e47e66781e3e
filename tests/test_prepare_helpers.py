"""Helpers (no tests) for the prepare/inspect tests: read a dataset back per document, hash a tree."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from mamba3lite.data.shards import Manifest, open_tokens


def shard_docs(dataset: Path) -> dict[str, list[list[np.ndarray]]]:
    """split -> [per shard: [per document: token ids without its EOS]]; asserts each shard ends in EOS."""
    m = Manifest.load(dataset)
    out: dict[str, list] = {"train": [], "val": []}
    for info in m.shards:
        ids = np.asarray(open_tokens(dataset / info.path, m.np_dtype), dtype=np.int64)
        assert ids.size and ids[-1] == m.eos_id, f"{info.path} does not end with EOS"
        cuts = np.flatnonzero(ids == m.eos_id)
        assert len(cuts) == info.n_docs, f"{info.path}: {len(cuts)} EOS != n_docs {info.n_docs}"
        starts = np.concatenate([[0], cuts[:-1] + 1])
        out[info.split].append([ids[s:e] for s, e in zip(starts, cuts)])
    return out


def tree_hashes(root: Path) -> dict[str, str]:
    """relative path -> sha256 of every file below root (hidden ones included); {} if root is missing."""
    if not root.exists():
        return {}
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }
