"""The plan of a `prepare` run: every source's files listed once, sorted, with sizes and modification
times, cut into work units, with the arguments and one hash of the two.

A *work unit* is a run of consecutive files of one source (about `UNIT_BYTES` of them, more on a corpus
past ~8 GiB (`default_unit_bytes`), or `--unit-mb`; a larger .jsonl file is cut into byte ranges, a
larger .parquet file into runs of row groups). It is what one task
computes (`units.run_unit`): a pure function of (plan, unit), read by the worker from the unit's own
paths, so the driver ships no corpus bytes. Units are consumed in plan order, so the output never
depends on how many workers computed them, or where.

An `hf:` source is a stream that cannot be read from a position: its units are not listed (its list is
empty) but cut while it is read, by the driver, every `STREAM_UNIT_ROWS` rows (`stream_units`), and
shipped to the workers with their rows; a resume reads the stream again up to its cursor.

The plan is written once into the staging directory (`plan.json`); a re-run of the same sources reads the
listing from there instead of walking the sources again (listing millions of files or objects is slow),
and only stats the listed files: one whose size or modification time changed makes the run start afresh.
A file added to a source directory after the first run is therefore not seen by its resume; delete
OUT/.prepare to list again. The plan hash covers the arguments (tokenizer and its vocabulary hash
included) and the listing: a unit's completion record carries it, and a record of another plan is never
reused.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from mamba3lite import intake
from mamba3lite.atomicfile import atomic_write_json
from mamba3lite.data.sources import Source
from mamba3lite.data.store import ObjectInfo, Store, is_url
from mamba3lite.errors import Mamba3LiteError

PLAN_NAME = "plan.json"
# Small files are grouped into units of about this many bytes: one task per stdlib file (~18 KB) would
# cost more in scheduling and records than in tokenizing; 1 MiB is ~0.5 s of one core's tokenizing.
UNIT_BYTES = 1 << 20
# A large corpus gets larger units, so that it is cut into about TARGET_UNITS of them (at most
# MAX_UNIT_BYTES each): the driver's work, and the executor's, is mostly a fixed share per task (reading
# its record and index; a Ray task costs its driver a few hundred microseconds), and a large corpus is the
# one a large cluster prepares, whose workers one driver must keep busy. 8,192 units still give each of
# 256 workers 32. The output does not depend on the units.
TARGET_UNITS = 8192
MAX_UNIT_BYTES = 64 << 20
PLAN_VERSION = 1
# An hf: stream is cut into units of this many rows (~0.5 MB of typical web text).
STREAM_UNIT_ROWS = 1024

# (path, size in bytes, modification time in ns); an object of a URL source: (URL, size, "etag:E" or
# "mtime:T"), what every read of it is checked against (data/store.py)
FileEntry = tuple[str, int, int | str]


@dataclass(frozen=True)
class WorkUnit:
    """One task's input: consecutive files of source `source` (its `index`-th unit), or its hf stream."""

    source: int  # index of the source in the plan
    index: int  # position of the unit in its source (units are consumed in this order)
    spec: str  # the source's spec (hf:NAME units read the stream of that name)
    files: tuple[FileEntry, ...]  # in source order; () for an hf: stream's unit
    part: tuple[int, int] | None = None  # of its one large file: bytes (.jsonl) or row groups (.parquet);
    # of an hf: stream: its rows [begin, end)

    @property
    def key(self) -> str:
        """The unit's name in the staging directory and in messages."""
        return f"{self.source:03d}-{self.index:06d}"

    @property
    def n_bytes(self) -> int:
        """Bytes of its files (of its part for a .jsonl part; row groups share their file's size)."""
        if self.part is not None:
            if not self.files or self.files[0][0].lower().endswith(".parquet"):  # a stream's; row groups
                return 0
            return self.part[1] - self.part[0]
        return sum(size for _, size, _ in self.files)

    def describe(self) -> str:
        """The unit for a message: its source and first file (and how many more)."""
        if not self.files:
            rows = "" if self.part is None else f" rows {self.part[0] + 1}-{self.part[1]}"
            return f"unit {self.key} ({self.spec}{rows})"
        more = f" and {len(self.files) - 1} more file(s)" if len(self.files) > 1 else ""
        part = "" if self.part is None else f" part {self.part[0]}:{self.part[1]}"
        return f"unit {self.key} ({self.files[0][0]}{part}{more})"


def _stat(path: Path) -> FileEntry:
    st = path.stat()
    return str(path), st.st_size, st.st_mtime_ns


def _object_entry(o: ObjectInfo) -> FileEntry:
    return o.url, o.size, f"etag:{o.etag}" if o.etag is not None else f"mtime:{o.mtime}"


def is_object(entry: FileEntry) -> bool:
    """Whether a plan's entry is an object of a URL source (not a file this machine stats)."""
    return isinstance(entry[2], str)


def listed_source(spec: str, entries: list[FileEntry], text_field: str, max_docs: int | None) -> Source:
    """The source `spec` with a plan's `entries` (each file or object once), nothing listed again."""
    if not is_url(spec):
        return Source.from_listing(
            spec, [Path(e[0]) for e in entries], text_field=text_field, max_docs=max_docs
        )
    store = Store(spec)
    root = store.url_of("")
    objects = []
    for url, size, tag in entries:
        what, _, value = str(tag).partition(":")
        key = "" if url == root else url[len(root.rstrip("/")) + 1 :]
        objects.append(ObjectInfo(key, url, size, value if what == "etag" else None,
                                  float(value) if what == "mtime" and value != "None" else None))  # fmt: skip
    return Source.from_listing(spec, [], text_field=text_field, max_docs=max_docs, objects=objects)


def default_unit_bytes(total_bytes: int) -> int:
    """The unit size for a corpus of `total_bytes` (see TARGET_UNITS): UNIT_BYTES up to ~8 GiB."""
    return min(MAX_UNIT_BYTES, max(UNIT_BYTES, total_bytes // TARGET_UNITS))


def list_units(sources: list[Source], unit_bytes: int | None = None) -> list[list[WorkUnit]]:
    """Each source's work units, in order: consecutive files grouped until they reach `unit_bytes`
    (default: `default_unit_bytes` of the whole listing)."""
    listings = [
        []
        if src.hf is not None
        else [(_object_entry(o), None) for o in src.objects] or [(_stat(p), p) for p in src.files]
        for src in sources
    ]
    if unit_bytes is None:
        unit_bytes = default_unit_bytes(sum(entry[1] for listed in listings for entry, _ in listed))
    out = []
    for i, (src, listed) in enumerate(zip(sources, listings)):
        if src.hf is not None:
            out.append([])  # a stream: cut while read (`stream_units`)
            continue
        units: list[WorkUnit] = []
        group: list[FileEntry] = []
        size = 0
        for entry, p in listed:
            parts = [] if p is None else _parts(src, p, entry[1], unit_bytes)
            if parts:  # a large file that can be cut: its parts are units of their own
                if group:
                    units.append(WorkUnit(i, len(units), src.spec, tuple(group)))
                    group, size = [], 0
                first = len(units)
                units += [WorkUnit(i, first + k, src.spec, (entry,), part) for k, part in enumerate(parts)]
                continue
            group.append(entry)
            size += entry[1]
            if size >= unit_bytes:
                units.append(WorkUnit(i, len(units), src.spec, tuple(group)))
                group, size = [], 0
        if group:
            units.append(WorkUnit(i, len(units), src.spec, tuple(group)))
        out.append(units)
    return out


def stream_units(src: Source, i: int, start: int) -> Iterator[tuple[WorkUnit, list]]:
    """(unit, its rows) of source i, an hf: stream, from its `start`-th unit on: every STREAM_UNIT_ROWS
    rows (`Source.units`: (location, kind, text)) in order. A read error ends it after a unit of the
    rows read before it, raised where the consumer reaches it."""
    rows = src.units(start * STREAM_UNIT_ROWS)
    k, batch = start, []

    def unit() -> tuple[WorkUnit, list]:
        begin = k * STREAM_UNIT_ROWS
        return WorkUnit(i, k, src.spec, (), (begin, begin + len(batch))), batch

    try:
        for row in rows:
            batch.append(row)
            if len(batch) == STREAM_UNIT_ROWS:
                yield unit()
                k, batch = k + 1, []
    except Exception:
        if batch:
            yield unit()
        raise
    if batch:
        yield unit()


def _parts(src: Source, path: Path, size: int, unit_bytes: int) -> list[tuple[int, int]]:
    """How a file larger than a unit is cut: a .jsonl file into byte ranges of `unit_bytes` (a line
    belongs to the range it starts in), a .parquet file into runs of row groups of about `unit_bytes`
    (its footer read); [] for a file that stays whole (small, compressed, or one row group)."""
    if size <= unit_bytes:
        return []
    name = path.name.lower()
    if name.endswith(".jsonl"):
        return [(b, min(b + unit_bytes, size)) for b in range(0, size, unit_bytes)]
    if not name.endswith(".parquet"):
        return []
    groups = src.parquet_row_group_bytes(path)
    parts, begin, acc = [], 0, 0
    for g, n_bytes in enumerate(groups):
        acc += n_bytes
        if acc >= unit_bytes:
            parts.append((begin, g + 1))
            begin, acc = g + 1, 0
    if begin < len(groups):
        parts.append((begin, len(groups)))
    return parts if len(parts) > 1 else []


@dataclass
class Plan:
    """What a run computes: the listing cut into units, and the arguments (`PrepareOptions.args_record`)."""

    specs: list[str]
    units: list[list[WorkUnit]]  # per source
    args: dict

    @property
    def hash(self) -> str:
        """sha256 of the arguments and the listing (paths, sizes, modification times, unit cuts)."""
        return _sha256_json(self._record(with_hash=False))

    @property
    def listing_hash(self) -> str:
        """sha256 of the listing alone: what a resume compares to say "the source files changed"."""
        return _sha256_json(self._record(with_hash=False)["sources"])

    def n_units(self) -> int:
        return sum(map(len, self.units))

    def sources(self, text_field: str, max_docs: int | None) -> list[Source]:
        """The sources with the plan's files (nothing listed again)."""
        return [
            listed_source(spec, list(dict.fromkeys(f for u in units for f in u.files)), text_field, max_docs)
            for spec, units in zip(self.specs, self.units)  # a cut file once
        ]

    def size_bytes(self, max_docs: int | None, sources: list[Source]) -> list[int | None]:
        """Each source's size for the mixer, from the listing (`Source.size_bytes` reads JSONL prefixes
        when max_docs is given, so that case is asked of the source)."""
        if max_docs is not None:
            return [src.size_bytes() for src in sources]
        return [
            None if src.hf is not None else sum({f[0]: f[1] for u in units for f in u.files}.values())
            for src, units in zip(sources, self.units)
        ]

    def changed(self) -> str | None:
        """Which listed file changed since the plan was made (size or modification time), else None."""
        for units in self.units:
            for unit in units:
                for path, size, mtime in unit.files:
                    if is_object((path, size, mtime)):
                        continue  # each read of an object is checked against its listing (store.py)
                    try:
                        now = _stat(Path(path))
                    except OSError:
                        return f"{path} is gone"
                    if now[1:] != (size, mtime):
                        return f"{path} changed"
        return None

    def _record(self, with_hash: bool = True) -> dict:
        record = {
            "plan_version": PLAN_VERSION,
            "args": self.args,
            "sources": [
                {"spec": spec, "units": [[[list(f) for f in u.files], u.part] for u in units]}
                for spec, units in zip(self.specs, self.units)
            ],
        }
        return {**record, "hash": self.hash} if with_hash else record

    def save(self, stage_dir: Path) -> None:
        stage_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(stage_dir / PLAN_NAME, self._record())


def _sha256_json(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _entry(path: str, size: int, tag: int | str) -> FileEntry:
    return str(path), int(size), tag if isinstance(tag, str) else int(tag)


def read_listing(stage_dir: Path, specs: list[str]) -> list[list[WorkUnit]] | None:
    """The units of the plan an earlier run of these sources wrote into `stage_dir`, or None (no plan,
    other sources, unreadable: the caller lists the sources)."""
    path = stage_dir / PLAN_NAME
    if not path.is_file():
        return None
    try:
        record = intake.read_json(path, intake.STAGE_STATE)
        if record.get("plan_version") != PLAN_VERSION or [s["spec"] for s in record["sources"]] != specs:
            return None
        return [
            [WorkUnit(i, k, s["spec"], tuple(_entry(*f) for f in files),
                      None if part is None else (int(part[0]), int(part[1])))
             for k, (files, part) in enumerate(s["units"])]
            for i, s in enumerate(record["sources"])
        ]  # fmt: skip
    except (Mamba3LiteError, OSError, KeyError, TypeError, ValueError):
        return None
