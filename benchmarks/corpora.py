"""The corpora of `bench_prepare.py`: a name on its command line -> a source spec `prepare` reads.

    stdlib      this interpreter's standard-library .py files (`prepare`'s own `stdlib` source)
    numpy       the .py files of the installed numpy package (a glob source: NUMPY_DIR/**/*.py)
    jsonl:MB    about MB megabytes (10^6 bytes) of JSON lines written by `write_jsonl` into a temporary
                directory, removed afterwards
    licences    the licence and copyright texts installed on this machine (`licence_files`: files named
                LICENSE*, LICENCE*, COPYING*, NOTICE* or copyright below LICENCE_ROOTS), copied into a
                temporary directory: many short plain-text files, many of them the same licence

The JSONL corpus is made of real text found on this machine: the .py .md .rst .txt files of the installed
packages (this interpreter's site-packages), taken in a seeded order and read line by line as one stream
(lines over 1 KiB, minified code and data tables, are left out). A document is a run of consecutive lines
of that stream, of a seeded size of 1-8 KB of UTF-8 (a document can run from the end of one file into the
next), each line `{"id": N, "text": ...}`. Documents are unique (one equal to an earlier one is drawn
again), except that every DUPLICATE_EVERY-th is an exact copy of an earlier one, chosen by the seed: 1% of
the documents are exact duplicates, for `prepare`'s dedup to drop. They are spread over several files
(about FILE_MB megabytes each, at least MIN_FILES), so `prepare` cuts them into many work units. The same
seed and the same installed packages give the same bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import math
import os
import random
import stat
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from mamba3lite.data.clean import clean_text

TEXT_SUFFIXES = frozenset({".py", ".md", ".rst", ".txt"})
MAX_LINE_BYTES = 1024  # longer lines (minified code, data tables) are not prose or code people write
MIN_DOC_BYTES = 1024
MAX_DOC_BYTES = 8192
assert MIN_DOC_BYTES + MAX_LINE_BYTES <= MAX_DOC_BYTES
DUPLICATE_EVERY = 100  # every 100th document repeats an earlier one: 1% exact duplicates
FILE_MB = 25.0  # megabytes per JSONL file
MIN_FILES = 4
# Where the licences corpus is looked for: this environment's packages, and the system's documentation.
LICENCE_ROOTS = (sys.prefix, sysconfig.get_paths()["purelib"], "/usr/share/doc", "/usr/share/common-licenses")
LICENCE_PREFIXES = ("license", "licence", "copying", "notice", "copyright")
MAX_LICENCE_BYTES = 1 << 20


@dataclass(frozen=True)
class Corpus:
    """One corpus, ready for `prepare` and for the raw tokenizer rows."""

    name: str  # as given to --source: stdlib, numpy, jsonl:MB
    spec: str  # the source spec `prepare` reads (a directory, a glob, or `stdlib`)
    about: str  # what it is, one line, for the table's header


@dataclass(frozen=True)
class JsonlCorpus:
    """What `write_jsonl` wrote."""

    files: list[Path]  # the JSONL files, in order
    n_docs: int  # lines (documents) in all
    n_duplicates: int  # documents that are exact copies of an earlier one
    n_bytes: int  # bytes of the files together


def check_name(name: str) -> str:
    """`name` if it names a corpus (argparse type), else argparse.ArgumentTypeError saying which do."""
    if name in ("stdlib", "numpy", "licences"):
        return name
    if name.startswith("jsonl:"):
        with contextlib.suppress(ValueError):
            if math.isfinite(mb := float(name[len("jsonl:") :])) and mb > 0:
                return name
    raise argparse.ArgumentTypeError(
        f"unknown corpus {name!r}: expected stdlib, numpy, licences or jsonl:MB with MB > 0 megabytes "
        "(e.g. jsonl:200)"
    )


@contextlib.contextmanager
def open_corpus(name: str, *, seed: int = 0) -> Iterator[Corpus]:
    """The corpus `name` (`check_name`'s); a jsonl:MB one is written into a temporary directory, which is
    removed when the block ends."""
    if name == "stdlib":
        yield Corpus(name, "stdlib", f"stdlib of Python {sys.version.split()[0]}")
    elif name == "numpy":
        spec = importlib.util.find_spec("numpy")
        assert spec is not None and spec.origin is not None, "numpy is a dependency of mamba3lite"
        root = Path(spec.origin).parent
        yield Corpus(name, f"{root}/**/*.py", f"the .py files of numpy {importlib.metadata.version('numpy')}")
    elif name == "licences":
        with tempfile.TemporaryDirectory(prefix="bench_corpus_", ignore_cleanup_errors=True) as tmp:
            files = licence_files()
            if not files:
                raise SystemExit(f"no licence files found below {', '.join(LICENCE_ROOTS)}")
            n_bytes = 0
            for k, f in enumerate(files):  # numbered in the listing's order: prepare reads them in that order
                n_bytes += len(data := f.read_bytes())
                (Path(tmp) / f"{k:05d}-{f.name}").write_bytes(data)
            yield Corpus(name, tmp, f"{len(files):,} licence and copyright files, {n_bytes / 1e6:.1f} MB")
    else:
        with tempfile.TemporaryDirectory(prefix="bench_corpus_", ignore_cleanup_errors=True) as tmp:
            made = write_jsonl(tmp, float(name[len("jsonl:") :]), seed=seed)
            about = (
                f"{made.n_bytes / 1e6:.1f} MB of generated JSONL in {len(made.files)} files, "
                f"{made.n_docs:,} documents ({made.n_duplicates:,} exact duplicates), seed {seed}"
            )
            yield Corpus(name, tmp, about)


def write_jsonl(out_dir: str | os.PathLike, megabytes: float, *, seed: int = 0) -> JsonlCorpus:
    """Write about `megabytes` (10^6 bytes; it stops at the first line past it) of the JSONL corpus this
    module's docstring describes into `out_dir` as part-NNNNN.jsonl. Deterministic in `seed` and the
    installed packages."""
    limit = int(megabytes * 1e6)
    n_files = max(MIN_FILES, math.ceil(megabytes / FILE_MB))
    files = [Path(out_dir) / f"part-{k:05d}.jsonl" for k in range(n_files)]
    rng = random.Random(seed)
    unique = _documents(_lines(_text_files(sysconfig.get_paths()["purelib"]), rng), rng)
    kept: list[str] = []  # the unique documents so far, for the duplicates to copy
    n_docs = n_duplicates = written = 0
    with contextlib.ExitStack() as stack:
        outs = [stack.enter_context(open(f, "wb")) for f in files]
        while written < limit:
            if (n_docs + 1) % DUPLICATE_EVERY == 0:
                text = kept[rng.randrange(len(kept))]
                n_duplicates += 1
            else:
                text = next(unique)
                kept.append(text)
            line = (json.dumps({"id": n_docs, "text": text}, ensure_ascii=False) + "\n").encode("utf-8")
            outs[min(written * n_files // limit, n_files - 1)].write(line)  # fill the files in turn
            written += len(line)
            n_docs += 1
    return JsonlCorpus(files, n_docs, n_duplicates, written)


def licence_files() -> list[Path]:
    """The regular files below LICENCE_ROOTS (each real file once, symlinks not followed) whose name starts
    with one of LICENCE_PREFIXES in any case, at most MAX_LICENCE_BYTES each, sorted by path."""
    found: dict[tuple[int, int], Path] = {}
    for root in LICENCE_ROOTS:
        for dirpath, _, filenames in os.walk(root):
            for f in filenames:
                if not f.lower().startswith(LICENCE_PREFIXES):
                    continue
                path = Path(dirpath) / f
                with contextlib.suppress(OSError):
                    st = path.lstat()  # one stat: a link is not a regular file here
                    if stat.S_ISREG(st.st_mode) and 0 < st.st_size <= MAX_LICENCE_BYTES:
                        found.setdefault((st.st_dev, st.st_ino), path)
    return sorted(found.values())


@cache
def _text_files(root: str) -> tuple[Path, ...]:
    """The text files below `root` (TEXT_SUFFIXES; hidden entries and __pycache__ skipped), sorted by
    relative path (listed once per process: a site-packages walk takes about a second)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
        rel = Path(dirpath).relative_to(root)
        found += [(rel / f).as_posix() for f in filenames if Path(f).suffix in TEXT_SUFFIXES]
    if not found:
        raise SystemExit(f"no .py/.md/.rst/.txt files below {root} to build the JSONL corpus from")
    return tuple(Path(root) / f for f in sorted(found))


def _lines(files: tuple[Path, ...], rng: random.Random) -> Iterator[tuple[str, int]]:
    """(line, its UTF-8 bytes) of `files` in a seeded order, line ends kept, endlessly (each pass over the
    files in a new order); files that are not UTF-8 text, and lines over MAX_LINE_BYTES, left out."""
    while True:
        order = list(files)
        rng.shuffle(order)
        n_lines = 0
        for path in order:
            try:
                text = path.read_bytes().decode("utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            if "\x00" in text:
                continue
            for line in text.splitlines(keepends=True):
                if (n := len(line.encode("utf-8"))) <= MAX_LINE_BYTES:
                    n_lines += 1
                    yield line, n
        if not n_lines:
            raise SystemExit("the text files found hold no lines to build the JSONL corpus from")


def _documents(lines: Iterator[tuple[str, int]], rng: random.Random) -> Iterator[str]:
    """Unique documents of MIN_DOC_BYTES..MAX_DOC_BYTES: consecutive `lines` up to a seeded target size
    (lines are taken past the target while the document is under MIN_DOC_BYTES: a line is at most
    MAX_LINE_BYTES, so it stays under MIN_DOC_BYTES + MAX_LINE_BYTES <= MAX_DOC_BYTES). Unique after
    `prepare`'s cleaning, so its dedup drops exactly the planted duplicates."""
    seen: set[bytes] = set()
    pending: tuple[str, int] | None = None
    while True:
        target = rng.randint(MIN_DOC_BYTES, MAX_DOC_BYTES)
        parts, size = [], 0
        while True:
            line, n = pending or next(lines)
            pending = None
            if size >= MIN_DOC_BYTES and size + n > target:
                pending = (line, n)
                break
            parts.append(line)
            size += n
        doc = "".join(parts)
        # Unique as `prepare` sees it: by the cleaned text, its dedup key.
        digest = hashlib.blake2b(clean_text(doc)[0].encode("utf-8"), digest_size=16).digest()
        if doc.strip() and digest not in seen:  # blank, or equal to an earlier one: draw again
            seen.add(digest)
            yield doc
