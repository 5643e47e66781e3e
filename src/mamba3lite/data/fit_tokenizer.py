"""The tokenizer stage of `prepare --train-tokenizer N`: a BPE fit to the train split, before tokenizing.

The split of a document is a pure function of its cleaned text (`clean.split_of`), so it is known
before any token exists: `train_sample` reads the sources once, in their fixed order (source by source,
unit by unit), cleans and filters every document exactly as the workers do (empty, shorter than
`--min-chars`, binary, exact duplicates of an earlier one dropped), and keeps the TRAIN documents only,
up to `SAMPLE_BYTES` of UTF-8 text: a val document is never seen, so bits per byte on val stays honest.
`fit_tokenizer` trains on that sample (`tokenizer_train.train_bpe`).

Deterministic and re-derivable: the same sources, options and N give byte-identical tokenizer.json, so a
resumed prepare fits the same tokenizer again (a few seconds) and its snapshot, whose arguments record
the vocabulary hash, is restored as if nothing happened.
"""

from __future__ import annotations

import hashlib

from mamba3lite.data.clean import _text_of, clean_text, split_of
from mamba3lite.data.sources import Source, format_location
from mamba3lite.errors import DataError

# The first 16 MB of train text (in source order) make the sample: an 8k BPE fits in ~5 s on one core,
# and a larger sample changes the merges little.
SAMPLE_BYTES = 16_000_000


def train_sample(sources: list[Source], opts, limit_bytes: int = SAMPLE_BYTES) -> list[str]:
    """The cleaned TRAIN documents the tokenizer is fit to (see the module docstring). DataError for an
    empty train split (no document kept, or every one in val) and, unless `opts.skip_bad_lines`, for a
    malformed JSONL line (the one the pipeline would stop at)."""
    texts: list[str] = []
    seen: set[bytes] = set()
    n_bytes = n_read = n_kept = 0
    for src in sources:
        for loc, kind, payload in src.units(0):
            n_read += 1
            text = _text_of(kind, payload, opts.text_field)
            if not isinstance(text, str):  # binary, or a bad JSONL line
                if text.problem is not None and not opts.skip_bad_lines:
                    raise DataError(f"{format_location(loc)}: {text.problem}")
                continue
            text = clean_text(text)[0]
            if not text.strip() or len(text) < opts.min_chars:
                continue
            data = text.encode("utf-8")
            digest = hashlib.sha256(data).digest()
            if opts.dedup and digest in seen:
                continue
            seen.add(digest)
            n_kept += 1
            if split_of(digest, opts.seed, opts.val_fraction) != "train":
                continue
            texts.append(text)
            n_bytes += len(data)
            if n_bytes >= limit_bytes:
                return texts
    if not texts:
        what = (
            f"all {n_kept:,} kept documents fell into the val split; lower --val-fraction or add text"
            if n_kept
            else f"no document kept of {n_read:,} read; check the sources, or lower --min-chars"
        )
        raise DataError(f"--train-tokenizer: the train split is empty, nothing to fit a tokenizer to: {what}")
    return texts


def fit_tokenizer(sources: list[Source], opts) -> bytes:
    """tokenizer.json bytes of a byte-level BPE of `opts.train_tokenizer` ids fit to the train split."""
    from mamba3lite.tokenizer_train import check_n_ids, require_tokenizers, train_bpe

    check_n_ids(opts.train_tokenizer)  # before reading anything
    require_tokenizers()
    return train_bpe(train_sample(sources, opts), opts.train_tokenizer)
