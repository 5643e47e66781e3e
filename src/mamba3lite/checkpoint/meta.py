"""The meta file of a step (meta_step_N.json): written last, it vouches for the other two files.

It records the run state (run_state.py's `RunState`: the step, the config, counters, scheduler/sampler/
RNG states, the dataset identity, the last metrics, the W&B run id, ...) and the manager's own fields:
the size and sha256 of the weights and optimizer files (a sharded step: of every file of its shard
directory, under `shards`), the tied aliases, and the sha256 of its own content (`meta_sha256`), so an
edit that still parses is detected too.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from mamba3lite import intake
from mamba3lite.checkpoint.run_state import RunState
from mamba3lite.errors import CheckpointError

META_FORMAT = "mamba3lite-checkpoint-v1"
# The shape of our metas (absent fields are not checked: older metas lack some): every reader (trainer,
# eval, generate, inspect, export) indexes into them without checks of its own. A meta whose digest was
# recomputed after an edit (`config.model` a string) passes the digest; this is what catches it. The run
# state's fields come from RunState itself; the rest are the manager's file-integrity fields.
_META_SCHEMA: dict[str, type | tuple[type, ...]] = {
    **RunState.meta_schema(),
    "files": dict,
    "tied": dict,
    "has_optimizer": bool,
    "shards": dict,
}
_CONFIG_SECTIONS: dict[str, type | tuple[type, ...]] = {"model": dict, "training": dict, "data": dict}
_FILE_ENTRY: dict[str, type | tuple[type, ...]] = {"name": str, "size": int, "sha256": str}
_SHARDS: dict[str, type | tuple[type, ...]] = {"dir": str, "files": dict, "optimizer": str}


def meta_digest(record: dict) -> str:
    """sha256 of a meta record without its own `meta_sha256`, over a canonical JSON form (round-tripped
    first, so int dict keys and tuples hash as they will read back)."""
    body = json.loads(json.dumps({k: v for k, v in record.items() if k != "meta_sha256"}))
    # hashlib releases the GIL on big buffers: this runs beside the data files' writes
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode("utf-8")).hexdigest()


def read_meta_file(path: Path, step: int) -> dict:
    """The parsed meta of `step` at `path` (CheckpointError naming the file if missing or unreadable).
    The one read of a meta file: through the border reader (a regular file, capped, every decoding
    failure one error), then the two fields every format has."""
    if not os.path.lexists(path):
        raise CheckpointError(f"{path} is missing (the save of step {step} did not finish)")
    meta = intake.read_json(path, intake.META)
    if not isinstance(meta.get("step"), int) or isinstance(meta["step"], bool):
        raise CheckpointError(f"{path}: not a checkpoint meta file (no integer `step`)")
    if meta["step"] != step:
        raise CheckpointError(f"{path}: records step {meta['step']}, not {step}")
    return meta


def schema_problem(meta: dict, path: Path) -> str | None:
    """Why `meta` (one of ours) does not have the shape its readers rely on, or None."""
    kind, where = intake.META, str(path)
    try:
        intake.expect(meta, _META_SCHEMA, where=where, kind=kind, optional=tuple(_META_SCHEMA))
        if "config" in meta:
            sections = tuple(_CONFIG_SECTIONS)
            intake.expect(meta["config"], _CONFIG_SECTIONS, where=where, kind=kind, optional=sections,
                          prefix="config.")  # fmt: skip
        for name in ("model", "optim", "average"):
            if name in meta.get("files", {}):
                intake.expect(meta["files"][name], _FILE_ENTRY, where=where, kind=kind,
                              optional=("name",), prefix=f"files.{name}.")  # fmt: skip
        if "shards" in meta:
            intake.expect(meta["shards"], _SHARDS, where=where, kind=kind, optional=("optimizer",),
                          prefix="shards.")  # fmt: skip
            for name, entry in meta["shards"]["files"].items():
                if "/" in name or "\\" in name or name in (".", ".."):
                    raise kind.fail(f"{where}: shards.files names {name!r}, not a file name")
                intake.expect(entry, _FILE_ENTRY, where=where, kind=kind, optional=("name",),
                              prefix=f"shards.files.{name}.")  # fmt: skip
        for alias, source in meta.get("tied", {}).items():
            intake.expect_type(source, str, where=where, kind=kind, what=f"tied.{alias}")
    except CheckpointError as e:
        return str(e)
    return None


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
    # An older meta has no digest to catch an edit, and a digest can be recomputed: the shape is checked.
    if problem := schema_problem(meta, path):
        problems.append(problem)
    return META_FORMAT, problems
