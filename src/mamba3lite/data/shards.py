"""The on-disk token format: raw little-endian token files plus a `manifest.json` that explains them.

A dataset directory looks like

    DIR/manifest.json
    DIR/train/shard_00000.bin    raw little-endian integers, no header
    DIR/val/shard_00000.bin

The dtype is uint16 when the vocabulary fits in 65,536 ids (GPT-2: 50,257), else uint32. The manifest
records the format version, the tokenizer (name and vocabulary hash), vocab_size, eos_id, dtype and, per
shard, its relative path, split, n_tokens, n_docs, max_token_id, sha256 and the UTF-8 byte count of its
source text (for bits per byte). It is always written LAST, so a directory with shards but no manifest
is an unfinished write, never a dataset.

Every write is atomic (mamba3lite/atomicfile.py: temp file in the same directory, fsync, rename, fsync
of the directory): a crash leaves either the old file or the new one, never half of one. `write_shard`
re-reads what it wrote and checks its hash, so a shard the manifest describes is a shard that is on disk.
`verify_dataset` re-hashes everything and re-counts sizes, max ids and EOS tokens.

Everything that reads or writes token files goes through this module.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from mamba3lite import intake
from mamba3lite.atomicfile import HASH_CHUNK_BYTES, atomic_write_bytes, atomic_write_json, sha256_file
from mamba3lite.data_identity import DataIdentity, is_tokenizer_file, resolve_name
from mamba3lite.errors import DataError, DataNotFoundError

FORMAT_VERSION: int = 1
MANIFEST_NAME = "manifest.json"
# A dataset's own tokenizer (`prepare --train-tokenizer`) is recorded in the manifest by the relative name
# TOKENIZER_NAME ("tokenizer.json", data_identity.py).
SPLITS = ("train", "val")
_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def dataset_dir(path: str | Path) -> Path:
    """The dataset directory a path names: a path to its manifest.json names the directory holding it.
    Every command that takes a dataset accepts either."""
    p = Path(path)
    return p.parent if p.name == MANIFEST_NAME and not p.is_dir() else p


def has_manifest(path: str | Path) -> bool:
    """Whether `path` names a prepared dataset, not seed-format tokens: its directory holds an entry
    manifest.json. Not that it is a readable file: a pipe or a device of that name is the manifest's
    problem, which `Manifest.load` names (read as manifest-less data it would only be "no shards")."""
    return (dataset_dir(path) / MANIFEST_NAME).exists()


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The on-disk dtype for a vocabulary: little-endian uint16 if every id fits (≤ 65,536), else uint32."""
    if vocab_size < 1:
        raise DataError(f"vocab_size must be >= 1, got {vocab_size}")
    if vocab_size > 2**32:
        raise DataError(f"vocab_size {vocab_size} does not fit uint32 token files (max 2**32)")
    return np.dtype("<u2") if vocab_size <= 65_536 else np.dtype("<u4")


def _dtype_name(dtype: np.dtype) -> str:
    return np.dtype(dtype).newbyteorder("=").name


@dataclass
class ShardInfo:
    """One token file of a dataset, as the manifest records it."""

    path: str  # relative to the dataset dir, posix, e.g. "train/shard_00000.bin"
    split: str  # "train" or "val"
    n_tokens: int
    n_docs: int  # documents in the shard; each ends with an EOS token
    max_token_id: int  # largest id in the shard; -1 for an empty shard
    sha256: str  # hex sha256 of the file's bytes
    n_bytes: int = 0  # UTF-8 bytes of the source text in this shard (0 = unknown); for bits/byte


def _check_type(value: Any, types: type | tuple[type, ...], what: str, where: str) -> None:
    # bool is an int subclass; a `true` where a count belongs is a corrupt manifest, not 1.
    if isinstance(value, bool) or not isinstance(value, types):
        names = types.__name__ if isinstance(types, type) else " or ".join(t.__name__ for t in types)
        raise DataError(f"{where}: {what} must be {names}, got {value!r}; re-run `mamba3lite prepare`")


def _shard_from_dict(d: Any, i: int, where: str) -> ShardInfo:
    what = f"shards[{i}]"
    if not isinstance(d, dict):
        raise DataError(f"{where}: {what} must be an object, got {d!r}")
    known = {f.name for f in fields(ShardInfo)}
    required = known - {"n_bytes"}
    if missing := sorted(required - d.keys()):
        raise DataError(f"{where}: {what} lacks {', '.join(missing)}; re-run `mamba3lite prepare`")
    if unknown := sorted(d.keys() - known):
        raise DataError(f"{where}: {what} has unknown keys {', '.join(unknown)}")
    for key in ("path", "split", "sha256"):
        _check_type(d[key], str, f"{what}.{key}", where)
    for key in ("n_tokens", "n_docs", "max_token_id", "n_bytes"):
        if key in d:
            _check_type(d[key], int, f"{what}.{key}", where)
    info = ShardInfo(**d)
    rel = PurePosixPath(info.path)
    if not info.path or rel.is_absolute() or ".." in rel.parts or "\\" in info.path:
        raise DataError(
            f"{where}: {what}.path {info.path!r} must be a relative posix path inside the dataset"
        )
    if info.split not in SPLITS:
        raise DataError(f"{where}: {what}.split is {info.split!r}; expected one of {', '.join(SPLITS)}")
    if info.n_tokens < 0 or info.n_docs < 0 or info.n_bytes < 0:
        raise DataError(f"{where}: {what} ({info.path}) has a negative count")
    if info.max_token_id < (0 if info.n_tokens else -1):
        raise DataError(f"{where}: {what} ({info.path}) has max_token_id {info.max_token_id}")
    if len(info.sha256) != 64 or any(c not in "0123456789abcdef" for c in info.sha256):
        raise DataError(f"{where}: {what} ({info.path}) sha256 is not 64 lowercase hex digits")
    return info


@dataclass
class Manifest:
    """A dataset directory's manifest.json: what the shards hold and how to read them."""

    vocab_size: int
    eos_id: int
    dtype: str  # "uint16" | "uint32" (little-endian on disk)
    # {"name": "gpt2" | an absolute tokenizer.json path | "tokenizer.json" (the dataset's own, relative to
    # it; `load` gives its path), "vocab_hash": "<sha256>" (of the tokenizer.json file, or GPT-2's ranks)}
    tokenizer: dict
    shards: list[ShardInfo]
    format_version: int = FORMAT_VERSION
    extra: dict = field(default_factory=dict)  # free-form: sources, filter counts, prepare args...

    @property
    def identity(self) -> DataIdentity:
        """The tokenizer the shards were made with, as the one typed record (data_identity.py); a
        manifest read by `load` has its own tokenizer's name resolved already."""
        return DataIdentity.from_manifest(self.tokenizer, self.vocab_size, self.eos_id)

    @property
    def np_dtype(self) -> np.dtype:
        """The shards' numpy dtype (explicitly little-endian)."""
        return _DTYPES[self.dtype]

    def to_dict(self) -> dict:
        """A JSON-able dict (shards as a list of dicts)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, where: str = "manifest") -> Manifest:
        """Build and validate a manifest from its dict form. Any problem raises DataError naming `where`."""
        if not isinstance(d, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        if missing := sorted((known - {"extra"}) - d.keys()):
            raise DataError(f"{where}: missing {', '.join(missing)}; re-run `mamba3lite prepare`")
        if unknown := sorted(d.keys() - known):
            raise DataError(f"{where}: unknown keys {', '.join(unknown)}")
        _check_type(d["format_version"], int, "format_version", where)
        if d["format_version"] > FORMAT_VERSION:
            raise DataError(
                f"{where}: format_version {d['format_version']} is newer than this mamba3lite reads "
                f"({FORMAT_VERSION}); upgrade mamba3lite"
            )
        if d["format_version"] < 1:
            raise DataError(f"{where}: format_version {d['format_version']} is invalid")
        for key in ("vocab_size", "eos_id"):
            _check_type(d[key], int, key, where)
        _check_type(d["dtype"], str, "dtype", where)
        _check_type(d["tokenizer"], dict, "tokenizer", where)
        _check_type(d["shards"], list, "shards", where)
        _check_type(d.get("extra", {}), dict, "extra", where)
        if d["dtype"] not in _DTYPES:
            raise DataError(f"{where}: dtype {d['dtype']!r} is not one of {', '.join(_DTYPES)}")
        vocab_size, eos_id = d["vocab_size"], d["eos_id"]
        capacity = 1 << (8 * _DTYPES[d["dtype"]].itemsize)
        if not 1 <= vocab_size <= capacity:
            raise DataError(f"{where}: vocab_size {vocab_size} does not fit dtype {d['dtype']}")
        if not 0 <= eos_id < vocab_size:
            raise DataError(f"{where}: eos_id {eos_id} is outside the vocabulary [0, {vocab_size})")
        tok = d["tokenizer"]
        if not isinstance(tok.get("name"), str) or not isinstance(tok.get("vocab_hash"), str):
            raise DataError(f"{where}: tokenizer must be {{'name': str, 'vocab_hash': str}}, got {tok!r}")
        shards = [_shard_from_dict(s, i, where) for i, s in enumerate(d["shards"])]
        seen: set[str] = set()
        for s in shards:
            if s.path in seen:
                raise DataError(f"{where}: shard {s.path} is listed twice")
            seen.add(s.path)
            if s.max_token_id >= vocab_size:
                raise DataError(
                    f"{where}: shard {s.path} has max_token_id {s.max_token_id} >= vocab_size {vocab_size}"
                )
        return cls(
            vocab_size=vocab_size,
            eos_id=eos_id,
            dtype=d["dtype"],
            tokenizer=dict(tok),
            shards=shards,
            format_version=d["format_version"],
            extra=dict(d.get("extra", {})),
        )

    def save(self, dataset_dir: Path) -> None:
        """Atomically write DIR/manifest.json. Call it after every shard is on disk."""
        # Round-trip through from_dict so that an invalid manifest is never written.
        Manifest.from_dict(self.to_dict(), where=f"manifest for {dataset_dir}")
        atomic_write_json(Path(dataset_dir) / MANIFEST_NAME, self.to_dict())

    @classmethod
    def load(cls, path: str | Path, *, check_tokenizer: bool = True) -> Manifest:
        """Read DIR/manifest.json (a path to the manifest file itself also works). DataError naming the
        file on any problem; DataNotFoundError when it does not exist.

        A tokenizer recorded by a name relative to the dataset (its own, `prepare --train-tokenizer`:
        "tokenizer.json") comes back as the path of that file, so the directory can be moved; with
        `check_tokenizer` that file must be there with the recorded sha256 (`check_own_tokenizer`)."""
        root = dataset_dir(path)
        p = root / MANIFEST_NAME
        # The border reader: a pipe or device named manifest.json, a 5,000-digit count, NaN, deep
        # nesting or bytes that are not UTF-8 are each one DataError naming the file.
        d = intake.read_json(p, intake.MANIFEST, top=None)
        m = cls.from_dict(d, where=str(p))
        name = m.tokenizer["name"]
        if is_own_tokenizer(name):
            if check_tokenizer:
                check_own_tokenizer(root, name, m.tokenizer["vocab_hash"])
            m.tokenizer["name"] = resolve_name(name, root)
        return m

    def split_shards(self, split: str) -> list[ShardInfo]:
        """The shards of one split, in manifest (= reading) order."""
        return [s for s in self.shards if s.split == split]

    def n_tokens(self, split: str | None = None) -> int:
        """Tokens in one split, or in all shards when split is None."""
        return sum(s.n_tokens for s in self.shards if split is None or s.split == split)

    def n_bytes(self, split: str | None = None) -> int:
        """Source-text UTF-8 bytes in one split (or all); 0 when any shard's count is unknown."""
        chosen = [s for s in self.shards if split is None or s.split == split]
        return 0 if any(s.n_bytes == 0 and s.n_tokens for s in chosen) else sum(s.n_bytes for s in chosen)


def is_own_tokenizer(name: str) -> bool:
    """Whether a manifest's tokenizer name is a file inside the dataset (a relative path such as
    "tokenizer.json", not "gpt2" or an absolute path)."""
    return is_tokenizer_file(name) and not PurePosixPath(name).is_absolute() and not Path(name).is_absolute()


def check_own_tokenizer(root: Path, name: str, vocab_hash: str) -> None:
    """DataError unless ROOT/name, the tokenizer the dataset's tokens were made with, is there with
    sha256 `vocab_hash` (`DataIdentity.verify`): deleted or edited after `prepare`, the ids mean nothing."""
    ident = DataIdentity(resolve_name(name, root), vocab_hash, None, None)
    fix = "put the original back, or run `mamba3lite prepare` again to rebuild the dataset"
    ident.verify(what=f"the dataset {root} was prepared with it", fix=fix)


def write_shard(
    dataset_dir: Path,
    rel_path: str,
    tokens: np.ndarray,
    *,
    split: str,
    n_docs: int,
    n_bytes: int = 0,
    dtype: np.dtype,
) -> ShardInfo:
    """Write a 1-D integer token array as DIR/rel_path (raw, little-endian `dtype`), atomically, then
    re-read the file and check its size and sha256 against what was written. Returns its ShardInfo.
    Raises DataError if an id does not fit `dtype` (it would wrap silently) or the re-read differs."""
    dataset_dir = Path(dataset_dir)
    dtype = np.dtype(dtype).newbyteorder("<")
    if _dtype_name(dtype) not in _DTYPES:
        raise DataError(f"shard dtype must be uint16 or uint32, got {dtype}")
    if split not in SPLITS:
        raise DataError(f"shard {rel_path}: split {split!r} is not one of {', '.join(SPLITS)}")
    rel = PurePosixPath(rel_path)
    if rel.is_absolute() or ".." in rel.parts:
        raise DataError(f"shard path {rel_path!r} must be relative to the dataset directory")
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or not (tokens.size == 0 or np.issubdtype(tokens.dtype, np.integer)):
        raise DataError(
            f"shard {rel_path}: tokens must be a 1-D integer array, got {tokens.dtype}{tokens.shape}"
        )
    max_id = int(tokens.max()) if tokens.size else -1
    min_id = int(tokens.min()) if tokens.size else 0
    if min_id < 0 or max_id > np.iinfo(dtype).max:
        raise DataError(
            f"shard {rel_path}: token ids span [{min_id}, {max_id}], which does not fit {dtype.name}"
        )
    data = np.ascontiguousarray(tokens.astype(dtype, copy=False))
    expected_sha = hashlib.sha256(memoryview(data).cast("B")).hexdigest()
    path = dataset_dir / rel
    atomic_write_bytes(path, data)
    # Read back what the filesystem holds: a manifest must never describe bytes that are not on disk.
    size = path.stat().st_size
    actual_sha = sha256_file(path)
    if size != data.nbytes or actual_sha != expected_sha:
        raise DataError(
            f"{path}: re-read after writing differs (size {size} vs {data.nbytes}, sha256 "
            f"{actual_sha[:12]} vs {expected_sha[:12]}); the disk or filesystem is faulty"
        )
    return ShardInfo(
        path=rel.as_posix(),
        split=split,
        n_tokens=int(data.size),
        n_docs=int(n_docs),
        max_token_id=max_id,
        sha256=expected_sha,
        n_bytes=int(n_bytes),
    )


def write_dataset(
    dataset_dir: Path,
    parts: Iterable[tuple[str, np.ndarray, int, int]],
    *,
    vocab_size: int,
    eos_id: int,
    tokenizer: dict,
    extra: dict | None = None,
) -> Manifest:
    """Write already-tokenized arrays as a dataset directory that `PretrainDataset` reads: each part
    `(split, tokens, n_docs, n_bytes)` becomes `split/shard_NNNNN.bin` (numbered per split, in order),
    then the manifest is written last. `tokenizer` is {"name", "vocab_hash"}. For pre-tokenized data
    and tests; `prepare` does the same from text."""
    dtype = dtype_for_vocab(vocab_size)
    counters = dict.fromkeys(SPLITS, 0)
    shards = []
    for split, tokens, n_docs, n_bytes in parts:
        if split not in counters:
            raise DataError(f"split {split!r} is not one of {', '.join(SPLITS)}")
        rel = f"{split}/shard_{counters[split]:05d}.bin"
        counters[split] += 1
        shards.append(
            write_shard(dataset_dir, rel, tokens, split=split, n_docs=n_docs, n_bytes=n_bytes, dtype=dtype)
        )
    manifest = Manifest(
        vocab_size=vocab_size,
        eos_id=eos_id,
        dtype=_dtype_name(dtype),
        tokenizer=dict(tokenizer),
        shards=shards,
        extra=dict(extra or {}),
    )
    manifest.save(Path(dataset_dir))
    return manifest


def open_tokens(path: Path, dtype: Any) -> np.ndarray:
    """Read-only memory map of a raw token file as a 1-D array of little-endian `dtype`.

    Returns an np.memmap (a plain empty array for an empty file, which cannot be mapped). Nothing is
    read until sliced. DataNotFoundError if missing; DataError if the size is not a multiple of the
    dtype's itemsize (a truncated or foreign file)."""
    path = Path(path)
    dtype = np.dtype(dtype).newbyteorder("<")
    if not np.issubdtype(dtype, np.integer):
        raise DataError(f"{path}: token dtype must be an integer type, got {dtype}")
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise DataNotFoundError(f"token file {path} does not exist") from None
    if not path.is_file():
        raise DataError(f"{path} is not a regular file")
    if size % dtype.itemsize:
        raise DataError(
            f"{path}: size {size} bytes is not a multiple of {dtype.itemsize} ({dtype.name}); the file is "
            f"truncated or not a {dtype.name} token file"
        )
    if size == 0:
        return np.empty(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def _scan_file(path: Path, dtype: np.dtype, eos_id: int) -> tuple[str, int, int]:
    """One pass over a token file: (sha256, max id or -1, EOS count). Constant memory."""
    h = hashlib.sha256()
    max_id, n_eos = -1, 0
    buf = bytearray(HASH_CHUNK_BYTES)  # a multiple of every itemsize, so chunks never split a token
    view = memoryview(buf)
    with open(path, "rb") as f:
        while n := f.readinto(buf):
            h.update(view[:n])
            usable = n - n % dtype.itemsize
            ids = np.frombuffer(buf, dtype=dtype, count=usable // dtype.itemsize)
            if ids.size:
                max_id = max(max_id, int(ids.max()))
                n_eos += int(np.count_nonzero(ids == eos_id))
    return h.hexdigest(), max_id, n_eos


def verify_shard(dataset_dir: Path, info: ShardInfo, manifest: Manifest) -> str | None:
    """Re-check one shard against the manifest: existence, size, sha256, max id, ids < vocab_size and
    EOS count ≥ n_docs. None if OK, else one line naming the shard and every problem found."""
    path = Path(dataset_dir) / info.path
    dtype = manifest.np_dtype
    if not path.is_file():
        return f"{info.path}: missing (expected {path})"
    size = path.stat().st_size
    if size != info.n_tokens * dtype.itemsize:
        return (
            f"{info.path}: size {size} bytes != n_tokens {info.n_tokens} x {dtype.itemsize} "
            f"({manifest.dtype}) = {info.n_tokens * dtype.itemsize}"
        )
    sha, max_id, n_eos = _scan_file(path, dtype, manifest.eos_id)
    problems = []
    if sha != info.sha256:
        problems.append(f"sha256 {sha[:12]}… != manifest {info.sha256[:12]}…")
    if max_id != info.max_token_id:
        problems.append(f"max id {max_id} != manifest max_token_id {info.max_token_id}")
    if max_id >= manifest.vocab_size:
        problems.append(f"max id {max_id} >= vocab_size {manifest.vocab_size}")
    if n_eos < info.n_docs:
        problems.append(f"{n_eos} EOS tokens (id {manifest.eos_id}) < n_docs {info.n_docs}")
    return f"{info.path}: " + "; ".join(problems) if problems else None


def verify_dataset(dataset_dir: Path) -> list[str]:
    """Re-hash and re-count every shard of a dataset directory. Returns every problem found, one line
    each (an unreadable or invalid manifest is one problem); an empty list means verified."""
    try:
        manifest = Manifest.load(dataset_dir)
    except DataError as e:
        return [str(e)]
    problems = []
    if not manifest.shards:
        problems.append(f"{Path(dataset_dir) / MANIFEST_NAME}: lists no shards")
    for info in manifest.shards:
        if (problem := verify_shard(dataset_dir, info, manifest)) is not None:
            problems.append(problem)
    return problems
