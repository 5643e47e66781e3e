"""Official weight files in and out: `pytorch_model.bin` (what `MambaLMHeadModel.from_pretrained`
reads; `save_pretrained` writes it with torch.save), `model.safetensors`, and safetensors sharded with
an index file (`model.safetensors.index.json`, `weight_map`: tensor name -> shard file).

Reading checks what a damaged download breaks (truncated files, shards missing or disagreeing with
the index) and names the file; it never unpickles code (torch.load weights_only=True).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from mamba3lite import intake
from mamba3lite.errors import CheckpointError
from mamba3lite.interop.names import EMBED_OFFICIAL, HEAD

BIN_NAME = "pytorch_model.bin"
SAFETENSORS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def _read_safetensors(path: Path) -> dict[str, Tensor]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    except Exception as e:  # safetensors' own error types on a truncated or corrupt file
        raise CheckpointError(
            f"{path}: cannot read weights ({e}); the file is damaged or incomplete"
        ) from None


def _read_bin(path: Path) -> dict[str, Tensor]:
    try:
        try:  # memory-mapped: a large model is not read into memory before it is written out again
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # a legacy (pre-zip) file cannot be mapped: read it whole
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated zip, a pickle with code in it, ...
        raise CheckpointError(f"{path}: cannot read weights ({intake.torch_load_refusal(e)})") from None
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise CheckpointError(f"{path}: not a state_dict (a mapping of names to tensors)")
    return state


def read_official_weights(files: list[Path], index: dict | None = None) -> dict[str, Tensor]:
    """The tensors of a model stored in `files` (one .bin, one .safetensors, or the shards named by a
    safetensors `index`, parsed). CheckpointError naming the file for anything damaged."""
    if index is None:
        (path,) = files
        return _read_bin(path) if path.suffix == ".bin" else _read_safetensors(path)
    weight_map = index["weight_map"]
    state: dict[str, Tensor] = {}
    for path in files:
        part = _read_safetensors(path)
        for name in part:
            if weight_map.get(name) != path.name:
                raise CheckpointError(
                    f"{path}: holds tensor {name!r}, which the index file assigns to "
                    f"{weight_map.get(name, 'no shard')}; the download is mixed up, fetch it again"
                )
        state.update(part)
    missing = sorted(set(weight_map) - set(state))
    if missing:
        raise CheckpointError(f"tensor {missing[0]!r} is in the index file but in none of its shards")
    return state


def write_official_weights(directory: Path, state: dict[str, Tensor], tied: bool) -> None:
    """Write `state` (official names) as pytorch_model.bin and model.safetensors into `directory`.

    Tied: the .bin carries `lm_head.weight` as the embedding's own storage (torch.save writes it once;
    `load_state_dict` needs both names); safetensors cannot hold two names for one tensor, so there
    it is left out, as Hugging Face writers do for tied heads."""
    from safetensors.torch import save_file

    state = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    if tied:
        state[HEAD] = state[EMBED_OFFICIAL]
    torch.save(state, directory / BIN_NAME)
    save_file({k: v for k, v in state.items() if not (tied and k == HEAD)}, directory / SAFETENSORS_NAME,
              metadata={"format": "pt"})  # fmt: skip
