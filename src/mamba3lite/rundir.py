"""Every name under a run directory (`training.checkpoint_dir`), in one place.

    RUN/config.yaml                  the resolved config (CONFIG_NAME)
    RUN/run.json                     the run record: code version, data identity (RUN_RECORD_NAME)
    RUN/metrics.jsonl                one JSON object per logged step, evaluation or event (METRICS_NAME)
    RUN/metrics.png                  `mamba3lite plot`'s picture of metrics.jsonl (PLOT_NAME)
    RUN/tokenizer.json               the run's tokenizer, when it is not GPT-2 (TOKENIZER_NAME)
    RUN/official_padding.safetensors embedding rows an imported model kept aside (PADDING_NAME)
    RUN/tb/                          TensorBoard event files (TENSORBOARD_DIRNAME)
    RUN/superseded/<time>-from-step-N/  checkpoints of an abandoned timeline (SUPERSEDED_DIRNAME)
    RUN/.lock                        held while a trainer owns the directory (LOCK_NAME)

and the checkpoints, three files per step (`checkpoint_files`; the one pattern every reader matches):

    RUN/model_step_N.safetensors     weights
    RUN/optim_step_N.pt              optimizer state
    RUN/meta_step_N.json             everything else, written last
    RUN/average_step_N.safetensors   the averaged weights (training.ema_decay > 0), a fourth file
                                     (`average_file`)

or, for a run whose parameters are sharded (FSDP2/HSDP), a directory of every rank's shards and the meta:

    RUN/dcp_step_N/                  torch.distributed.checkpoint's files: `__R_K.distcp` per rank and
                                     `.metadata` (`sharded_dir`)
    RUN/meta_step_N.json             the same meta, written last, with the size and sha256 of each

The atomic writers' temp files are `.NAME.XXXX.tmp` (mamba3lite/atomicfile.py).

A module that writes one of these takes its name from here; a new file in a run directory is one line
here plus its use. Reading is `RunDir` (mamba3lite/checkpoint/run_dir.py): whether a directory is a run,
its steps, the newest verified one; no module outside mamba3lite/checkpoint/ matches these patterns
itself. No imports beyond the standard library: a run directory is recognised without loading torch.
"""

from __future__ import annotations

import re
from pathlib import Path

CONFIG_NAME = "config.yaml"
RUN_RECORD_NAME = "run.json"
METRICS_NAME = "metrics.jsonl"
PLOT_NAME = "metrics.png"
TOKENIZER_NAME = "tokenizer.json"
PADDING_NAME = "official_padding.safetensors"
TENSORBOARD_DIRNAME = "tb"
SUPERSEDED_DIRNAME = "superseded"
LOCK_NAME = ".lock"

# Entries that say nothing about whose directory it is (a run lock, a refused start's TensorBoard
# directory, an abandoned timeline): outdir.check_may_write does not count them.
NEUTRAL_ENTRIES = frozenset({LOCK_NAME, TENSORBOARD_DIRNAME, SUPERSEDED_DIRNAME})


# ------------------------------------------------------------------------------------- checkpoints

# kind -> extension: the one definition of the layout; the patterns below are built from it.
EXTENSIONS = {"model": "safetensors", "optim": "pt", "meta": "json"}
# Every kind of a step's file: the three, and the averaged weights of a run that averages.
_ALL_KINDS = {**EXTENSIONS, "average": "safetensors"}
_KIND = "|".join(_ALL_KINDS)
_EXT = "|".join(sorted(set(_ALL_KINDS.values())))
_NAME_RE = re.compile(rf"^({_KIND})_step_(\d+)\.({_EXT})$")
_TEMP_RE = re.compile(rf"^\.({_KIND})_step_\d+\.({_EXT})\..+\.tmp$")
_ANY_RE = re.compile(rf"^\.?({_KIND})_step_\d+\.({_EXT})")
SHARDED_PREFIX = "dcp_step_"
_SHARDED_RE = re.compile(rf"^{SHARDED_PREFIX}(\d+)$")


def checkpoint_files(directory: Path, step: int) -> dict[str, Path]:
    """The three paths of one step: {"model": ..., "optim": ..., "meta": ...}."""
    return {kind: Path(directory) / f"{kind}_step_{step}.{ext}" for kind, ext in EXTENSIONS.items()}


def average_file(directory: Path, step: int) -> Path:
    """The averaged weights of one step (training.ema_decay > 0): beside its three files."""
    return Path(directory) / f"average_step_{step}.{_ALL_KINDS['average']}"


def sharded_dir(directory: Path, step: int) -> Path:
    """The directory of one step's shards (a sharded run's checkpoint, beside its meta)."""
    return Path(directory) / f"{SHARDED_PREFIX}{step}"


def step_of(name: str) -> int | None:
    """The step a checkpoint file (or shard directory) name belongs to (`model_step_7.safetensors`,
    `dcp_step_7` -> 7), else None."""
    if (m := _SHARDED_RE.match(name)) is not None:
        return int(m.group(1))
    m = _NAME_RE.match(name)
    if m is None or _ALL_KINDS[m.group(1)] != m.group(3):
        return None
    return int(m.group(2))


def is_temp_file(name: str) -> bool:
    """Whether `name` is an unfinished atomic write of a checkpoint file."""
    return _TEMP_RE.match(name) is not None


def looks_like_checkpoint_file(name: str) -> bool:
    """Whether `name` is a checkpoint file, the temp file of one or a shard directory (a run directory's
    content)."""
    return _ANY_RE.match(name) is not None or _SHARDED_RE.match(name) is not None


def steps_in(directory: Path) -> list[int]:
    """Every step with at least one of its files (or its shard directory) in `directory`, ascending."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted({s for p in directory.iterdir() if (s := step_of(p.name)) is not None})


def finished_save(directory: Path, step: int) -> bool:
    """Whether the save of `step` got to its meta (written last): without one, the files are a save
    killed mid-way (kill -9, disk full), never a checkpoint."""
    return checkpoint_files(directory, step)["meta"].exists()
