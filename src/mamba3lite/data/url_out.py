"""`prepare --out URL`: the dataset is built in a local staging directory, then uploaded, manifest last.

    publish("s3://bucket/ds/", stage_dir, expected_record, overwrite, build)

Why stage on local disk: `prepare` memory-maps its units' token files, renames shards into place and
resumes from snapshots, none of which an object store offers; and a dataset staged whole before the
first upload keeps the bucket's rule simple: a prefix without `manifest.json` is an unfinished write,
one with it is complete. The staging directory is `--stage-dir`, by default
`~/.cache/mamba3lite/prepare/<sha256 of the URL>[:24]`: keyed by the URL, so that the same command finds
it again to resume without being told where, and under the user's cache because it is disposable (it is
removed once the upload is complete). It needs room for the whole dataset; with `--ray` it must be a
path every node sees.

The run, under the URL's lock object (`object_lock`):
1. **Check the URL** as a local `--out` is checked: a prefix holding a dataset prepared with other
   arguments is refused unless `--overwrite`; a prefix holding objects that are not a dataset's (no
   manifest, and keys other than shards and tokenizer.json) is refused, --overwrite or not.
2. **Build** the dataset in the staging directory (the local `prepare`, resumable as always), then write
   `STAGE/.upload-to` (the URL): from here on the staged dataset is final and only the upload remains.
3. **Upload** (`store.upload_dataset`): the destination's manifest is deleted first, the shards and
   tokenizer.json are uploaded, each checked by size and recorded in `STAGE/.upload.json` with the etag
   the store gave it, and `manifest.json` last. Then the objects of a replaced dataset that the new
   manifest does not name are deleted (readers of the new manifest never look for them), and the
   staging directory is removed.

**Resume.** The same command after an interruption: during the build, the local prepare resumes from
its snapshot (a URL source's recorded listing is read, not listed again); during the upload (`.upload-to`
names this URL and the staged manifest has the expected arguments), nothing is computed again and the
upload goes on: an object already at the URL with the size and etag recorded after its upload is skipped
(the etag changes with every write, so it is the same object), anything else is uploaded again. Skipping
by our own record rather than by comparing a hash is what any store allows: S3's etag is an MD5 only for
single-part uploads, and reading an object back to hash it costs as much as uploading it.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mamba3lite.atomicfile import atomic_write_bytes
from mamba3lite.data.object_lock import LOCK_KEY, ObjectLock
from mamba3lite.data.shards import MANIFEST_NAME, Manifest
from mamba3lite.data.store import Store, upload_dataset
from mamba3lite.data_identity import TOKENIZER_NAME
from mamba3lite.errors import ConfigError, DataError, DataNotFoundError

DEFAULT_STAGE_ROOT = Path("~/.cache/mamba3lite/prepare")
MARKER_NAME = ".upload-to"  # in the staging directory: the dataset there is final, being uploaded to URL
JOURNAL_NAME = ".upload.json"  # in the staging directory: what the upload wrote (store.upload_dataset)
# What a prefix of ours may hold: a dataset's objects and our lock (an unfinished upload has no manifest).
_OURS = re.compile(r"^(?:manifest\.json|tokenizer\.json|(?:train|val)/shard_\d+\.bin)$")


def default_stage_dir(url: str) -> Path:
    """The staging directory of `prepare --out URL` when --stage-dir is not given."""
    return DEFAULT_STAGE_ROOT.expanduser() / hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:24]


def _same_arguments(previous: Any, expected: dict) -> bool:
    """Whether a manifest's `extra["prepare"]` matches `expected`; a `vocab_hash` of None in `expected`
    (a tokenizer not fit yet, --train-tokenizer) matches any."""
    if not isinstance(previous, dict):
        return False
    if expected.get("vocab_hash") is None:
        previous = {**previous, "vocab_hash": None}
    return previous == expected


def _previous_arguments(store: Store) -> tuple[bool, Any]:
    """(whether the prefix holds a manifest, its `extra["prepare"]` or None); DataError for a prefix
    that holds objects of another kind (the user's files: never written into, --overwrite or not)."""
    try:
        keys = [o.key for o in store.list()]
    except DataNotFoundError:
        return False, None
    foreign = [k for k in keys if k != LOCK_KEY and not _OURS.match(k)]
    if foreign and MANIFEST_NAME not in keys:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        raise ConfigError(
            f"--out {store.url} holds objects that are not a mamba3lite dataset ({store.url_of(foreign[0])}"
            f"{more}); choose another --out (an empty prefix, or one holding a dataset)"
        )
    if MANIFEST_NAME not in keys:
        return False, None  # empty, or an unfinished upload of ours: written over
    try:
        raw = store.read(store.stat(MANIFEST_NAME), limit=64 << 20)
        return True, json.loads(raw).get("extra", {}).get("prepare")
    except (DataError, ValueError, AttributeError):
        return True, None


def _refuse(url: str, previous: Any) -> ConfigError:
    what = "a dataset prepared with different arguments" if previous else "a different dataset"
    return ConfigError(
        f"--out {url} holds {what}; choose another --out, or pass --overwrite to replace it (its manifest "
        "is removed when the upload starts, and the new one written when it ends)"
    )


def _staged_for(stage: Path, url: str, expected: dict) -> Manifest | None:
    """The finished dataset an interrupted upload to `url` left in `stage`, if it has `expected`'s
    arguments; else None (build it)."""
    try:
        if (stage / MARKER_NAME).read_text() != url:
            return None
        manifest = Manifest.load(stage, check_tokenizer=False)
    except (OSError, DataError):
        return None
    return manifest if _same_arguments(manifest.extra.get("prepare"), expected) else None


def publish(
    url: str,
    stage_dir: str | Path | None,
    expected: dict,
    overwrite: bool,
    build: Callable[[Path], Any],
) -> tuple[Any, Manifest]:
    """Build the dataset in the staging directory with `build(stage)` (a local prepare, unless an
    interrupted upload left it finished there) and upload it to `url`, manifest last. `expected`: the
    arguments record the dataset will have (`PrepareOptions.args_record`). Returns (what `build`
    returned, or None when the build was skipped; the uploaded manifest)."""
    store = Store(url)
    lock = ObjectLock(store, "another `mamba3lite prepare`", "wait for it to finish, or choose another --out")
    with lock:
        had_manifest, previous = _previous_arguments(store)
        if had_manifest and not overwrite and not _same_arguments(previous, expected):
            raise _refuse(url, previous)
        stage = Path(stage_dir).expanduser() if stage_dir is not None else default_stage_dir(url)
        if stage.exists() and not stage.is_dir():
            raise ConfigError(f"--stage-dir {stage} exists and is not a directory; choose another")
        built = None
        if (manifest := _staged_for(stage, url, expected)) is not None:
            print(f"note: the dataset for {url} is complete in {stage}; resuming its upload", file=sys.stderr)
        else:
            (stage / MARKER_NAME).unlink(missing_ok=True)
            (stage / JOURNAL_NAME).unlink(missing_ok=True)
            built = build(stage)
            manifest = Manifest.load(stage, check_tokenizer=False)
            atomic_write_bytes(stage / MARKER_NAME, url.encode())
        staged = manifest.extra.get("prepare")
        if had_manifest and not overwrite and previous != staged:  # a tokenizer fit to other text
            raise _refuse(url, previous)
        n_files = len(manifest.shards) + 1 + (stage / TOKENIZER_NAME).is_file()
        uploaded = upload_dataset(stage, url, journal=stage / JOURNAL_NAME)
        skipped = (
            f", {n_files - len(uploaded)} already there from the interrupted upload"
            if n_files > len(uploaded)
            else ""
        )
        print(f"uploaded {len(uploaded)} object(s) to {url}, manifest.json last{skipped}", file=sys.stderr)
        _remove_replaced(store, {MANIFEST_NAME, *(info.path for info in manifest.shards)}, stage)
        shutil.rmtree(stage, ignore_errors=True)
    return built, manifest


def _remove_replaced(store: Store, keep: set[str], stage: Path) -> None:
    """Delete the objects of a dataset this upload replaced (--overwrite with fewer shards, a
    tokenizer.json no longer used): after the new manifest, which names none of them, so no reader of
    it misses one."""
    if (stage / TOKENIZER_NAME).is_file():
        keep.add(TOKENIZER_NAME)
    for obj in store.list():
        if _OURS.match(obj.key) and obj.key not in keep:
            store.delete(obj.key)
