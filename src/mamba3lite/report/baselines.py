"""What general-purpose compressors make of a dataset's validation text: the numbers a language model
trained on the same data should beat, in bits per byte of the validation text.

    zlib          zlib level 9 of the val text alone
    xz            lzma (xz) preset 9 | extreme of the val text alone
    xz_given_train  xz of (the last HISTORY_BYTES of the train text + the val text) minus xz of the same
                  history alone: the bits the val text costs a compressor that has read the training
                  data first. A model that has read that data should compress held-out text of the
                  same kind at least as well: the number to beat.

The texts are the splits' documents decoded from their tokens with the dataset's own tokenizer (a
byte-level tokenizer gives back the prepared text exactly), joined by one newline each, so every
compressor and the model read the same documents. Everything here is the standard library's.

`xz_given_train` compresses about 9 MB twice (about a minute on one core): `baselines_for` keeps the
result next to nothing else, in a small JSON file keyed by the texts' sha256, so a re-run (the
quickstart's second run) reads it back; `start_baselines` computes it in a child process at low
priority beside the training that runs meanwhile.
"""

from __future__ import annotations

import contextlib
import hashlib
import lzma
import multiprocessing
import os
import sys
import zlib
from pathlib import Path

from mamba3lite import intake
from mamba3lite.atomicfile import atomic_write_json

HISTORY_BYTES = 9 * 2**20  # the train text xz reads before the val text (its dictionary holds 64 MiB)
_XZ = 9 | lzma.PRESET_EXTREME  # xz -9e
NAMES = ("zlib", "xz", "xz_given_train")


def split_text(dataset: str | Path, split: str) -> bytes:
    """The documents of `split` decoded with the dataset's tokenizer, joined by newlines (UTF-8)."""
    import numpy as np

    from mamba3lite.data.shards import Manifest
    from mamba3lite.tokenizer import load_tokenizer

    dataset = Path(dataset)
    manifest = Manifest.load(dataset)
    tok = load_tokenizer(manifest.identity.tokenizer)
    docs: list[str] = []
    for shard in manifest.split_shards(split):
        ids = np.fromfile(dataset / shard.path, dtype=manifest.np_dtype)
        cuts = np.flatnonzero(ids == manifest.eos_id)
        starts = np.concatenate([[0], cuts + 1])
        ends = np.concatenate([cuts, [len(ids)]])
        docs += [tok.decode(ids[a:b].tolist()) for a, b in zip(starts, ends) if b > a]
    return "\n".join(docs).encode("utf-8")


def compressor_bits_per_byte(val: bytes, history: bytes) -> dict[str, float]:
    """{zlib, xz, xz_given_train}: bits per byte of `val` (see the module docstring)."""
    if not val:
        raise ValueError("no validation text to compress")
    n = len(val)
    given = len(lzma.compress(history + val, preset=_XZ)) - len(lzma.compress(history, preset=_XZ))
    return {
        "zlib": 8 * len(zlib.compress(val, 9)) / n,
        "xz": 8 * len(lzma.compress(val, preset=_XZ)) / n,
        "xz_given_train": 8 * given / n,
    }


def _texts(dataset: str | Path) -> tuple[bytes, bytes, str]:
    val = split_text(dataset, "val")
    history = split_text(dataset, "train")[-HISTORY_BYTES:]
    key = hashlib.sha256(hashlib.sha256(history).digest() + val).hexdigest()
    return val, history, key


def cached(cache: str | Path, key: str | None = None) -> dict | None:
    """The baselines stored in `cache` for texts `key` (None: whatever texts they are of), or None
    (absent, another key, unreadable). The one read of a cache file, through the border reader."""
    cache = Path(cache)
    if not cache.is_file():
        return None
    try:
        record = intake.read_json(cache, intake.CONFIG)
    except Exception:  # a damaged cache is recomputed, never an error
        return None
    if key is not None and record.get("key") != key:
        return None
    if not all(isinstance(record.get(k), float) for k in NAMES):
        return None
    return record


def baselines_for(dataset: str | Path, cache: str | Path) -> dict:
    """{zlib, xz, xz_given_train, val_bytes, key} for `dataset`'s val split, from `cache` when it holds
    these texts' numbers, else computed and stored there."""
    val, history, key = _texts(dataset)
    if (hit := cached(cache, key)) is not None:
        return hit
    record = {**compressor_bits_per_byte(val, history), "val_bytes": len(val), "key": key}
    Path(cache).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(Path(cache), record)
    return record


def _child(dataset: str, cache: str) -> None:
    """The child's work: a failure is its exit code (the quickstart says the numbers are missing), not
    a traceback on the quickstart's terminal."""
    with contextlib.suppress(OSError):
        os.nice(19)  # the training beside it comes first
    try:
        baselines_for(dataset, cache)
    except Exception:
        sys.exit(1)


def start_baselines(dataset: str | Path, cache: str | Path) -> multiprocessing.process.BaseProcess:
    """Compute `baselines_for(dataset, cache)` in a child process at the lowest priority; `join()` it
    and read `cache` (or call `baselines_for`, which then finds it there)."""
    ctx = multiprocessing.get_context("spawn")  # no fork of a process with torch threads running
    proc = ctx.Process(target=_child, args=(str(dataset), str(cache)), daemon=True)
    proc.start()
    return proc


def as_text(model_bpb: float | None, b: dict) -> str:
    """One line: the model's bits/byte beside the compressors', and its ratio to the number to beat."""
    model = f"model {model_bpb:.3f}" if model_bpb is not None else "model n/a"
    ratio = f" = {model_bpb / b['xz_given_train']:.2f}x xz given train" if model_bpb is not None else ""
    return (
        f"{model} | zlib -9 {b['zlib']:.3f} | xz -9e {b['xz']:.3f} | xz given the train text "
        f"{b['xz_given_train']:.3f} (the number to beat){ratio}"
    )
