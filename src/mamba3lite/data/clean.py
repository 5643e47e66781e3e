"""The worker side of `prepare`: clean, filter, hash, split and tokenize units (pure functions).

A unit (`sources.Source.units`) is decoded, cleaned (`clean_text`), dropped when empty, too short or
binary, hashed (sha256 of the cleaned UTF-8 text: the dedup key), given its split (`split_of`) and
encoded, with EOS appended. `process_batch` does this for a batch in a tokenizer worker process (or in
the main process with `--workers 0`) and returns one `UnitResult` per unit, in order.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from mamba3lite.data import shards
from mamba3lite.data.sources import (
    KIND_JSONL,
    KIND_TEXT_BYTES,
    decode_bytes,
    decode_wide_text,
    looks_binary,
    parse_jsonl_line,
    replace_surrogates,
    wide_text_looks_binary,
)
from mamba3lite.tokenizer import load_tokenizer

# Unit outcomes, as the workers report them.
KEPT, EMPTY, TOO_SHORT, BINARY, BAD_LINE = range(5)
DROP_NAMES = {EMPTY: "empty", TOO_SHORT: "too_short", BINARY: "binary", BAD_LINE: "bad_lines"}

DIGEST_BYTES = 16  # of the sha256 of the cleaned text; the dedup key
# C0 controls except \t \n (CR is turned into \n before), DEL and the C1 controls.
_CONTROL_RE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
# What clean_text changes in ASCII text (CR included): their absence means there is nothing to do.
_ASCII_CONTROL_BYTES = bytes([*range(0, 9), *range(11, 32), 127])


def clean_text(text: str) -> tuple[str, int]:
    """The cleaned form of a document and the number of replaced characters.

    Lone surrogates (undecodable bytes, bad JSON escapes) → U+FFFD (counted); CRLF and CR → LF; control
    characters other than newline and tab removed; Unicode NFC."""
    if text.isascii():
        # Fast path for the common case (source code, English): a C-speed scan finds nothing to do.
        raw = text.encode("ascii")
        if len(raw.translate(None, _ASCII_CONTROL_BYTES)) == len(raw):
            return text, 0
        n_replaced = 0
    else:
        text, n_replaced = replace_surrogates(text)
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _CONTROL_RE.sub("", text)
    if not text.isascii():  # last: removing a control character can join a letter and a combining mark
        text = unicodedata.normalize("NFC", text)
    return text, n_replaced


def split_of(digest: bytes, seed: int, val_fraction: float) -> str:
    """ "val" or "train" for a document whose cleaned-text sha256 is `digest`: a pure function, so the split
    of a document never changes when others are added or removed."""
    h = hashlib.sha256(b"mamba3lite-split:%d:" % seed + digest).digest()
    return "val" if int.from_bytes(h[:8], "big") / 2.0**64 < val_fraction else "train"


class UnitResult(NamedTuple):
    """One unit's outcome. Only a KEPT unit has a digest, a split and tokens."""

    status: int  # KEPT, EMPTY, TOO_SHORT, BINARY or BAD_LINE
    n_replaced: int = 0  # characters replaced by U+FFFD
    digest: bytes | None = None  # the first DIGEST_BYTES of the cleaned text's sha256
    split: str = "train"
    tokens: np.ndarray | None = None  # the document's ids, EOS last
    n_bytes: int = 0  # of the cleaned text, UTF-8
    n_special: int = 0  # EOS ids the tokenizer produced inside the text (removed)
    problem: str | None = None  # why a JSONL line is bad


@dataclass(frozen=True)
class WorkerConfig:
    """What a worker needs besides its units (the settings that change a unit's outcome)."""

    tokenizer: str
    min_chars: int
    text_field: str
    seed: int
    val_fraction: float


_WORKER: dict = {}  # per-process: the tokenizer and settings, built once by init_worker


def init_worker(cfg: WorkerConfig) -> None:
    """Build this process's tokenizer and remember `cfg` (once per worker, before any batch)."""
    tok = load_tokenizer(cfg.tokenizer)
    _WORKER.update(cfg=cfg, tok=tok, dtype=shards.dtype_for_vocab(tok.vocab_size))


def ensure_worker(cfg: WorkerConfig) -> None:
    """init_worker unless this process is already set up for `cfg` (a long-lived Ray worker process
    runs the tasks of many runs)."""
    if _WORKER.get("cfg") != cfg:
        init_worker(cfg)


def _text_of(kind: int, payload: bytes | str | None, text_field: str) -> str | UnitResult:
    """The unit's text, or the result of a unit dropped before cleaning (binary, bad JSONL line)."""
    if kind == KIND_TEXT_BYTES:
        assert isinstance(payload, bytes)
        text = decode_wide_text(payload)
        if looks_binary(payload) if text is None else wide_text_looks_binary(text):
            return UnitResult(BINARY)
        return decode_bytes(payload) if text is None else text
    if kind == KIND_JSONL:
        assert isinstance(payload, bytes)
        text, problem = parse_jsonl_line(payload, text_field)
        return UnitResult(BAD_LINE, problem=problem) if problem is not None else text
    return payload or ""


def _tokens_with_eos(ids, dtype: np.dtype, eos: int) -> tuple[np.ndarray, int]:
    """A document's ids followed by EOS, and the number of EOS ids removed from inside it: a tokenizer
    that parses its special tokens inside text (HF) could put EOS inside a document, and EOS must mean
    "document boundary" only."""
    tokens = np.empty(len(ids) + 1, dtype=dtype)
    tokens[:-1] = ids
    tokens[-1] = eos
    n_special = int(np.count_nonzero(tokens[:-1] == eos))
    if n_special:
        tokens = np.concatenate([tokens[:-1][tokens[:-1] != eos], tokens[-1:]])
    return tokens, n_special


def process_batch(items: list[tuple[int, bytes | str | None]]) -> list[UnitResult]:
    """Clean, filter, hash and tokenize a batch of (kind, payload) units. Runs in a worker."""
    cfg: WorkerConfig = _WORKER["cfg"]
    tok = _WORKER["tok"]
    out: list = [None] * len(items)
    keep_idx, keep_text, keep_meta = [], [], []
    for i, (kind, payload) in enumerate(items):
        text = _text_of(kind, payload, cfg.text_field)
        if isinstance(text, UnitResult):
            out[i] = text
            continue
        clean, n_rep = clean_text(text)
        if not clean.strip():
            out[i] = UnitResult(EMPTY, n_rep)
        elif len(clean) < cfg.min_chars:
            out[i] = UnitResult(TOO_SHORT, n_rep)
        else:
            data = clean.encode("utf-8")
            keep_idx.append(i)
            keep_text.append(clean)
            keep_meta.append((n_rep, hashlib.sha256(data).digest(), len(data)))
    if keep_text:
        encode_numpy = getattr(tok, "encode_numpy", None)  # GPT-2: straight to numpy, no Python list
        encoded = map(encode_numpy, keep_text) if encode_numpy else tok.encode_batch(keep_text)
        for i, ids, (n_rep, digest, n_bytes) in zip(keep_idx, encoded, keep_meta):
            tokens, n_special = _tokens_with_eos(ids, _WORKER["dtype"], tok.eos_id)
            split = split_of(digest, cfg.seed, cfg.val_fraction)
            out[i] = UnitResult(KEPT, n_rep, digest[:DIGEST_BYTES], split, tokens, n_bytes, n_special)
    return out
