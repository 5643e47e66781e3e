"""The sharded step format: every rank writes its own shards with torch.distributed.checkpoint (DCP).

    RUN/dcp_step_N/__R_K.distcp   rank R's shards of the model and optimizer state (local DTensor pieces;
                                  no rank gathers the whole state)
    RUN/dcp_step_N/.metadata      DCP's index: which tensor pieces are where (written by rank 0 once
                                  every rank's files are written)
    RUN/meta_step_N.json          written LAST, by rank 0, once DCP's save completed on every rank: the
                                  RunState (with every rank's RNG state) and the size and sha256 of every
                                  file above, under "shards"; it is the commit marker, as in the
                                  three-file format

What is saved is {"model": model state, "optim": optimizer state}, both keyed by parameter name (state.py),
so DCP reshards on load: a step saved by 4 processes loads into 2, into one process without a process
group, or into a DDP or plain model. This module does the DCP I/O and the checks of the files against the
meta; sharded_save.py decides when, and writes the meta.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from mamba3lite.errors import CheckpointError

_ONE_PROCESS_WARNING = "torch.distributed is disabled, unavailable or uninitialized, assuming the intent"


class _PausableWriter(FileSystemWriter):
    """DCP's file writer, with the test-only pause of writer.SLOW_SAVE_ENV before each rank's data is
    written (in the background thread for an async save): a test can prove the save call returned first,
    or kill the process mid-save."""

    def __init__(self, path: Path, pause: Callable[[], None]) -> None:
        super().__init__(path, sync_files=True)
        self._pause = pause

    def write_data(self, plan: Any, planner: Any) -> Any:
        self._pause()
        return super().write_data(plan, planner)


def write_shards(
    directory: Path,
    content: dict[str, Any],
    *,
    async_save: bool,
    process_group: Any = None,
    pause: Callable[[], None] = lambda: None,
) -> Future | None:
    """Every rank's part of `content` into `directory` (collective over the default process group, or
    none in one process). `async_save`: the tensors are copied to the CPU now (training may change them
    next), the files written in a background thread whose collectives run over `process_group` (a gloo
    group of its own, so they never interleave with the training's); returns the Future that completes
    once DCP's save finished on every rank (its `.metadata` written). Else the files are written before
    it returns None."""
    writer = _PausableWriter(directory, pause)
    if not async_save:
        dcp.save(content, storage_writer=writer, no_dist=_one_process())
        return None
    return dcp.async_save(content, storage_writer=writer, process_group=process_group, no_dist=_one_process())


def _one_process() -> bool:
    """No process group: DCP reads and writes every shard in this process. Said explicitly; DCP still
    warns that it assumes so, on every call (`generate` and `eval` would print it): that one warning is
    silenced (from any thread: an async save warns in its own)."""
    if dist.is_available() and dist.is_initialized():
        return False
    warnings.filterwarnings("ignore", message=_ONE_PROCESS_WARNING, category=UserWarning)
    return True


def shard_file_names(directory: Path) -> list[str]:
    """The files of a step's shard directory (DCP writes them flat), sorted."""
    return sorted(p.name for p in Path(directory).iterdir() if p.is_file())


def shard_problems(record: dict, directory: Path, sha256_of: Callable[[Path], str]) -> list[str]:
    """Each file the meta's `shards.files` records, against its size and sha256; one line per bad or
    missing file, naming it. [] when every shard verifies."""
    directory = Path(directory)
    if not directory.is_dir():
        return [f"{directory} is missing (the shards of this step)"]
    problems = []
    for name, want in sorted(record.get("files", {}).items()):
        path = directory / name
        size = path.stat().st_size if path.is_file() else None
        if size is None:
            problems.append(f"{path} is missing")
        elif size != want.get("size"):
            problems.append(f"{path} has {size} bytes, its meta records {want.get('size')}")
        elif sha256_of(path) != want.get("sha256"):
            problems.append(f"{path}: sha256 differs from its meta (corrupt file)")
    return problems


def read_shards(directory: Path, content: dict[str, Any]) -> None:
    """Fill `content` ({"model": ..., "optim": ...} of this rank's current state, the shapes to load
    into) from a step's shards, resharding as needed; collective when a process group is initialized,
    else one process reads everything. CheckpointError naming the directory when they do not fit."""
    try:
        dcp.load(content, storage_reader=FileSystemReader(directory), no_dist=_one_process())
    except Exception as e:  # DCP raises CheckpointException (wrapping every rank's error) and others
        first = " ".join(str(e).strip().splitlines()[:3])[:400]
        raise CheckpointError(
            f"{directory}: the shards do not fit this model ({first}); is the model config the one this "
            "checkpoint was trained with?"
        ) from None


def stored_dtypes(directory: Path) -> dict[str, torch.dtype]:
    """{parameter name: dtype} of the model tensors a step's shards hold (from DCP's `.metadata`, which
    DCP unpickles: read it only once its sha256 verified against the meta)."""
    meta = FileSystemReader(directory).read_metadata()
    out = {}
    for key, md in meta.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(md, TensorStorageMetadata):
            out[key[len("model.") :]] = md.properties.dtype
    return out
