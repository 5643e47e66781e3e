"""Which split of a dataset to validate on, and where a dataset is: rules shared by train, eval and
the quickstart, so that they decide alike.

A split holds a window when it has more than `max_seq_len` tokens (a window is `max_seq_len + 1`
tokens: inputs and shifted targets). The val split is used when it holds one; otherwise training runs
without validation and `eval` falls back to the train split, each saying why (`short_val_split`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mamba3lite.data.shards import MANIFEST_NAME


def dataset_dir(path: str | Path) -> Path:
    """The dataset directory a path names: a path to its manifest.json names the directory holding it."""
    p = Path(path)
    return p.parent if p.name == MANIFEST_NAME and not p.is_dir() else p


def val_split_holds_window(manifest: Any, max_seq_len: int) -> bool:
    """Whether the dataset's val split has a window of `max_seq_len` (the rule: see the module)."""
    return manifest.n_tokens("val") > max_seq_len


def short_val_split(n_tokens: int, max_seq_len: int) -> str:
    """Why a val split of `n_tokens` holds no window (the trainer and `eval` say it alike)."""
    return (
        f"the val split ({n_tokens:,} tokens) is too short for one window of max_seq_len + 1 = "
        f"{max_seq_len + 1} tokens"
    )
