"""Verification: whether one step's files are what its meta records, and can be trusted.

A step counts only when its meta parses (and matches its own digest) and every file it records matches
its size and sha256, so a torn-but-complete step is detected. `StepVerifier.status(step)` answers with a
`CheckpointStatus` and never raises for bad files: the problems are lines naming each bad or missing file.
A seed-format step (no checksums) is loadable when its files are whole, never "verified".

Hashing a multi-gigabyte file is the cost of a check, so the verifier remembers each file's sha256 by
(path, size, mtime_ns): a file the manager just wrote, or one hashed moments ago, is not read again.
`forget` drops them (corruption after a save changes neither size nor mtime: a rollback checks afresh).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mamba3lite.atomicfile import sha256_file
from mamba3lite.checkpoint.lazy import sharded_files
from mamba3lite.checkpoint.meta import meta_problems, read_meta_file
from mamba3lite.checkpoint.seed_format import is_seed_meta, seed_file_problems
from mamba3lite.errors import CheckpointError
from mamba3lite.rundir import average_file, checkpoint_files, sharded_dir


@dataclass
class CheckpointStatus:
    """What is on disk for one step and whether it can be trusted."""

    step: int
    verified: bool  # meta parses and both other files match their recorded size and sha256
    loadable: bool  # verified, or a whole seed-format triple (no checksums to check)
    format: str | None  # META_FORMAT, "seed", or None when the meta is missing/unreadable/of unknown format
    problems: list[str] = field(default_factory=list)  # one line per bad/missing file, naming it
    sizes: dict[str, int | None] = field(default_factory=dict)
    sharded: bool = False  # a sharded step (its shard directory is on disk)
    meta: dict | None = None  # the parsed meta (None when missing or unreadable): trusted when `loadable`


def has_average(meta: dict) -> bool:
    """Whether the step of `meta` holds averaged weights (average_step_N.safetensors, in its files)."""
    return "average" in (meta.get("files") or {})


class StepVerifier:
    """Checks the steps of one run directory against their metas, each file hashed once while unchanged."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self._hashes: dict[tuple[str, int, int], str] = {}  # (path, size, mtime_ns) -> sha256

    def remember(self, path: Path, sha: str) -> None:
        """`path` (as it is now) has sha256 `sha`: what a save just wrote needs no re-hash when loaded."""
        st = path.stat()
        self._hashes[(str(path), st.st_size, st.st_mtime_ns)] = sha

    def forget(self) -> None:
        """Hash every file again from now on (see the module docstring)."""
        self._hashes.clear()

    def sha256(self, path: Path) -> str:
        """The sha256 of `path`, read once while its size and mtime stay the same."""
        st = path.stat()
        key = (str(path), st.st_size, st.st_mtime_ns)
        if key not in self._hashes:
            self._hashes[key] = sha256_file(path)
        return self._hashes[key]

    def status(self, step: int, *, need_optimizer: bool = True) -> CheckpointStatus:
        """Check one step's files against its meta (sizes, then hashes). Never raises for bad files.
        `need_optimizer=False`: the weights alone (generate, eval), so a step whose optimizer file was
        deleted to save space still counts. A sharded step: every file its meta records in its shard
        directory (weights and optimizer state share files), whatever `need_optimizer` says."""
        paths = checkpoint_files(self.dir, step)
        sdir = sharded_dir(self.dir, step)
        kinds = ("model", "optim") if need_optimizer else ("model",)
        sizes = {k: _size(p) for k, p in paths.items()}
        has_shards = sdir.is_dir()
        if has_shards:  # for `inspect`: the shards' bytes in all
            sizes["shards"] = sum(f.stat().st_size for f in sdir.iterdir() if f.is_file())
        try:
            meta = read_meta_file(paths["meta"], step)
        except CheckpointError as e:
            if has_shards:  # a sharded save killed before its meta
                problems = [str(e), f"{sdir} holds the shards of a save that did not finish"]
            else:
                problems = [str(e), *(f"{paths[kind]} is missing" for kind in kinds if sizes[kind] is None)]
            return CheckpointStatus(step, False, False, None, problems, sizes, has_shards)
        if is_seed_meta(meta):
            problems = seed_file_problems(paths, kinds)
            return CheckpointStatus(step, False, not problems, "seed", problems, sizes, meta=meta)
        fmt, problems = meta_problems(meta, paths["meta"])
        sharded = isinstance(meta.get("shards"), dict)
        if not problems:  # an edited or damaged meta: its other fields cannot be trusted to have any shape
            if sharded:
                problems = sharded_files().shard_problems(meta["shards"], sdir, self.sha256)
            else:
                if has_average(meta):  # every user of the step may read the average
                    kinds, paths = (*kinds, "average"), {**paths, "average": average_file(self.dir, step)}
                    sizes["average"] = _size(paths["average"])
                problems = self._data_file_problems(meta, paths, sizes, kinds)
        ok = not problems
        return CheckpointStatus(step, ok, ok, fmt, problems, sizes, sharded, meta)

    def _data_file_problems(
        self, meta: dict, paths: dict[str, Path], sizes: dict[str, int | None], kinds: tuple[str, ...]
    ) -> list[str]:
        """Each data file `kinds` against the size and sha256 its (trusted) meta records."""
        problems = []
        for kind in kinds:
            want = meta.get("files", {}).get(kind)
            want = want if isinstance(want, dict) else {}
            path = paths[kind]
            if sizes[kind] is None:
                problems.append(f"{path} is missing")
            elif sizes[kind] != want.get("size"):
                problems.append(f"{path} has {sizes[kind]} bytes, its meta records {want.get('size')}")
            elif self.sha256(path) != want.get("sha256"):
                problems.append(f"{path}: sha256 differs from its meta (corrupt file)")
        return problems


def _size(path: Path) -> int | None:
    return path.stat().st_size if path.exists() else None
