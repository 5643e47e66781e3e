"""The run's record of itself: RUN/config.yaml (the resolved config) and RUN/run.json (the data it
trains on, the manifest hash, the code version, and one entry per start, the last 50)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
from pathlib import Path
from typing import Any

from mamba3lite.atomicfile import atomic_write_json
from mamba3lite.config import Config, write_resolved_config
from mamba3lite.data.shards import MANIFEST_NAME
from mamba3lite.data.splits import dataset_dir

RUN_RECORD_NAME = "run.json"
KEEP_STARTS = 50


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
    return hashlib.sha256(m.read_bytes()).hexdigest() if m.is_file() else None


def data_identity(manifest: Any, data_path: str | None) -> dict | None:
    """What a checkpoint records of its training data, to compare on resume: tokenizer and the
    manifest's hash. None without a manifest."""
    if manifest is None:
        return None
    return {
        "tokenizer": manifest.tokenizer.get("name"),
        "vocab_hash": manifest.tokenizer.get("vocab_hash"),
        "vocab_size": manifest.vocab_size,
        "eos_id": manifest.eos_id,
        "manifest_sha256": manifest_sha256(data_path),
    }


def read_run_record(path: Path) -> dict:
    """RUN/run.json as a dict; {} when missing, unreadable or not an object (then rewritten as ours).
    The one read of run.json."""
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def write_run_records(cfg: Config, run_dir: Path, start: dict, data: dict | None) -> dict:
    """Write RUN/config.yaml and RUN/run.json with one more entry in its `starts` (`start`: world_size,
    resume, device); returns the code version recorded."""
    write_resolved_config(cfg, run_dir / "config.yaml")
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
