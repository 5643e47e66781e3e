"""Raw text → verified token shards: read → clean → dedup → tokenize (parallel) → pack. Resumable.

`prepare(sources, out, ...)` is the library form of `mamba3lite prepare`. The pipeline:

1. **Read** (main process): each source (`sources.Source`) yields units in a fixed order.
2. **Clean + tokenize** (worker processes, `--workers`): decode (UTF-8 without its byte-order mark, or
   UTF-16/32 after theirs; undecodable bytes → U+FFFD, counted), skip binary files, NFC-normalise,
   CRLF/CR → LF, drop control characters other than newline and tab, drop empty and `< min_chars`
   documents, hash the cleaned text (sha256), pick its split from that hash, and encode it; every
   document is followed by EOS. Batches go to a process pool and come back in
   submission order, so the result never depends on the number of workers or on timing.
3. **Mix** (main process): the next document comes from the source with the fewest tokens taken per
   unit of rate (ties: lowest index). With a target token count, source i stops after
   weight_i / Σweights × target tokens and its rate is its weight; without one, every document of every
   source is used and the rate is the source's size on disk. Either way the sources run out together,
   so every shard sees every source. No source is ever repeated: one that runs out early contributes
   what it has (the manifest records what each source contributed).
4. **Dedup** (main process): exact duplicates of an earlier kept document (same cleaned-text hash, in
   mixing order) are dropped.
5. **Pack**: per split, whole documents are appended until the next one would overflow `shard_tokens`;
   the shard is then written atomically and re-read/verified through `shards.write_shard`. A document
   longer than `shard_tokens` gets a shard of its own. Documents are never split across shards.

The split is a pure function of a document's cleaned content and `seed` (sha256 → a number in [0, 1),
below `val_fraction` → val), so it is stable when a source grows.

**Staging and resume.** All work happens in `OUT/.prepare/`; a previous dataset in OUT stays intact
until the new one is complete, and the manifest is written last. After a shard (at most once a second,
SNAPSHOT_MIN_INTERVAL_S), a snapshot of the pipeline (per-source cursors, counters, both splits' partly
filled shards, the dedup set) goes to `OUT/.prepare/state.json` (atomically). A re-run with the same
arguments and unchanged source files re-verifies the shards of the snapshot, restores it and continues
from there; the result is byte-identical to an uninterrupted run. A failure caused by bad input removes
the staging directory (a re-run would fail the same way); an interruption (kill, Ctrl-C, disk full, a
worker killed for memory) leaves it for the resume. A run holds `OUT/.prepare.lock` (mamba3lite.dirlock)
from before it looks at OUT until the manifest is written, so a second prepare into OUT fails at once
instead of sharing the staging directory; the file is removed when the run ends.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import math
import multiprocessing
import os
import re
import shutil
import signal
import sys
import threading
import time
import unicodedata
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mamba3lite.config import strict_yaml_load, yaml_error_line
from mamba3lite.data import shards
from mamba3lite.data.shards import MANIFEST_NAME, SPLITS, Manifest, ShardInfo
from mamba3lite.data.sources import (
    KIND_JSONL,
    KIND_TEXT_BYTES,
    Source,
    decode_bytes,
    decode_wide_text,
    format_location,
    looks_binary,
    parse_jsonl_line,
    replace_surrogates,
    wide_text_looks_binary,
)
from mamba3lite.dirlock import DirLock
from mamba3lite.errors import ConfigError, DataError, Mamba3LiteError, TransientError
from mamba3lite.tokenizer import load_tokenizer

DEFAULT_SHARD_TOKENS = 50_000_000  # as the seed's pipeline
# 0.5% of documents: plenty of validation text for large corpora; small ones (the quickstart) pass ~0.02.
DEFAULT_VAL_FRACTION = 0.005
# Shorter documents are mostly noise (an empty `__init__.py`, a stray "ok" line).
DEFAULT_MIN_CHARS = 16
STAGE_DIRNAME = ".prepare"
LOCK_NAME = ".prepare.lock"  # exists while a prepare runs (mamba3lite.dirlock), or after one was killed
STATE_NAME = "state.json"
COMMIT_NAME = "commit.json"  # written when the dataset is complete, before it is moved into `out`
SEEN_NAME = "seen.bin"
# Test hook: seconds to sleep after each shard, so a test can kill a run reliably in the middle.
SLEEP_ENV = "MAMBA3LITE_PREPARE_TEST_SLEEP_S"
# Snapshots for resume are taken after a shard, at most this often: each costs a few fsyncs, which
# dominate with tiny shards; at most this much work is redone after an interruption.
SNAPSHOT_MIN_INTERVAL_S = 1.0
# Bumped whenever a change makes the same arguments produce different output (invalidates resume state).
PIPELINE_VERSION = 1

# Unit outcomes, as the workers report them.
KEPT, EMPTY, TOO_SHORT, BINARY, BAD_LINE = range(5)
_DROP_NAMES = {EMPTY: "empty", TOO_SHORT: "too_short", BINARY: "binary", BAD_LINE: "bad_lines"}
DROP_REASONS = ("too_short", "duplicate", "binary", "empty", "bad_lines")

_DIGEST_BYTES = 16  # of the sha256 of the cleaned text; the dedup key
_BATCH_UNITS = 512
_BATCH_BYTES = 256 * 1024
# C0 controls except \t \n (CR is turned into \n before), DEL and the C1 controls.
_CONTROL_RE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
# What clean_text changes in ASCII text (CR included): their absence means there is nothing to do.
_ASCII_CONTROL_BYTES = bytes([*range(0, 9), *range(11, 32), 127])


@dataclass(frozen=True)
class SourceSpec:
    """A source spec (see `mamba3lite.data.sources`) and its mixing weight (> 0)."""

    spec: str
    weight: float = 1.0


# ---------------------------------------------------------------------------------------------------------
# Cleaning and the worker side (pure functions of their inputs).


def clean_text(text: str) -> tuple[str, int]:
    """The cleaned form of a document and the number of replaced characters.

    Lone surrogates (undecodable bytes, bad JSON escapes) → U+FFFD (counted); CRLF and CR → LF; control
    characters other than newline and tab removed; Unicode NFC."""
    if text.isascii():
        # Fast path for the common case (source code, English): a C-speed scan finds nothing to do.
        raw = text.encode("ascii")
        if len(raw.translate(None, _ASCII_CONTROL_BYTES)) == len(raw):
            return text, 0
        n_replaced = 0
    else:
        text, n_replaced = replace_surrogates(text)
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _CONTROL_RE.sub("", text)
    if not text.isascii():  # last: removing a control character can join a letter and a combining mark
        text = unicodedata.normalize("NFC", text)
    return text, n_replaced


def split_of(digest: bytes, seed: int, val_fraction: float) -> str:
    """ "val" or "train" for a document whose cleaned-text sha256 is `digest`: a pure function, so the split
    of a document never changes when others are added or removed."""
    h = hashlib.sha256(b"mamba3lite-split:%d:" % seed + digest).digest()
    return "val" if int.from_bytes(h[:8], "big") / 2.0**64 < val_fraction else "train"


@dataclass(frozen=True)
class _WorkerConfig:
    tokenizer: str
    min_chars: int
    text_field: str
    seed: int
    val_fraction: float


_WORKER: dict = {}  # per-process: the tokenizer and settings, built once by _init_worker


def _init_worker(cfg: _WorkerConfig) -> None:
    tok = load_tokenizer(cfg.tokenizer)
    _WORKER.update(cfg=cfg, tok=tok, dtype=shards.dtype_for_vocab(tok.vocab_size))


def _init_pool_worker(cfg: _WorkerConfig, parent: int) -> None:
    # Ctrl-C is the main process's to handle (it stops the pool); workers would only add tracebacks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A worker whose parent was killed (SIGKILL, OOM killer) would otherwise wait on the task queue
    # forever: the other workers keep its write end open, so no EOF ever arrives.
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True, name="parent-watch").start()
    _init_worker(cfg)


def _exit_with_parent(parent: int, poll_s: float = 0.5) -> None:
    while os.getppid() == parent:
        time.sleep(poll_s)
    os._exit(1)


# A unit's outcome: (status, n_replaced, digest, is_val, tokens incl. EOS, n_bytes, n_special, problem)
Result = tuple


def _process_batch(items: list[tuple[int, bytes | str | None]]) -> list[Result]:
    """Clean, filter, hash and tokenize a batch of (kind, payload) units. Runs in a worker."""
    cfg: _WorkerConfig = _WORKER["cfg"]
    tok = _WORKER["tok"]
    out: list = [None] * len(items)
    keep_idx, keep_text, keep_meta = [], [], []
    for i, (kind, payload) in enumerate(items):
        if kind == KIND_TEXT_BYTES:
            assert isinstance(payload, bytes)
            text = decode_wide_text(payload)
            binary = looks_binary(payload) if text is None else wide_text_looks_binary(text)
            if binary:
                out[i] = (BINARY, 0, None, False, None, 0, 0, None)
                continue
            if text is None:
                text = decode_bytes(payload)
        elif kind == KIND_JSONL:
            assert isinstance(payload, bytes)
            text, problem = parse_jsonl_line(payload, cfg.text_field)
            if problem is not None:
                out[i] = (BAD_LINE, 0, None, False, None, 0, 0, problem)
                continue
        else:
            text = payload or ""
        clean, n_rep = clean_text(text)
        if not clean.strip():
            out[i] = (EMPTY, n_rep, None, False, None, 0, 0, None)
        elif len(clean) < cfg.min_chars:
            out[i] = (TOO_SHORT, n_rep, None, False, None, 0, 0, None)
        else:
            data = clean.encode("utf-8")
            digest = hashlib.sha256(data).digest()
            keep_idx.append(i)
            keep_text.append(clean)
            keep_meta.append((n_rep, digest, len(data)))
    if keep_text:
        dtype, eos = _WORKER["dtype"], tok.eos_id
        encode_numpy = getattr(tok, "encode_numpy", None)  # GPT-2: straight to numpy, no Python list
        encoded = map(encode_numpy, keep_text) if encode_numpy else tok.encode_batch(keep_text)
        for i, ids, (n_rep, digest, n_bytes) in zip(keep_idx, encoded, keep_meta):
            tokens = np.empty(len(ids) + 1, dtype=dtype)
            tokens[:-1] = ids
            tokens[-1] = eos
            # A tokenizer that parses its special tokens inside text (HF) could put EOS inside a document;
            # EOS must mean "document boundary" only, so such ids are removed (and counted).
            n_special = int(np.count_nonzero(tokens[:-1] == eos))
            if n_special:
                tokens = np.concatenate([tokens[:-1][tokens[:-1] != eos], tokens[-1:]])
            is_val = split_of(digest, cfg.seed, cfg.val_fraction) == "val"
            out[i] = (KEPT, n_rep, digest[:_DIGEST_BYTES], is_val, tokens, n_bytes, n_special, None)
    return out


# ---------------------------------------------------------------------------------------------------------
# Mixture files.

_MIXTURE_KEYS = ("sources", "target_tokens")
_MIXTURE_SOURCE_KEYS = ("source", "weight")


def _unknown_key(key: str, known: Sequence[str], where: str) -> ConfigError:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(known)}"
    return ConfigError(f"{where}: unknown key {key!r}{hint}")


def load_mixture(path: str | os.PathLike) -> tuple[list[SourceSpec], int | None]:
    """Read a mixture YAML file:

        target_tokens: 20_000_000        # optional
        sources:
          - source: data/web/*.jsonl     # any source spec; relative paths are relative to this file
            weight: 0.7
          - source: stdlib
            weight: 0.3

    Returns (sources, target_tokens). ConfigError naming the file and field on anything wrong."""
    import yaml

    path = Path(path)
    try:
        doc = strict_yaml_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"mixture file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"--mixture {path} is a directory; pass the mixture YAML file") from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte {e.start}); a mixture file is YAML, see `prepare --help`"
        ) from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({yaml_error_line(e)})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: expected a mapping with `sources:` (and optionally `target_tokens:`)")
    for key in doc:
        if key not in _MIXTURE_KEYS:
            raise _unknown_key(str(key), _MIXTURE_KEYS, str(path))
    items = doc.get("sources")
    if not isinstance(items, list) or not items:
        raise ConfigError(f"{path}: `sources` must be a non-empty list of {{source: ..., weight: ...}}")
    specs = []
    for i, item in enumerate(items):
        where = f"{path}: sources[{i}]"
        if isinstance(item, str):
            item = {"source": item}
        if not isinstance(item, dict) or "source" not in item:
            raise ConfigError(f"{where} must be a mapping with a `source` key")
        for key in item:
            if key not in _MIXTURE_SOURCE_KEYS:
                raise _unknown_key(str(key), _MIXTURE_SOURCE_KEYS, where)
        spec = str(item["source"])
        if spec != "stdlib" and not spec.startswith("hf:") and not os.path.isabs(spec):
            spec = os.path.join(path.parent, spec)
        weight = item.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, int | float):
            raise ConfigError(f"{where}.weight must be a number, got {weight!r}")
        try:
            specs.append(SourceSpec(spec, float(weight)))
        except OverflowError:  # an integer of hundreds of digits
            raise ConfigError(f"{where}.weight is too large for a number") from None
    target = doc.get("target_tokens")
    if target is not None and (isinstance(target, bool) or not isinstance(target, int) or target < 1):
        raise ConfigError(f"{path}: target_tokens must be an integer >= 1, got {target!r}")
    return specs, target


# ---------------------------------------------------------------------------------------------------------
# The main-process side.


class _Ready:
    """A batch processed lazily in this process (workers=0): the same interface as a Future."""

    def __init__(self, items: list) -> None:
        self._items = items

    def result(self) -> list[Result]:
        return _process_batch(self._items)


class _Stream:
    """One source's units, processed in batches with up to `depth` batches in flight, yielded in order
    as (location, result)."""

    def __init__(self, units: Iterator, submit, depth: int, on_read) -> None:
        self._units = units
        self._submit = submit
        self._depth = depth
        self._on_read = on_read
        self._pending: deque = deque()
        self._current: Iterator = iter(())
        self._reading = True

    def _fill(self) -> None:
        while self._reading and len(self._pending) < self._depth:
            locs, items, n_bytes, error = [], [], 0, None
            try:
                for loc, kind, payload in self._units:
                    locs.append(loc)
                    items.append((kind, payload))
                    n_bytes += len(payload) if payload is not None else 0
                    if len(items) >= _BATCH_UNITS or n_bytes >= _BATCH_BYTES:
                        break
            except Exception as e:  # re-raised by next() at this position
                # A read error (a truncated archive, a damaged Parquet page) is raised where the consumer
                # reaches it: read-ahead depth grows with --workers, and a run that reaches its target
                # first must not fail with more workers when it succeeds with fewer.
                error = e
            if items:
                self._on_read(len(items), n_bytes)
                self._pending.append((locs, self._submit(items)))
            if error is not None or not items:
                self._reading = False
                if error is not None:
                    self._pending.append((None, error))
                return

    def next(self) -> tuple | None:
        """The next (location, result), or None when the source is exhausted."""
        while True:
            nxt = next(self._current, None)
            if nxt is not None:
                return nxt
            self._fill()
            if not self._pending:
                return None
            locs, handle = self._pending.popleft()
            if locs is None:
                raise handle
            results = handle.result()
            self._fill()  # keep the workers busy while this batch is consumed
            self._current = zip(locs, results)


@dataclass
class _Packer:
    """Whole documents of one split waiting for their shard."""

    split: str
    parts: list = field(default_factory=list)
    n_tokens: int = 0
    n_docs: int = 0
    n_bytes: int = 0
    next_index: int = 0

    def tokens(self) -> np.ndarray:
        return np.concatenate(self.parts) if self.parts else np.empty(0, dtype=np.uint32)


def _new_stats(specs: list[SourceSpec]) -> dict:
    zero = {"train": 0, "val": 0}
    return {
        "documents_in": 0,
        "kept": 0,
        "dropped": dict.fromkeys(DROP_REASONS, 0),
        "replaced_bytes": 0,
        "special_tokens_removed": 0,
        "sources": [
            {
                "spec": s.spec,
                "weight": s.weight,
                "documents_in": 0,
                "documents": dict(zero),
                "tokens": dict(zero),
                "bytes": dict(zero),
                "exhausted": False,
            }
            for s in specs
        ],
    }


@dataclass
class PrepareSummary:
    """What `prepare` did. `stats` is the manifest's `extra["stats"]`; timings live only here."""

    out: Path
    manifest: Manifest
    stats: dict
    seconds: float
    resumed_shards: int  # shards kept from an interrupted earlier run

    @property
    def n_tokens(self) -> int:
        return self.manifest.n_tokens()

    def table(self) -> str:
        """A human-readable summary table."""
        from mamba3lite.report.dataset import split_table

        s, m = self.stats, self.manifest
        dropped = ", ".join(f"{k} {v:,}" for k, v in s["dropped"].items())
        lines = [
            f"dataset   {self.out}  ({m.tokenizer['name']}, vocab {m.vocab_size:,}, {m.dtype})",
            f"documents read {s['documents_in']:,}  kept {s['kept']:,}  dropped: {dropped}",
            f"replaced undecodable bytes/chars {s['replaced_bytes']:,}",
            "",
            *split_table(m),
        ]
        lines += ["", f"{'source':<40}{'weight':>8}{'documents':>12}{'train tok':>14}{'val tok':>12}"]
        for src in s["sources"]:
            spec = src["spec"] if len(src["spec"]) <= 38 else "…" + src["spec"][-37:]
            docs = src["documents"]["train"] + src["documents"]["val"]
            lines.append(
                f"{spec:<40}{src['weight']:>8g}{docs:>12,}{src['tokens']['train']:>14,}"
                f"{src['tokens']['val']:>12,}"
            )
        shard_bytes = m.n_tokens() * m.np_dtype.itemsize
        rate = m.n_tokens() / self.seconds if self.seconds > 0 else float("nan")
        resumed = f", {self.resumed_shards} shards resumed" if self.resumed_shards else ""
        lines += [
            "",
            f"{len(m.shards)} shards, {shard_bytes / 1e6:.2f} MB on disk, {self.seconds:.1f} s, "
            f"{rate:,.0f} tokens/s{resumed}",
        ]
        val_fraction = m.extra.get("prepare", {}).get("val_fraction", 0)
        if val_fraction and not m.split_shards("val"):
            lines.append(
                f"note: no document fell into the val split (--val-fraction {val_fraction}); "
                "raise it if you need validation data"
            )
        return "\n".join(lines)


def _check_args(
    specs: list[SourceSpec],
    shard_tokens: int,
    val_fraction: float,
    min_chars: int,
    workers: int,
    target_tokens: int | None,
    max_docs: int | None,
) -> None:
    if not specs:
        raise ConfigError(
            "no sources; pass --source PATH (repeatable), --source stdlib or --mixture FILE.yaml"
        )
    for s in specs:
        if not (s.weight > 0 and math.isfinite(s.weight)):
            raise ConfigError(f"source {s.spec!r}: weight must be a positive number, got {s.weight}")
    if shard_tokens < 1:
        raise ConfigError(f"--shard-tokens must be >= 1, got {shard_tokens}")
    if not 0 <= val_fraction < 1:
        raise ConfigError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    if min_chars < 0:
        raise ConfigError(f"--min-chars must be >= 0, got {min_chars}")
    if workers < 0:
        raise ConfigError(f"--workers must be >= 0 (0 = in this process), got {workers}")
    if workers > (most := 4 * (os.cpu_count() or 1)):  # each is a process with its own tokenizer
        raise ConfigError(f"--workers {workers} is more than 4 per CPU of this machine (at most {most})")
    if target_tokens is not None and target_tokens < 1:
        raise ConfigError(f"--target-tokens must be >= 1, got {target_tokens}")
    if max_docs is not None and max_docs < 1:
        raise ConfigError(f"--max-docs must be >= 1, got {max_docs}")


def _check_out(out: Path, args_record: dict, overwrite: bool) -> None:
    """Refuse to replace something that is not this same dataset, unless `overwrite`. `out` is a
    directory by now (`prepare` refused a file and created it to hold its lock)."""
    if overwrite:
        return
    if (out / MANIFEST_NAME).exists():
        try:
            previous = Manifest.load(out).extra.get("prepare")
        except DataError:
            previous = None
        if previous == args_record:
            return  # the same dataset, rebuilt from the same arguments
        what = "a dataset prepared with different arguments" if previous else "a different dataset"
        raise ConfigError(
            f"--out {out} holds {what}; choose another --out, or pass --overwrite to "
            "replace it (it stays intact until the new dataset is complete)"
        )
    others = [p.name for p in out.iterdir() if p.name not in (STAGE_DIRNAME, LOCK_NAME)]
    if others:
        raise ConfigError(
            f"--out {out} is not empty ({', '.join(sorted(others)[:3])}...) and holds no "
            "mamba3lite dataset; choose an empty or new directory, or pass --overwrite"
        )


class _Run:
    """One execution of the pipeline into the staging directory; see the module docstring."""

    def __init__(
        self,
        *,
        stage: Path,
        sources: list[Source],
        specs: list[SourceSpec],
        args_record: dict,
        dtype: np.dtype,
        eos_id: int,
        shard_tokens: int,
        target_tokens: int | None,
        dedup: bool,
        skip_bad_lines: bool,
        progress: bool,
    ) -> None:
        self.stage = stage
        self.sources = sources
        self.args_record = args_record
        self.dtype = dtype
        self.eos_id = eos_id
        self.shard_tokens = shard_tokens
        self.dedup = dedup
        self.skip_bad_lines = skip_bad_lines
        self.progress = progress
        top = max(s.weight for s in specs)  # relative weights: a sum of 1e308s must not overflow to inf
        total_w = sum(s.weight / top for s in specs)
        self.budgets = [
            None if target_tokens is None else target_tokens * (s.weight / top) / total_w for s in specs
        ]
        # The interleaving rate of each source. With a target, its weight: every source reaches its budget
        # at about the same time. Without one every document is used, so the rate is the source's size
        # (bytes on disk, when every source's is known) and all sources run out at about the same time:
        # either way every shard sees every source.
        sizes = [src.size_bytes() for src in sources]
        if target_tokens is None and all(sizes):
            self.rates = [float(n) for n in sizes]
        else:
            self.rates = [s.weight for s in specs]
        # Pipeline state (all of it goes into the snapshot).
        self.cursors = [0] * len(sources)
        self.taken = [0] * len(sources)
        self.stats = _new_stats(specs)
        self.seen: set[bytes] = set()
        self.seen_new: list[bytes] = []
        self.n_seen_saved = 0
        self.shards: list[ShardInfo] = []
        self.packers = {split: _Packer(split) for split in SPLITS}
        self.resumed_shards = 0
        self.fingerprints = [src.fingerprint() for src in sources]
        self._sleep = float(os.environ.get(SLEEP_ENV, "0") or 0)
        self._last_snapshot = time.monotonic()

    # --- snapshot / resume -----------------------------------------------------------------------------

    def _pending_path(self, snap: int) -> Path:
        return self.stage / f"pending.{snap}.bin"

    def _snapshot(self) -> None:
        """Persist the pipeline state; called right after a shard is written (before the next unit).
        The partly filled shards of both splits go into one file (train's tokens, then val's)."""
        snap = len(self.shards)
        pending, parts = {}, []
        for split in SPLITS:
            p = self.packers[split]
            tokens = p.tokens().astype(self.dtype, copy=False)
            parts.append(tokens)
            pending[split] = {
                "n_tokens": int(tokens.size),
                "n_docs": p.n_docs,
                "n_bytes": p.n_bytes,
                "next_index": p.next_index,
            }
        both = np.concatenate(parts)
        shards.atomic_write_bytes(self._pending_path(snap), both)
        pending["sha256"] = hashlib.sha256(memoryview(both).cast("B")).hexdigest()
        with open(self.stage / SEEN_NAME, "ab") as f:
            f.write(b"".join(self.seen_new))
            f.flush()
            os.fsync(f.fileno())
        self.n_seen_saved += len(self.seen_new)
        self.seen_new = []
        state = {
            "args": self.args_record,
            "fingerprints": self.fingerprints,
            "snapshot": snap,
            "cursors": self.cursors,
            "taken": self.taken,
            "stats": self.stats,
            "n_seen": self.n_seen_saved,
            "pending": pending,
            "shards": [s.__dict__ for s in self.shards],
        }
        shards.atomic_write_json(self.stage / STATE_NAME, state)
        self._last_snapshot = time.monotonic()
        for p in self.stage.glob("pending.*.bin"):
            if p.name != self._pending_path(snap).name:
                p.unlink()

    def interrupted_commit(self) -> Manifest | None:
        """The staged manifest when an earlier run of these same arguments, on the same source files,
        completed its dataset and was interrupted while moving it into `out` (`_commit`), and every shard
        it lists verifies, in the stage or already in `out`; else None."""
        import json

        try:
            manifest = Manifest.load(self.stage)
            commit = json.loads((self.stage / COMMIT_NAME).read_text(encoding="utf-8"))
        except (DataError, OSError, ValueError):
            return None
        if not isinstance(commit, dict):
            return None
        same_sources = commit.get("fingerprints") == self.fingerprints
        if manifest.extra.get("prepare") != self.args_record or not same_sources:
            return None
        for info in manifest.shards:
            path = self.stage / info.path
            if not path.is_file():
                path = self.stage.parent / info.path
            if not path.is_file() or shards.sha256_file(path) != info.sha256:
                return None
        return manifest

    def try_resume(self) -> str | None:
        """Restore the snapshot in the staging dir if it matches these arguments and verifies.
        Returns None when resumed, else why not (the caller starts afresh)."""
        import json

        try:
            state = json.loads((self.stage / STATE_NAME).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return "no readable state"
        if not isinstance(state, dict):
            return "no readable state"
        if state.get("args") != self.args_record:
            return "the arguments differ"
        if state.get("fingerprints") != self.fingerprints:
            return "the source files changed"
        try:
            infos = [ShardInfo(**d) for d in state["shards"]]
            for info in infos:
                path = self.stage / info.path
                if not path.is_file() or shards.sha256_file(path) != info.sha256:
                    return f"shard {info.path} does not verify"
            both = np.fromfile(self._pending_path(state["snapshot"]), dtype=self.dtype)
            if hashlib.sha256(memoryview(both).cast("B")).hexdigest() != state["pending"]["sha256"]:
                return "the partly filled shards do not verify"
            packers, offset = {}, 0
            for split in SPLITS:
                meta = state["pending"][split]
                tokens = both[offset : offset + meta["n_tokens"]]
                offset += meta["n_tokens"]
                packers[split] = _Packer(
                    split,
                    [tokens] if tokens.size else [],
                    int(tokens.size),
                    meta["n_docs"],
                    meta["n_bytes"],
                    meta["next_index"],
                )
            if offset != both.size:
                return "the partly filled shards have the wrong size"
            n_seen = state["n_seen"]
            with open(self.stage / SEEN_NAME, "rb") as f:
                blob = f.read(n_seen * _DIGEST_BYTES)
            if len(blob) != n_seen * _DIGEST_BYTES:
                return "the dedup record is short"
        except (OSError, KeyError, TypeError, ValueError) as e:
            return f"the state is unreadable ({e})"
        with open(self.stage / SEEN_NAME, "r+b") as f:  # drop digests appended after the snapshot
            f.truncate(n_seen * _DIGEST_BYTES)
        self.seen = {blob[i : i + _DIGEST_BYTES] for i in range(0, len(blob), _DIGEST_BYTES)}
        self.n_seen_saved = n_seen
        self.cursors, self.taken, self.stats = state["cursors"], state["taken"], state["stats"]
        self.shards, self.packers = infos, packers
        self.resumed_shards = len(infos)
        return None

    # --- the loop --------------------------------------------------------------------------------------

    def _flush(self, packer: _Packer) -> None:
        rel = f"{packer.split}/shard_{packer.next_index:05d}.bin"
        info = shards.write_shard(
            self.stage,
            rel,
            packer.tokens(),
            split=packer.split,
            n_docs=packer.n_docs,
            n_bytes=packer.n_bytes,
            dtype=self.dtype,
        )
        self.shards.append(info)
        packer.parts, packer.n_tokens, packer.n_docs, packer.n_bytes = [], 0, 0, 0
        packer.next_index += 1

    def _pick(self, active: list[int]) -> int | None:
        best = None
        for i in active:
            b = self.budgets[i]
            if b is not None and self.taken[i] >= b:
                continue
            if best is None or self.taken[i] * self.rates[best] < self.taken[best] * self.rates[i]:
                best = i
        return best

    def run(self, pool, depth: int) -> None:
        from tqdm import tqdm

        bar_read = tqdm(desc="read", unit=" doc", disable=not self.progress, position=0, leave=False)
        bar_tok = tqdm(desc="tokenize", unit=" doc", disable=not self.progress, position=1, leave=False)
        read_bytes = [0]
        t_read = time.perf_counter()

        def on_read(n: int, n_bytes: int) -> None:
            read_bytes[0] += n_bytes
            bar_read.update(n)
            dt = max(time.perf_counter() - t_read, 1e-9)
            bar_read.set_postfix_str(
                f"{read_bytes[0] / 1e6:.1f} MB, {read_bytes[0] / dt / 1e6:.1f} MB/s", refresh=False
            )

        submit = (lambda items: pool.submit(_process_batch, items)) if pool else _Ready
        streams = [
            _Stream(src.units(self.cursors[i]), submit, depth, on_read) for i, src in enumerate(self.sources)
        ]
        stats, dropped, per_source = self.stats, self.stats["dropped"], self.stats["sources"]
        active = [i for i in range(len(streams)) if not per_source[i]["exhausted"]]
        t0, n_tok, n_bytes, n_units, last = time.perf_counter(), 0, 0, 0, 0.0
        try:
            while (i := self._pick(active)) is not None:
                item = streams[i].next()
                if item is None:
                    per_source[i]["exhausted"] = True
                    active.remove(i)
                    continue
                loc, (status, n_rep, digest, is_val, tokens, doc_bytes, n_special, problem) = item
                if status == KEPT and not (self.dedup and digest in self.seen):
                    packer = self.packers["val" if is_val else "train"]
                    if packer.n_tokens and packer.n_tokens + tokens.size > self.shard_tokens:
                        self._flush(packer)  # a snapshot describes the state *before* this unit
                        if time.monotonic() - self._last_snapshot >= SNAPSHOT_MIN_INTERVAL_S:
                            self._snapshot()
                        if self._sleep:
                            time.sleep(self._sleep)
                self.cursors[i] += 1
                stats["documents_in"] += 1
                per_source[i]["documents_in"] += 1
                stats["replaced_bytes"] += n_rep
                if status == BAD_LINE and not self.skip_bad_lines:
                    raise DataError(f"{format_location(loc)}: {problem}")
                if status != KEPT:
                    dropped[_DROP_NAMES[status]] += 1
                    continue
                if self.dedup:
                    if digest in self.seen:
                        dropped["duplicate"] += 1
                        continue
                    self.seen.add(digest)
                    self.seen_new.append(digest)
                split = "val" if is_val else "train"
                packer = self.packers[split]
                packer.parts.append(tokens)
                packer.n_tokens += tokens.size
                packer.n_docs += 1
                packer.n_bytes += doc_bytes
                self.taken[i] += int(tokens.size)
                stats["kept"] += 1
                stats["special_tokens_removed"] += n_special
                src = per_source[i]
                src["documents"][split] += 1
                src["tokens"][split] += int(tokens.size)
                src["bytes"][split] += doc_bytes
                n_units += 1
                n_tok += tokens.size
                n_bytes += doc_bytes
                if self.progress and (n_units & 63) == 0:
                    now = time.perf_counter()
                    bar_tok.update(n_units - bar_tok.n)
                    if now - last > 0.5:
                        dt, last = now - t0, now
                        bar_tok.set_postfix_str(f"{n_tok / dt:,.0f} tok/s, {n_bytes / dt / 1e6:.1f} MB/s")
            for split in SPLITS:  # the last, partly filled shards
                if self.packers[split].n_docs:
                    self._flush(self.packers[split])
        finally:
            bar_tok.close()
            bar_read.close()


def _start_method():
    """fork where available: workers inherit the tokenizer already built here (building it takes ~0.5 s,
    a large part of a small corpus's time) and start in milliseconds. The workers are started before
    any thread of ours (tqdm's, the executor's) exists. Elsewhere (macOS, Windows) spawn."""
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


def prepare(
    sources: Sequence[str | SourceSpec | tuple[str, float]] = (),
    out: str | os.PathLike = "data/dataset",
    *,
    mixture: str | os.PathLike | None = None,
    tokenizer: str = "gpt2",
    workers: int | None = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    min_chars: int = DEFAULT_MIN_CHARS,
    dedup: bool = True,
    target_tokens: int | None = None,
    text_field: str = "text",
    skip_bad_lines: bool = False,
    overwrite: bool = False,
    seed: int = 0,
    max_docs: int | None = None,
    progress: bool = False,
) -> PrepareSummary:
    """Turn text sources into a verified token dataset in `out` (manifest.json + train/ val/ shards).

    Arguments mirror `mamba3lite prepare` (see its --help). `sources` are specs or (spec, weight) pairs;
    `mixture` adds those of a YAML file (its target_tokens applies unless `target_tokens` is given).
    `workers`: tokenizer processes (default min(4, CPUs); 0 = in this process); the output does not
    depend on it. `max_docs`: at most this many documents (units) from each source. Returns a summary;
    raises ConfigError / DataError (nothing in `out` damaged) on bad input."""
    t_start = time.perf_counter()
    specs = [
        s if isinstance(s, SourceSpec) else SourceSpec(s) if isinstance(s, str) else SourceSpec(*s)
        for s in sources
    ]
    if mixture is not None:
        mix_specs, mix_target = load_mixture(mixture)
        specs = mix_specs + specs
        target_tokens = target_tokens if target_tokens is not None else mix_target
    if workers is None:
        workers = min(4, os.cpu_count() or 1)
    _check_args(specs, shard_tokens, val_fraction, min_chars, workers, target_tokens, max_docs)
    if target_tokens is None and len({s.weight for s in specs}) > 1:
        print(
            "note: without a target token count every document of every source is used; the weights "
            "apply only with --target-tokens",
            file=sys.stderr,
        )
    tok = load_tokenizer(tokenizer)
    dtype = shards.dtype_for_vocab(tok.vocab_size)
    resolved = [Source(s.spec, text_field=text_field, max_docs=max_docs) for s in specs]
    args_record = {
        "pipeline_version": PIPELINE_VERSION,
        "format_version": shards.FORMAT_VERSION,
        "sources": [{"spec": s.spec, "weight": s.weight} for s in specs],
        "tokenizer": tok.name,
        "vocab_hash": tok.vocab_hash,
        "shard_tokens": shard_tokens,
        "val_fraction": val_fraction,
        "min_chars": min_chars,
        "dedup": dedup,
        "target_tokens": target_tokens,
        "text_field": text_field,
        "skip_bad_lines": skip_bad_lines,
        "seed": seed,
        "max_docs": max_docs,
    }
    out = Path(out)
    _skip_own_output(resolved, out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} exists and is not a directory; choose another --out")
    out_existed = out.exists()
    # Held until the manifest is written: a second prepare into `out` fails at once instead of sharing
    # (and resuming from) this one's staging directory.
    lock = DirLock(
        out, LOCK_NAME, "another `mamba3lite prepare`", "wait for it to finish, or choose another --out",
        DataError, remove=True,
    )  # fmt: skip
    with lock:
        stage = out / STAGE_DIRNAME
        try:
            run = _Run(
                stage=stage,
                sources=resolved,
                specs=specs,
                args_record=args_record,
                dtype=dtype,
                eos_id=tok.eos_id,
                shard_tokens=shard_tokens,
                target_tokens=target_tokens,
                dedup=dedup,
                skip_bad_lines=skip_bad_lines,
                progress=progress,
            )
        except Mamba3LiteError:  # a source that cannot be read: leave no empty `out` behind
            if not out_existed:
                shutil.rmtree(out, ignore_errors=True)
            raise
        if (finished := run.interrupted_commit()) is not None:
            print(
                f"note: the previous run of this command finished its dataset but was interrupted while "
                f"moving it into {out}; completing that move",
                file=sys.stderr,
            )
            _commit(stage, out, finished)
            return PrepareSummary(
                out=out,
                manifest=finished,
                stats=finished.extra["stats"],
                seconds=time.perf_counter() - t_start,
                resumed_shards=len(finished.shards),
            )
        _check_out(out, args_record, overwrite)
        if stage.is_dir() and (why := run.try_resume()) is not None:
            print(
                f"note: not resuming the unfinished run in {stage}: {why}; starting afresh", file=sys.stderr
            )
            shutil.rmtree(stage)
        if run.resumed_shards:
            print(f"resuming: {run.resumed_shards} shards already done and verified", file=sys.stderr)
        stage.mkdir(parents=True, exist_ok=True)

        def discard() -> None:
            """Remove what this run made: its staging directory, and `out` if the run created it."""
            shutil.rmtree(stage, ignore_errors=True)
            if not out_existed:
                shutil.rmtree(out, ignore_errors=True)

        pool = None
        try:
            cfg = _WorkerConfig(tok.name, min_chars, text_field, seed, val_fraction)
            if workers:
                # A ProcessPoolExecutor, not a multiprocessing.Pool: when a worker dies (killed for memory)
                # a Pool loses its task and waits forever; the executor raises BrokenProcessPool.
                pool = ProcessPoolExecutor(
                    workers,
                    mp_context=_start_method(),
                    initializer=_init_pool_worker,
                    initargs=(cfg, os.getpid()),
                )
                pool.submit(int).result()  # start the workers now, before any thread of ours exists
            else:
                _init_worker(cfg)
            run.run(pool, depth=2 * workers + 1 if workers else 1)
        except BrokenProcessPool as e:
            raise Mamba3LiteError(
                f"a tokenizer worker process died (killed for memory?); the shards done so far are kept in "
                f"{stage}: re-run the same command to resume, perhaps with fewer --workers"
            ) from e
        except TransientError:
            raise  # a network error, say: the shards done so far are kept for a re-run to resume
        except Mamba3LiteError:
            discard()  # bad input: the same arguments would fail the same way, nothing to resume
            raise
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)  # batches still queued (a target was reached)
        stats = run.stats
        if stats["kept"] == 0 or not run.packers["train"].next_index:
            discard()
            dropped = ", ".join(f"{k} {v}" for k, v in stats["dropped"].items() if v)
            if stats["kept"] == 0:
                raise DataError(
                    f"empty corpus: {stats['documents_in']:,} documents read, none kept "
                    f"(dropped: {dropped or 'none'}); check the sources, or lower --min-chars"
                )
            raise DataError(
                f"all {stats['kept']:,} kept documents fell into the val split; lower --val-fraction or "
                "add text"
            )
        order = {split: k for k, split in enumerate(SPLITS)}
        manifest = Manifest(
            vocab_size=tok.vocab_size,
            eos_id=tok.eos_id,
            dtype=np.dtype(dtype).newbyteorder("=").name,
            tokenizer={"name": tok.name, "vocab_hash": tok.vocab_hash},
            shards=sorted(run.shards, key=lambda s: (order[s.split], s.path)),
            extra={"prepare": args_record, "stats": _public_stats(stats)},
        )
        _finalize(stage, out, manifest, run.fingerprints)
        return PrepareSummary(
            out=out,
            manifest=manifest,
            stats=manifest.extra["stats"],
            seconds=time.perf_counter() - t_start,
            resumed_shards=run.resumed_shards,
        )


def _skip_own_output(sources: list[Source], out: Path) -> None:
    """Drop the files under `out` from directory and glob sources (an --out inside the corpus directory):
    a re-run would otherwise read the previous run's manifest and shards as documents."""
    if not out.exists():  # a first run: nothing of ours to skip, and no file needs resolving
        return
    root = out.resolve()
    for src in sources:
        kept = [f for f in src.files if not f.resolve().is_relative_to(root)]
        if len(kept) < len(src.files):
            print(
                f"note: source {src.spec}: skipping {len(src.files) - len(kept)} file(s) under --out {out}",
                file=sys.stderr,
            )
            src.files = kept


def _public_stats(stats: dict) -> dict:
    public = copy.deepcopy(stats)
    for src in public["sources"]:
        src.pop("exhausted", None)  # internal bookkeeping
    return public


def _finalize(stage: Path, out: Path, manifest: Manifest, fingerprints: list) -> None:
    """Move the staged shards into `out` and put the manifest in place last. The manifest is validated
    and written into the staging dir first, so a manifest that cannot be written (invalid, disk full)
    fails before anything in `out`, an older dataset included, is touched. From then on an interrupted
    move is completed by the next run of the same command (`_Run.interrupted_commit`, `_commit`)."""
    for split in SPLITS:  # temp files of writes killed mid-way in an earlier, resumed run
        for tmp in (stage / split).glob(".*.tmp"):
            tmp.unlink()
    shards.atomic_write_json(stage / COMMIT_NAME, {"fingerprints": fingerprints})
    manifest.save(stage)
    _commit(stage, out, manifest)


def _commit(stage: Path, out: Path, manifest: Manifest) -> None:
    """The move itself; idempotent, so it can be run again after an interruption at any point: a split
    still in the stage is moved into `out`, one the manifest lists that the stage lacks is there already,
    and a split of an older dataset that the new one does not have is removed."""
    old = out / MANIFEST_NAME
    if old.exists():
        old.unlink()  # from here on `out` is not a dataset until the new manifest lands
        shards.fsync_dir(out)
    listed = {s.split for s in manifest.shards}
    for split in SPLITS:
        dst = out / split
        if (stage / split).is_dir():
            if dst.exists():
                shutil.rmtree(dst)
            os.replace(stage / split, dst)
        elif split not in listed and dst.exists():
            shutil.rmtree(dst)
    shards.fsync_dir(out)
    os.replace(stage / MANIFEST_NAME, old)
    shards.fsync_dir(out)
    shutil.rmtree(stage)
