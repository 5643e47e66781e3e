"""An official model directory on disk (or `hf:NAME`, downloaded first): where its config, weights and
tokenizer are, each checked to be there.

    src = open_source("path/to/mamba3-siso-187m")     # or "hf:state-spaces/mamba3-siso-187m"
    src.config          the parsed config.json
    src.weight_files    [model.safetensors] | the shards of model.safetensors.index.json | [pytorch_model.bin]
    src.tokenizer       SRC/tokenizer.json, or None

Safetensors are preferred over the .bin when both are there (no pickle, memory-mapped).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mamba3lite import intake
from mamba3lite.errors import CheckpointError, ConfigError
from mamba3lite.interop.weights import BIN_NAME, INDEX_NAME, SAFETENSORS_NAME
from mamba3lite.rundir import TOKENIZER_NAME  # an official directory names it as a run directory does

CONFIG_NAME = "config.json"
HF_PREFIX = "hf:"
# What `hf:NAME` downloads: the model's files, not every file of the repository.
HF_PATTERNS = [CONFIG_NAME, SAFETENSORS_NAME, INDEX_NAME, "model-*.safetensors", BIN_NAME, TOKENIZER_NAME]


@dataclass
class OfficialSource:
    root: Path
    config: dict
    weight_files: list[Path]
    index: dict | None  # the parsed safetensors index, when the weights are sharded
    tokenizer: Path | None
    name: str  # as the user gave it (a path or hf:NAME)


def download_hf(name: str) -> Path:
    """The local snapshot of Hugging Face model `name` (huggingface_hub's cache)."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ConfigError(
            f"hf:{name} needs the package huggingface_hub; fix: pip install 'mamba3lite[hf]'"
        ) from None
    try:
        return Path(snapshot_download(repo_id=name, allow_patterns=HF_PATTERNS))
    except Exception as e:  # network, unknown repository, gated model: the hub's message says which
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"cannot download hf:{name} ({first})") from None


def open_source(src: str) -> OfficialSource:
    """The official model at `src` (a directory, or hf:NAME); CheckpointError when it is not one."""
    root = download_hf(src[len(HF_PREFIX) :]) if src.startswith(HF_PREFIX) else Path(src)
    if not root.is_dir():
        what = "does not exist" if not root.exists() else "is a file"
        raise CheckpointError(
            f"{root} {what}; pass a directory in the official mamba_ssm format (config.json + "
            f"{BIN_NAME} or {SAFETENSORS_NAME}), or hf:NAME"
        )
    config_path = root / CONFIG_NAME
    if not config_path.is_file():
        raise CheckpointError(
            f"{root} has no {CONFIG_NAME}: it is not a model in the official mamba_ssm format "
            f"(config.json + {BIN_NAME} or {SAFETENSORS_NAME})"
        )
    # Through the border reader: a pipe, a huge file, NaN or a list instead of an object are each one
    # CheckpointError naming the file.
    config = intake.read_json(config_path, intake.OFFICIAL_CONFIG)
    files, index = weight_files(root)
    tok = root / TOKENIZER_NAME
    return OfficialSource(root, config, files, index, tok if tok.is_file() else None, src)


def weight_files(root: Path, *, bin_ok: bool = True) -> tuple[list[Path], dict | None]:
    """(the weight files of the model directory `root`, its safetensors index or None): the shards its
    index names (each a file directly in `root`), else model.safetensors, else (`bin_ok`) the
    torch-pickled weights; CheckpointError naming the file otherwise."""
    if (root / INDEX_NAME).is_file():
        index = intake.read_json(root / INDEX_NAME, intake.SAFETENSORS_INDEX)
        wm = index.get("weight_map")
        if not isinstance(wm, dict) or not wm or not all(isinstance(v, str) for v in wm.values()):
            raise CheckpointError(f"{root / INDEX_NAME}: no weight_map (tensor name -> shard file)")
        files = [root / f for f in dict.fromkeys(wm.values())]
        for f in files:
            if f.parent != root:  # "../x", "sub/x" or an absolute "/dev/zero"
                raise CheckpointError(f"{root / INDEX_NAME}: shard {f} is not a file directly in {root}")
            if not f.is_file():
                raise CheckpointError(f"{f}: a shard named by {INDEX_NAME} is missing; fetch it again")
        return files, index
    if (root / SAFETENSORS_NAME).is_file():
        return [root / SAFETENSORS_NAME], None
    if bin_ok and (root / BIN_NAME).is_file():
        return [root / BIN_NAME], None
    found = f"{SAFETENSORS_NAME}, {INDEX_NAME}" + (f" or {BIN_NAME}" if bin_ok else "")
    raise CheckpointError(f"{root} has {CONFIG_NAME} but no weights ({found})")
