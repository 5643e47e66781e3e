"""The crash-safe staging protocol of `prepare`: all work in OUT/.prepare/, snapshots, resume, commit.

    OUT/.prepare.lock       held (mamba3lite.dirlock) from before a run looks at OUT until it ends
    OUT/.prepare/           the staging directory: train/ val/ shards as they are written, and
      tokenizer.json        the tokenizer fit by --train-tokenizer (written again by every run)
      state.json            the last snapshot: arguments, source fingerprints, cursors, counters, the
                            shards written, those still being written and both splits' partly filled
                            ones (each as pieces of the units' token files, `packing`)
      seen.bin              the dedup digests, appended at each snapshot (state.json says how many count)
      commit.json           written when the dataset is complete, before it is moved into OUT
      plan.json             the plan: the sources' listing cut into work units, the arguments (`plan`)
      units/                each work unit's tokens, index and completion record (`units`)

A snapshot is taken after a shard is sent to be written. A re-run with the same arguments and unchanged
source files re-verifies the snapshot's shards and the units its unwritten shards name, and restores it
(`Stage.restore`). When the dataset is complete its manifest is validated and written into the stage
(`Stage.finalize`), then moved into OUT split by split, manifest last (`commit`); an interrupted move is
completed by the next run of the same command (`Stage.finished_manifest`), computing nothing again.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mamba3lite import intake
from mamba3lite.atomicfile import atomic_write_json, fsync_dir, sha256_file
from mamba3lite.data.clean import DIGEST_BYTES
from mamba3lite.data.packing import Dedup, Packer, ShardJob
from mamba3lite.data.plan import PLAN_NAME
from mamba3lite.data.shards import (
    MANIFEST_NAME,
    SPLITS,
    Manifest,
    ShardInfo,
    check_own_tokenizer,
    is_own_tokenizer,
)
from mamba3lite.data.stats import PrepareStats
from mamba3lite.data.units import UNITS_DIRNAME, tokens_verify
from mamba3lite.data_identity import TOKENIZER_NAME
from mamba3lite.errors import Mamba3LiteError

STAGE_DIRNAME = ".prepare"
LOCK_NAME = ".prepare.lock"  # exists while a prepare runs (mamba3lite.dirlock), or after one was killed
STATE_NAME = "state.json"
COMMIT_NAME = "commit.json"
SEEN_NAME = "seen.bin"


@dataclass
class PipelineState:
    """Everything a snapshot holds, besides the arguments: per-source cursors ([work unit, documents of
    it consumed]) and tokens taken, the counters, the dedup set, the shards written, those sent to be
    written (`queued`, in order) and both splits' partly filled shards."""

    cursors: list[list[int]]
    taken: list[int]
    stats: PrepareStats
    dedup: Dedup
    shards: list[ShardInfo]
    packers: dict[str, Packer]
    queued: list[ShardJob]

    @classmethod
    def fresh(cls, stats: PrepareStats) -> PipelineState:
        n = len(stats.sources)
        packers = {s: Packer(s) for s in SPLITS}
        return cls([[0, 0] for _ in range(n)], [0] * n, stats, Dedup(), [], packers, [])

    def unit_keys(self) -> set[str]:
        """The units whose tokens the unwritten shards name."""
        keys = {key for p in self.packers.values() for key, _, _ in p.pieces}
        return keys.union(*(job.unit_keys() for job in self.queued))


class Stage:
    """The staging directory of one run: `args_record` and `fingerprints` say which run a snapshot
    belongs to (a snapshot of other arguments or changed source files is never restored)."""

    def __init__(self, out: Path, args_record: dict, fingerprints: list, dtype: np.dtype) -> None:
        self.dir = out / STAGE_DIRNAME
        self.args_record = args_record
        self.fingerprints = fingerprints
        self.dtype = dtype

    def _save_seen(self, dedup: Dedup) -> None:
        with open(self.dir / SEEN_NAME, "ab") as f:
            f.write(b"".join(dedup.unsaved))
            f.flush()
            os.fsync(f.fileno())
        dedup.saved()

    def save(self, state: PipelineState) -> None:
        """Persist `state` (between two documents)."""
        self._save_seen(state.dedup)
        record = {
            "args": self.args_record,
            "fingerprints": self.fingerprints,
            "cursors": state.cursors,
            "taken": state.taken,
            "stats": state.stats.to_dict(public=False),
            "n_seen": state.dedup.n_saved,
            "packers": [state.packers[split].to_dict() for split in SPLITS],
            "queued": [job.to_dict() for job in state.queued],
            "shards": [s.__dict__ for s in state.shards],
        }
        atomic_write_json(self.dir / STATE_NAME, record)

    def _load(self, record: dict) -> PipelineState | str:
        infos = [ShardInfo(**d) for d in record["shards"]]
        for info in infos:
            path = self.dir / info.path
            if not path.is_file() or sha256_file(path) != info.sha256:
                return f"shard {info.path} does not verify"
        packers = {p.split: p for p in map(Packer.from_dict, record["packers"])}
        queued = [ShardJob.from_dict(d) for d in record["queued"]]
        if set(packers) != set(SPLITS):
            return "the partly filled shards are not one per split"
        n_seen = record["n_seen"]
        with intake.open_regular(self.dir / SEEN_NAME, intake.STAGE_DATA) as f:
            blob = f.read(n_seen * DIGEST_BYTES)
        if len(blob) != n_seen * DIGEST_BYTES:
            return "the dedup record is short"
        seen = {blob[i : i + DIGEST_BYTES] for i in range(0, len(blob), DIGEST_BYTES)}
        stats = PrepareStats.from_dict(record["stats"])
        dedup = Dedup(seen, n_seen)
        state = PipelineState(record["cursors"], record["taken"], stats, dedup, infos, packers, queued)
        for key in sorted(state.unit_keys()):
            if not tokens_verify(self.dir, key):
                return f"unit {key}, which an unwritten shard names, does not verify"
        return state

    def restore(self) -> PipelineState | str:
        """The snapshot in the staging dir if it matches these arguments and verifies, else why not (the
        caller starts afresh)."""
        if not (self.dir / STATE_NAME).exists():
            return "it left no snapshot (it stopped before its first shard)"
        try:
            record = intake.read_json(self.dir / STATE_NAME, intake.STAGE_STATE)
        except Mamba3LiteError as e:
            return f"no readable state ({e})"
        if record.get("args") != self.args_record:
            return "the arguments differ"
        if record.get("fingerprints") != self.fingerprints:
            return "the source files changed"
        try:
            state = self._load(record)
        except (Mamba3LiteError, OSError, KeyError, TypeError, ValueError) as e:
            return f"the state is unreadable ({e})"
        if isinstance(state, PipelineState):
            with open(self.dir / SEEN_NAME, "r+b") as f:  # drop digests appended after the snapshot
                f.truncate(state.dedup.n_saved * DIGEST_BYTES)
        return state

    def clear(self) -> None:
        """Remove the snapshot and the shards, keeping the plan and the work units' records (`units`):
        a run that starts afresh reuses each unit that belongs to its plan and verifies."""
        for p in self.dir.iterdir():
            if p.name in (UNITS_DIRNAME, PLAN_NAME):
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()

    def finished_manifest(self) -> Manifest | None:
        """The staged manifest when an earlier run of these same arguments, on the same source files,
        completed its dataset and was interrupted while moving it into `out` (`commit`), and every shard
        it lists verifies, in the stage or already in `out`; else None."""
        try:
            manifest = Manifest.load(self.dir, check_tokenizer=False)
            record = intake.read_json(self.dir / COMMIT_NAME, intake.STAGE_STATE)
            if is_own_tokenizer(own := self.args_record["tokenizer"]):  # in the stage, or moved already
                where = self.dir if (self.dir / own).exists() else self.dir.parent
                check_own_tokenizer(where, own, manifest.identity.vocab_hash or "")
        except (Mamba3LiteError, OSError):
            return None
        same_sources = record.get("fingerprints") == self.fingerprints
        if manifest.extra.get("prepare") != self.args_record or not same_sources:
            return None
        for info in manifest.shards:
            path = self.dir / info.path
            if not path.is_file():
                path = self.dir.parent / info.path
            if not path.is_file() or sha256_file(path) != info.sha256:
                return None
        return manifest

    def finalize(self, manifest: Manifest) -> None:
        """Move the staged shards into `out` and put the manifest in place last. The manifest is
        validated and written into the staging dir first, so a manifest that cannot be written (invalid,
        disk full) fails before anything in `out`, an older dataset included, is touched. From then on an
        interrupted move is completed by the next run of the same command (`finished_manifest`, `commit`)."""
        for split in SPLITS:  # temp files of writes killed mid-way in an earlier, resumed run
            for tmp in (self.dir / split).glob(".*.tmp"):
                tmp.unlink()
        atomic_write_json(self.dir / COMMIT_NAME, {"fingerprints": self.fingerprints})
        manifest.save(self.dir)
        commit(self.dir, self.dir.parent, manifest)


def commit(stage: Path, out: Path, manifest: Manifest) -> None:
    """The move itself; idempotent, so it can be run again after an interruption at any point: a split
    still in the stage is moved into `out`, one the manifest lists that the stage lacks is there already,
    and a split of an older dataset that the new one does not have is removed."""
    old = out / MANIFEST_NAME
    if old.exists():
        old.unlink()  # from here on `out` is not a dataset until the new manifest lands
        fsync_dir(out)
    listed = {s.split for s in manifest.shards}
    tokenizer = stage / TOKENIZER_NAME
    if tokenizer.exists():  # the dataset's own (--train-tokenizer): before the manifest that names it
        os.replace(tokenizer, out / TOKENIZER_NAME)
    elif manifest.tokenizer["name"] == "gpt2" and (out / TOKENIZER_NAME).is_file():
        (out / TOKENIZER_NAME).unlink()  # an older dataset's own tokenizer, which nothing names now
    for split in SPLITS:
        dst = out / split
        if (stage / split).is_dir():
            if dst.exists():
                shutil.rmtree(dst)
            os.replace(stage / split, dst)
        elif split not in listed and dst.exists():
            shutil.rmtree(dst)
    fsync_dir(out)
    os.replace(stage / MANIFEST_NAME, old)
    fsync_dir(out)
    shutil.rmtree(stage)
