"""Object storage: one small store over fsspec for `s3://`, `gs://`, `hf://`, `file://` URLs and plain paths.

    store = Store("s3://bucket/corpus/")       # a root: a prefix (or one object)
    objects = store.list()                     # once, sorted by key, each with its size and etag / mtime
    data = store.read(objects[0])              # the bytes, refused if the object changed since the listing
    store.put("out/manifest.json", b"...")     # atomic: readers see the old object or the new one
    upload_dataset(local_dir, "s3://bucket/ds/")   # a prepared dataset, manifest.json last

A listing is the plan: every `ObjectInfo` records the object's size and its etag (object stores) or
mtime (file systems), and every read compares the object it opens with that record, so a corpus that
changes under a run is one `ObjectChangedError` naming the object, never a mix of old and new bytes.
On S3 the reads of one open object also carry `If-Match: etag`, so a change mid-read is caught too.

Credentials and endpoints are whatever fsspec and the cloud SDK already read: for S3 the AWS variables
and files (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ~/.aws/credentials) and, for an
S3-compatible server, AWS_ENDPOINT_URL (botocore's own setting). Nothing new is configured here.

Every failure is one line naming the URL: a missing object or bucket is `DataNotFoundError`, a refused
request `StorageAccessError`, an endpoint that cannot be reached `StorageUnreachableError` (transient:
the same command may work later), a changed object `ObjectChangedError`. fsspec (and s3fs / gcsfs /
huggingface_hub for their schemes) is an optional dependency, imported only when a URL is used: the
extra `mamba3lite[s3]`.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from mamba3lite.atomicfile import HASH_CHUNK_BYTES, atomic_write_bytes
from mamba3lite.data.shards import MANIFEST_NAME
from mamba3lite.errors import (
    ConfigError,
    DataError,
    DataNotFoundError,
    Mamba3LiteError,
    ObjectChangedError,
    StorageAccessError,
    StorageUnreachableError,
)

# scheme:// (RFC 3986 scheme characters); `hf:NAME` (no slashes) is the datasets source, not a URL.
_URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
# The package each scheme's fsspec implementation lives in, for the install hint.
_SCHEME_PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "hf": "huggingface_hub"}
# Exception class names (anywhere in the cause chain) that mean "the endpoint cannot be reached":
# botocore's, aiohttp's and the stdlib's, matched by name so that none of them is imported here.
_UNREACHABLE = frozenset(
    {
        "EndpointConnectionError",
        "ConnectTimeoutError",
        "ConnectionClosedError",
        "ClientConnectorError",
        "ServerDisconnectedError",
        "ConnectionError",
        "ConnectionRefusedError",
        "TimeoutError",
    }
)
# Buffer of a file opened from a store (fsspec's own files read ahead in blocks of their own as well).
_READ_BUFFER_BYTES = 1 << 20
# S3's answer to a read whose If-Match etag no longer matches (s3fs raises it as OSError(EINVAL)).
_CHANGED = frozenset({"FileExpired", "PreconditionFailed"})
# Schemes whose fsspec implementation sends a conditional create (s3fs: PUT with If-None-Match: *).
_CONDITIONAL_PUT = frozenset({"s3", "s3a"})
_CREDENTIALS_HINT = (
    "check the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ~/.aws/credentials; "
    "gcloud auth for gs://, HF_TOKEN for hf://) and the bucket's policy"
)
_ENDPOINT_HINT = "check the network and the endpoint (AWS_ENDPOINT_URL for an S3-compatible server)"


def is_url(spec: str | os.PathLike) -> bool:
    """Whether `spec` is a URL with a scheme (`s3://b/k`, `file:///x`), not a plain path."""
    return isinstance(spec, str) and bool(_URL_RE.match(spec))


def url_scheme(spec: str) -> str:
    return spec.split("://", 1)[0].lower() if is_url(spec) else "file"


@dataclass(frozen=True)
class ObjectInfo:
    """One object of a listing: what a later read is checked against."""

    key: str  # posix path relative to the store's root ("" when the root is the object itself)
    url: str  # the full URL (or path) of the object, for messages
    size: int  # bytes
    etag: str | None  # the store's version tag (S3 ETag, GCS etag / md5, hf blob id); None on file systems
    mtime: float | None  # modification time (seconds), where the store gives one

    def __str__(self) -> str:  # messages name the object by its URL
        return self.url

    def record(self) -> dict:
        """What a plan stores of a listing (JSON-able), so that a resumed run reads the same objects, held
        to the same sizes and etags, without listing again (`Store.object_from_record`)."""
        return {"key": self.key, "size": self.size, "etag": self.etag, "mtime": self.mtime}


def _filesystem(url: str) -> tuple[Any, str]:
    """(fsspec filesystem, root path in its own terms) for a URL or a plain path; ConfigError naming
    the package to install when fsspec or the scheme's implementation is missing."""
    scheme = url_scheme(url)
    package = _SCHEME_PACKAGES.get(scheme, "fsspec")
    try:
        from fsspec.core import url_to_fs
    except ImportError as e:
        raise ConfigError(
            f"{url}: reading URLs needs the `fsspec` package; fix: pip install 'mamba3lite[s3]'"
        ) from e
    try:
        # A fresh instance: the environment (credentials, endpoint) is read now, and no listing cached by
        # an earlier instance is trusted.
        fs, root = url_to_fs(url, skip_instance_cache=True)
    except ImportError as e:
        raise ConfigError(
            f"{url}: the {scheme}:// scheme needs the `{package}` package; fix: pip install "
            f"'mamba3lite[s3]' (or pip install {package})"
        ) from e
    except ValueError as e:  # an unknown protocol
        raise ConfigError(f"{url}: {e}; use s3://, gs://, hf://, file:// or a local path") from e
    return fs, root.rstrip("/") if root not in ("/", "") else root


def _chain(e: BaseException) -> Iterator[BaseException]:
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def storage_error(e: BaseException, url: str, doing: str) -> Mamba3LiteError:
    """The one-line error for an exception fsspec raised while `doing` ("list", "read", ...) `url`."""
    if isinstance(e, Mamba3LiteError):
        return e
    names = {c.__name__ for x in _chain(e) for c in type(x).__mro__}
    if names & _CHANGED or (isinstance(e, OSError) and e.errno == errno.EINVAL and "Precondition" in str(e)):
        return ObjectChangedError(
            f"{url} changed while it was read (its etag no longer matches); the corpus must not change "
            "during a run: re-run once it is stable"
        )
    if isinstance(e, FileNotFoundError):
        return DataNotFoundError(
            f"{url}: no such object or bucket (while trying to {doing} it); check the URL"
        )
    if isinstance(e, PermissionError):
        return StorageAccessError(f"{url}: access denied (while trying to {doing} it); {_CREDENTIALS_HINT}")
    if names & _UNREACHABLE:
        endpoint = os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL_S3")
        where = f" (AWS_ENDPOINT_URL={endpoint})" if endpoint and url_scheme(url) in ("s3", "s3a") else ""
        return StorageUnreachableError(
            f"{url}: cannot reach the object store{where} (while trying to {doing} it: "
            f"{type(e).__name__}); {_ENDPOINT_HINT}, then re-run the same command"
        )
    return DataError(f"{url}: cannot {doing} it ({type(e).__name__}: {e})")


def _etag(info: dict) -> str | None:
    for key in ("ETag", "etag", "md5Hash", "blob_id", "sha"):
        if info.get(key):
            return str(info[key]).strip('"')
    lfs = info.get("lfs")
    if isinstance(lfs, dict) and lfs.get("sha256"):
        return str(lfs["sha256"])
    return None


def _mtime(info: dict) -> float | None:
    for key in ("mtime", "LastModified", "updated", "last_modified"):
        v = info.get(key)
        if v is None:
            continue
        if hasattr(v, "timestamp"):
            return float(v.timestamp())
        try:
            return float(v)
        except (TypeError, ValueError):
            continue
    return None


class Store:
    """A root (a prefix or one object) in an object store or a file system, read through fsspec.

    Keys are posix paths relative to the root. Every method raises the module's one-line errors."""

    def __init__(self, url: str | os.PathLike) -> None:
        self.url = str(url)
        self.fs, self.root = _filesystem(self.url)
        self._local = "file" in (
            self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        )

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    def url_of(self, key: str) -> str:
        return f"{self.url.rstrip('/')}/{key}" if key else self.url

    def _call(self, doing: str, url: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise storage_error(e, url, doing) from None

    def _info(self, key: str, raw: dict) -> ObjectInfo:
        return ObjectInfo(key, self.url_of(key), int(raw.get("size") or 0), _etag(raw), _mtime(raw))

    # ------------------------------------------------------------------------------------------ read
    def list(self) -> list[ObjectInfo]:
        """Every object below the root (the root itself when it names one object), sorted by key.
        DataNotFoundError when there is nothing there."""
        self.fs.invalidate_cache()
        found = self._call("list", self.url, self.fs.find, self.root, detail=True, withdirs=False)
        prefix = self.root.rstrip("/") + "/"
        out = [
            self._info(path[len(prefix) :], raw)
            for path, raw in found.items()
            if path.startswith(prefix) and raw.get("type", "file") == "file"
        ]
        if not out:
            try:
                raw = self.fs.info(self.root)
            except FileNotFoundError:
                raw = None
            except Exception as e:
                raise storage_error(e, self.url, "list") from None
            if raw is None or raw.get("type") != "file":
                raise DataNotFoundError(f"{self.url}: no objects there; check the URL (bucket and prefix)")
            out = [self._info("", raw)]
        return sorted(out, key=lambda o: o.key)

    def object_from_record(self, record: dict) -> ObjectInfo:
        """The `ObjectInfo` that `ObjectInfo.record` wrote, for this store's root."""
        key = str(record["key"])
        return ObjectInfo(key, self.url_of(key), int(record["size"]), record.get("etag"), record.get("mtime"))

    def stat(self, key: str) -> ObjectInfo:
        """The object `key` as the store has it now (no cached listing)."""
        self.fs.invalidate_cache()
        return self._info(key, self._call("read", self.url_of(key), self.fs.info, self._path(key)))

    def exists(self, key: str) -> bool:
        self.fs.invalidate_cache()
        return bool(self._call("read", self.url_of(key), self.fs.exists, self._path(key)))

    def _check_unchanged(self, listed: ObjectInfo, now: ObjectInfo) -> None:
        if now.size != listed.size or (listed.etag is not None and now.etag != listed.etag):
            raise ObjectChangedError(
                f"{listed.url} changed after it was listed (size {listed.size} -> {now.size}"
                f"{', etag differs' if now.etag != listed.etag else ''}); the corpus must not change "
                "during a run: re-run once it is stable (a resumed run refuses a changed corpus)"
            )
        if listed.etag is None and listed.mtime is not None and now.mtime != listed.mtime:
            raise ObjectChangedError(
                f"{listed.url} changed after it was listed (modified again); re-run once it is stable"
            )

    def open(self, obj: ObjectInfo) -> BinaryIO:
        """A binary file for `obj`, checked against its listing (size, etag / mtime)."""
        try:
            f = self.fs.open(self._path(obj.key), "rb")
        except Exception as e:
            raise storage_error(e, obj.url, "read") from None
        details = getattr(f, "details", None)
        try:
            self._check_unchanged(obj, self._info(obj.key, details) if details else self.stat(obj.key))
        except BaseException:
            f.close()
            raise
        return io.BufferedReader(_CheckedRaw(f, obj.url), buffer_size=_READ_BUFFER_BYTES)

    def read(
        self, obj: ObjectInfo, start: int = 0, end: int | None = None, *, limit: int | None = None
    ) -> bytes:
        """Bytes [start, end) of `obj` (to its end by default), checked against its listing. `limit`:
        the most bytes a caller accepts for the whole object (a DataError beyond it, before reading)."""
        if limit is not None and obj.size > limit:
            raise DataError(
                f"{obj.url} is {obj.size:,} bytes, more than the {limit:,} one read may take; split it"
            )
        stop = obj.size if end is None else min(end, obj.size)
        with self.open(obj) as f:
            f.seek(start)
            data = f.read(max(0, stop - start))
        if len(data) != max(0, stop - start):
            raise ObjectChangedError(f"{obj.url} is shorter than its listed {obj.size} bytes; re-run")
        return data

    def get_file(self, obj: ObjectInfo, dest: Path, *, sha256: str | None = None) -> None:
        """Download `obj` to the local file `dest` atomically (temp file beside it, then rename), its
        bytes hashed on the way and held to `sha256` when given (a DataError naming the object on a
        mismatch: nothing is left at `dest`)."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.part{os.getpid()}")
        h = hashlib.sha256()
        n = 0
        try:
            with self.open(obj) as f, open(tmp, "wb") as out:
                while chunk := f.read(HASH_CHUNK_BYTES):
                    h.update(chunk)
                    out.write(chunk)
                    n += len(chunk)
                out.flush()
                os.fsync(out.fileno())
            if n != obj.size:
                raise ObjectChangedError(f"{obj.url}: read {n} bytes, its listing says {obj.size}; re-run")
            if sha256 is not None and h.hexdigest() != sha256:
                raise DataError(
                    f"{obj.url}: its sha256 is {h.hexdigest()[:16]}..., the manifest records "
                    f"{sha256[:16]}...; the object is corrupt or was replaced: upload the dataset again "
                    "(or re-run `mamba3lite prepare`)"
                )
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)

    # ----------------------------------------------------------------------------------------- write
    def put(self, key: str, data: bytes) -> None:
        """Write object `key` atomically: on a file system a temp file and a rename, on an object store one
        PUT (an object is whole or absent: S3, GCS and the Hub never show half of one)."""
        if self._local:
            atomic_write_bytes(Path(self._path(key)), data)
            return
        self._call("write", self.url_of(key), self.fs.pipe_file, self._path(key), data)

    def put_file(self, key: str, src: Path) -> None:
        """Upload the local file `src` as object `key`, atomically as `put` is (a multipart upload appears
        at its completion, whole); on a file system a copy to a temp file, then a rename."""
        if self._local:
            dest = Path(self._path(key))
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(f".{dest.name}.part{os.getpid()}")
            try:
                self._call("write", self.url_of(key), self.fs.put_file, str(src), str(tmp))
                os.replace(tmp, dest)
            finally:
                tmp.unlink(missing_ok=True)
            return
        self._call("write", self.url_of(key), self.fs.put_file, str(src), self._path(key))

    def create(self, key: str, data: bytes) -> bool:
        """Write object `key` only if it does not exist: True when written, False when something was
        there already. One conditional request, so of two writers exactly one wins: on S3 a PUT with
        `If-None-Match: *` (s3fs's `mode="create"`; AWS S3 and moto honour it, some S3-compatible
        servers do not), on a file system `O_CREAT | O_EXCL`. A store without a conditional write is a
        ConfigError naming the URL."""
        if self._local:
            path = Path(self._path(key))
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            return True
        if url_scheme(self.url) not in _CONDITIONAL_PUT:
            # fsspec's other implementations accept mode="create" but may ignore it: a lock that two
            # writers could both take is worse than none.
            raise ConfigError(
                f"{self.url_of(key)}: mamba3lite knows no conditional write (create-if-absent) for "
                f"{url_scheme(self.url)}:// that it could test, and the lock of a run needs one; write to "
                "s3:// or to a local --out (then upload it with mamba3lite.data.store.upload_dataset)"
            )
        try:
            self.fs.pipe_file(self._path(key), data, mode="create")
        except FileExistsError:
            return False
        except Exception as e:
            raise storage_error(e, self.url_of(key), "write") from None
        return True

    def delete(self, key: str) -> None:
        """Remove object `key` (nothing when it is absent)."""
        if self.exists(key):
            self._call("delete", self.url_of(key), self.fs.rm_file, self._path(key))


class _CheckedRaw(io.RawIOBase):
    """An fsspec file as a raw stream whose read errors are the module's one-line errors (an etag that
    no longer matches mid-read is ObjectChangedError); `Store.open` buffers it (readline(n), iteration,
    seek: what the line reader, gzip and pyarrow ask of a file)."""

    def __init__(self, f: Any, url: str) -> None:
        super().__init__()
        self._f, self.url = f, url

    def readinto(self, b: Any) -> int:
        try:
            data = self._f.read(len(b))
        except Exception as e:
            raise storage_error(e, self.url, "read") from None
        b[: len(data)] = data
        return len(data)

    def seek(self, pos: int, whence: int = 0) -> int:
        return self._f.seek(pos, whence)

    def tell(self) -> int:
        return self._f.tell()

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self._f.close()
        super().close()


def upload_dataset(local_dir: str | Path, dest_url: str, *, journal: Path | None = None) -> list[str]:
    """Upload the prepared dataset in `local_dir` to `dest_url`, the object-store form of the shards
    module's rule "manifest last": an existing manifest at the destination is removed first, then every
    other file (shards, tokenizer.json) is uploaded and checked by size, and manifest.json last. A reader
    that finds a manifest finds every shard it names; a prefix without one is an unfinished upload.
    Staging leftovers (names that start with a dot: OUT/.prepare, lock files) are not uploaded. Returns
    the keys uploaded, in order (the manifest last).

    `journal`: a local JSON file recording, after each object, the size and etag the store gave it. A
    re-run with the same journal skips an object the store still has with that size and etag (the etag
    changes with every write, so the object is the one this upload wrote, byte for byte) and uploads
    everything else again; the journal belongs to one local dataset (delete it with the dataset)."""
    root = Path(local_dir)
    if not (root / MANIFEST_NAME).is_file():
        raise DataNotFoundError(
            f"{root} holds no {MANIFEST_NAME}: not a finished dataset; run `mamba3lite prepare` to "
            "the end first"
        )
    store = Store(dest_url)
    files = sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)
    )
    done = _read_journal(journal)
    store.delete(MANIFEST_NAME)  # from here on the destination is an unfinished write
    keys = [k for k in files if k != MANIFEST_NAME]
    uploaded = []
    for key in keys:
        size = (root / key).stat().st_size
        if done.get(key, [None])[0] == size and done[key][1] and done[key][1] == _etag_now(store, key):
            continue  # this upload's own object, unchanged since (see the docstring)
        store.put_file(key, root / key)
        now = store.stat(key)
        if now.size != size:
            raise DataError(f"{store.url_of(key)}: uploaded {now.size} bytes of {size}; re-run")
        uploaded.append(key)
        if journal is not None:
            done[key] = [size, now.etag]
            atomic_write_bytes(journal, json.dumps(done, sort_keys=True).encode())
    store.put(MANIFEST_NAME, (root / MANIFEST_NAME).read_bytes())
    return [*uploaded, MANIFEST_NAME]


def _read_journal(journal: Path | None) -> dict:
    if journal is None or not journal.is_file():
        return {}
    try:
        done = json.loads(journal.read_bytes())
    except (OSError, ValueError):
        return {}  # unreadable: upload everything again
    return done if isinstance(done, dict) else {}


def _etag_now(store: Store, key: str) -> str | None:
    """The etag of object `key` now, None when it is absent (or the store keeps no etag)."""
    try:
        return store.stat(key).etag
    except DataNotFoundError:
        return None
