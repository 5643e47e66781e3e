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
"""

from __future__ import annotations

import bisect
import logging
import operator
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from mamba3lite import intake
from mamba3lite.data.shards import MANIFEST_NAME, SPLITS, Manifest, dataset_dir, has_manifest, open_tokens
from mamba3lite.errors import ConfigError, DataError, DataNotFoundError

log = logging.getLogger("mamba3lite")

LAYOUTS = ("single", "sharded", "dummy")
SEED_SHARD_GLOB = "shard_*.bin"
DUMMY_WINDOWS = 1000  # the seed's dummy length, used when dummy_tokens is not given
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save writes a zip archive
_TORCH_INT_DTYPES = {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64} | {
    getattr(torch, name) for name in ("uint16", "uint32", "uint64") if hasattr(torch, name)
}
_SCAN_TOKENS = 1 << 24  # ids checked per vectorised step when validating manifest-less data


def n_windows(n_tokens: int, max_seq_len: int) -> int:
    """Number of complete windows in a stream of n_tokens: (T − 1) // L (0 when T < L + 1).

    The − 1 is load-bearing: window n − 1 ends at token n·L ≤ T − 1, so every window is complete."""
    return max(0, (n_tokens - 1) // max_seq_len)


def window_span(index: int, max_seq_len: int) -> tuple[int, int]:
    """Token range [start, stop) of window `index`: [i·L, i·L + L + 1) (L + 1 tokens: inputs and target)."""
    start = index * max_seq_len
    return start, start + max_seq_len + 1


def is_torch_file(path: Path) -> bool:
    """True if `path` starts with the zip magic that torch.save writes (PK\\x03\\x04). DataError for a
    path that is not a regular file (a named pipe would block the read, SIGTERM included)."""
    return intake.read_prefix(path, intake.TOKEN_FILE, len(_ZIP_MAGIC)) == _ZIP_MAGIC


def _load_torch_tokens(path: Path) -> torch.Tensor:
    """Memory-map a torch.save'd 1-D integer tensor (weights_only: no arbitrary pickles)."""
    try:
        obj = torch.load(path, weights_only=True, mmap=True, map_location="cpu")
    except pickle.UnpicklingError:  # weights_only refused a pickled object (a numpy array, ...)
        raise DataError(
            f"{path}: holds a pickled object other than a tensor (or a damaged pickle); save a 1-D "
            "integer tensor of token ids (e.g. torch.save(torch.from_numpy(ids), path))"
        ) from None
    except Exception as e:  # torch raises many types for corrupt or foreign archives
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""  # torch's are paragraphs
        raise DataError(
            f"{path}: cannot load as a torch.save'd token tensor ({type(e).__name__}: {first})"
        ) from None
    if not isinstance(obj, torch.Tensor) or obj.dim() != 1 or obj.dtype not in _TORCH_INT_DTYPES:
        what = (
            f"a {obj.dtype} tensor of shape {tuple(obj.shape)}"
            if isinstance(obj, torch.Tensor)
            else type(obj)
        )
        raise DataError(f"{path}: expected a torch.save'd 1-D integer tensor of token ids, found {what}")
    return obj


def _check_id_range(tokens: np.ndarray, vocab_size: int, path: Path) -> None:
    """One vectorised min/max pass (in chunks: bounded memory) so bad ids fail here, not as a CUDA assert."""
    for lo in range(0, tokens.shape[0], _SCAN_TOKENS):
        chunk = tokens[lo : lo + _SCAN_TOKENS]
        lo_id, hi_id = int(chunk.min()), int(chunk.max())
        if lo_id < 0 or hi_id >= vocab_size:
            bad = hi_id if hi_id >= vocab_size else lo_id
            raise DataError(
                f"{path}: token id {bad} is outside the vocabulary [0, {vocab_size}); the data was tokenized "
                f"with a different vocabulary, or vocab_size / dtype is wrong"
            )


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
        if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 1:
            raise ConfigError(f"max_seq_len must be a positive integer, got {max_seq_len!r}")
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ConfigError(f"vocab_size must be a positive integer, got {vocab_size!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ConfigError(f"seed must be a non-negative integer, got {seed!r}")
        self.max_seq_len = max_seq_len
        self.vocab_size = vocab_size
        self.split = split
        self.seed = seed
        self.manifest: Manifest | None = None
        self.bytes_per_token: float | None = None
        self.paths: list[Path] = []
        # (path, dtype or None for torch.save'd): enough to reopen the maps after pickling.
        self._sources: list[tuple[Path, np.dtype | None]] = []
        self._arrays: list[np.ndarray] = []  # the non-empty token arrays, in reading order
        self._starts: list[int] = []  # global index of each array's first token (for bisect)
        self._ends: list[int] = []  # global index one past each array's last token
        self._array_paths: list[Path] = []  # the file of each array (for errors)
        self._tensors: list[torch.Tensor] = []  # torch.load'ed sources, kept alive under their numpy views
        self._units: list[Any] = []  # what _gather slices: _arrays, or byte views of them (_open_sources)
        self._unit_dtype: np.dtype | None = None
        self._unit_scale = 1

        if dummy:
            self.layout = "dummy"
            self.data_path = None if data_path is None else Path(data_path)
            self.n_tokens = DUMMY_WINDOWS * max_seq_len + 1 if dummy_tokens is None else int(dummy_tokens)
            if n_windows(self.n_tokens, max_seq_len) < 1:
                raise ConfigError(
                    f"dummy_tokens={self.n_tokens} gives no window of max_seq_len + 1 = "
                    f"{max_seq_len + 1} tokens"
                )
            log.warning(
                "DUMMY DATA: training on %d windows of uniformly random token ids (seed %d), not on a "
                "dataset; the loss can only approach ln(vocab_size) = %.2f",
                len(self),
                seed,
                float(np.log(vocab_size)),
            )
            return

        if data_path is None:
            raise ConfigError("no data path given: pass a dataset directory or token file, or dummy=True")
        path = Path(data_path)
        self.data_path = path
        if not path.exists():
            raise DataNotFoundError(
                f"data path {path} does not exist: create the dataset with `mamba3lite prepare`, or fix "
                "the path"
            )
        np_dtype = None if dtype is None else self._parse_dtype(dtype)
        path = dataset_dir(path)
        if path.is_dir():
            self.layout = "sharded"
            if has_manifest(path):
                self._init_manifest(path, np_dtype)
            else:
                self._init_seed_dir(path, np_dtype)
        else:
            self.layout = "single"
            self._sources = [(path, self._file_dtype(path, np_dtype))]
            self._check_ranges(self._open_sources())

        self.n_tokens = sum(a.shape[0] for a in self._arrays)
        if n_windows(self.n_tokens, max_seq_len) < 1:
            raise DataError(
                f"{path}: {self.n_tokens} tokens hold no window of max_seq_len + 1 = {max_seq_len + 1} "
                f"tokens; use a smaller max_seq_len or more data"
            )

    # ----------------------------------------------------------------------------------- construction

    @staticmethod
    def _parse_dtype(dtype: Any) -> np.dtype:
        try:
            np_dtype = np.dtype(dtype)
        except TypeError:
            raise ConfigError(
                f"dtype {dtype!r} is not a numpy dtype; use e.g. 'uint16' or 'uint32'"
            ) from None
        if not np.issubdtype(np_dtype, np.integer):
            raise ConfigError(f"dtype {dtype!r} is not an integer dtype; use e.g. 'uint16' or 'uint32'")
        return np_dtype.newbyteorder("<")

    @staticmethod
    def _file_dtype(path: Path, np_dtype: np.dtype | None) -> np.dtype | None:
        """None for a torch.save'd file, else the raw dtype (which must then have been given)."""
        if is_torch_file(path):
            return None
        if np_dtype is None:
            raise DataError(
                f"{path} is a raw token file without a manifest, so its dtype is unknown: set "
                "data.token_dtype in the run's config (`eval --token-dtype`; dtype= in Python): uint32 for "
                "the seed pipeline's files, uint16 for GPT-2-sized vocabularies"
            )
        return np_dtype

    def _init_manifest(self, root: Path, np_dtype: np.dtype | None) -> None:
        manifest_path = root / MANIFEST_NAME
        m = Manifest.load(root)
        self.manifest = m
        if m.vocab_size != self.vocab_size:
            raise DataError(
                f"{manifest_path}: the data's vocab_size is {m.vocab_size} but the model's vocab_size is "
                f"{self.vocab_size}; use the tokenizer the data was prepared with, or re-prepare the data"
            )
        if np_dtype is not None and np_dtype != m.np_dtype:
            raise DataError(
                f"{manifest_path}: dtype {m.dtype} differs from the dtype argument {np_dtype.name}"
            )
        infos = m.split_shards(self.split)
        if not infos:
            have = sorted({s.split for s in m.shards})
            raise DataError(
                f"{manifest_path}: no shards for split {self.split!r} (it has: {', '.join(have) or 'none'}); "
                f"re-run `mamba3lite prepare` or choose another split"
            )
        itemsize = m.np_dtype.itemsize
        for info in infos:
            p = root / info.path
            if not p.is_file():
                raise DataError(f"{p}: listed in {manifest_path} but missing; re-run `mamba3lite prepare`")
            size = p.stat().st_size
            if size != info.n_tokens * itemsize:
                raise DataError(
                    f"{p}: {size} bytes, but {manifest_path} says {info.n_tokens} tokens x {itemsize} "
                    f"bytes = {info.n_tokens * itemsize}; the shard or manifest is damaged, re-run "
                    f"`mamba3lite prepare`"
                )
            # Manifest.from_dict already refused max_token_id >= the manifest's vocab_size, which equals ours.
            assert info.max_token_id < self.vocab_size
        self._sources = [(root / s.path, m.np_dtype) for s in infos]
        n_bytes, n_tok = m.n_bytes(self.split), m.n_tokens(self.split)
        self.bytes_per_token = n_bytes / n_tok if n_bytes > 0 and n_tok > 0 else None
        self._open_sources()

    def _init_seed_dir(self, root: Path, np_dtype: np.dtype | None) -> None:
        if root.name in SPLITS and (root.parent / MANIFEST_NAME).exists():
            # DATASET/train holds raw shards without a manifest of its own: reading them as the seed's
            # manifest-less layout would only say that their dtype is unknown.
            raise DataError(
                f"{root} is the {root.name} split of the prepared dataset {root.parent}; pass the dataset "
                f"directory itself (--data-path {root.parent}), which holds {MANIFEST_NAME}"
            )
        files = sorted(p for p in root.glob(SEED_SHARD_GLOB) if p.is_file())
        if not files:
            unfinished = any(root.glob(f"*/{SEED_SHARD_GLOB}"))
            hint = (
                f" It has shards in subdirectories but no {MANIFEST_NAME}: an unfinished "
                f"`mamba3lite prepare` (the manifest is written last); re-run it."
                if unfinished
                else " Create a dataset with `mamba3lite prepare`, or point at a token file."
            )
            raise DataError(f"{root}: no {MANIFEST_NAME} and no {SEED_SHARD_GLOB} files.{hint}")
        self._sources = [(p, self._file_dtype(p, np_dtype)) for p in files]
        self._check_ranges(self._open_sources())

    def _open_sources(self) -> list[np.ndarray]:
        """(Re)open every source as a read-only memory-mapped 1-D array. Returns them per source; only
        the non-empty ones are kept for reading (so every step of the spanning loop makes progress)."""
        self.paths = [p for p, _ in self._sources]
        per_source, self._tensors = [], []
        for p, np_dtype in self._sources:
            if np_dtype is None:
                t = _load_torch_tokens(p)
                self._tensors.append(t)  # keeps the mapping alive; the numpy view shares its memory
                per_source.append(t.numpy())
            else:
                per_source.append(open_tokens(p, np_dtype))
        # Plain ndarray views of the maps: np.memmap's subclass machinery costs ~1 µs per slice.
        self._arrays = [np.asarray(a) for a in per_source if a.shape[0]]
        self._array_paths = [p for (p, _), a in zip(self._sources, per_source) if a.shape[0]]
        sizes = [a.shape[0] for a in self._arrays]
        self._starts = np.cumsum([0, *sizes[:-1]], dtype=np.int64).tolist() if sizes else []
        self._ends = [start + size for start, size in zip(self._starts, sizes)]
        # What _gather slices. When every array has one dtype and is contiguous, byte memoryviews: slicing
        # one is ~2x cheaper than slicing an ndarray, and b"".join copies all pieces in one C loop.
        self._units: list[Any] = self._arrays
        self._unit_dtype: np.dtype | None = None  # the arrays' common dtype when _units are byte views
        self._unit_scale = 1  # _units elements per token
        dtypes = {a.dtype for a in self._arrays}
        if len(dtypes) == 1 and all(a.flags.c_contiguous for a in self._arrays):
            try:
                self._units = [memoryview(a).cast("B") for a in self._arrays]
            except (TypeError, ValueError):  # a dtype the buffer protocol cannot export: slice arrays
                pass
            else:
                self._unit_dtype = dtypes.pop()
                self._unit_scale = self._unit_dtype.itemsize
        return per_source

    def _check_ranges(self, per_source: list[np.ndarray]) -> None:
        # Manifest-less data has no recorded max id: scan once, here, rather than fail mid-run on the GPU.
        for (p, _), arr in zip(self._sources, per_source):
            if arr.shape[0]:
                _check_id_range(arr, self.vocab_size, p)

    # ------------------------------------------------------------------------------------------ access

    def __len__(self) -> int:
        return n_windows(self.n_tokens, self.max_seq_len)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) for window `index`: CPU int64 tensors of shape (L,), y[j] == x[j+1]."""
        i = operator.index(index)
        n = len(self)
        if not 0 <= i < n:
            raise IndexError(f"window {i} out of range for {n} windows")
        chunk = self._dummy_window(i) if self.layout == "dummy" else self._checked_ids(self._window(i), [i])
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
        """Windows `indices` as one int64 (B, L + 1) array. Rows are contiguous, so the pieces of all
        windows (one slice per window and shard touched), in order, tile the flat buffer exactly: one
        bulk copy (b"".join, or np.concatenate for mixed dtypes) assembles them all, one pass widens
        them to int64. Locating pieces costs a few integer ops per piece; nothing is done per token.
        `_window` is the per-window reference it must equal."""
        n, L = len(self), self.max_seq_len
        T = L + 1
        if self.layout == "dummy":
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
        starts, ends, units, u = self._starts, self._ends, self._units, self._unit_scale
        pieces: list[Any] = []
        append = pieces.append  # this loop is the data path's hot spot: keep it lean
        for i in indices:
            start = i * L
            stop = start + T
            k = bisect.bisect_right(starts, start) - 1
            if ends[k] < stop:  # the window runs past shard k: the rest of it, whole shards, ...
                append(units[k][(start - starts[k]) * u :])
                k += 1
                while ends[k] < stop:
                    append(units[k])
                    k += 1
                start = starts[k]
            append(units[k][(start - starts[k]) * u : (stop - starts[k]) * u])  # ... and the part in shard k
        if self._unit_dtype is not None:
            # Byte pieces: one join copies them, the id check runs on the narrow dtype, one astype widens.
            flat = np.frombuffer(b"".join(pieces), dtype=self._unit_dtype)
            if int(flat.max()) >= self.vocab_size:
                self._checked_ids(flat.reshape(len(indices), T), indices)  # raises, naming the shard
            return flat.astype(np.int64).reshape(len(indices), T)
        # Mixed dtypes: one call copies and widens every piece. "unsafe" only matters for a torch uint64
        # source (a "safe" uint64 + int64 mix would promote to float); large ids are refused just below.
        out_BT = np.concatenate(pieces, dtype=np.int64, casting="unsafe").reshape(len(indices), T)
        return self._checked_ids(out_BT, indices)

    def _checked_ids(self, chunks: np.ndarray, indices: list[int]) -> np.ndarray:
        """`chunks` ((B, L + 1) or (L + 1,) int64, windows `indices`) after one max() over it: manifest
        shards are not scanned at construction (their recorded max_token_id is trusted), so a shard whose
        bytes changed since `prepare` is caught here, naming it, before an id >= vocab_size reaches the
        embedding (an IndexError mid-run on CPU, a device-side assert on GPU)."""
        if chunks.size == 0 or int(chunks.max()) < self.vocab_size:
            return chunks
        flat = chunks.reshape(-1)
        pos = int(np.argmax(flat >= self.vocab_size))
        row, col = divmod(pos, self.max_seq_len + 1)
        g = int(indices[row]) * self.max_seq_len + col  # global token index
        k = bisect.bisect_right(self._starts, g) - 1
        raise DataError(
            f"{self._array_paths[k]}: token id {int(flat[pos])} at token {g - self._starts[k]} is outside "
            f"the vocabulary [0, {self.vocab_size}); the shard's bytes changed after it was written: run "
            f"`mamba3lite inspect {self.data_path} --verify`, then re-run `mamba3lite prepare`"
        )

    def _window(self, i: int) -> np.ndarray:
        """Tokens [i·L, i·L + L + 1) as a fresh int64 array, one slice copy per shard touched."""
        start, stop = window_span(i, self.max_seq_len)
        k = bisect.bisect_right(self._starts, start) - 1
        off = start - self._starts[k]
        arr = self._arrays[k]
        if off + (stop - start) <= arr.shape[0]:
            return arr[off : off + stop - start].astype(np.int64)  # astype copies: never a view of the map
        out = np.empty(stop - start, dtype=np.int64)
        pos = 0
        while pos < out.shape[0]:  # each step consumes a whole non-empty shard (or the rest of the window)
            arr = self._arrays[k]
            take = min(out.shape[0] - pos, arr.shape[0] - off)
            out[pos : pos + take] = arr[off : off + take]
            pos, k, off = pos + take, k + 1, 0
        return out

    def _dummy_window(self, i: int) -> np.ndarray:
        # A generator seeded by (seed, i) alone: the same window in every process, worker and rank.
        rng = np.random.Generator(np.random.PCG64([self.seed, i]))
        return rng.integers(0, self.vocab_size, self.max_seq_len + 1, dtype=np.int64)

    # --------------------------------------------------------------------------------------- pickling

    def __getstate__(self) -> dict:
        # DataLoader workers (spawn) pickle the dataset: ship the file list, not the mapped bytes.
        state = self.__dict__.copy()
        state["_arrays"], state["_starts"], state["_ends"], state["_tensors"] = [], [], [], []
        state["_units"] = []  # memoryviews do not pickle; _open_sources rebuilds them
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.layout != "dummy":
            self._open_sources()

    def __repr__(self) -> str:
        where = "" if self.layout == "dummy" else f", path={str(self.data_path)!r}"
        return (
            f"PretrainDataset(layout={self.layout!r}{where}, n_tokens={self.n_tokens}, "
            f"max_seq_len={self.max_seq_len}, windows={len(self)})"
        )
