"""The data a run trains and validates on, built from the config and checked before any step.

Datasets given as URLs (s3://, gs://, hf://, file://) are fetched into the verified local cache first
(`localize_data`, data/remote_cache.py): the rest of the run reads the cached copy by its local path.

Validation data: `data.val_data_path` when set (its val split when it has one, else its train split,
but never the training data's own train split), else the training dataset's val split when it holds
a window (`data/splits.py`: the rule `eval` and the quickstart use too), else none, with the reason.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from mamba3lite.config import Config
from mamba3lite.data.remote_cache import CachedDataset, fetch_dataset
from mamba3lite.data.shards import dataset_dir
from mamba3lite.data.splits import short_val_split, val_split_holds_window
from mamba3lite.data.store import is_url
from mamba3lite.data_identity import DataIdentity
from mamba3lite.errors import ConfigError, DataError, DataNotFoundError


def localize_data(cfg: Config) -> tuple[Config, tuple[CachedDataset, ...]]:
    """`cfg` with each dataset URL (data.train_data_path, data.val_data_path) replaced by the path of its
    verified copy in data.cache_dir, and the cached datasets, held until they are closed (or the process
    exits): the one place a URL becomes a path, before anything reads the data. A config of local
    paths comes back as it is."""
    dc = cfg.data
    if dc.dummy:
        return cfg, ()
    held: list[CachedDataset] = []
    paths = {}
    max_bytes = int(dc.cache_max_gb * 2**30)
    try:
        for name in ("train_data_path", "val_data_path"):
            url = getattr(dc, name)
            if url and is_url(url):
                held.append(fetch_dataset(url, dc.cache_dir, max_bytes))
                paths[name] = str(held[-1].path)
                got = held[-1]
                if os.environ.get("RANK", "0") == "0":  # under torchrun every rank fetches; one line says so
                    print(
                        f"data: {url} -> {got.path} ({len(got.fetched)} file(s) fetched, "
                        f"{len(got.reused)} verified in the cache)"
                    )
    except BaseException:
        for h in held:
            h.close()
        raise
    return (cfg.replace("data", **paths) if paths else cfg), tuple(held)


def build_train_data(cfg: Config) -> Any:
    """The training `PretrainDataset` (random tokens only with data.dummy, never as a fallback)."""
    from mamba3lite.data import PretrainDataset

    dc, tc = cfg.data, cfg.training
    try:
        return PretrainDataset(
            None if dc.dummy else dc.train_data_path,
            tc.max_seq_len,
            cfg.model.vocab_size,
            split="train",
            dummy=dc.dummy,
            seed=tc.seed,
            dtype=None if dc.dummy else dc.token_dtype,
        )
    except DataNotFoundError as e:  # (the seed trained on random tokens here without a word)
        raise DataNotFoundError(f"{e}; random tokens on purpose, for plumbing tests: --dummy") from None


def build_val_data(cfg: Config, train_data: Any) -> tuple[Any, str]:
    """(validation dataset or None, why there is none: "" when there is one)."""
    from mamba3lite.data import PretrainDataset

    dc, tc = cfg.data, cfg.training
    if dc.dummy:
        n_tokens = max(tc.eval_batches * tc.micro_batch_size, 8) * tc.max_seq_len + 1
        data = PretrainDataset(
            None, tc.max_seq_len, cfg.model.vocab_size, dummy=True, seed=tc.seed + 1, dummy_tokens=n_tokens
        )
        return data, ""
    if dc.val_data_path:
        return _explicit_val_data(cfg), ""
    manifest = getattr(train_data, "manifest", None)
    n_val = manifest.n_tokens("val") if manifest is not None else 0
    if manifest is not None and val_split_holds_window(manifest, tc.max_seq_len):
        return PretrainDataset(dc.train_data_path, tc.max_seq_len, cfg.model.vocab_size, split="val"), ""
    if n_val:
        why = short_val_split(n_val, tc.max_seq_len)
        return (
            None,
            f"{dc.train_data_path}: {why}; lower training.max_seq_len, or prepare with a larger "
            "--val-fraction",
        )
    return (
        None,
        f"{dc.train_data_path} has no val split; prepare with --val-fraction, or set data.val_data_path",
    )


def _explicit_val_data(cfg: Config) -> Any:
    from mamba3lite.data import PretrainDataset
    from mamba3lite.data.shards import Manifest, has_manifest

    dc, tc = cfg.data, cfg.training
    p = dataset_dir(dc.val_data_path)
    has_val = has_manifest(p) and Manifest.load(p).split_shards("val")
    if not has_val and p.resolve() == Path(dc.train_data_path).resolve():
        raise ConfigError(
            f"data.val_data_path {dc.val_data_path} is the training data, which has no val split: "
            "validating on it would measure memorisation; point it at held-out data, or unset it"
        )
    split = "val" if has_val else "train"
    return PretrainDataset(p, tc.max_seq_len, cfg.model.vocab_size, split=split, dtype=dc.token_dtype)


def check_data_matches(cfg: Config, train_data: Any, val_data: Any) -> None:
    """What `eval` refuses, refused before training: a dataset whose EOS id is not the model's (the
    state resets at EOS, generation stops at it), and validation data of another tokenizer than the
    training data's. (A vocab_size mismatch is the dataset's own error.)"""
    dc, mc = cfg.data, cfg.model
    train_m = getattr(train_data, "manifest", None)
    val_m = getattr(val_data, "manifest", None)
    train_tok = train_m.identity if train_m is not None else DataIdentity("", None, None, None)
    for m, where, ref in (
        (train_m, f"the training data ({dc.train_data_path})", DataIdentity("", None, None, None)),
        (val_m, f"the validation data ({dc.val_data_path or dc.train_data_path})", train_tok),
    ):  # fmt: skip
        if m is not None:
            model = DataIdentity(ref.tokenizer, ref.vocab_hash, mc.vocab_size, mc.eos_id)
            m.identity.compatible_with(
                model, where=where, reference="the training data",
                eos_fix=f": set model.eos_id={m.eos_id}, or prepare the data with the model's tokenizer",
            )  # fmt: skip


def check_fits_global_batch(n_windows: int, global_windows: int, max_seq_len: int) -> None:
    """DataError when the training data does not fill one global batch (no step could be drawn)."""
    if n_windows < global_windows:
        raise DataError(
            f"the training data has {n_windows} windows of {max_seq_len} tokens, fewer than one global "
            f"batch ({global_windows} windows: training.global_batch_size, or micro_batch_size x "
            "gradient_accumulation_steps when it is 0); use more data or a smaller batch"
        )
