"""Raw text → verified token shards: plan → map (clean + tokenize each work unit) → commit. Resumable.

`prepare(sources, out, options)` is the library form of `mamba3lite prepare`. Each stage has its own
module: `fit_tokenizer` (with --train-tokenizer: a BPE fit to the train split, before anything else),
`plan` (the listing cut into work units), `units` (one unit computed by a worker, the pure function,
and the driver's reading of it), `clean` (what it does to a document), `workers` (the executor seam and
the local pool; `ray_executor` for --ray), `mixture` (which source is next), `packing` (the dedup set,
the shard being filled), `dedup_partition` (--dedup-partitions), `stats` (the counters) and `staging`
(snapshots, resume, the final move); this module is the driver that joins them. The pipeline:

0. **Fit the tokenizer** (`--train-tokenizer N` only): the sources are read once for the first 16 MB of
   train documents (the split is a hash of the cleaned text, so it is known before any token is), a
   byte-level BPE of N ids is fit to them and written into the staging directory; it is moved into OUT
   as `tokenizer.json` with the shards, and the manifest names it relative to OUT.

1. **Plan** (driver): each source's files are listed once, sorted, with sizes and modification times,
   and cut into work units (`plan`: about a MiB, more on a large corpus, or `--unit-mb`); the plan, with
   the arguments and its hash, is written to `OUT/.prepare/plan.json`, and a re-run reads it instead of
   listing again. (An `hf:` stream cannot be read from a position: the driver reads it and cuts it into
   units of 1,024 rows, shipped with their rows.)
2. **Map** (the executor: `--workers` processes of this machine, or Ray tasks with `--ray`): each unit
   is a pure function of (plan, unit), computed by a worker on its own (`units.run_unit`): it reads the
   unit's files itself, decodes (UTF-8 without its byte-order mark, or UTF-16/32 after theirs;
   undecodable bytes → U+FFFD, counted), skips binary files, NFC-normalises, turns CRLF/CR into LF,
   drops control characters other than newline and tab, drops empty and `< min_chars` documents, hashes
   the cleaned text (sha256), picks its split from that hash and encodes it, EOS after every document;
   it writes the unit's tokens, an index of 42 bytes per document (outcome, split, counts, digest) and
   last a completion record with the plan hash and both files' sha256. A unit with a complete, verified
   record is never computed again. The driver submits each source's units in plan order, a few in
   flight, and takes their records in that order, so the result never depends on the executor, the
   number of workers or timing.
3. **Mix** (driver, from the indexes): the next document comes from the source with the fewest tokens
   taken per unit of rate (ties: lowest index). With a target token count, source i stops after
   weight_i / Σweights × target tokens and its rate is its weight; without one, every document of every
   source is used and the rate is the source's size on disk. Either way the sources run out together,
   so every shard sees every source. No source is ever repeated: one that runs out early contributes
   what it has (the manifest records what each source contributed).
4. **Dedup** (driver): exact duplicates of an earlier kept document (same cleaned-text hash, in mixing
   order) are dropped.
5. **Commit**: per split, whole documents are appended until the next one would overflow `shard_tokens`;
   the shard is then sent to be written, as a task like a unit's (`packing.write_shard_job`): the driver
   describes it as pieces of the units' token files, and the task gathers them, writes the shard
   atomically and re-reads/verifies it (`shards.write_shard`). A document longer than `shard_tokens` gets
   a shard of its own. Documents are never split across shards. The manifest is written last.

The split is a pure function of a document's cleaned content and `seed` (sha256 → a number in [0, 1),
below `val_fraction` → val), so it is stable when a source grows.

**What the driver does and keeps per document.** It reads each unit's index (42 bytes a document) while
the unit is consumed and drops it after, and it never reads or copies a token: a shard is a list of
(unit, token range) pieces. It takes a source's documents a run at a time, a run being as many as the
mixer picks in a row (`Mixer.run_length`; with one source, a whole unit), decided with numpy over the
index's columns, so its cost per document is a few array operations' share, not a Python step. What
grows with the corpus is the dedup set: one 16-byte digest per kept document in a Python set, measured
at ~83 bytes a digest (the bytes object, 56, and its share of the hash table), ~90 with the digests not
yet snapshotted. A 64 GB driver, leaving 8 GB for the rest, therefore dedups ~600M kept documents
(~0.6-1.2T tokens at 1-2k tokens a document).
Beyond that, `--dedup-partitions P` partitions the set by digest (`dedup_partition`): after every unit
is computed, P tasks, each reading the digests of its 1/P of the digest space from every unit's index,
write the digests that occur more than once in the whole corpus; the driver then keeps in its set only
those (a document whose digest occurs once is never a duplicate), ~90 bytes per repeated digest, and the
decisions stay exact and in mixing order: the same bytes out. `--no-dedup` keeps nothing per document.

**Staging and resume.** All work happens in `OUT/.prepare/`; a previous dataset in OUT stays intact
until the new one is complete, and the manifest is written last. After a shard (at most once a second,
SNAPSHOT_MIN_INTERVAL_S), a snapshot of the driver (per-source cursors, counters, the shards written and
those sent to be written, both splits' partly filled shards, the dedup set) goes to
`OUT/.prepare/state.json` (atomically). A re-run with the same
arguments and unchanged source files re-verifies the shards of the snapshot, restores it and continues
from there, reusing every unit already computed; without a usable snapshot it starts the driver afresh
and still reuses the units. The result is byte-identical to an uninterrupted run, and the summary counts
the units computed and reused. A failure caused by bad input removes the staging directory (a re-run
would fail the same way); an interruption (kill, Ctrl-C, disk full, a worker killed for memory, a lost
node) leaves it for the resume. A run holds `OUT/.prepare.lock` (mamba3lite.dirlock) from before it
looks at OUT until the manifest is written, so a second prepare into OUT fails at once instead of
sharing the staging directory; the file is removed when the run ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shutil
import sys
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mamba3lite.atomicfile import atomic_write_bytes
from mamba3lite.data import dedup_partition, packing, ray_executor, shards, staging, units, url_out, workers
from mamba3lite.data import plan as planning
from mamba3lite.data.clean import BAD_LINE, DROP_NAMES, KEPT, WorkerConfig
from mamba3lite.data.mixture import Mixer, SourceSpec, as_spec, load_mixture
from mamba3lite.data.packing import Packer
from mamba3lite.data.plan import Plan
from mamba3lite.data.shards import SPLITS, Manifest
from mamba3lite.data.sources import Source, format_location
from mamba3lite.data.staging import LOCK_NAME, STAGE_DIRNAME, PipelineState, Stage
from mamba3lite.data.stats import PrepareStats, WorkCounts
from mamba3lite.data.store import is_url, url_scheme
from mamba3lite.data.units import UnitJob, UnitRecord
from mamba3lite.data.workers import Executor, UnitStream
from mamba3lite.data_identity import TOKENIZER_NAME, vocab_hash_of
from mamba3lite.dirlock import DirLock
from mamba3lite.errors import ConfigError, DataError, Mamba3LiteError, TransientError
from mamba3lite.tokenizer import load_tokenizer

DEFAULT_SHARD_TOKENS = 50_000_000  # as the seed's pipeline
# 0.5% of documents: plenty of validation text for large corpora; small ones (the quickstart) pass ~0.02.
DEFAULT_VAL_FRACTION = 0.005
# Shorter documents are mostly noise (an empty `__init__.py`, a stray "ok" line).
DEFAULT_MIN_CHARS = 16
# Test hook: seconds to sleep after each shard, so a test can kill a run reliably in the middle.
SLEEP_ENV = "MAMBA3LITE_PREPARE_TEST_SLEEP_S"
# Snapshots for resume are taken after a shard, at most this often: each costs a few fsyncs, which
# dominate with tiny shards; at most this much work is redone after an interruption.
SNAPSHOT_MIN_INTERVAL_S = 1.0
# Bumped whenever a change makes the same arguments produce different output (invalidates resume state).
PIPELINE_VERSION = 1


@dataclass(frozen=True)
class PrepareOptions:
    """How a dataset is made from its sources: the `mamba3lite prepare` flags (see its --help)."""

    tokenizer: str = "gpt2"  # 'gpt2' (offline) or a path to a Hugging Face tokenizer.json
    train_tokenizer: int | None = None  # fit a byte-level BPE of this many ids to the train split
    workers: int | None = None  # tokenizer processes (None: min(4, CPUs); 0: in this process)
    shard_tokens: int = DEFAULT_SHARD_TOKENS  # tokens per shard; documents are never split
    val_fraction: float = DEFAULT_VAL_FRACTION  # fraction of documents in val, chosen by content hash
    min_chars: int = DEFAULT_MIN_CHARS  # documents shorter than this after cleaning are dropped
    dedup: bool = True  # drop exact duplicates of an earlier kept document
    target_tokens: int | None = None  # stop after about this many tokens, split between sources by weight
    text_field: str = "text"  # the text field of .jsonl / .parquet / hf sources
    skip_bad_lines: bool = False  # skip and count malformed JSONL lines instead of stopping
    overwrite: bool = False  # replace a different dataset in `out` (kept intact until the new one is done)
    seed: int = 0  # salts the train/val split hash
    max_docs: int | None = None  # at most this many documents (units) from each source
    progress: bool = False  # progress bars on stderr
    ray: str | None = None  # a Ray cluster's address ('auto': the one this machine joined) runs the units
    dedup_partitions: int = 0  # > 0: find the repeated digests in this many tasks first (dedup_partition)
    # MiB of source text a work unit holds (None: plan.UNIT_BYTES, 1 MiB). The output does not depend on
    # it; the driver's work is mostly per unit, so larger units let it keep more workers busy.
    unit_mb: float | None = None
    stage_dir: str | None = (
        None  # --out URL only: the local directory it is built in (url_out; None: default)
    )

    def n_workers(self) -> int:
        return min(4, os.cpu_count() or 1) if self.workers is None else self.workers

    def check(self) -> None:
        """ConfigError naming the flag of the first value out of range."""
        if self.shard_tokens < 1:
            raise ConfigError(f"--shard-tokens must be >= 1, got {self.shard_tokens}")
        if not 0 <= self.val_fraction < 1:
            raise ConfigError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if self.min_chars < 0:
            raise ConfigError(f"--min-chars must be >= 0, got {self.min_chars}")
        workers = self.n_workers()
        if self.ray is not None and not self.ray.strip():
            raise ConfigError(
                "--ray needs a cluster address (HOST:PORT, or auto for the local node's cluster)"
            )
        if workers < 0:
            raise ConfigError(f"--workers must be >= 0 (0 = in this process), got {workers}")
        if workers > (most := 4 * (os.cpu_count() or 1)):  # each is a process with its own tokenizer
            raise ConfigError(f"--workers {workers} is more than 4 per CPU of this machine (at most {most})")
        if self.target_tokens is not None and self.target_tokens < 1:
            raise ConfigError(f"--target-tokens must be >= 1, got {self.target_tokens}")
        if self.dedup_partitions < 0:
            raise ConfigError(
                f"--dedup-partitions must be >= 0 (0 = one set in the driver), got {self.dedup_partitions}"
            )
        if self.max_docs is not None and self.max_docs < 1:
            raise ConfigError(f"--max-docs must be >= 1, got {self.max_docs}")
        if self.unit_mb is not None and not 0 < self.unit_mb <= 1024:
            raise ConfigError(
                f"--unit-mb must be in (0, 1024] (MiB of text a task reads), got {self.unit_mb}"
            )
        if self.train_tokenizer is not None:
            from mamba3lite.tokenizer_train import check_n_ids

            if self.tokenizer != "gpt2":
                raise ConfigError(
                    f"--train-tokenizer fits a new tokenizer and --tokenizer {self.tokenizer} names one: "
                    "pass one of the two"
                )
            check_n_ids(self.train_tokenizer)

    def args_record(self, specs: list[SourceSpec], tok: dict) -> dict:
        """What defines the dataset (the manifest's `extra["prepare"]`; a contract, key order included):
        the same record means the same dataset, so it also decides resume and rebuild-in-place. `tok`:
        the manifest's tokenizer record. `train_tokenizer` is there only when set, so the records of
        datasets tokenized otherwise are those of earlier versions."""
        trained = {} if self.train_tokenizer is None else {"train_tokenizer": self.train_tokenizer}
        return {
            "pipeline_version": PIPELINE_VERSION,
            "format_version": shards.FORMAT_VERSION,
            "sources": [{"spec": s.spec, "weight": s.weight} for s in specs],
            "tokenizer": tok["name"],
            "vocab_hash": tok["vocab_hash"],
            **trained,
            "shard_tokens": self.shard_tokens,
            "val_fraction": self.val_fraction,
            "min_chars": self.min_chars,
            "dedup": self.dedup,
            "target_tokens": self.target_tokens,
            "text_field": self.text_field,
            "skip_bad_lines": self.skip_bad_lines,
            "seed": self.seed,
            "max_docs": self.max_docs,
        }


@dataclass
class PrepareSummary:
    """What `prepare` did. `stats` is the manifest's `extra["stats"]`; timings live only here."""

    out: Path | str  # the dataset directory, or the URL it was uploaded to
    manifest: Manifest
    stats: dict
    seconds: float
    resumed_shards: int  # shards kept from an interrupted earlier run
    work: WorkCounts | None = None  # the units computed and reused, and where (None: nothing computed)

    @property
    def n_tokens(self) -> int:
        return self.manifest.n_tokens()

    def table(self) -> str:
        """A human-readable summary table."""
        from mamba3lite.data.tables import source_table, split_table

        s, m = self.stats, self.manifest
        dropped = ", ".join(f"{k} {v:,}" for k, v in s["dropped"].items())
        name = m.tokenizer["name"]
        if name == TOKENIZER_NAME:
            name = f"its own BPE, {str(self.out).rstrip('/')}/{name}"
        lines = [
            f"dataset   {self.out}  ({name}, vocab {m.vocab_size:,}, eos id {m.eos_id}, {m.dtype})",
            f"documents read {s['documents_in']:,}  kept {s['kept']:,}  dropped: {dropped}",
            f"replaced undecodable bytes/chars {s['replaced_bytes']:,}",
            "",
            *split_table(m),
            "",
            *source_table(s["sources"]),
        ]
        shard_bytes = m.n_tokens() * m.np_dtype.itemsize
        rate = m.n_tokens() / self.seconds if self.seconds > 0 else float("nan")
        resumed = f", {self.resumed_shards} shards resumed" if self.resumed_shards else ""
        lines += [
            "",
            f"{len(m.shards)} shards, {shard_bytes / 1e6:.2f} MB on disk, {self.seconds:.1f} s, "
            f"{rate:,.0f} tokens/s written{resumed}",
        ]
        if self.work is not None:
            if tokenized := self.work.n_tokens():
                # What the workers encoded, the documents dropped as duplicates and the EOS tokens included:
                # the rate to set beside a tokenizer's own (the written one lower by the duplicates' share).
                per_s = tokenized / self.seconds if self.seconds > 0 else float("nan")
                lines.append(f"{tokenized:,} tokens tokenized in this run: {per_s:,.0f} tokens/s")
            lines += self.work.table()
        val_fraction = m.extra.get("prepare", {}).get("val_fraction", 0)
        if val_fraction and not m.split_shards("val"):
            lines.append(
                f"note: no document fell into the val split (--val-fraction {val_fraction}); "
                "raise it if you need validation data"
            )
        return "\n".join(lines)


class _Progress:
    """The two progress bars (units read; units kept, with tokens/s and MB/s); silent unless enabled."""

    def __init__(self, enabled: bool) -> None:
        from tqdm import tqdm

        self._read = tqdm(desc="read", unit=" doc", disable=not enabled, position=0, leave=False)
        self._tok = tqdm(desc="tokenize", unit=" doc", disable=not enabled, position=1, leave=False)
        self._enabled = enabled
        self._t0 = time.perf_counter()
        self._last = 0.0
        self._read_bytes = self._n_units = self._n_tokens = self._n_bytes = 0

    def on_read(self, n_units: int, n_bytes: int) -> None:
        self._read_bytes += n_bytes
        self._read.update(n_units)
        dt = max(time.perf_counter() - self._t0, 1e-9)
        mb = self._read_bytes / 1e6
        self._read.set_postfix_str(f"{mb:.1f} MB, {mb / dt:.1f} MB/s", refresh=False)

    def on_kept(self, n_tokens: int, n_bytes: int) -> None:
        self._n_units += 1
        self._n_tokens += n_tokens
        self._n_bytes += n_bytes
        if not self._enabled or self._n_units & 63:
            return
        self._tok.update(self._n_units - self._tok.n)
        now = time.perf_counter()
        if now - self._last > 0.5:
            dt, self._last = now - self._t0, now
            self._tok.set_postfix_str(
                f"{self._n_tokens / dt:,.0f} tok/s, {self._n_bytes / dt / 1e6:.1f} MB/s"
            )

    def close(self) -> None:
        self._tok.close()
        self._read.close()


class _Run:
    """One execution of the pipeline into the staging directory; see the module docstring."""

    def __init__(
        self,
        stage: Stage,
        plan: Plan,
        sources: list[Source],
        mixer: Mixer,
        stats: PrepareStats,
        opts: PrepareOptions,
    ):
        self.stage = stage
        self.plan = plan
        self.sources = sources
        self.opts = opts
        self.mixer = mixer
        self.state = PipelineState.fresh(stats)
        self.resumed_shards = 0
        self.work = WorkCounts()
        self._sleep = float(os.environ.get(SLEEP_ENV, "0") or 0)
        self._last_snapshot = time.monotonic()

    def unit_items(self, i: int) -> Iterator[tuple[planning.WorkUnit, list | None]]:
        """Source i's units from its cursor on, each with its rows when it is a stream's (hf:)."""
        start = self.state.cursors[i][0]
        if self.sources[i].hf is not None:
            return planning.stream_units(self.sources[i], i, start)
        return ((unit, None) for unit in self.plan.units[i][start:])

    def try_resume(self) -> str | None:
        """Restore the staged snapshot; None when resumed, else why not (the caller starts afresh)."""
        state = self.stage.restore()
        if isinstance(state, str):
            return state
        self.state = state
        self.resumed_shards = len(state.shards)
        return None

    def _snapshot(self) -> None:
        self.stage.save(self.state)
        self._last_snapshot = time.monotonic()

    def _written(self, info: shards.ShardInfo) -> None:
        self.state.queued.pop(0)
        self.state.shards.append(info)

    def _flush(self, packer: Packer) -> None:
        """Send the split's current shard to be written (a task), and start the next."""
        self._send(packer.job())
        packer.shard_written()
        self._flushed = True
        while len(self._writes) > self._executor.parallelism:
            self._written(self._writes.popleft().result())
        if self._sleep:
            time.sleep(self._sleep)

    def _send(self, job: packing.ShardJob) -> None:
        self.state.queued.append(job)
        stage, dtype = str(self.stage.dir), self.stage.dtype
        self._writes.append(self._executor.call(packing.write_shard_job, stage, dtype, job))

    def _drain(self) -> None:
        """Wait for every shard sent to be written."""
        while self._writes:
            self._written(self._writes.popleft().result())

    def _pack(self, view: units.UnitView, docs: np.ndarray) -> None:
        """Append the kept documents `docs` (positions in `view`, in mixing order) to their splits' shards,
        writing each shard that the next document would overflow (`Packer.fits`)."""
        for code, split in enumerate(units.SPLIT_NAMES):
            mine = docs[view.split[docs] == code]
            if not mine.size:
                continue
            packer, starts, ends = self.state.packers[split], view.starts[mine], view.ends[mine]
            sizes_cum, bytes_cum = np.cumsum(ends - starts), np.cumsum(view.n_bytes[mine])
            k = 0
            while k < mine.size:
                base, bbase = (sizes_cum[k - 1], bytes_cum[k - 1]) if k else (0, 0)
                j = k + packer.room(sizes_cum[k:] - base, self.opts.shard_tokens)
                if j > k:
                    packer.add(view.record.key, starts[k:j], ends[k:j], int(bytes_cum[j - 1] - bbase))
                if j < mine.size:
                    self._flush(packer)
                k = j

    def _window(self, i: int, left: int) -> int:
        """How many documents of source i to look at for its next run of picks: as many as its last run
        took, doubled while runs fill their window (a run is usually a whole unit for one source, one or
        two documents when sources interleave)."""
        return max(1, min(left, self._windows[i]))

    def _take(self, i: int, docs: units.SourceDocs, view: units.UnitView) -> None:
        """Consume source i's next run of documents from `view`: as many as the mixer picks in a row,
        each counted, filtered, deduplicated and packed as one at a time would be."""
        state, lo = self.state, view.pos
        w = self._window(i, docs.limit())
        hi = lo + w
        status = view.status[lo:hi]
        kept = np.flatnonzero(status == KEPT)
        digests = view.digests[lo:hi][kept].tolist() if self.opts.dedup else []
        dup = np.zeros(kept.size, dtype=bool)
        dup[state.dedup.duplicates(digests) if self.opts.dedup else []] = True
        gain = np.zeros(w, dtype=np.int64)
        gain[kept[~dup]] = view.n_tokens[lo:hi][kept[~dup]]
        totals = state.taken[i] + np.cumsum(gain) - gain  # source i's tokens taken before each document
        m = 1 if w == 1 else self.mixer.run_length(state.taken, self._active, i, totals.tolist())
        bad = np.flatnonzero(status[:m] == BAD_LINE) if not self.opts.skip_bad_lines else []
        if len(bad):
            m = int(bad[0]) + 1
        self._windows[i] = 2 * w if m == w else max(1, 2 * m)
        take = kept < m
        taken_docs, taken_dup = kept[take], dup[take]
        self._count(i, view, lo, m, taken_docs, taken_dup)
        docs.advance(m)
        if len(bad):
            k = lo + int(bad[0])
            raise DataError(f"{format_location(view.location(k))}: {view.problem(k)}")
        fresh = taken_docs[~taken_dup]
        if self.opts.dedup:  # the documents taken are a prefix of those kept
            taken_digests = digests[: taken_docs.size]
            if taken_dup.any():
                taken_digests = [taken_digests[k] for k in np.flatnonzero(~taken_dup).tolist()]
            state.dedup.add_all(taken_digests)
        self._pack(view, lo + fresh)
        state.taken[i] = int(totals[m - 1] + gain[m - 1])

    def _count(
        self, i: int, view: units.UnitView, lo: int, m: int, kept: np.ndarray, dup: np.ndarray
    ) -> None:
        """Count documents lo..lo+m of `view`: read, dropped (by reason) and kept (per split)."""
        stats, progress = self.state.stats, self._progress
        stats.read(i, int(view.n_replaced[lo : lo + m].sum()), m)
        codes = np.bincount(view.status[lo : lo + m], minlength=len(DROP_NAMES) + 1).tolist()
        for code, name in DROP_NAMES.items():
            if codes[code]:
                stats.drop(name, codes[code])
        if dup.any():
            stats.drop("duplicate", int(dup.sum()))
        fresh = lo + kept[~dup]
        for code, split in enumerate(units.SPLIT_NAMES):
            mine = fresh[view.split[fresh] == code]
            if mine.size:
                n_tokens, n_bytes = int(view.n_tokens[mine].sum()), int(view.n_bytes[mine].sum())
                stats.keep(i, split, n_tokens, n_bytes, int(view.n_special[mine].sum()), int(mine.size))
                progress.on_kept(n_tokens, n_bytes)

    def run(self, executor: Executor, depth: int) -> None:
        """Mix, dedup and pack every source's documents into shards in the stage (the last ones
        included), `executor` computing the units, up to `depth` per source in flight, and writing the
        shards."""
        self._progress = progress = _Progress(self.opts.progress)
        self._executor, self._writes = executor, deque()
        self.work.executor = executor.describe()

        def on_record(record: UnitRecord) -> None:
            self.work.add(record)
            progress.on_read(record.n_docs, record.n_bytes_read)

        max_docs, per_source = self.opts.max_docs, self.state.stats.sources
        streams = [
            units.SourceDocs(
                self.stage.dir,
                UnitStream(self.unit_items(i), executor, depth, on_record).next,
                self.state.cursors[i],
                None if max_docs is None else max_docs - per_source[i].documents_in,
            )
            for i in range(len(self.plan.units))
        ]
        self._active = [i for i in range(len(streams)) if not per_source[i].exhausted]
        self._windows = [1] * len(streams)
        queued, self.state.queued = self.state.queued, []  # a resumed snapshot's, written again
        for job in queued:
            self._send(job)
        try:
            while (i := self.mixer.pick(self.state.taken, self._active)) is not None:
                view = streams[i].view()
                if view is None:
                    per_source[i].exhausted = True
                    self._active.remove(i)
                    continue
                self._flushed = False
                self._take(i, streams[i], view)
                if self._flushed and time.monotonic() - self._last_snapshot >= SNAPSHOT_MIN_INTERVAL_S:
                    self._snapshot()
            for split in SPLITS:  # the last, partly filled shards
                if self.state.packers[split].n_docs:
                    self._flush(self.state.packers[split])
            self._drain()
        except BaseException:
            for handle in self._writes:  # let the shard writes already sent end before the stage is touched
                with contextlib.suppress(Exception):
                    handle.result()
            raise
        finally:
            progress.close()


def _resolve_specs(
    sources: Sequence[str | SourceSpec | tuple[str, float]],
    mixture: str | os.PathLike | None,
    opts: PrepareOptions,
) -> tuple[list[SourceSpec], PrepareOptions]:
    """The sources (a mixture file's first) and the options with the mixture's target applied unless one
    was given; ConfigError on bad values."""
    specs = [as_spec(s) for s in sources]
    if mixture is not None:
        mix_specs, mix_target = load_mixture(mixture)
        specs = mix_specs + specs
        if opts.target_tokens is None:
            opts = dataclasses.replace(opts, target_tokens=mix_target)
    if not specs:
        raise ConfigError(
            "no sources; pass --source PATH (repeatable), --source stdlib or --mixture FILE.yaml"
        )
    for s in specs:
        if not (s.weight > 0 and math.isfinite(s.weight)):
            raise ConfigError(f"source {s.spec!r}: weight must be a positive number, got {s.weight}")
    opts.check()
    if opts.target_tokens is None and len({s.weight for s in specs}) > 1:
        print(
            "note: without a target token count every document of every source is used; the weights "
            "apply only with --target-tokens",
            file=sys.stderr,
        )
    return specs, opts


def prepare(
    sources: Sequence[str | SourceSpec | tuple[str, float]] = (),
    out: str | os.PathLike = "data/dataset",
    options: PrepareOptions | None = None,
    *,
    mixture: str | os.PathLike | None = None,
    **fields: Any,
) -> PrepareSummary:
    """Turn text sources into a verified token dataset in `out` (manifest.json + train/ val/ shards).

    `sources` are specs or (spec, weight) pairs; `mixture` adds those of a YAML file (its target_tokens
    applies unless the options give one). `options` (a PrepareOptions), or its fields as keywords
    (`prepare(["stdlib"], "data/stdlib", val_fraction=0.02)`; keywords override `options`). The output
    does not depend on the number of workers. `out` may be an s3:// URL: the dataset is built in the
    local `stage_dir` and uploaded, manifest last, under a lock object (`url_out`). Returns a summary;
    raises ConfigError / DataError (nothing in `out` damaged) on bad input."""
    t_start = time.perf_counter()
    opts = dataclasses.replace(options or PrepareOptions(), **fields)
    specs, opts = _resolve_specs(sources, mixture, opts)
    if is_url(str(out)) and url_scheme(str(out)) != "file":
        return _prepare_to_url(specs, str(out), opts, t_start)
    if opts.stage_dir is not None:
        raise ConfigError("--stage-dir applies only to an --out URL (s3://...); a local --out stages in OUT")
    return _prepare_local(specs, Path(str(out).split("://", 1)[-1]), opts, t_start)


def _prepare_to_url(
    specs: list[SourceSpec], url: str, opts: PrepareOptions, t_start: float
) -> PrepareSummary:
    """`prepare --out URL`: built in a local staging directory, uploaded manifest last (url_out)."""
    if opts.ray is not None:
        ray_executor.check(opts.ray)  # before the lock is taken or anything written
    if opts.train_tokenizer is None:
        tok = load_tokenizer(opts.tokenizer)
        tok_record = {"name": tok.name, "vocab_hash": tok.vocab_hash}
    else:  # known once the tokenizer is fit; url_out checks it again before uploading
        tok_record = {"name": TOKENIZER_NAME, "vocab_hash": None}
    expected = opts.args_record(specs, tok_record)
    # The staging directory is ours (disposable): a dataset there with other arguments is replaced.
    local = dataclasses.replace(opts, overwrite=True, stage_dir=None)
    built, manifest = url_out.publish(
        url,
        opts.stage_dir,
        expected,
        opts.overwrite,
        lambda stage: _prepare_local(specs, stage, local, t_start),
    )
    seconds = time.perf_counter() - t_start
    if built is None:  # an interrupted upload, resumed: nothing computed
        return PrepareSummary(url, manifest, manifest.extra["stats"], seconds, len(manifest.shards))
    return dataclasses.replace(built, out=url, manifest=manifest, seconds=seconds)


def _prepare_local(
    specs: list[SourceSpec], out: Path, opts: PrepareOptions, t_start: float
) -> PrepareSummary:
    """`prepare` into the local directory `out` (see the module docstring)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} exists and is not a directory; choose another --out")
    if opts.ray is not None:
        ray_executor.check(opts.ray)  # before any source is read or anything written
    resolved, listing = _list_sources(specs, opts, out)
    tok = _DatasetTokenizer.make(resolved, opts)  # fit to the train split before anything is written
    out_existed = out.exists()
    with _lock(out):
        record = opts.args_record(specs, tok.record)
        plan = Plan([s.spec for s in specs], listing, record)
        try:
            mixer = Mixer(
                [s.weight for s in specs], plan.size_bytes(opts.max_docs, resolved), opts.target_tokens
            )
            stage = Stage(out, record, [plan.listing_hash], shards.dtype_for_vocab(tok.vocab_size))
            run = _Run(stage, plan, resolved, mixer, PrepareStats.new(specs), opts)
        except Mamba3LiteError:  # a source that cannot be read: leave no empty `out` behind
            if not out_existed:
                shutil.rmtree(out, ignore_errors=True)
            raise
        if (finished := _complete_interrupted_move(stage)) is not None:
            seconds = time.perf_counter() - t_start
            return PrepareSummary(out, finished, finished.extra["stats"], seconds, len(finished.shards))
        _check_out(out, record, opts.overwrite)
        _start_or_resume(run)
        plan.save(stage.dir)
        cfg = WorkerConfig(tok.stage(stage), opts.min_chars, opts.text_field, opts.seed, opts.val_fraction)
        _run_pipeline(
            run, UnitJob(cfg, str(stage.dir), plan.hash, opts.max_docs, _test_unit_sleep()), out_existed
        )
        manifest = _manifest(run, tok)
        stage.finalize(manifest)
        seconds = time.perf_counter() - t_start
        return PrepareSummary(out, manifest, manifest.extra["stats"], seconds, run.resumed_shards, run.work)


def _test_unit_sleep() -> float:
    return float(os.environ.get(units.UNIT_SLEEP_ENV, "0") or 0)


def _list_sources(
    specs: list[SourceSpec], opts: PrepareOptions, out: Path
) -> tuple[list[Source], list[list[planning.WorkUnit]]]:
    """The sources and their work units: from the plan an earlier run of these sources recorded in the
    staging directory (nothing listed again; its files only stat'ed), else listed now."""
    names = [s.spec for s in specs]
    listing = planning.read_listing(out / STAGE_DIRNAME, names)
    if listing is not None:
        recorded = Plan(names, listing, {})
        if recorded.changed() is None:
            return recorded.sources(opts.text_field, opts.max_docs), listing
    resolved = [Source(s.spec, text_field=opts.text_field, max_docs=opts.max_docs) for s in specs]
    _skip_own_output(resolved, out)
    unit_bytes = None if opts.unit_mb is None else max(1, round(opts.unit_mb * (1 << 20)))
    return resolved, planning.list_units(resolved, unit_bytes)


@dataclass(frozen=True)
class _DatasetTokenizer:
    """The dataset's tokenizer: `record` is the manifest's {"name", "vocab_hash"}; `trained` the bytes of
    the tokenizer.json fit by `--train-tokenizer` (None: an existing tokenizer, `loaded`)."""

    record: dict
    vocab_size: int
    eos_id: int
    trained: bytes | None = None
    loaded: str | None = None

    @classmethod
    def make(cls, sources: list[Source], opts: PrepareOptions) -> _DatasetTokenizer:
        if opts.train_tokenizer is None:
            tok = load_tokenizer(opts.tokenizer)
            record = {"name": tok.name, "vocab_hash": tok.vocab_hash}
            return cls(record, tok.vocab_size, tok.eos_id, loaded=tok.name)
        from mamba3lite.data.fit_tokenizer import fit_tokenizer
        from mamba3lite.tokenizer_train import trained_eos_id

        raw = fit_tokenizer(sources, opts)
        record = {"name": TOKENIZER_NAME, "vocab_hash": vocab_hash_of(raw)}
        return cls(record, opts.train_tokenizer, trained_eos_id(), trained=raw)

    def stage(self, stage: Stage) -> str:
        """What the workers load: the trained tokenizer, written into the staging directory (moved into
        the dataset with the shards, `staging.commit`), or the existing one."""
        if self.trained is None:
            assert self.loaded is not None
            return self.loaded
        path = stage.dir / TOKENIZER_NAME
        atomic_write_bytes(path, self.trained)
        tok = load_tokenizer(str(path))  # built here once: forked workers inherit it
        assert (tok.vocab_size, tok.eos_id, tok.vocab_hash) == (
            self.vocab_size, self.eos_id, self.record["vocab_hash"]
        ), (tok.vocab_size, tok.eos_id)  # fmt: skip
        return str(path)


def _lock(out: Path) -> DirLock:
    """Held until the manifest is written: a second prepare into `out` fails at once instead of sharing
    (and resuming from) this one's staging directory."""
    return DirLock(
        out, LOCK_NAME, "another `mamba3lite prepare`", "wait for it to finish, or choose another --out",
        DataError, remove=True,
    )  # fmt: skip


def _complete_interrupted_move(stage: Stage) -> Manifest | None:
    """The dataset of an earlier run of this same command that was complete but interrupted while being
    moved into `out`, now moved; None when there is none."""
    finished = stage.finished_manifest()
    if finished is not None:
        print(
            f"note: the previous run of this command finished its dataset but was interrupted while "
            f"moving it into {stage.dir.parent}; completing that move",
            file=sys.stderr,
        )
        staging.commit(stage.dir, stage.dir.parent, finished)
    return finished


def _discard(stage: Stage, out_existed: bool) -> None:
    """Remove what this run made: its staging directory, and `out` if the run created it."""
    shutil.rmtree(stage.dir, ignore_errors=True)
    if not out_existed:
        shutil.rmtree(stage.dir.parent, ignore_errors=True)


def _start_or_resume(run: _Run) -> None:
    stage = run.stage
    if stage.dir.is_dir() and (why := run.try_resume()) is not None:
        print(
            f"note: not resuming the driver of the unfinished run in {stage.dir}: {why}; it starts afresh,"
            " reusing each work unit already computed that verifies",
            file=sys.stderr,
        )
        stage.clear()  # the units' records stay: each is reused if it belongs to this plan and verifies
    if run.resumed_shards:
        print(f"resuming: {run.resumed_shards} shards already done and verified", file=sys.stderr)
    stage.dir.mkdir(parents=True, exist_ok=True)


def _executor(opts: PrepareOptions, job: UnitJob) -> Executor:
    """The local pool, or a Ray cluster with --ray (Ray is imported only then)."""
    if opts.ray is None:
        return workers.LocalPool(job, opts.n_workers())
    return ray_executor.RayExecutor(opts.ray, job)


def _partition_dedup(run: _Run, executor: Executor, depth: int) -> Executor:
    """The pre-pass of a partitioned dedup (`dedup_partition`): compute every unit not yet consumed (up
    to `depth` in flight), find the digests that occur more than once in `dedup_partitions` tasks, and
    make them the dedup's candidates. Returns the executor answering from the records computed here."""
    records: dict[str, UnitRecord] = {}
    window: deque = deque()
    for i in range(len(run.plan.units)):
        try:
            for unit, rows in run.unit_items(i):
                window.append((unit.key, executor.submit(unit, rows)))
                if len(window) >= depth:
                    key, handle = window.popleft()
                    records[key] = handle.result()
        except Mamba3LiteError:
            pass  # a stream's read error: raised again where the driver reaches it (it reads it again)
    while window:
        key, handle = window.popleft()
        records[key] = handle.result()
    n_parts = run.opts.dedup_partitions
    stage = str(run.stage.dir)
    handles = [executor.call(dedup_partition.duplicate_digests, stage, p, n_parts) for p in range(n_parts)]
    for handle in handles:
        handle.result()
    run.state.dedup.candidates = dedup_partition.load_candidates(stage, n_parts)
    run.work.dedup_partitions, run.work.dedup_candidates = n_parts, len(run.state.dedup.candidates)
    return workers.Prefetched(executor, records)


def _run_pipeline(run: _Run, job: UnitJob, out_existed: bool) -> None:
    """Run the pipeline with its executor. Bad input removes the staging directory (the same arguments
    would fail the same way) once the executor has stopped (no task writes into it after); an
    interruption or a lost worker leaves it for the resume."""
    executor = None
    try:
        executor = _executor(run.opts, job)
        depth = 2 * executor.parallelism + 1 if run.opts.ray is not None or run.opts.n_workers() else 1
        if run.opts.dedup and run.opts.dedup_partitions:
            executor = _partition_dedup(run, executor, depth)
        run.run(executor, depth)
    except BrokenProcessPool as e:
        raise Mamba3LiteError(
            f"a tokenizer worker process died (killed for memory?); the shards done so far are kept in "
            f"{run.stage.dir}: re-run the same command to resume, perhaps with fewer --workers"
        ) from e
    except TransientError:
        raise  # a network error, say: the shards done so far are kept for a re-run to resume
    except Mamba3LiteError:
        if executor is not None:
            executor.close()
            executor = None
        _discard(run.stage, out_existed)
        raise
    finally:
        if executor is not None:
            executor.close()
    stats = run.state.stats
    if stats.kept == 0:
        _discard(run.stage, out_existed)
        raise DataError(
            f"empty corpus: {stats.documents_in:,} documents read, none kept "
            f"(dropped: {stats.dropped_text() or 'none'}); check the sources, or lower --min-chars"
        )
    if not run.state.packers["train"].next_index:
        _discard(run.stage, out_existed)
        raise DataError(
            f"all {stats.kept:,} kept documents fell into the val split; lower --val-fraction or add text"
        )


def _manifest(run: _Run, tok: _DatasetTokenizer) -> Manifest:
    order = {split: k for k, split in enumerate(SPLITS)}
    return Manifest(
        vocab_size=tok.vocab_size,
        eos_id=tok.eos_id,
        dtype=np.dtype(run.stage.dtype).newbyteorder("=").name,
        tokenizer=dict(tok.record),
        shards=sorted(run.state.shards, key=lambda s: (order[s.split], s.path)),
        extra={"prepare": run.stage.args_record, "stats": run.state.stats.to_dict(public=True)},
    )


def _skip_own_output(sources: list[Source], out: Path) -> None:
    """Say which prepared datasets the sources' walks skipped (`sources.is_prepared_dataset`), and drop
    the files under `out` from directory and glob sources (an --out inside the corpus directory), in
    whatever state an interrupted run left it: a re-run would otherwise read them as documents."""
    for src in sources:
        if src.skipped_datasets:
            names = ", ".join(map(str, src.skipped_datasets[:3]))
            more = f" and {len(src.skipped_datasets) - 3} more" if len(src.skipped_datasets) > 3 else ""
            print(f"note: source {src.spec}: skipping the prepared dataset(s) {names}{more}", file=sys.stderr)
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


def _check_out(out: Path, args_record: dict, overwrite: bool) -> None:
    """Refuse to write into a directory of the user's files (the one rule, `outdir.check_may_write`;
    --overwrite does not lift it: it replaces a dataset, not whatever is there), and to replace a
    dataset that is not this same one, unless `overwrite`. `out` is a directory by now (`prepare`
    refused a file and created it to hold its lock)."""
    from mamba3lite import outdir

    outdir.check_may_write(
        out,
        flag="--out",
        is_ours=_is_dataset_dir,
        what="a mamba3lite dataset",
        ignore=(STAGE_DIRNAME, LOCK_NAME),
    )
    if overwrite or not shards.has_manifest(out):
        return
    try:  # its tokenizer is not checked: the same arguments rebuild a dataset whose tokenizer was deleted
        previous = Manifest.load(out, check_tokenizer=False).extra.get("prepare")
    except DataError:
        previous = None
    if previous == args_record:
        return  # the same dataset, rebuilt from the same arguments
    what = "a dataset prepared with different arguments" if previous else "a different dataset"
    raise ConfigError(
        f"--out {out} holds {what}; choose another --out, or pass --overwrite to "
        "replace it (it stays intact until the new dataset is complete)"
    )


def _is_dataset_dir(out: Path) -> bool:
    """Whether `out` is prepare's own: it holds a manifest, or the staging directory of a run of ours
    (whose shards a commit cut short may have moved into `out` already)."""
    return shards.has_manifest(out) or (out / STAGE_DIRNAME).is_dir()
