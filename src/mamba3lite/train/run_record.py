"""The run's record of itself: RUN/config.yaml (the resolved config), RUN/run.json (the data it
trains on, the manifest hash, the code version, and one entry per start, the last 50) and, when the data
was tokenized with a tokenizer.json (its own, `prepare --train-tokenizer`, or one given), a copy of it as
RUN/tokenizer.json: the checkpoints record it by that relative name, so the run keeps generating,
evaluating and exporting when the dataset is deleted or moved."""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mamba3lite import intake
from mamba3lite.atomicfile import atomic_write_bytes, atomic_write_json
from mamba3lite.checkpoint.run_state import RngState, RunState
from mamba3lite.config import Config, write_resolved_config
from mamba3lite.data.shards import MANIFEST_NAME, Manifest, dataset_dir, has_manifest
from mamba3lite.data_identity import TOKENIZER_NAME
from mamba3lite.errors import CheckpointError, ConfigError, Mamba3LiteError
from mamba3lite.rundir import CONFIG_NAME, RUN_RECORD_NAME

KEEP_STARTS = 50


@dataclass
class RunRecord:
    """What a trainer keeps of its run's record between saves: how it resumes ("latest", "none" or a
    step), this process's random generators (a stateful part), the W&B run id a resumed run continues,
    and the code version its start wrote to run.json (each checkpoint records it too)."""

    resume: str | int
    rng: RngState = field(default_factory=RngState)
    wandb_run_id: str | None = None
    code_version: dict | None = None

    def continue_wandb(self, ckpt, step: int) -> None:
        """Take the W&B run id checkpoint `step` recorded (-1: none), so a resumed run continues it."""
        if step >= 0:
            with contextlib.suppress(CheckpointError):
                self.wandb_run_id = RunState.from_meta(ckpt.read_meta(step)).wandb_run_id


def check_not_a_dataset(run_dir: str | Path) -> None:
    """A run directory that holds a dataset's manifest is refused: checkpoints would be mixed into it."""
    if has_manifest(run_dir):
        raise ConfigError(
            f"training.checkpoint_dir {run_dir} is a dataset directory (it holds {MANIFEST_NAME}): "
            "checkpoints would be mixed into the dataset; point --checkpoint-dir at a run directory"
        )


def code_version() -> dict:
    """Package version and, when running from a git checkout, the commit (and whether it is dirty)."""
    from mamba3lite import __version__

    info: dict[str, Any] = {"package": __version__, "git_commit": None}
    here = Path(__file__).resolve().parent

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=here, capture_output=True, text=True, timeout=5)

    try:
        commit = git("rev-parse", "HEAD")
        if commit.returncode == 0:
            info["git_commit"] = commit.stdout.strip()
            dirty = git("status", "--porcelain", "--untracked-files=no")
            info["git_dirty"] = bool(dirty.stdout.strip()) if dirty.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def manifest_sha256(path: str | None) -> str | None:
    """sha256 of the manifest of the dataset at `path`, None when there is none (dummy, seed files)."""
    if not path:
        return None
    m = dataset_dir(path) / MANIFEST_NAME
    if not os.path.lexists(m):
        return None
    return hashlib.sha256(intake.read_bytes_capped(m, intake.MANIFEST)).hexdigest()


def data_identity(manifest: Any, data_path: str | None) -> dict | None:
    """What a checkpoint records of its training data, to compare on resume: the manifest's
    `DataIdentity` with the manifest's hash, in its meta form (`DataIdentity.to_dict`: a tokenizer.json
    is recorded as the run's copy of it, "tokenizer.json" relative to the run directory,
    `copy_tokenizer`). None without a manifest."""
    if manifest is None:
        return None
    return manifest.identity.with_manifest_sha256(manifest_sha256(data_path)).to_dict()


_NONE = type(None)
_RUN_SCHEMA: dict[str, type | tuple[type, ...]] = {
    "data_path": (str, _NONE),
    "val_data_path": (str, _NONE),
    "dummy": bool,
    "data_manifest_sha256": (str, _NONE),
    "data": (dict, _NONE),
    "code_version": (dict, _NONE),
    "starts": list,
}


def read_run_record(path: Path) -> dict:
    """RUN/run.json as a dict ({} when there is none), through the border reader and its schema: a
    damaged or foreign record is a CheckpointError naming the file, not replaced. The one read of
    run.json."""
    if not os.path.lexists(path):
        return {}
    info = intake.read_json(path, intake.RUN_INFO)
    intake.expect(info, _RUN_SCHEMA, where=str(path), kind=intake.RUN_INFO, optional=tuple(_RUN_SCHEMA))
    for i, entry in enumerate(info.get("starts", [])):
        intake.expect_type(entry, dict, where=str(path), kind=intake.RUN_INFO, what=f"starts[{i}]")
    return info


def run_records_problem(run_dir: Path) -> str | None:
    """Why the records in `run_dir` that a start rewrites (run.json, metrics.jsonl) cannot be carried
    on, or None. Checked before a start changes anything (a resume moves newer checkpoints aside, the
    metrics log is rewritten): a damaged record is refused then, not dropped or crashed on later."""
    from mamba3lite.rundir import METRICS_NAME
    from mamba3lite.train.metrics.jsonl import check_row

    try:
        read_run_record(run_dir / RUN_RECORD_NAME)
        metrics = run_dir / METRICS_NAME
        if not os.path.lexists(metrics):
            return None
        lines = list(intake.iter_jsonl(metrics, intake.METRICS))
        with intake.open_regular(metrics, intake.METRICS) as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(size - 1, 0))
            torn_tail = size > 0 and f.read(1) != b"\n"
    except Mamba3LiteError as e:
        return str(e)
    for i, line in enumerate(lines):
        problem = line.problem
        if problem is None:
            try:
                check_row(line.value, f"{metrics} line {line.lineno}")
            except Mamba3LiteError as e:
                problem = str(e)
        if problem is not None and not (torn_tail and i == len(lines) - 1):  # a crash tears the last line
            return (
                f"{problem}; a start rewrites that log, so it is refused as it is: remove the line (or "
                "move metrics.jsonl away) and run again"
            )
    return None


def copy_tokenizer(cfg: Config, run_dir: Path, data: dict | None) -> None:
    """Copy the tokenizer.json the training data was tokenized with to RUN/tokenizer.json, when `data`
    (`data_identity`) records one; the file is verified against that record first
    (`DataIdentity.verify`): a tokenizer file changed since `prepare` is a DataError, not a run whose copy
    means nothing."""
    if not data or data.get("tokenizer") != TOKENIZER_NAME or cfg.data.dummy:
        return
    # The file the manifest names, held to the hash the run's checkpoints record for it.
    ident = Manifest.load(cfg.data.train_data_path or "", check_tokenizer=False).identity
    raw = replace(ident, vocab_hash=data.get("vocab_hash")).verify(
        what=f"the data at {cfg.data.train_data_path} was tokenized with it",
        fix="put the original back, or prepare the data again",
    )
    assert raw is not None  # data names a tokenizer file, so the manifest does
    atomic_write_bytes(Path(run_dir) / TOKENIZER_NAME, raw)


def write_run_records(cfg: Config, run_dir: Path, start: dict, data: dict | None) -> dict:
    """Write RUN/config.yaml, RUN/run.json with one more entry in its `starts` (`start`: world_size,
    resume, device) and the run's copy of its tokenizer (`copy_tokenizer`); returns the code version
    recorded."""
    copy_tokenizer(cfg, run_dir, data)
    write_resolved_config(cfg, run_dir / CONFIG_NAME)
    version = code_version()
    path = run_dir / RUN_RECORD_NAME
    info = read_run_record(path)
    starts = info.get("starts", []) if isinstance(info.get("starts"), list) else []
    starts.append({"time": time.time(), "code_version": version, **start})
    train_path = None if cfg.data.dummy else cfg.data.train_data_path
    record = {
        "data_path": train_path,
        "val_data_path": cfg.data.val_data_path,
        "dummy": cfg.data.dummy,
        "data_manifest_sha256": manifest_sha256(train_path),
        "data": data,
        "code_version": version,
        "starts": starts[-KEEP_STARTS:],
    }
    atomic_write_json(path, record)
    return version
