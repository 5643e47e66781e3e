"""PretrainDataset: a windowed view over one long stream of token ids, stored in one file or many.

The window math is exactly the seed's. With T tokens and L = max_seq_len there are n = (T − 1) // L
windows; window i is chunk = tokens[i·L : i·L + L + 1], x = chunk[:-1], y = chunk[1:], so y[j] == x[j+1]
and consecutive windows share one token. The tail shorter than L + 1 tokens is never used. Shard
boundaries are invisible: the shards are one logical sequence in reading order.

Layouts (`.layout`):
  "sharded"  a directory: with manifest.json (the shards of `split`, dtype from the manifest), or without
             one: the seed's `shard_*.bin` files, each a torch.save'd 1-D integer tensor or a raw token
             file (raw needs `dtype`, e.g. "uint32", the seed pipeline's format).
  "single"   one file: a torch.save'd 1-D integer tensor, or a raw token file (needs `dtype`).
  "dummy"    random tokens, only with dummy=True; never a fallback for a missing path.

Unlike the seed, every layout is memory-mapped (torch.load(..., mmap=True) for torch.save'd files,
np.memmap for raw ones), so iterating a corpus does not make it resident as anonymous memory, and a
window that spans shards is assembled from one array slice per shard, never token by token.

The parts: `layout.find_layout` (which files a path names, checked), `token_stream.TokenStream` (the
files mapped and read as one sequence), the window math here (`n_windows`, `window_span`).
"""

from __future__ import annotations

import logging
import operator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from mamba3lite.data.layout import LAYOUT_KINDS, check_id_ranges, find_layout
from mamba3lite.data.shards import Manifest
from mamba3lite.data.token_stream import TokenStream
from mamba3lite.errors import ConfigError, DataError

log = logging.getLogger("mamba3lite")

LAYOUTS = (*LAYOUT_KINDS, "dummy")
DUMMY_WINDOWS = 1000  # the seed's dummy length, used when dummy_tokens is not given


def n_windows(n_tokens: int, max_seq_len: int) -> int:
    """Number of complete windows in a stream of n_tokens: (T − 1) // L (0 when T < L + 1).

    The − 1 is load-bearing: window n − 1 ends at token n·L ≤ T − 1, so every window is complete."""
    return max(0, (n_tokens - 1) // max_seq_len)


def window_span(index: int, max_seq_len: int) -> tuple[int, int]:
    """Token range [start, stop) of window `index`: [i·L, i·L + L + 1) (L + 1 tokens: inputs and target)."""
    start = index * max_seq_len
    return start, start + max_seq_len + 1


def dummy_n_tokens(dummy_tokens: int | None, max_seq_len: int) -> int:
    """Length of the dummy stream: `dummy_tokens`, or enough for DUMMY_WINDOWS windows. ConfigError when
    it holds no window."""
    n_tokens = DUMMY_WINDOWS * max_seq_len + 1 if dummy_tokens is None else int(dummy_tokens)
    if n_windows(n_tokens, max_seq_len) < 1:
        raise ConfigError(
            f"dummy_tokens={n_tokens} gives no window of max_seq_len + 1 = {max_seq_len + 1} tokens"
        )
    return n_tokens


def _check_count(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive integer" if minimum == 1 else "a non-negative integer"
        raise ConfigError(f"{name} must be {what}, got {value!r}")


class PretrainDataset(Dataset):
    """Packed pre-training windows over flat token files (see the module docstring for layouts and math).

    Args:
        data_path: dataset directory (with manifest.json, or the seed's shard_*.bin files), a single
            token file, or None with dummy=True.
        max_seq_len: window length L (tokens per x and per y).
        vocab_size: the model's vocabulary; ids ≥ vocab_size are an error (DataError naming the file):
            at construction from the manifest (or a scan of manifest-less data), and per batch read.
        split: which manifest split to read ("train" / "val"); ignored without a manifest.
        dummy: random tokens instead of data. Must be asked for; a missing path is always an error.
        dummy_tokens: length of the dummy stream in tokens (default: enough for 1000 windows).
        seed: dummy window i is a pure function of (seed, i), in any process.
        dtype: dtype of raw token files without a manifest (e.g. "uint32"); ignored for torch.save'd
            files; if given with a manifest it must match the manifest's.

    `ds[i]` returns (x, y): CPU int64 tensors of shape (L,), y[j] == x[j+1].
    Attributes: layout, manifest (Manifest or None), n_tokens, bytes_per_token (UTF-8 bytes of source
    text per token for the split, or None when unknown), paths (the token files, in reading order).
    """

    def __init__(
        self,
        data_path: str | Path | None,
        max_seq_len: int,
        vocab_size: int,
        *,
        split: str = "train",
        dummy: bool = False,
        dummy_tokens: int | None = None,
        seed: int = 0,
        dtype: Any = None,
    ) -> None:
        _check_count("max_seq_len", max_seq_len, 1)
        _check_count("vocab_size", vocab_size, 1)
        _check_count("seed", seed, 0)
        self.max_seq_len = max_seq_len
        self.vocab_size = vocab_size
        self.split = split
        self.seed = seed
        self.data_path = None if data_path is None else Path(data_path)
        if dummy:
            self.layout = "dummy"
            self.manifest: Manifest | None = None
            self.bytes_per_token: float | None = None
            self._tokens: TokenStream | None = None
            self.n_tokens = dummy_n_tokens(dummy_tokens, max_seq_len)
            log.warning(
                "DUMMY DATA: training on %d windows of uniformly random token ids (seed %d), not on a "
                "dataset; the loss can only approach ln(vocab_size) = %.2f",
                len(self),
                seed,
                float(np.log(vocab_size)),
            )
            return
        found = find_layout(data_path, split=split, vocab_size=vocab_size, dtype=dtype)
        self.layout, self.manifest, self.bytes_per_token = found.kind, found.manifest, found.bytes_per_token
        self._tokens = TokenStream(found.sources)
        if found.manifest is None:
            check_id_ranges(self._tokens, vocab_size)
        self.n_tokens = self._tokens.n_tokens
        if n_windows(self.n_tokens, max_seq_len) < 1:
            raise DataError(
                f"{found.root}: {self.n_tokens} tokens hold no window of max_seq_len + 1 = {max_seq_len + 1} "
                f"tokens; use a smaller max_seq_len or more data"
            )

    @property
    def paths(self) -> list[Path]:
        """The token files, in reading order (none for dummy data)."""
        return [] if self._tokens is None else self._tokens.paths

    # ------------------------------------------------------------------------------------------ access

    def __len__(self) -> int:
        return n_windows(self.n_tokens, self.max_seq_len)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) for window `index`: CPU int64 tensors of shape (L,), y[j] == x[j+1]."""
        i = operator.index(index)
        n = len(self)
        if not 0 <= i < n:
            raise IndexError(f"window {i} out of range for {n} windows")
        if self._tokens is None:
            chunk = self._dummy_window(i)
        else:
            chunk = self._checked_ids(self._tokens.read(*window_span(i, self.max_seq_len)), [i])
        t = torch.from_numpy(chunk)
        return t[:-1], t[1:]

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Batched __getitem__ (the DataLoader calls it with one batch's indices): the same windows as
        [ds[i] for i in indices], assembled into one (B, L + 1) buffer by a single copy."""
        t_BT = torch.from_numpy(self._gather(indices))
        return list(zip(t_BT[:, :-1].unbind(0), t_BT[:, 1:].unbind(0)))

    def get_batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(x_BT, y_BT) for windows `indices`: CPU int64 tensors of shape (B, L), y_BT[:, j] ==
        x_BT[:, j+1]; views of one (B, L + 1) buffer. The same windows a DataLoader would stack, without
        its per-sample collation (for a trainer that feeds WindowSampler batches straight in)."""
        t_BT = torch.from_numpy(self._gather(indices))
        return t_BT[:, :-1], t_BT[:, 1:]

    def _gather(self, indices: list[int]) -> np.ndarray:
        """Windows `indices` as one int64 (B, L + 1) array: `TokenStream.gather` assembles them with one
        bulk copy; `TokenStream.read` (what `ds[i]` uses) is the per-window reference it must equal."""
        n, L = len(self), self.max_seq_len
        T = L + 1
        if self._tokens is None:
            out_BT = np.empty((len(indices), T), dtype=np.int64)
            for b, i in enumerate(indices):
                if not 0 <= i < n:
                    raise IndexError(f"window {i} out of range for {n} windows")
                out_BT[b] = self._dummy_window(operator.index(i))
            return out_BT
        if indices and not (min(indices) >= 0 and max(indices) < n):
            raise IndexError(f"window indices {min(indices)}..{max(indices)} out of range for {n} windows")
        if not indices:
            return np.empty((0, T), dtype=np.int64)
        chunks_BT = self._checked_ids(self._tokens.gather([i * L for i in indices], T), indices)
        # Byte views come back read-only in the files' dtype (the id check ran on it): one astype widens
        # and copies them. Mixed dtypes come back as a fresh int64 array already.
        return chunks_BT if self._tokens.unit_dtype is None else chunks_BT.astype(np.int64)

    def _checked_ids(self, chunks: np.ndarray, indices: list[int]) -> np.ndarray:
        """`chunks` ((B, L + 1) or (L + 1,) integers, windows `indices`) after one max() over it: manifest
        shards are not scanned at construction (their recorded max_token_id is trusted), so a shard whose
        bytes changed since `prepare` is caught here, naming it, before an id >= vocab_size reaches the
        embedding (an IndexError mid-run on CPU, a device-side assert on GPU)."""
        if chunks.size == 0 or int(chunks.max()) < self.vocab_size:
            return chunks
        flat = chunks.reshape(-1)
        pos = int(np.argmax(flat >= self.vocab_size))
        row, col = divmod(pos, self.max_seq_len + 1)
        g = int(indices[row]) * self.max_seq_len + col  # global token index
        path, at = self._tokens.locate(g)
        raise DataError(
            f"{path}: token id {int(flat[pos])} at token {at} is outside "
            f"the vocabulary [0, {self.vocab_size}); the shard's bytes changed after it was written: run "
            f"`mamba3lite inspect {self.data_path} --verify`, then re-run `mamba3lite prepare`"
        )

    def _dummy_window(self, i: int) -> np.ndarray:
        # A generator seeded by (seed, i) alone: the same window in every process, worker and rank.
        rng = np.random.Generator(np.random.PCG64([self.seed, i]))
        return rng.integers(0, self.vocab_size, self.max_seq_len + 1, dtype=np.int64)

    def __repr__(self) -> str:
        where = "" if self.layout == "dummy" else f", path={str(self.data_path)!r}"
        return (
            f"PretrainDataset(layout={self.layout!r}{where}, n_tokens={self.n_tokens}, "
            f"max_seq_len={self.max_seq_len}, windows={len(self)})"
        )
