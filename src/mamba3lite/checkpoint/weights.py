"""Model weights as safetensors: tied tensors stored once, streamed from memory, re-tied on load.

The tied LM head is written once (its alias recorded in the file header and in the meta), not twice;
files with both copies (the seed's) load as they are.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from mamba3lite import intake
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


def read_header(path: Path) -> dict:
    """The JSON header of a safetensors file, read through the border: a regular file, the header
    length (the first 8 bytes, little-endian) within the header cap and the file, then intake's JSON
    parse. CheckpointError naming the file otherwise. Called before `safe_open`, which would trust the
    length and parse whatever it names."""
    import struct

    kind = intake.SAFETENSORS_HEADER
    size = intake.regular_file_size(path, intake.FileKind(kind.what, 1 << 62, kind.error, kind.fix))
    prefix = intake.read_prefix(path, kind, 8)
    if len(prefix) < 8:
        raise kind.fail(f"{path} is {size} bytes, too short for a safetensors file")
    (n_bytes,) = struct.unpack("<Q", prefix)
    if n_bytes > kind.max_bytes or 8 + n_bytes > size:
        raise kind.fail(
            f"{path} declares a header of {n_bytes:,} bytes, the file holds {size:,} (at most "
            f"{kind.max_bytes // intake.MiB} MiB of header)"
        )
    text = intake.decode_utf8(intake.read_prefix(path, kind, 8 + n_bytes)[8:], str(path), kind)
    header = intake.parse_json(text, str(path), kind)
    intake.expect_type(header, dict, where=str(path), kind=kind, what="its header")
    return header


def tensor_dtypes(path: Path) -> dict[str, torch.dtype]:
    """{tensor name: dtype} of a safetensors file, from its header (the data is not read); CheckpointError
    naming the file for a header that does not parse or a dtype that is not a tensor type here."""
    by_code = {code: dtype for dtype, code in _ST_DTYPES.items()}
    out = {}
    for name, entry in read_header(path).items():
        if name == "__metadata__":
            continue
        code = entry.get("dtype") if isinstance(entry, dict) else None
        if code not in by_code:
            raise intake.SAFETENSORS_HEADER.fail(
                f"{path}: tensor {name!r} has dtype {code!r}, not one of {', '.join(by_code)}"
            )
        out[name] = by_code[code]
    return out


def tied_aliases(header: dict, path: Path) -> dict[str, str]:
    """The {alias: source} that our writer records in the header's `mamba3lite_tied` ({} in others)."""
    kind, where = intake.SAFETENSORS_HEADER, str(path)
    metadata = header.get("__metadata__") or {}
    intake.expect_type(metadata, dict, where=where, kind=kind, what="__metadata__")
    raw = metadata.get("mamba3lite_tied", "{}")
    intake.expect_type(raw, str, where=where, kind=kind, what="__metadata__.mamba3lite_tied")
    aliases = intake.parse_json(raw, f"{path} (__metadata__.mamba3lite_tied)", kind)
    intake.expect_type(aliases, dict, where=where, kind=kind, what="__metadata__.mamba3lite_tied")
    for alias, source in aliases.items():
        intake.expect_type(source, str, where=where, kind=kind, what=f"mamba3lite_tied.{alias}")
    return aliases


def read_model_file(path: Path, aliases: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """The whole state_dict a safetensors file holds, tied aliases filled from their source (read from
    the header when `aliases` is None). CheckpointError naming the file when it cannot be read."""
    from safetensors import safe_open

    header = read_header(path)
    if aliases is None:
        aliases = tied_aliases(header, path)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    except Exception as e:  # safetensors raises its own error types on truncated/corrupt files
        raise CheckpointError(f"{path}: cannot read weights ({e})") from None
    for alias, source in aliases.items():
        if alias not in state and source in state:
            state[alias] = state[source]
    return state


def load_model_file(path: Path, model: torch.nn.Module, aliases: dict[str, str] | None = None) -> None:
    """Load weights from a safetensors file into `model` (strict), re-creating tied aliases.

    Tied tensors stored once are filled from their source; files with both copies (the seed's) load
    as they are. `load_state_dict` copies in place (assign=False), so the model's own tying survives.
    """
    state = read_model_file(path, aliases)
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
        read_header(path)
    except CheckpointError as e:
        return str(e)
    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except Exception as e:  # safetensors raises its own error types on truncated/corrupt files
        return f"{path}: unreadable ({e})"
    return None
