"""TokenStream: token files read as one logical sequence, memory-mapped, sliced without per-token work.

A source is (path, dtype): a raw little-endian token file of that dtype, or, with dtype None, a
torch.save'd 1-D integer tensor. Every source is memory-mapped (torch.load(..., mmap=True) or
np.memmap), so reading a corpus does not make it resident as anonymous memory; the sources are one
sequence in reading order, and a token range that spans files is assembled from one slice per file.
Pickling ships the source list, never the mapped bytes (DataLoader workers reopen the maps).
"""

from __future__ import annotations

import bisect
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mamba3lite import intake
from mamba3lite.data.shards import open_tokens
from mamba3lite.errors import DataError

_ZIP_MAGIC = b"PK\x03\x04"  # torch.save writes a zip archive
_TORCH_INT_DTYPES = {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64} | {
    getattr(torch, name) for name in ("uint16", "uint32", "uint64") if hasattr(torch, name)
}

Source = tuple[Path, "np.dtype | None"]


def is_torch_file(path: Path) -> bool:
    """True if `path` starts with the zip magic that torch.save writes (PK\\x03\\x04). DataError for a
    path that is not a regular file (a named pipe would block the read, SIGTERM included)."""
    return intake.read_prefix(path, intake.TOKEN_FILE, len(_ZIP_MAGIC)) == _ZIP_MAGIC


def load_torch_tokens(path: Path) -> torch.Tensor:
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


class TokenStream:
    """The concatenation of `sources` (see the module docstring).

    `per_source`: each source's 1-D array (empty ones included), for a caller that checks them once.
    `gather(spans)` and `read(start, stop)` return tokens; `locate(g)` names the file of token g."""

    def __init__(self, sources: list[Source]) -> None:
        self.sources = list(sources)
        self._open()

    @property
    def paths(self) -> list[Path]:
        """The token files, in reading order."""
        return [p for p, _ in self.sources]

    @property
    def n_tokens(self) -> int:
        return self._ends[-1] if self._ends else 0

    def _open(self) -> None:
        """(Re)open every source as a read-only memory-mapped 1-D array. Only the non-empty ones are kept
        for reading (so every step of the spanning loop makes progress)."""
        self.per_source, self._tensors = [], []
        for p, np_dtype in self.sources:
            if np_dtype is None:
                t = load_torch_tokens(p)
                self._tensors.append(t)  # keeps the mapping alive; the numpy view shares its memory
                self.per_source.append(t.numpy())
            else:
                self.per_source.append(open_tokens(p, np_dtype))
        # Plain ndarray views of the maps: np.memmap's subclass machinery costs ~1 µs per slice.
        kept = [(p, np.asarray(a)) for (p, _), a in zip(self.sources, self.per_source) if a.shape[0]]
        self._arrays = [a for _, a in kept]
        self._array_paths = [p for p, _ in kept]
        sizes = [a.shape[0] for a in self._arrays]
        self._starts: list[int] = np.cumsum([0, *sizes[:-1]], dtype=np.int64).tolist() if sizes else []
        self._ends = [start + size for start, size in zip(self._starts, sizes)]
        self._units, self.unit_dtype = _slice_units(self._arrays)
        self._unit_scale = 1 if self.unit_dtype is None else self.unit_dtype.itemsize

    def gather(self, starts: list[int], length: int) -> np.ndarray:
        """Tokens [s, s + length) for each s in `starts` as one (B, length) array: in the sources' common
        dtype when they share one (`unit_dtype`), else int64. Rows are contiguous, so the pieces of all
        rows (one slice per row and file touched), in order, tile the flat buffer exactly: one bulk copy
        (b"".join, or np.concatenate for mixed dtypes) assembles them all. Locating pieces costs a few
        integer ops per piece; nothing is done per token. `read` is the per-row reference it must equal."""
        ends, units, u = self._ends, self._units, self._unit_scale
        first = self._starts
        pieces: list[Any] = []
        append = pieces.append  # this loop is the data path's hot spot: keep it lean
        for start in starts:
            stop = start + length
            k = bisect.bisect_right(first, start) - 1
            if ends[k] < stop:  # the row runs past file k: the rest of it, whole files, ...
                append(units[k][(start - first[k]) * u :])
                k += 1
                while ends[k] < stop:
                    append(units[k])
                    k += 1
                start = first[k]
            append(units[k][(start - first[k]) * u : (stop - first[k]) * u])  # ... and the part in file k
        if self.unit_dtype is not None:
            return np.frombuffer(b"".join(pieces), dtype=self.unit_dtype).reshape(len(starts), length)
        # Mixed dtypes: one call copies and widens every piece. "unsafe" only matters for a torch uint64
        # source (a "safe" uint64 + int64 mix would promote to float); the caller checks id ranges.
        return np.concatenate(pieces, dtype=np.int64, casting="unsafe").reshape(len(starts), length)

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) as a fresh int64 array, one slice copy per file touched."""
        k = bisect.bisect_right(self._starts, start) - 1
        off = start - self._starts[k]
        arr = self._arrays[k]
        if off + (stop - start) <= arr.shape[0]:
            return arr[off : off + stop - start].astype(np.int64)  # astype copies: never a view of the map
        out = np.empty(stop - start, dtype=np.int64)
        pos = 0
        while pos < out.shape[0]:  # each step consumes a whole non-empty file (or the rest of the range)
            arr = self._arrays[k]
            take = min(out.shape[0] - pos, arr.shape[0] - off)
            out[pos : pos + take] = arr[off : off + take]
            pos, k, off = pos + take, k + 1, 0
        return out

    def locate(self, g: int) -> tuple[Path, int]:
        """(file, index in that file) of global token `g`."""
        k = bisect.bisect_right(self._starts, g) - 1
        return self._array_paths[k], g - self._starts[k]

    def __getstate__(self) -> dict:
        return {"sources": self.sources}  # mapped bytes and memoryviews do not pickle: reopen them

    def __setstate__(self, state: dict) -> None:
        self.sources = state["sources"]
        self._open()


def _slice_units(arrays: list[np.ndarray]) -> tuple[list[Any], np.dtype | None]:
    """(what `gather` slices, their dtype when they are byte views). When every array has one dtype and
    is contiguous, byte memoryviews: slicing one is ~2x cheaper than slicing an ndarray, and b"".join
    copies all pieces in one C loop. Otherwise the arrays themselves (and None)."""
    dtypes = {a.dtype for a in arrays}
    if len(dtypes) == 1 and all(a.flags.c_contiguous for a in arrays):
        try:
            return [memoryview(a).cast("B") for a in arrays], dtypes.pop()
        except (TypeError, ValueError):  # a dtype the buffer protocol cannot export: slice arrays
            pass
    return list(arrays), None
