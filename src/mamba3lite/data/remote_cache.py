"""A dataset in object storage, trained on through a verified local cache.

    held = fetch_dataset("s3://bucket/ds/", cache_dir, max_bytes)   # a local copy, verified
    PretrainDataset(held.path, ...)                                   # memory-mapped from the cache
    held.close()                                                      # (or at process exit)

`fetch_dataset` reads the dataset's manifest.json from the store, then fetches each shard the run
reads into CACHE/<hash of the URL>/, hashing it on the way: a shard whose sha256 is not the manifest's
is a DataError naming its URL (never a silent substitute, and nothing is left in the cache for it); a
shard missing from the store is a DataNotFoundError naming it. A copy already in the cache is used
when it is the file that was verified (the same size and mtime as then, `.verified.json`), else hashed
again, and fetched again if it no longer matches. The manifest is written to the
cache last, as `prepare` writes it: a cache entry without one is an unfinished fetch.

Which shards a rank reads: every shard of the splits it reads. The window sampler spreads each global
batch over the whole dataset (its order is the same at any world size), so every rank's windows touch
every shard of a split within an epoch; a rank that fetched only part of them would fetch the rest
mid-run. Ranks on one node share the cache: a lock lets one fetch while the others wait, then each
checks the copy.

Size limit and eviction: the cache holds at most `max_bytes`. "No rank reads it any more" is decided
by leases: a process that uses an entry holds a shared `flock` on the entry's lease file for as long
as it trains on it (the kernel drops it when the process exits, however it exits). Before a fetch, the
entries no process holds are evicted, least recently used first, until the new shards fit, and so are
files of the held entry that its current manifest no longer names (an older upload to the same URL).
Entries in use are never evicted; when the data in use alone exceeds the limit, the fetch is refused
with a ConfigError naming data.cache_max_gb.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from mamba3lite.atomicfile import HASH_CHUNK_BYTES, atomic_write_bytes, atomic_write_json
from mamba3lite.data.shards import MANIFEST_NAME, Manifest, is_own_tokenizer
from mamba3lite.data.store import Store
from mamba3lite.errors import ConfigError, DataError, DataNotFoundError

_LEASE = ".lease"  # shared flock: a process trains on this entry
_LOCK = ".lock"  # exclusive flock: a process is fetching into this entry
_USED = ".last_used"  # mtime: when a process last took this entry (eviction order)
_SOURCE = ".source"  # the URL the entry holds, for people looking at the cache
_VERIFIED = ".verified.json"  # {path: [sha256, size, mtime_ns]} of the files verified since they changed


@dataclass
class CachedDataset:
    """A dataset fetched into the cache and held (its lease) until `close` or the process's exit."""

    url: str
    path: Path  # the local dataset directory: manifest.json + shards, as `prepare` writes them
    fetched: list[str] = field(default_factory=list)  # files (shards, tokenizer.json) downloaded by this call
    reused: list[str] = field(default_factory=list)  # files found in the cache, verified
    _lease: Any = field(default=None, repr=False)

    def close(self) -> None:
        """Release the lease: the entry may be evicted from now on."""
        if self._lease is not None:
            self._lease.close()
            self._lease = None


def entry_dir(cache_dir: str | Path, url: str) -> Path:
    """The cache directory of the dataset at `url`."""
    return Path(cache_dir).expanduser() / hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:24]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def _stamp(path: Path, sha256: str) -> list:
    st = path.stat()
    return [sha256, st.st_size, st.st_mtime_ns]


def _read_stamps(entry: Path) -> dict:
    """The entry's verification record: a file whose size and mtime are those it had when its sha256 was
    checked is not hashed again (one hash per download, not one per start and rank; a file changed in
    the cache since is hashed again). A missing or unreadable record means: hash everything."""
    try:
        d = json.loads((entry / _VERIFIED).read_text())
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}


def _take_lease(entry: Path) -> Any:
    """A shared flock on the entry's lease file, on the file that is at that path now (an evictor may
    have removed the entry while this process waited: then the lock is taken again on the new file)."""
    while True:
        entry.mkdir(parents=True, exist_ok=True)
        f = open(entry / _LEASE, "a+b")  # noqa: SIM115 (held for the life of the lease)
        fcntl.flock(f, fcntl.LOCK_SH)
        try:
            if os.fstat(f.fileno()).st_ino == os.stat(entry / _LEASE).st_ino:
                return f
        except FileNotFoundError:
            pass
        f.close()


def _entry_bytes(entry: Path) -> int:
    return sum(p.stat().st_size for p in entry.rglob("*") if p.is_file())


def _evict(cache: Path, keep: Path, need: int, max_bytes: int) -> None:
    """Remove the entries no process holds, least recently used first, until `need` more bytes fit in
    `max_bytes`; ConfigError when the entries in use leave no room."""
    entries = sorted(
        (e for e in cache.iterdir() if e.is_dir() and e != keep),
        key=lambda e: (e / _USED).stat().st_mtime if (e / _USED).exists() else 0.0,
    )
    total = _entry_bytes(keep) + sum(_entry_bytes(e) for e in entries)
    for e in entries:
        if total + need <= max_bytes:
            return
        try:
            f = open(e / _LEASE, "a+b")  # noqa: SIM115
        except OSError:
            continue
        with f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a process trains on it
            size = _entry_bytes(e)
            shutil.rmtree(e, ignore_errors=True)
            total -= size
    if total + need > max_bytes:
        raise ConfigError(
            f"the dataset cache {cache} holds {total / 2**30:.2f} GB in use and needs {need / 2**30:.2f} GB "
            f"more, over its limit of {max_bytes / 2**30:.2f} GB (data.cache_max_gb); raise the limit, or "
            "stop the runs that hold the other cached datasets"
        )


def _remote_manifest(store: Store, splits: tuple[str, ...]) -> tuple[bytes, Manifest, list[tuple[str, str]]]:
    """(the manifest's bytes, the manifest, (path, sha256) of every file a run of `splits` reads: their
    shards, and the dataset's own tokenizer.json, whose sha256 is the manifest's vocab_hash)."""
    where = store.url_of(MANIFEST_NAME)
    if not store.exists(MANIFEST_NAME):
        raise DataNotFoundError(
            f"{where} does not exist: {store.url} is not a prepared dataset, or its upload did not finish "
            "(the manifest is uploaded last); upload it again"
        )
    raw = store.read(store.stat(MANIFEST_NAME), limit=256 << 20)
    try:
        d = json.loads(raw)
    except ValueError as e:
        raise DataError(f"{where} is not a valid dataset manifest ({e})") from None
    manifest = Manifest.from_dict(d, where=where)
    wanted = [(s.path, s.sha256) for s in manifest.shards if s.split in splits]
    if is_own_tokenizer(name := manifest.tokenizer["name"]):  # a file inside the dataset
        if ".." in PurePosixPath(name).parts:
            raise DataError(f"{where}: its tokenizer {name!r} is outside the dataset")
        wanted.append((PurePosixPath(name).as_posix(), manifest.tokenizer["vocab_hash"]))
    return raw, manifest, wanted


def _drop_unlisted(entry: Path, keep: set[str]) -> None:
    """Remove the entry's files that the current manifest does not name (an older upload's)."""
    for p in entry.rglob("*"):
        rel = p.relative_to(entry).as_posix()
        if p.is_file() and not rel.startswith(".") and rel not in keep:
            p.unlink()


def fetch_dataset(
    url: str, cache_dir: str | Path, max_bytes: int, splits: tuple[str, ...] = ("train", "val")
) -> CachedDataset:
    """The dataset at `url` in the local cache, its shards of `splits` verified against the manifest's
    sha256 and held (see the module docstring). Raises the store's one-line errors, DataError for a
    corrupt shard, ConfigError when the cache limit leaves no room."""
    store = Store(url)
    cache = Path(cache_dir).expanduser()
    entry = entry_dir(cache, url)
    raw, manifest, wanted = _remote_manifest(store, splits)
    held = CachedDataset(url, entry, _lease=_take_lease(entry))
    try:
        with open(entry / _LOCK, "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one fetcher per entry; the others wait, then verify
            cached = entry / MANIFEST_NAME
            if not (cached.is_file() and cached.read_bytes() == raw):
                # Another upload at this URL (or a first fetch): the entry is unfinished until the end.
                cached.unlink(missing_ok=True)
                _drop_unlisted(entry, {s.path for s in manifest.shards} | {path for path, _ in wanted})
            stamps = _read_stamps(entry)
            todo = []
            for path, sha in wanted:
                local = entry / path
                if local.is_file() and (stamps.get(path) == _stamp(local, sha) or _sha256(local) == sha):
                    held.reused.append(path)
                    stamps[path] = _stamp(local, sha)
                else:
                    local.unlink(missing_ok=True)
                    todo.append((path, sha))
            objects = {path: store.stat(path) for path, _ in todo}  # a missing one fails before any fetch
            _evict(cache, entry, sum(o.size for o in objects.values()), max_bytes)
            for path, sha in todo:
                store.get_file(objects[path], entry / path, sha256=sha)
                held.fetched.append(path)
                stamps[path] = _stamp(entry / path, sha)
            atomic_write_json(entry / _VERIFIED, {p: stamps[p] for p, _ in wanted})
            atomic_write_bytes(entry / _SOURCE, url.encode())
            if not (cached.is_file() and cached.read_bytes() == raw):
                atomic_write_bytes(cached, raw)  # last: the entry is complete
            now = time.time()
            (entry / _USED).touch()
            os.utime(entry / _USED, (now, now))
    except BaseException:
        held.close()
        raise
    return held
