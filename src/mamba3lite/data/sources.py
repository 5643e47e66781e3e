"""Text sources for `mamba3lite prepare`: where documents come from, in a fixed order.

A source spec is one of

    path/to/file        .txt .md .py (any other name is read as UTF-8 text too), .jsonl, .jsonl.gz, .parquet
                        (suffixes in any case: DATA.JSONL is JSON lines)
    path/to/dir         every regular file below it, hidden files/dirs and __pycache__ skipped, and so are
                        datasets `prepare` wrote below it (their shards and manifest are not text);
                        symlinked directories followed, each real directory once
    'glob/**/*.md'      a glob (recursive `**` allowed, walked as a directory is: each real directory
                        once); matching directories are walked as above
    stdlib              the running interpreter's standard-library .py files (see `stdlib_files`)
    hf:NAME[:CONFIG]    a Hugging Face dataset's "train" split, streamed (needs the `datasets` package)
    s3://bucket/prefix/ an object-store URL (s3://, gs://, hf://, file://; data/store.py): every object below
                        the prefix, read as the files of a directory are (by name; hidden names, __pycache__
                        and prepared datasets skipped), listed once, each read checked against its listing

A source is a deterministic sequence of *units*, one per document: a text file is one unit, a JSONL line
one unit (blank lines are not units), a Parquet row or a streamed dataset row one unit. Files are taken in
sorted relative-path order, so the same input gives the same sequence on every machine. Each unit is
`(location, kind, payload)`:

    KIND_TEXT_BYTES   payload = the file's raw bytes; the worker decodes it (UTF-8, or UTF-16/32 when the
                      file starts with their byte-order mark) and detects binary files
    KIND_JSONL        payload = one raw JSONL line (bytes); the worker parses it
    KIND_STR          payload = an already decoded str (Parquet, hf); None when the row has no text

Decoding and parsing happen in the tokenizer workers (`decode_bytes`, `looks_binary`, `parse_jsonl_line`
are pure functions for that), so the reading process only does I/O.
"""

from __future__ import annotations

import codecs
import contextlib
import fnmatch
import glob as globlib
import gzip
import hashlib
import itertools
import os
import re
import sysconfig
import zlib
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from mamba3lite import intake
from mamba3lite.data.shards import MANIFEST_NAME
from mamba3lite.data.store import ObjectInfo, Store, is_url
from mamba3lite.errors import ConfigError, DataError, DataNotFoundError, Mamba3LiteError, TransientError

KIND_TEXT_BYTES = 0
KIND_JSONL = 1
KIND_STR = 2

# stdlib parts left out of the `stdlib` corpus: third-party packages, the (huge, repetitive) test suite,
# IDLE, and `encodings/`, whose generated charmap tables ("0x00e9 -> LATIN SMALL LETTER E WITH ACUTE")
# are ~12% of the bytes and taught small models to write tables instead of code. What remains is
# ~550 files / ~10 MB of Python for CPython 3.11.
STDLIB_EXCLUDED_PARTS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "encodings", "__pycache__"}
)

_BINARY_PROBE_BYTES = 8192
_UTF8_BOM = b"\xef\xbb\xbf"
# UTF-32 first: its little-endian mark starts with UTF-16's.
_WIDE_BOMS = (
    (b"\xff\xfe\x00\x00", "utf-32-le"),
    (b"\x00\x00\xfe\xff", "utf-32-be"),
    (b"\xff\xfe", "utf-16-le"),
    (b"\xfe\xff", "utf-16-be"),
)
# Bytes that never occur in text: C0 controls except \t \n \v \f \r and ESC (ANSI colours), and DEL.
_NON_TEXT_BYTES = bytes([*range(0, 7), 8, *range(14, 27), *range(28, 32), 127])
_SURROGATE_RE = re.compile("[\ud800-\udfff]")
_IMPLAUSIBLE_RE = re.compile("[\x00-\x08\x0e-\x1f\ud800-\udfff\ue000-\uf8ff]")
_WIDE_PROBE_CHARS = 4096
# A URL source's small text objects are read ahead by a few threads (each read is one round trip to the
# store): at most this many objects and bytes in flight.
_READ_AHEAD_THREADS = 16
_READ_AHEAD_OBJECTS = 64
_READ_AHEAD_BYTES = 64 << 20

Location = str | tuple[str, int]
Unit = tuple[Location, int, "bytes | str | None"]


def format_location(loc: Location) -> str:
    """`path` or `path:line` (1-based line / row number), for messages."""
    return f"{loc[0]}:{loc[1]}" if isinstance(loc, tuple) else loc


# ---------------------------------------------------------------------------------------------------------
# Pure helpers run in the workers.


def looks_binary(data: bytes) -> bool:
    """True if `data` is evidently not text: a NUL byte, or > 10% non-text control bytes, in the first 8 KiB.

    (git's heuristic plus a control-byte ratio; UTF-8 multi-byte sequences are text.)"""
    head = data[:_BINARY_PROBE_BYTES]
    if not head:
        return False
    if b"\x00" in head:
        return True
    n_bad = len(head) - len(head.translate(None, _NON_TEXT_BYTES))
    return n_bad > 0.1 * len(head)


def decode_bytes(data: bytes) -> str:
    """UTF-8 decode that never fails: each undecodable byte becomes a lone surrogate (surrogateescape).
    A leading UTF-8 byte-order mark is dropped (it marks the encoding; it is not text).

    The cleaner turns every lone surrogate into U+FFFD and counts them, so undecodable file bytes and
    invalid `\\ud800` escapes in JSON are replaced and counted in one place."""
    if data.startswith(_UTF8_BOM):
        data = data[len(_UTF8_BOM) :]
    return data.decode("utf-8", errors="surrogateescape")


def decode_wide_text(data: bytes) -> str | None:
    """The text of a UTF-32 or UTF-16 file that starts with its byte-order mark (Windows tools write
    UTF-16, whose NUL bytes would otherwise make it look binary), else None. Undecodable code units
    become lone surrogates, as in `decode_bytes`."""
    for bom, codec in _WIDE_BOMS:
        if data.startswith(bom):
            return data[len(bom) :].decode(codec, errors=_LONE_SURROGATE_ERRORS)
    return None


def wide_text_looks_binary(text: str) -> bool:
    """True if text decoded from behind a UTF-16/32 mark (`decode_wide_text`) is evidently binary: more
    than 5% of its first 4096 characters are C0 controls (other than whitespace), lone surrogates or
    private-use code points. Random bytes decode to ~13% of those as UTF-16 (surrogates and the private
    use area) and to nearly all lone surrogates as UTF-32; text has next to none."""
    head = text[:_WIDE_PROBE_CHARS]
    return len(_IMPLAUSIBLE_RE.findall(head)) > 0.05 * len(head)


def _lone_surrogate(err: UnicodeError) -> tuple[str, int]:
    """Codec error handler: an undecodable span becomes one lone surrogate (counted, then replaced, by the
    cleaner). surrogateescape cannot do this for codecs that are not ASCII-compatible."""
    assert isinstance(err, UnicodeDecodeError)
    return "\udcff", err.end


_LONE_SURROGATE_ERRORS = "mamba3lite-lone-surrogate"
codecs.register_error(_LONE_SURROGATE_ERRORS, _lone_surrogate)


def parse_jsonl_line(line: bytes, text_field: str) -> tuple[str | None, str | None]:
    """(text, None) for a good line, (None, problem) for a malformed one (problem names the fix)."""
    # The border's JSON parser, by a document's rules: NaN and long integers are fine, a line Python
    # cannot parse (syntax, > 4,300 digits, nesting too deep) is malformed.
    obj, problem = intake.json_problem(decode_bytes(line), intake.SOURCE_JSONL)
    if problem is not None:
        return None, f"malformed JSON ({problem})"
    if not isinstance(obj, dict):
        return None, f"expected a JSON object, got {type(obj).__name__}"
    if text_field not in obj:
        fields = ", ".join(sorted(map(str, obj))[:8]) or "none"
        return None, (
            f"no field {text_field!r} (fields: {fields}); fix: --text-field NAME, "
            "or --skip-bad-lines to skip such lines"
        )
    text = obj[text_field]
    if text is None:
        return "", None
    if not isinstance(text, str):
        return None, (
            f"field {text_field!r} is a {type(text).__name__}, not a string; fix: --text-field NAME of a "
            "text field, or --skip-bad-lines to skip such lines"
        )
    return text, None


def replace_surrogates(text: str) -> tuple[str, int]:
    """Replace lone surrogates (undecodable bytes, bad JSON escapes) by U+FFFD; returns (text, n_replaced)."""
    return _SURROGATE_RE.subn("\ufffd", text)


# ---------------------------------------------------------------------------------------------------------
# Sources.


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    """The interpreter's standard-library .py files minus STDLIB_EXCLUDED_PARTS, by relative path."""
    root = stdlib_dir()
    if not root.is_dir():
        raise DataNotFoundError(
            f"the standard library directory {root} does not exist; use file sources instead of `stdlib`"
        )
    found = []  # (relative posix path, path)
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune while walking: site-packages alone can hold far more files than the stdlib itself.
        dirnames[:] = [d for d in dirnames if d not in STDLIB_EXCLUDED_PARTS]
        rel = Path(dirpath).relative_to(root).as_posix()
        for f in filenames:
            if f.endswith(".py"):
                found.append((f if rel == "." else f"{rel}/{f}", Path(dirpath) / f))
    return [p for _, p in sorted(found) if p.is_file()]


def is_prepared_dataset(directory: str | Path, filenames: list[str] | None = None) -> bool:
    """Whether `directory` holds a dataset `prepare` wrote: its manifest.json reads (through the border
    reader: a pipe of that name is never opened) as a JSON object of a manifest's fields
    (format_version, vocab_size, shards); another program's manifest.json (a browser extension's, say)
    is not one. `filenames`: its listing, if known."""
    names = os.listdir(directory) if filenames is None else filenames
    if MANIFEST_NAME not in names:
        return False
    try:
        manifest = intake.read_json(os.path.join(directory, MANIFEST_NAME), intake.MANIFEST)
    except Mamba3LiteError:  # not JSON, not an object, too large, not a regular file: not one of ours
        return False
    return {"format_version", "vocab_size", "shards"} <= manifest.keys()


def _walk_dir(root: Path, skipped: list[Path] | None = None) -> list[Path]:
    """Every regular file below `root` by relative posix path; hidden entries, __pycache__ and prepared
    datasets (`is_prepared_dataset`: a corpus directory that holds the dataset made from it, or an
    earlier one) skipped. Symlinked directories are followed (as `**` globs do), each real directory
    walked once: a link back to a directory already walked (a cycle, or a second link to it) adds
    nothing. The datasets skipped are appended to `skipped`; DataError if `root` itself is one."""
    out: list[tuple[str, str]] = []  # (path relative to root, path): strings, as pathlib costs ~10x per file
    prefix = os.path.join(os.fspath(root), "")  # every dirpath os.walk yields starts with it

    def unreadable(e: OSError) -> None:  # os.walk skips a directory it cannot list, silently
        raise DataError(
            f"cannot read directory {e.filename}: {e.strerror}; fix its permissions or leave it out"
        )

    seen = {os.path.realpath(root)}
    for dirpath, dirnames, filenames in os.walk(root, onerror=unreadable, followlinks=True):
        if is_prepared_dataset(dirpath, filenames):
            if os.path.realpath(dirpath) == os.path.realpath(root):
                raise DataError(
                    f"source {root} is a dataset `prepare` wrote (its {MANIFEST_NAME}), not text; pass "
                    "the text it was prepared from, or train on it (--data-path)"
                )
            dirnames[:] = []
            if skipped is not None:
                skipped.append(Path(dirpath))
            continue
        keep = []
        # Real directories before links, each group sorted: which name a directory is read under is fixed.
        for d in sorted(dirnames, key=lambda d: (os.path.islink(os.path.join(dirpath, d)), d)):
            real = os.path.realpath(os.path.join(dirpath, d))
            if not d.startswith(".") and d != "__pycache__" and real not in seen:
                seen.add(real)
                keep.append(d)
        dirnames[:] = keep
        for f in filenames:
            if not f.startswith("."):
                path = os.path.join(dirpath, f)
                out.append((path[len(prefix) :].replace(os.sep, "/"), path))
    return [Path(path) for _, path in sorted(out) if os.path.isfile(path)]


def _glob(spec: str, skipped: list[Path] | None = None) -> list[Path]:
    """What a glob source matches (files and directories; the caller walks the directories), in sorted
    order (with `**`: by root, then by path below it).
    A `**` component is expanded by `_walk_dir` and matched component by component, not by glob.glob,
    which follows symlinked directories round a cycle until the OS refuses (a link to `.` listed every
    file 41 times; two such links never finished)."""
    parts = spec.split("/")
    if "**" not in parts:
        return [Path(m) for m in sorted(globlib.glob(spec))]
    i = parts.index("**")
    head = "/".join(parts[:i]) or "."
    rest = [c for c in parts[i:] if c]  # a trailing "/" (directories only) walks them all the same
    out: dict[str, Path] = {}  # by real path: two roots (d/sub, and d/self -> d) share files
    for root in map(Path, sorted(globlib.glob(head)) if _is_glob(head) else [head]):
        if not root.is_dir():
            continue
        for f in _walk_dir(root, skipped):
            comps = f.relative_to(root).parts
            # A file counts when its path, or a directory above it, matches (matched directories are walked).
            if any(_match_parts(rest, comps[:k]) for k in range(len(comps), 0, -1)):
                out.setdefault(os.path.realpath(f), f)
    return list(out.values())


def _glob_files(spec: str, skipped: list[Path]) -> list[Path]:
    """The files of a glob source: those it matches and those below the directories it matches (walked
    as a directory source is), each once, in order; the prepared datasets it skips appended to
    `skipped` (each once)."""
    matches = _glob(spec, skipped)
    if not matches:
        raise DataNotFoundError(f"source {spec!r}: the glob matches no files; check the pattern")
    files: list[Path] = []
    for m in matches:
        p = Path(m)
        if p.is_dir() and is_prepared_dataset(p):
            skipped.append(p)
        elif p.is_dir():
            files.extend(_walk_dir(p, skipped))
        elif p.is_file():
            files.append(p)
    skipped[:] = list(dict.fromkeys(skipped))
    return list(dict.fromkeys(files))  # `dir/**` matches dir and its files: once each


def _match_parts(pattern: list[str], comps: tuple[str, ...]) -> bool:
    """Glob match of path components: `**` matches any number of components, others one (fnmatch)."""
    if not pattern:
        return not comps
    if pattern[0] == "**":
        return any(_match_parts(pattern[1:], comps[k:]) for k in range(len(comps) + 1))
    return bool(comps) and fnmatch.fnmatchcase(comps[0], pattern[0]) and _match_parts(pattern[1:], comps[1:])


def _listed_objects(store: Store, skipped: list[str]) -> list[ObjectInfo]:
    """The objects of a URL source, as `_walk_dir` takes a directory's files: sorted by key, names that
    start with a dot and __pycache__ directories skipped, and so are prepared datasets below the root
    (their URLs appended to `skipped`); DataError when the root itself is one."""
    objects = [
        o
        for o in store.list()
        if not any(c.startswith(".") for c in o.key.split("/")) and "__pycache__" not in o.key.split("/")[:-1]
    ]
    datasets = set()
    for o in objects:
        parts = o.key.split("/")
        if parts[-1] != MANIFEST_NAME:
            continue
        manifest, problem = intake.json_problem(
            decode_bytes(store.read(o, limit=intake.MANIFEST.max_bytes)), intake.MANIFEST
        )
        if (
            problem is None
            and isinstance(manifest, dict)
            and {"format_version", "vocab_size", "shards"} <= manifest.keys()
        ):
            datasets.add("/".join(parts[:-1]))
    if "" in datasets:
        raise DataError(
            f"source {store.url} is a dataset `prepare` wrote (its {MANIFEST_NAME}), not text; pass the "
            "text it was prepared from, or train on it (data.train_data_path)"
        )
    skipped.extend(store.url_of(d) for d in sorted(datasets))
    return [o for o in objects if not any(o.key.startswith(d + "/") for d in datasets)]


def _is_glob(spec: str) -> bool:
    return any(c in spec for c in "*?[")


class Source:
    """One source spec, resolved at construction (a missing path fails here, before any work starts).

    `units(start)` yields the source's units from index `start` on (earlier ones are skipped as cheaply
    as the format allows: text files are not even read), at most `max_docs` units in all."""

    def __init__(self, spec: str, *, text_field: str = "text", max_docs: int | None = None) -> None:
        self.spec = spec
        self.text_field = text_field
        self.max_docs = max_docs
        self.files: list[Path] = []
        self.hf: tuple[str, str | None] | None = None
        self.store: Store | None = None  # a URL source: its objects, listed once, are read through it
        self.objects: list[ObjectInfo] = []
        self.skipped_datasets: list[Path] = []  # prepared datasets found below the source, not read
        if not spec.strip():
            # Path("") is the current directory: an unset shell variable (`--source "$CORPUS"`) would
            # tokenize whatever directory the command runs in.
            raise ConfigError(
                f"source {spec!r} is empty (an unset shell variable?); pass a file, a directory, a "
                "'GLOB', stdlib or hf:NAME"
            )
        if spec == "stdlib":
            self.files = stdlib_files()
        elif is_url(spec):  # listed once: every read is checked against this listing
            self.store = Store(spec)
            self.objects = _listed_objects(self.store, self.skipped_datasets)
        elif spec.startswith("hf:"):
            parts = spec[3:].split(":")
            if not parts[0] or len(parts) > 2:
                raise ConfigError(f"bad source {spec!r}; expected hf:NAME or hf:NAME:CONFIG")
            self.hf = (parts[0], parts[1] if len(parts) == 2 and parts[1] else None)
            _import_datasets()  # fail now, not after the other sources were read
        elif _is_glob(spec) and not Path(spec).exists():  # a name with [ or ? that exists is that file
            self.files = _glob_files(spec, self.skipped_datasets)
        else:
            p = Path(spec)
            if p.is_dir():
                self.files = _walk_dir(p, self.skipped_datasets)
            elif p.is_file():
                self.files = [p]
            elif p.exists():  # a pipe, a device, `<(cmd)`: read once, cannot be resumed or fingerprinted
                raise DataError(
                    f"source {spec} is not a regular file or a directory; write it to a file first "
                    "(e.g. `cmd > corpus.jsonl`) and pass that"
                )
            else:
                raise DataNotFoundError(
                    f"source not found: {spec}; fix: check the path, or use `stdlib` or hf:NAME"
                )
        if self.hf is None and not self.files and not self.objects:
            raise DataError(f"source {spec!r} holds no files")
        if unreadable := [p for p in self.files if not os.access(p, os.R_OK)]:  # now, not mid-run
            more = f" (and {len(unreadable) - 1} more)" if len(unreadable) > 1 else ""
            raise DataError(
                f"cannot read {unreadable[0]}{more}: permission denied; fix the permissions or leave it out"
            )

    @classmethod
    def from_listing(
        cls,
        spec: str,
        files: list[Path],
        *,
        text_field: str = "text",
        max_docs: int | None = None,
        objects: list[ObjectInfo] | None = None,
    ) -> Source:
        """The source `spec` with the files (or, for a URL, the `objects`) a recorded plan listed
        (`data.plan`): nothing is listed again, so a resume, or a worker reading one unit of the plan,
        costs no directory walk."""
        src = cls.__new__(cls)
        src.spec, src.text_field, src.max_docs = spec, text_field, max_docs
        src.files, src.skipped_datasets = list(files), []
        src.store = Store(spec) if objects is not None else None
        src.objects = list(objects or [])
        src.hf = None
        if spec.startswith("hf:"):
            parts = spec[3:].split(":")
            src.hf = (parts[0], parts[1] if len(parts) == 2 and parts[1] else None)
        return src

    def __repr__(self) -> str:
        return f"Source({self.spec!r})"

    def fingerprint(self) -> str | None:
        """A hash of the file list with sizes and modification times (None for hf: sources): a resumed run
        must read exactly the files the interrupted one read."""
        if self.hf is not None:
            return None
        h = hashlib.sha256()
        for o in self.objects:  # a URL source: what its listing recorded (key, size, etag or mtime)
            h.update(f"{o.url}\0{o.size}\0{o.etag or o.mtime}\n".encode())
        for p in self.files:
            st = p.stat()
            h.update(f"{p}\0{st.st_size}\0{st.st_mtime_ns}\n".encode("utf-8", "surrogateescape"))
        return h.hexdigest()

    def size_bytes(self) -> int | None:
        """Bytes on disk of the source's files (an estimate of its size; compressed for .gz and .parquet);
        with max_docs, of the part the first max_docs units come from (JSONL lines are read up to there,
        Parquet is taken pro rata by its row count). None for hf: sources (unknown)."""
        if self.hf is not None:
            return None
        entries = self.objects or self.files
        if self.max_docs is None:
            return sum(self._size(e) for e in entries)
        total, left = 0, self.max_docs
        for p in entries:
            if left <= 0:
                break
            name = self._name(p).lower()
            if name.endswith((".jsonl", ".jsonl.gz")):
                n, used = self._jsonl_prefix(p, left)
            elif name.endswith(".parquet"):
                n = self._open_parquet(p).metadata.num_rows
                used = self._size(p) * min(1.0, left / n) if n else 0
            else:
                n, used = 1, self._size(p)
            total += int(used)
            left -= n
        return total

    # A file of a path source or an object of a URL source: the few things the readers below ask of one.
    @staticmethod
    def _name(entry: Path | ObjectInfo) -> str:
        return entry.name if isinstance(entry, Path) else entry.url.rsplit("/", 1)[-1]

    @staticmethod
    def _size(entry: Path | ObjectInfo) -> int:
        return entry.stat().st_size if isinstance(entry, Path) else entry.size

    def _open(self, entry: Path | ObjectInfo, kind: intake.FileKind):
        if isinstance(entry, Path):
            return intake.open_regular(entry, kind)
        assert self.store is not None
        return self.store.open(entry)

    def _jsonl_prefix(self, path: Path | ObjectInfo, n: int) -> tuple[int, int]:
        """(units, bytes on disk) of the first `n` units of a JSONL file (all of it if it has fewer)."""
        gz = self._name(path).lower().endswith(".gz")
        try:
            with (
                self._open(path, intake.SOURCE_JSONL) as raw,
                gzip.GzipFile(fileobj=raw) if gz else contextlib.nullcontext(raw) as f,
            ):
                count = sum(1 for _ in itertools.islice((line for line in f if line.strip()), n))
                return count, raw.tell()  # for .gz: the compressed bytes read so far (to a buffer's size)
        except Mamba3LiteError:  # the border's own refusal (not a regular file, missing): already one line
            raise
        except (OSError, EOFError, zlib.error) as e:
            raise intake.SOURCE_JSONL.fail(f"cannot read {path}: {e}") from e

    def _open_parquet(self, path: Path | ObjectInfo):
        """A pyarrow ParquetFile (its footer read), or one clear error: pyarrow missing, file unreadable."""
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise ConfigError(
                f"reading {path} needs the `pyarrow` package; fix: pip install 'mamba3lite[parquet]'"
            ) from e
        try:
            return pq.ParquetFile(path if isinstance(path, Path) else self._open(path, intake.SOURCE_JSONL))
        except Mamba3LiteError:
            raise
        except Exception as e:
            raise DataError(f"cannot read parquet file {path}: {e}") from e

    def units(self, start: int = 0) -> Iterator[Unit]:
        """The units from index `start` (0-based), at most `max_docs` in all; see the module docstring."""
        if self.hf is not None:
            gen = self._iter_hf()
        else:
            gen = self._iter_objects(start) if self.store is not None else self._iter_files(start)
        if self.max_docs is not None:  # stop before the next unit is read, not after
            gen = itertools.islice(gen, self.max_docs)
        for index, unit in enumerate(gen):
            if unit is None:  # a skipped unit (index < start), not read
                assert index < start
                continue
            if index >= start:
                yield unit

    @staticmethod
    def _jsonl_lines(path: Path) -> Iterator[tuple[int, bytes]]:
        """(line number, raw line) of the non-blank lines of a .jsonl or .jsonl.gz file, through the
        border reader: a regular file only, bounded reads (a line with no newline in gigabytes, or a
        small .gz that inflates to one, is never read whole), a damaged .gz one DataError."""
        cap = intake.MAX_SOURCE_LINE_BYTES
        for lineno, line in intake.iter_lines(path, intake.SOURCE_JSONL, max_line_bytes=cap):
            if line is None:
                raise DataError(
                    f"{path} line {lineno} is longer than {cap // intake.MiB} MiB, more than one "
                    "document may be; split that document, or fix the file if it is not JSON lines"
                )
            yield lineno, line

    def _iter_files(self, start: int) -> Iterator[Unit | None]:
        index = 0
        for path in self.files:
            name = path.name.lower()
            if name.endswith((".jsonl", ".jsonl.gz")):
                for lineno, line in self._jsonl_lines(path):
                    yield None if index < start else (((str(path), lineno)), KIND_JSONL, line)
                    index += 1
            elif name.endswith(".parquet"):
                for row, text in enumerate(self._parquet_texts(path), 1):
                    yield None if index < start else ((str(path), row), KIND_STR, text)
                    index += 1
            else:
                if index >= start:  # through the one reader: a regular file within the size of a document
                    yield str(path), KIND_TEXT_BYTES, intake.read_bytes_capped(path, intake.SOURCE_DOCUMENT)
                else:
                    yield None
                index += 1

    def _iter_objects(self, start: int) -> Iterator[Unit | None]:
        """`_iter_files` for a URL source: the same units from the same bytes, read through the store
        (each object checked against its listing); locations are the objects' URLs."""
        pool = ThreadPoolExecutor(_READ_AHEAD_THREADS, thread_name_prefix="mamba3lite-read")
        ahead: dict[int, Future] = {}  # object position -> its bytes, being read
        try:
            yield from self._object_units(start, pool, ahead)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def _object_units(
        self, start: int, pool: ThreadPoolExecutor, ahead: dict[int, Future]
    ) -> Iterator[Unit | None]:
        assert self.store is not None
        index = 0
        cap = intake.MAX_SOURCE_LINE_BYTES
        for pos, obj in enumerate(self.objects):
            name = self._name(obj).lower()
            if name.endswith((".jsonl", ".jsonl.gz")):
                with self.store.open(obj) as f:
                    for lineno, line in intake.iter_stream_lines(
                        f, obj.url, intake.SOURCE_JSONL, max_line_bytes=cap
                    ):
                        if line is None:
                            raise DataError(
                                f"{obj.url} line {lineno} is longer than {cap // intake.MiB} MiB, more "
                                "than one document may be; split that document, or fix the file if it is "
                                "not JSON lines"
                            )
                        yield None if index < start else ((obj.url, lineno), KIND_JSONL, line)
                        index += 1
            elif name.endswith(".parquet"):
                for row, text in enumerate(self._parquet_texts(obj), 1):
                    yield None if index < start else ((obj.url, row), KIND_STR, text)
                    index += 1
            else:
                if index >= start:
                    self._read_ahead(pool, ahead, pos)
                    yield obj.url, KIND_TEXT_BYTES, ahead.pop(pos).result()
                else:
                    yield None
                index += 1

    def _read_ahead(self, pool: ThreadPoolExecutor, ahead: dict[int, Future], pos: int) -> None:
        """Start reading the text objects from position `pos` on, up to the next object of another kind,
        at most _READ_AHEAD_OBJECTS of them and _READ_AHEAD_BYTES in flight (at least the one at `pos`):
        one small object costs a round trip, so reading them one at a time is bound by latency. Their
        bytes are handed out in order, and an error is raised when its object's turn comes."""
        assert self.store is not None
        in_flight = sum(self.objects[p].size for p in ahead)
        for p in range(pos, min(pos + _READ_AHEAD_OBJECTS, len(self.objects))):
            obj = self.objects[p]
            if self._name(obj).lower().endswith((".jsonl", ".jsonl.gz", ".parquet")):
                return
            if p in ahead:
                continue
            if p > pos and in_flight + obj.size > _READ_AHEAD_BYTES:
                return
            ahead[p] = pool.submit(self.store.read, obj, limit=intake.SOURCE_DOCUMENT.max_bytes)
            in_flight += obj.size

    def parquet_row_group_bytes(self, path: Path) -> list[int]:
        """The (uncompressed) size of each row group of a .parquet file, from its footer: how a plan cuts
        a large one into units."""
        meta = self._open_parquet(path).metadata
        return [meta.row_group(g).total_byte_size for g in range(meta.num_row_groups)]

    def part_units(self, path: Path, part: tuple[int, int]) -> Iterator[Unit]:
        """The units of one part of a large file, as a plan cut it (`data.plan`), at most `max_docs`:
        of a .jsonl file the lines that start in bytes [begin, end) (located as `path byte N`: a line
        number would need the file read from its start); of a .parquet file the rows of row groups
        [begin, end) (numbered as in the whole file)."""
        if path.name.lower().endswith(".parquet"):
            pf = self._open_parquet(path)
            first = sum(pf.metadata.row_group(g).num_rows for g in range(part[0])) + 1
            texts = self._parquet_texts(path, row_groups=list(range(*part)))
            gen: Iterator[Unit] = (((str(path), row), KIND_STR, t) for row, t in enumerate(texts, first))
        else:
            gen = self._jsonl_range(path, *part)
        return itertools.islice(gen, self.max_docs) if self.max_docs is not None else gen

    @staticmethod
    def _jsonl_range(path: Path, begin: int, end: int) -> Iterator[Unit]:
        cap = intake.MAX_SOURCE_LINE_BYTES
        with intake.open_regular(path, intake.SOURCE_JSONL) as f:

            def rest_of_line(line: bytes) -> int:  # bounded reads to the end of a long line
                n = 0
                while line and not line.endswith(b"\n"):
                    line = f.readline(cap + 1)
                    n += len(line)
                return n

            pos = max(begin - 1, 0)
            f.seek(pos)
            if begin:  # the line that holds byte begin - 1 started in the part before
                line = f.readline(cap + 1)
                pos += len(line) + rest_of_line(line)
            while pos < end:
                line = f.readline(cap + 1)
                if not line:
                    return
                where = f"{path} byte {pos}"
                pos += len(line)
                if len(line) > cap:
                    pos += rest_of_line(line)
                    raise DataError(
                        f"{where}: a line longer than {cap // intake.MiB} MiB, more than one document "
                        "may be; split that document, or fix the file if it is not JSON lines"
                    )
                if line.strip():
                    yield where, KIND_JSONL, line

    def _parquet_texts(
        self, path: Path | ObjectInfo, row_groups: list[int] | None = None
    ) -> Iterator[str | None]:
        pf = self._open_parquet(path)
        names = pf.schema_arrow.names
        if self.text_field not in names:
            raise DataError(
                f"{path} has no column {self.text_field!r} (columns: {', '.join(names)}); "
                "fix: --text-field NAME"
            )
        import pyarrow as pa

        kind = pf.schema_arrow.field(self.text_field).type
        if pa.types.is_dictionary(kind):
            kind = kind.value_type
        is_bytes = pa.types.is_binary(kind) or pa.types.is_large_binary(kind)  # text without the UTF8 mark
        if not (is_bytes or pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise DataError(
                f"{path}: column {self.text_field!r} holds {kind}, not text; fix: --text-field NAME of a "
                "string column"
            )
        batches = pf.iter_batches(columns=[self.text_field], batch_size=1024, row_groups=row_groups)
        while True:
            try:  # damaged pages fail here, in the middle of the file
                batch = next(batches, None)
            except Exception as e:
                raise DataError(f"cannot read parquet file {path}: {e}") from e
            if batch is None:
                return
            values = batch.column(0).to_pylist()
            yield from (decode_bytes(v) if v is not None else None for v in values) if is_bytes else values

    def _iter_hf(self) -> Iterator[Unit]:
        assert self.hf is not None
        name, config = self.hf
        datasets = _import_datasets()
        try:
            ds = datasets.load_dataset(name, config, split="train", streaming=True)
        except Exception as e:  # network, unknown name, bad config: the library's message says which
            raise DataError(f"cannot load Hugging Face dataset {self.spec!r}: {e}") from e
        rows = iter(ds)
        for row in itertools.count(1):
            try:  # a streamed dataset fetches and decodes lazily: most of its failures happen here
                example = next(rows, None)
            except (OSError, TimeoutError) as e:  # the network (ConnectionError is an OSError)
                raise TransientError(
                    f"{self.spec}: reading row {row} failed ({e}); the shards done so far are kept: re-run "
                    "the same command to resume"
                ) from e
            except Exception as e:
                raise DataError(f"{self.spec}: cannot read row {row}: {type(e).__name__}: {e}") from e
            if example is None:
                return
            if self.text_field not in example:
                raise DataError(
                    f"{self.spec} row {row} has no field {self.text_field!r} "
                    f"(fields: {', '.join(map(str, example))}); fix: --text-field NAME"
                )
            text = example[self.text_field]
            if text is not None and not isinstance(text, str):
                raise DataError(
                    f"{self.spec} row {row}: field {self.text_field!r} is a {type(text).__name__}, not a "
                    "string; fix: --text-field NAME of a text field"
                )
            yield (self.spec, row), KIND_STR, text


def _import_datasets():
    try:
        import datasets
    except ImportError as e:
        raise ConfigError(
            "hf: sources need the Hugging Face `datasets` package; fix: pip install 'mamba3lite[hf]'"
        ) from e
    return datasets
