"""Which token files a data path names, and how to read them: the layouts of `PretrainDataset`.

  "sharded"  a directory: with manifest.json (the shards of `split`, dtype from the manifest), or without
             one: the seed's `shard_*.bin` files, each a torch.save'd 1-D integer tensor or a raw token
             file (raw needs `dtype`, e.g. "uint32", the seed pipeline's format).
  "single"   one file: a torch.save'd 1-D integer tensor, or a raw token file (needs `dtype`).
  ("dummy", random tokens, has no files: PretrainDataset makes it only when asked.)

`find_layout` checks what the files claim before any is opened (a manifest's vocabulary, dtype and shard
sizes); ids of manifest-less data are checked by `check_id_ranges` once the files are mapped.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mamba3lite.data.shards import MANIFEST_NAME, SPLITS, Manifest, dataset_dir, has_manifest
from mamba3lite.data.token_stream import Source, TokenStream, is_torch_file
from mamba3lite.errors import ConfigError, DataError, DataNotFoundError

LAYOUT_KINDS = ("single", "sharded")
SEED_SHARD_GLOB = "shard_*.bin"
_SCAN_TOKENS = 1 << 24  # ids checked per vectorised step when validating manifest-less data


@dataclass(frozen=True)
class Layout:
    """What a data path holds. `root`: the dataset directory or file (a manifest.json path names its
    directory); `sources`: the token files in reading order, each with its raw dtype (None: torch.save'd);
    `manifest` and `bytes_per_token` (UTF-8 bytes of source text per token of the split) only with a
    manifest, whose recorded max ids make a scan of the ids unnecessary."""

    kind: str
    root: Path
    sources: list[Source]
    manifest: Manifest | None = None
    bytes_per_token: float | None = None


def find_layout(data_path: str | Path | None, *, split: str, vocab_size: int, dtype: Any = None) -> Layout:
    """The layout of `data_path` (see the module docstring). ConfigError for a missing path argument or a
    bad `dtype`; DataNotFoundError when the path does not exist; DataError naming the file when the data
    cannot be read as tokens of `vocab_size` ids."""
    if data_path is None:
        raise ConfigError("no data path given: pass a dataset directory or token file, or dummy=True")
    path = Path(data_path)
    if not path.exists():
        raise DataNotFoundError(
            f"data path {path} does not exist: create the dataset with `mamba3lite prepare`, or fix the path"
        )
    np_dtype = None if dtype is None else parse_dtype(dtype)
    root = dataset_dir(path)
    if not root.is_dir():
        return Layout("single", root, [(root, file_dtype(root, np_dtype))])
    if has_manifest(root):
        return _manifest_layout(root, split, vocab_size, np_dtype)
    return Layout("sharded", root, _seed_dir_sources(root, np_dtype))


def parse_dtype(dtype: Any) -> np.dtype:
    """`dtype` (a name or numpy dtype) as a little-endian integer dtype; ConfigError otherwise."""
    try:
        np_dtype = np.dtype(dtype)
    except TypeError:
        raise ConfigError(f"dtype {dtype!r} is not a numpy dtype; use e.g. 'uint16' or 'uint32'") from None
    if not np.issubdtype(np_dtype, np.integer):
        raise ConfigError(f"dtype {dtype!r} is not an integer dtype; use e.g. 'uint16' or 'uint32'")
    return np_dtype.newbyteorder("<")


def file_dtype(path: Path, np_dtype: np.dtype | None) -> np.dtype | None:
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


def _manifest_layout(root: Path, split: str, vocab_size: int, np_dtype: np.dtype | None) -> Layout:
    manifest_path = root / MANIFEST_NAME
    m = Manifest.load(root)
    if m.vocab_size != vocab_size:
        raise DataError(
            f"{manifest_path}: the data's vocab_size is {m.vocab_size} but the model's vocab_size is "
            f"{vocab_size}; use the tokenizer the data was prepared with, or re-prepare the data"
        )
    if np_dtype is not None and np_dtype != m.np_dtype:
        raise DataError(f"{manifest_path}: dtype {m.dtype} differs from the dtype argument {np_dtype.name}")
    infos = m.split_shards(split)
    if not infos:
        have = sorted({s.split for s in m.shards})
        raise DataError(
            f"{manifest_path}: no shards for split {split!r} (it has: {', '.join(have) or 'none'}); "
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
        assert info.max_token_id < vocab_size
    n_bytes, n_tok = m.n_bytes(split), m.n_tokens(split)
    bytes_per_token = n_bytes / n_tok if n_bytes > 0 and n_tok > 0 else None
    return Layout("sharded", root, [(root / s.path, m.np_dtype) for s in infos], m, bytes_per_token)


def _seed_dir_sources(root: Path, np_dtype: np.dtype | None) -> list[Source]:
    if root.name in SPLITS and has_manifest(root.parent):
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
    return [(p, file_dtype(p, np_dtype)) for p in files]


def check_id_ranges(tokens: TokenStream, vocab_size: int) -> None:
    """Manifest-less data has no recorded max id: scan it once, when it is opened, rather than fail
    mid-run on the GPU. DataError naming the file of the first id outside [0, vocab_size)."""
    for (p, _), arr in zip(tokens.sources, tokens.per_source):
        if arr.shape[0]:
            _check_id_range(arr, vocab_size, p)


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
