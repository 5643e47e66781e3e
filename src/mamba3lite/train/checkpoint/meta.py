"""The meta file of a step (meta_step_N.json): written last, it vouches for the other two files.

It records the step, the config, counters, scheduler/sampler/RNG states, the dataset identity, the
last metrics, the W&B run id, the size and sha256 of the weights and optimizer files, and the sha256
of its own content (`meta_sha256`), so an edit that still parses is detected too.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from mamba3lite.errors import CheckpointError

META_FORMAT = "mamba3lite-checkpoint-v1"
# Types of our metas' fields (absent ones are not checked): every reader (trainer, eval, generate,
# inspect) relies on them.
_META_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "tokens_seen": int,
    "files": dict,
    "config": dict,
    "data": (dict, type(None)),
    "metrics": (dict, type(None)),
    "last_eval": (dict, type(None)),
    "sampler": dict,
    "rng": dict,
    "tied": dict,
    "has_optimizer": bool,
    "wandb_run_id": (str, type(None)),
}


def meta_digest(record: dict) -> str:
    """sha256 of a meta record without its own `meta_sha256`, over a canonical JSON form (round-tripped
    first, so int dict keys and tuples hash as they will read back)."""
    body = json.loads(json.dumps({k: v for k, v in record.items() if k != "meta_sha256"}))
    # hashlib releases the GIL on big buffers: this runs beside the data files' writes
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode("utf-8")).hexdigest()


def read_meta_file(path: Path, step: int) -> dict:
    """The parsed meta of `step` at `path` (CheckpointError naming the file if missing or unreadable).
    The one read of a meta file."""
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing (the save of step {step} did not finish)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
        raise CheckpointError(f"{path}: not a checkpoint meta file (no integer `step`)")
    if meta["step"] != step:
        raise CheckpointError(f"{path}: records step {meta['step']}, not {step}")
    return meta


def meta_problems(meta: dict, path: Path) -> tuple[str | None, list[str]]:
    """(format, problems) of one of our metas, read from `path`: format is META_FORMAT, or None for an
    unknown format value, whose other fields are then not checked."""
    digest_ok = "meta_sha256" not in meta or meta["meta_sha256"] == meta_digest(meta)  # absent: older v1
    if meta.get("format") != META_FORMAT:
        # A damaged value (a flipped bit must not turn verification off by making the step look like
        # a seed-format one) or another version's file.
        why = "corrupt or edited" if not digest_ok else "written by another version of mamba3lite?"
        return None, [
            f"{path}: unknown checkpoint format {meta.get('format')!r}, expected {META_FORMAT!r} ({why})"
        ]
    problems = [] if digest_ok else [f"{path}: content differs from its meta_sha256 (corrupt or edited)"]
    # An older meta has no digest to catch an edit: its fields' types are checked.
    bad = [k for k, types in _META_FIELD_TYPES.items() if k in meta and not isinstance(meta[k], types)]
    if bad:
        problems.append(f"{path}: field(s) {', '.join(bad)} of the wrong type (corrupt or edited)")
    return META_FORMAT, problems
