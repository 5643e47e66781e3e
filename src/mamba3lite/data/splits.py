"""Which split of a dataset to validate on: the rule shared by train, eval and the quickstart, so that
they decide alike (where a dataset is, from a path, is the token format's: `shards.dataset_dir`).

A split holds a window when it has more than `max_seq_len` tokens (a window is `max_seq_len + 1`
tokens: inputs and shifted targets). The val split is used when it holds one; otherwise training runs
without validation and `eval` falls back to the train split, each saying why (`short_val_split`).
"""

from __future__ import annotations

from typing import Any


def val_split_holds_window(manifest: Any, max_seq_len: int) -> bool:
    """Whether the dataset's val split has a window of `max_seq_len` (the rule: see the module)."""
    return manifest.n_tokens("val") > max_seq_len


def short_val_split(n_tokens: int, max_seq_len: int) -> str:
    """Why a val split of `n_tokens` holds no window (the trainer and `eval` say it alike)."""
    return (
        f"the val split ({n_tokens:,} tokens) is too short for one window of max_seq_len + 1 = "
        f"{max_seq_len + 1} tokens"
    )
