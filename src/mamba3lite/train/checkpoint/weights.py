"""Model weights as safetensors: tied tensors stored once, streamed from memory, re-tied on load.

The tied LM head is written once (its alias recorded in the file header and in the meta), not twice;
files with both copies (the seed's) load as they are.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from mamba3lite.atomicfile import HashingAtomicFile
from mamba3lite.errors import CheckpointError


def _alias_key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def split_tied(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Drop every tensor that is the same view of the same storage as an earlier one.

    Returns (unique tensors, {alias_name: source_name}). For a tied LM head this keeps `embed.weight`
    and records {"lm_head.weight": "embed.weight"}: the embedding is written once.
    """
    first: dict[tuple, str] = {}
    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name, t in state.items():
        key = _alias_key(t)
        if key in first:
            aliases[name] = first[key]
        else:
            first[key] = name
            unique[name] = t
    return unique, aliases


_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def write_safetensors(
    f: HashingAtomicFile, tensors: dict[str, torch.Tensor], metadata: dict[str, str]
) -> None:
    """Stream tensors in the safetensors format (8-byte header length, JSON header, raw little-endian
    data in header order) straight from their memory: no serialised copy of the model is built."""
    import struct
    import sys

    assert sys.byteorder == "little", "safetensors data is little-endian"
    header: dict[str, Any] = {}
    offset = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": _ST_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as the reference writer does
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    for t in tensors.values():
        if t.numel():
            f.write(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())


def load_model_file(path: Path, model: torch.nn.Module, aliases: dict[str, str] | None = None) -> None:
    """Load weights from a safetensors file into `model` (strict), re-creating tied aliases.

    Tied tensors stored once are filled from their source; files with both copies (the seed's) load
    as they are. `load_state_dict` copies in place (assign=False), so the model's own tying survives.
    """
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            header = f.metadata() or {}
            state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    except Exception as e:  # safetensors raises its own error types on truncated/corrupt files
        raise CheckpointError(f"{path}: cannot read weights ({e})") from None
    if aliases is None:
        aliases = json.loads(header.get("mamba3lite_tied", "{}"))
    for alias, source in aliases.items():
        if alias not in state and source in state:
            state[alias] = state[source]
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        first = str(e).strip().splitlines()
        raise CheckpointError(
            f"{path}: the weights do not fit this model ({' '.join(first[:3])[:400]}); "
            "is the model config the one this checkpoint was trained with?"
        ) from None


def safetensors_problem(path: Path) -> str | None:
    """None if `path` is a whole safetensors file (its header parses and covers the file), else why not."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except Exception as e:  # safetensors raises its own error types on truncated/corrupt files
        return f"{path}: unreadable ({e})"
    return None
