"""One work unit of `prepare`, computed by a worker on its own: `run_unit(job, unit)`.

A pure function of (plan, unit): the worker reads the unit's files from their paths (checking each
against the size and modification time the plan recorded), decodes, cleans, hashes, splits and
tokenizes every document (`clean.process_batch`), and writes into the staging directory

    units/KEY.tok    the kept documents' tokens, EOS after each, raw little-endian in the dataset's dtype
    units/KEY.idx    one INDEX_DTYPE row per document read, in order: outcome, split, counts, digest
    units/KEY.json   the completion record, last: the plan hash, counts, both files' sha256, the bad
                     JSONL lines (position, location, problem), who computed it and in how long

The driver reads only the index (42 bytes a document) and the record; the shard-writing tasks
(`packing.write_shard_job`) read the token files. A unit whose record exists, names this plan and whose two
files verify is never computed again (`stored_record`): a resumed run, or a task Ray re-runs after a
node was lost, returns it as it is.

A read error in the middle of a unit (a damaged Parquet page, a truncated archive) ends it: the
documents before it are written, and the record, returned but not saved (a re-run would meet the same
error), carries the error, which the driver raises when it reaches that position (a run that reaches its
target first does not fail).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mamba3lite import intake
from mamba3lite.atomicfile import sha256_file
from mamba3lite.data import clean
from mamba3lite.data.clean import BAD_LINE, KEPT, WorkerConfig
from mamba3lite.data.plan import WorkUnit, is_object, listed_source
from mamba3lite.data.sources import format_location
from mamba3lite.errors import DataError, Mamba3LiteError, TransientError

UNITS_DIRNAME = "units"
_SPLIT_CODES = {"train": 0, "val": 1}
SPLIT_NAMES = ("train", "val")
INDEX_DTYPE = np.dtype(
    [
        ("status", "u1"),  # clean.KEPT, EMPTY, ...
        ("split", "u1"),  # 0 train, 1 val
        ("n_replaced", "<u4"),
        ("n_special", "<u4"),
        ("n_tokens", "<u8"),  # EOS included; 0 unless kept
        ("n_bytes", "<u8"),  # of the cleaned text, UTF-8
        ("digest", "u1", (clean.DIGEST_BYTES,)),
    ]
)
# Units are read and tokenized in batches of at most this many documents or bytes (as the pool's were).
_BATCH_UNITS = 512
_BATCH_BYTES = 256 * 1024
# Test hook, read by the driver into UnitJob.test_sleep_s: a fault test can then lose a node while
# its units are running.
UNIT_SLEEP_ENV = "MAMBA3LITE_PREPARE_TEST_UNIT_SLEEP_S"


@dataclass(frozen=True)
class UnitJob:
    """What every task of a run shares: the worker settings, the staging directory, the plan's hash."""

    cfg: WorkerConfig  # tokenizer and the settings that change a document's outcome
    stage_dir: str  # OUT/.prepare, on storage every worker sees
    plan_hash: str  # `Plan.hash`; a record of another plan is never reused
    max_docs: int | None  # no unit needs more documents than its source may give
    test_sleep_s: float = 0.0  # test hook (UNIT_SLEEP_ENV): seconds each computed unit sleeps first


@dataclass
class UnitRecord:
    """A computed unit (the completion record, `units/KEY.json`)."""

    key: str
    plan_hash: str
    n_docs: int  # documents read (index rows)
    n_tokens: int  # tokens in the token file
    n_bytes_read: int  # raw bytes of the unit's files
    tok_sha256: str
    idx_sha256: str
    problems: list = field(default_factory=list)  # [doc position, location, problem] of bad JSONL lines
    error: str | None = None  # a read error after the n_docs documents (never in a saved record)
    transient: bool = False  # the error is a network's: the staged work is kept for a re-run
    node: str = ""  # where it was computed
    seconds: float = 0.0  # how long it took there
    reused: bool = False  # found complete and verified instead of computed


def units_dir(stage_dir: str | Path) -> Path:
    return Path(stage_dir) / UNITS_DIRNAME


def _paths(stage_dir: str | Path, key: str) -> tuple[Path, Path, Path]:
    d = units_dir(stage_dir)
    return d / f"{key}.tok", d / f"{key}.idx", d / f"{key}.json"


def stored_record(job: UnitJob, unit: WorkUnit) -> UnitRecord | None:
    """The unit's saved record if it names this plan and both its files verify, else None."""
    tok, idx, rec = _paths(job.stage_dir, unit.key)
    try:
        record = UnitRecord(**intake.read_json(rec, intake.STAGE_STATE))
    except (Mamba3LiteError, OSError, TypeError):
        return None
    if record.plan_hash != job.plan_hash or record.key != unit.key or record.error is not None:
        return None
    try:
        for path in (tok, idx):  # through the border first: a pipe put there would block the hash
            intake.regular_file_size(path, intake.STAGE_DATA)
        if sha256_file(tok) != record.tok_sha256 or sha256_file(idx) != record.idx_sha256:
            return None
    except (Mamba3LiteError, OSError):
        return None
    record.reused = True
    return record


class _StagedFile:
    """A unit's file written under a temporary name and renamed into place, hashed as it is written.
    Not fsync'ed (unlike the dataset's own files): a unit is only ever reused after its record and both
    files verify against each other, so a crash that loses or tears one costs a recomputation, never
    a wrong byte; skipping three fsyncs a unit keeps the staging cheap."""

    def __init__(self, path: Path) -> None:
        self.path = path
        fd, self._tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        self._f = os.fdopen(fd, "wb", buffering=1 << 20)
        self._sha = hashlib.sha256()

    def write(self, data: bytes | memoryview) -> None:
        self._f.write(data)
        self._sha.update(data)

    def commit(self) -> str:
        self._f.close()
        os.replace(self._tmp, self.path)
        return self._sha.hexdigest()

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self._f.close()
        with contextlib.suppress(OSError):
            os.unlink(self._tmp)


def write_staged(path: Path, data: bytes | memoryview) -> str:
    f = _StagedFile(path)
    try:
        f.write(data)
        return f.commit()
    except BaseException:
        f.abort()
        raise


def node_name() -> str:
    return socket.gethostname()


def run_unit(job: UnitJob, unit: WorkUnit, rows: list | None = None, node: str | None = None) -> UnitRecord:
    """Compute `unit` (see the module docstring), or return its stored record. Runs in a worker whose
    tokenizer `clean.init_worker(job.cfg)` built. `rows`: an hf: stream's unit comes with its rows
    (`plan.stream_units`); any other is read from its files."""
    if (stored := stored_record(job, unit)) is not None:
        return stored
    t0 = time.perf_counter()
    if job.test_sleep_s:
        time.sleep(job.test_sleep_s)
    tok_path, idx_path, rec_path = _paths(job.stage_dir, unit.key)
    tok_path.parent.mkdir(parents=True, exist_ok=True)
    index_rows: list[tuple] = []
    problems: list = []
    error, transient = None, False
    out = _StagedFile(tok_path)
    n_tokens = 0
    try:
        try:
            for locs, results in _batches(job, unit, rows):
                for loc, r in zip(locs, results):
                    if r.status == BAD_LINE:
                        problems.append([len(index_rows), format_location(loc), r.problem])
                    if r.status == KEPT:
                        out.write(memoryview(r.tokens).cast("B"))
                        n_tokens += int(r.tokens.size)
                    index_rows.append(_index_row(r))
        except TransientError as e:
            error, transient = str(e), True
        except Mamba3LiteError as e:
            error = f"{unit.describe()}: {e}"
        tok_sha = out.commit()
    except BaseException:
        out.abort()
        raise
    index = np.array(index_rows, dtype=INDEX_DTYPE)
    idx_sha = write_staged(idx_path, index.tobytes())
    record = UnitRecord(
        key=unit.key,
        plan_hash=job.plan_hash,
        n_docs=len(index_rows),
        n_tokens=n_tokens,
        n_bytes_read=unit.n_bytes,
        tok_sha256=tok_sha,
        idx_sha256=idx_sha,
        problems=problems,
        error=error,
        transient=transient,
        node=node or node_name(),
        seconds=time.perf_counter() - t0,
    )
    if error is None:
        write_staged(rec_path, json.dumps(asdict(record)).encode())  # last: the unit is complete
    return record


def _index_row(r) -> tuple:
    """A document's row of the unit's index (INDEX_DTYPE): a kept one's split, counts and digest; any
    other's status and replacement count."""
    if r.status == KEPT:
        digest = np.frombuffer(r.digest, dtype=np.uint8)
        return KEPT, _SPLIT_CODES[r.split], r.n_replaced, r.n_special, r.tokens.size, r.n_bytes, digest
    return r.status, 0, r.n_replaced, 0, 0, 0, np.zeros(clean.DIGEST_BYTES, np.uint8)


def _batches(job: UnitJob, unit: WorkUnit, rows: list | None):
    """(locations, results) of the unit's documents, a batch at a time, each file checked against the
    plan first (a file that changed between listing and reading is an error naming it)."""
    if rows is not None:
        for b in range(0, len(rows), _BATCH_UNITS):
            batch = rows[b : b + _BATCH_UNITS]
            yield [loc for loc, _, _ in batch], clean.process_batch([(kind, text) for _, kind, text in batch])
        return
    for path, size, mtime in unit.files:
        if is_object((path, size, mtime)):
            continue  # an object: each read is checked against its listing (data/store.py)
        try:
            st = os.stat(path)
        except OSError as e:
            raise intake.SOURCE_DOCUMENT.fail(
                f"cannot read {path} on {node_name()}: {e.strerror}; every worker must see the sources "
                "at the paths they were listed under (a file system every node mounts at the same path)"
            ) from e
        if (st.st_size, st.st_mtime_ns) != (size, mtime):
            raise intake.SOURCE_DOCUMENT.fail(
                f"{path} changed since this run listed it (size or modification time); "
                "re-run the same command to list the sources again"
            )
    src = listed_source(unit.spec, list(unit.files), job.cfg.text_field, job.max_docs)
    docs = src.units(0) if unit.part is None else src.part_units(Path(unit.files[0][0]), unit.part)
    locs, items, n_bytes = [], [], 0
    for loc, kind, payload in docs:
        locs.append(loc)
        items.append((kind, payload))
        n_bytes += len(payload) if payload is not None else 0
        if len(items) >= _BATCH_UNITS or n_bytes >= _BATCH_BYTES:
            yield locs, clean.process_batch(items)
            locs, items, n_bytes = [], [], 0
    if items:
        yield locs, clean.process_batch(items)


def load_index(stage_dir: str | Path, record: UnitRecord) -> np.ndarray:
    """The unit's index rows (INDEX_DTYPE), checked against the record's count. (Plain strings, not
    pathlib: the driver calls this once a unit, and pathlib's joins were most of its cost.)"""
    d = os.path.join(stage_dir, UNITS_DIRNAME)
    idx, tok = os.path.join(d, f"{record.key}.idx"), os.path.join(d, f"{record.key}.tok")
    if not (os.path.exists(idx) and (not record.n_tokens or os.path.exists(tok))):
        raise DataError(
            f"unit {record.key} was computed on {record.node}, but its files are not in {d} as "
            f"{node_name()} sees it; --out must be on storage every node mounts at the same path"
        )
    with intake.open_regular(idx, intake.STAGE_DATA) as f:
        index = np.frombuffer(f.read(), dtype=INDEX_DTYPE)
    assert index.size == record.n_docs, (record.key, index.size, record.n_docs)
    return index


def map_tokens(stage_dir: str | Path, key: str, dtype: np.dtype) -> np.ndarray:
    """Unit `key`'s token file, memory-mapped read-only (empty when the unit kept nothing)."""
    tok, _, _ = _paths(stage_dir, key)
    if not tok.exists() or tok.stat().st_size == 0:
        return np.empty(0, dtype=dtype)
    return np.memmap(tok, dtype=np.dtype(dtype).newbyteorder("<"), mode="r")


def tokens_verify(stage_dir: str | Path, key: str) -> bool:
    """Whether unit `key` has a saved record and its token file matches it (a resumed driver checks the
    units its unwritten shards name)."""
    tok, _, rec = _paths(stage_dir, key)
    try:
        record = UnitRecord(**intake.read_json(rec, intake.STAGE_STATE))
        if record.n_tokens == 0:
            return True
        intake.regular_file_size(tok, intake.STAGE_DATA)
        return sha256_file(tok) == record.tok_sha256
    except (Mamba3LiteError, OSError, TypeError):
        return False


@dataclass
class UnitView:
    """The driver's view of one computed unit: its index as columns (numpy arrays, one entry a document),
    each kept document's [start, end) in the unit's token file, and `pos`, the documents consumed."""

    record: UnitRecord
    status: np.ndarray
    split: np.ndarray
    n_replaced: np.ndarray
    n_special: np.ndarray
    n_tokens: np.ndarray  # int64
    n_bytes: np.ndarray  # int64
    digests: np.ndarray  # V16: .tolist() gives each digest as bytes
    starts: np.ndarray  # int64
    ends: np.ndarray  # int64
    pos: int

    @classmethod
    def open(cls, stage_dir: str | Path, record: UnitRecord, pos: int) -> UnitView:
        index = load_index(stage_dir, record)
        n_tokens = index["n_tokens"].astype(np.int64)
        ends = np.cumsum(n_tokens)
        digests = np.ascontiguousarray(index["digest"]).view(f"V{clean.DIGEST_BYTES}").reshape(-1)
        return cls(
            record, index["status"], index["split"], index["n_replaced"].astype(np.int64),
            index["n_special"].astype(np.int64), n_tokens, index["n_bytes"].astype(np.int64), digests,
            ends - n_tokens, ends, pos,
        )  # fmt: skip

    @property
    def size(self) -> int:
        return int(self.status.size)

    def location(self, k: int) -> Any:
        """Where document k was read, for an error message: a bad line's position, else the unit."""
        for pos, loc, _ in self.record.problems:
            if pos == k:
                return loc
        return self.record.key

    def problem(self, k: int) -> str:
        return next(problem for pos, _, problem in self.record.problems if pos == k)


class SourceDocs:
    """The driver's side of one source: its units' views in plan order, from `cursor` on (the driver
    reads each unit's index, never its text or tokens). `next_record` gives the source's next unit record
    (None: no more); `cursor` ([unit index, documents of it consumed], the snapshot's) is advanced in
    place by `advance`; at most `left` more documents (None: all)."""

    def __init__(
        self,
        stage_dir: Path,
        next_record: Callable[[], UnitRecord | None],
        cursor: list[int],
        left: int | None,
    ) -> None:
        self._stage_dir, self._next_record = stage_dir, next_record
        self._cursor, self.left = cursor, left
        self._view: UnitView | None = None

    def view(self) -> UnitView | None:
        """The unit with the next document (`pos`), or None when the source is exhausted. A unit whose
        read ended in an error raises it once its documents before the error are consumed."""
        if self.left is not None and self.left <= 0:
            return None
        while self._view is None or self._view.pos >= self._view.size:
            if self._view is not None:  # every document of the current unit was consumed
                record = self._view.record
                if record.error is not None:
                    raise (TransientError if record.transient else DataError)(record.error)
                self._cursor[:] = [self._cursor[0] + 1, 0]
            record = self._next_record()
            if record is None:
                self._view = None
                return None
            self._view = UnitView.open(self._stage_dir, record, self._cursor[1])
        return self._view

    def limit(self) -> int:
        """How many documents may be taken from the current view."""
        assert self._view is not None
        n = self._view.size - self._view.pos
        return n if self.left is None else min(n, self.left)

    def advance(self, n: int) -> None:
        """`n` documents of the current view were consumed."""
        assert self._view is not None
        self._view.pos += n
        self._cursor[1] += n
        if self.left is not None:
            self.left -= n
