"""The quickstart's dataset and its evaluation.

ensure_dataset   WORKDIR/data/<source>-<tokenizer>: prepared from the source (with its own BPE fit
                 to the train split, or GPT-2's), or reused when it was made the same way and verifies
evaluator        the before/after evaluation: every window of the val split (the same documents the
                 compressors read: report/baselines.py), or a few train windows when val is too small
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mamba3lite.data.splits import val_split_holds_window

QUICKSTART_VAL_FRACTION = 0.02  # ~10 documents (~73 kB) of the full stdlib
EVAL_WINDOWS = 32  # windows of the train split evaluated when the val split is too small for one


def dataset_name(source: str, vocab: int | None) -> str:
    """The dataset's folder under WORKDIR/data: the source's last path part and the tokenizer."""
    base = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(source.rstrip("/")).name or source) or "source"
    return f"{base}-{'gpt2' if vocab is None else f'bpe{vocab}'}"


def _made_as_asked(manifest, source: str, max_docs: int | None, vocab: int | None) -> bool:
    record = manifest.extra.get("prepare", {})
    return (
        [s.get("spec") for s in record.get("sources", [])] == [source]
        and record.get("max_docs") == max_docs
        and record.get("train_tokenizer") == vocab
        and (vocab is not None or record.get("tokenizer") == "gpt2")
    )


def ensure_dataset(
    out: Path, source: str, max_docs: int | None, vocab: int | None, log: Callable[[str], None]
) -> tuple[Path, bool]:
    """The dataset of `source` in `out`, tokenized with a BPE of `vocab` ids fit to its train split (None:
    GPT-2): reused when it was made from the same source, slice (`max_docs`) and tokenizer request and
    its manifest and every shard verify, else prepared (replacing the old one). Returns (path, reused)."""
    from mamba3lite.data.prepare import prepare
    from mamba3lite.data.shards import Manifest, has_manifest, verify_dataset

    if has_manifest(out):
        problems = verify_dataset(out)
        if problems:
            log(f"data      {out} does not verify ({problems[0]}); preparing it again")
        elif not _made_as_asked(Manifest.load(out), source, max_docs, vocab):
            log(f"data      {out} was made from another source, slice or tokenizer; preparing it again")
        else:
            log(f"data      reusing {out} (manifest and shards verify)")
            return out, True
    what = f"the first {max_docs} files of " if max_docs else ""
    how = "GPT-2's tokenizer" if vocab is None else f"a {vocab:,}-id BPE fit to its train split"
    log(f"data      preparing {what}{source} with {how} -> {out}")
    summary = prepare(
        [source], out, val_fraction=QUICKSTART_VAL_FRACTION, max_docs=max_docs, overwrite=True,
        progress=False, train_tokenizer=vocab,
    )  # fmt: skip
    log(summary.table())
    return out, False


def eval_split(manifest, max_seq_len: int) -> str:
    """The split the before/after evaluations use: val when it holds more than one window's tokens."""
    return "val" if val_split_holds_window(manifest, max_seq_len) else "train"


@dataclass(frozen=True)
class Evaluator:
    """The before/after evaluation of a model on `split` of the dataset (`max_batches` None: every
    window). Its result is `evaluate_model`'s, with "whole_split": whether every window was scored."""

    data_path: Path
    split: str
    max_seq_len: int
    batch_size: int
    max_batches: int | None
    dtype: str
    vocab_hash: str | None
    tokenizer_name: str

    def __call__(self, model) -> dict:
        from mamba3lite.evaluate import evaluate_model

        r = evaluate_model(
            model, self.data_path, max_seq_len=self.max_seq_len, batch_size=self.batch_size,
            max_batches=self.max_batches, split=self.split, dtype=self.dtype, vocab_hash=self.vocab_hash,
            tokenizer_name=self.tokenizer_name,
        )  # fmt: skip
        return {**r.to_dict(), "whole_split": self.max_batches is None}


def evaluator(cfg, data_path: Path, log, manifest=None) -> Evaluator:
    """The evaluation of `cfg`'s runs on the dataset at `data_path` (its `manifest`, loaded if None)."""
    from mamba3lite.data.shards import Manifest

    tc, manifest = cfg.training, manifest or Manifest.load(data_path)
    split = eval_split(manifest, tc.max_seq_len)
    if split == "train":
        log("note      the validation split is too small for one window; evaluating on the train split")
    batches = None if split == "val" else max(1, EVAL_WINDOWS // tc.micro_batch_size)
    return Evaluator(
        data_path, split, tc.max_seq_len, tc.micro_batch_size, batches, tc.dtype,
        manifest.identity.vocab_hash, manifest.identity.tokenizer,
    )  # fmt: skip
