"""Evaluating a model on a token dataset: loss, perplexity, bits per byte, tokens evaluated.

`evaluate_model` is what `mamba3lite eval` and the quickstart call. It measures exactly what the
trainer's periodic evaluation measures (`Pretrainer.evaluate`): the mean next-token cross-entropy over
windows of `max_seq_len` tokens (the dataset's window math), spread evenly over the split, in the
run's compute dtype; the same windows give the same number.

    loss          mean cross-entropy, nats per token (natural log)
    perplexity    exp(loss)
    bits_per_byte loss / ln 2 / (UTF-8 bytes of source text per token of the split); None when the
                  dataset does not record text bytes (seed-format token files). Comparable across
                  tokenizers, unlike the loss.
    tokens        target tokens scored (windows × max_seq_len)

A dataset the model cannot read correctly is refused (`DataIdentity.compatible_with`,
data_identity.py): another tokenizer (vocabulary hash), another vocab size or EOS id. Token ids are only
meaningful under the tokenizer that made them, so a silent evaluation across tokenizers would report a
number that means nothing.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from mamba3lite.data.shards import dataset_dir
from mamba3lite.data.splits import short_val_split, val_split_holds_window
from mamba3lite.data_identity import DataIdentity
from mamba3lite.errors import ConfigError, DataError
from mamba3lite.model.precision import resolve_precision

__all__ = ["evaluate_model", "pick_split", "short_val_split", "spread_picks"]


@dataclass
class EvalResult:
    """The numbers of one evaluation (see the module docstring for units)."""

    loss: float
    perplexity: float
    bits_per_byte: float | None
    tokens: int
    windows: int
    max_seq_len: int
    split: str
    data_path: str

    def to_dict(self) -> dict:
        return asdict(self)


def pick_split(data_path: str | Path, split: str | None, max_seq_len: int) -> str:
    """The split to evaluate: `split` if given (checked), else "val" when the dataset's val split holds
    at least one window (more than `max_seq_len` tokens, as the trainer and the quickstart decide), else
    "train" (with a warning when a val split exists but is too short). DataError, naming the split, when
    the split chosen holds no window."""
    from mamba3lite.data.shards import SPLITS, Manifest, has_manifest

    root = dataset_dir(data_path)
    if not has_manifest(root):
        return split or "train"  # seed-format token files have no splits
    m = Manifest.load(root)
    if split is not None:
        if split not in SPLITS:
            raise ConfigError(f"--split must be one of {', '.join(SPLITS)}, got {split!r}")
        if not m.split_shards(split):
            raise DataError(f"{root} has no {split} split (its splits: {', '.join(_splits(m))})")
    elif val_split_holds_window(m, max_seq_len):
        split = "val"
    else:
        split = "train"
        n_val = m.n_tokens("val")
        why = short_val_split(n_val, max_seq_len) if n_val else "it has no val split"
        warnings.warn(
            f"{root}: {why}; evaluating the train split (text the model may have trained on; "
            "prepare with a larger --val-fraction for held-out numbers)",
            stacklevel=3,
        )
    n = m.n_tokens(split)
    if n <= max_seq_len:
        if split == "val":
            fix = "evaluate the train split instead (--split train), or prepare with a larger --val-fraction"
        else:
            fix = "prepare more data, or evaluate a run trained with a smaller max_seq_len"
        raise DataError(
            f"{root}: its {split} split has {n:,} tokens, too few for one window of max_seq_len + 1 = "
            f"{max_seq_len + 1} tokens (the run's max_seq_len); {fix}"
        )
    return split


def _splits(m) -> list[str]:
    return sorted({s.split for s in m.shards})


def spread_picks(n_windows: int, total: int) -> list[int]:
    """`total` window indices spread evenly over `n_windows` (deterministic): the windows an evaluation
    scores, the same in `mamba3lite eval` and in the trainer's periodic evaluation."""
    return [k * n_windows // total for k in range(total)]


@torch.no_grad()
def window_loss_sum(
    model: torch.nn.Module, ds, indices: list[int], batch_size: int, device: torch.device, bf16: bool
) -> float:
    """Sum over windows `indices` of each window's mean next-token loss (nats), in batches of
    `batch_size` (under bf16 autocast when `bf16`). The caller sets eval mode and divides."""
    total = 0.0
    for i in range(0, len(indices), batch_size):
        idx = indices[i : i + batch_size]
        x_BT, y_BT = ds.get_batch(idx)
        ctx = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        with ctx:
            loss = model(x_BT.to(device), y_BT.to(device))
        total += float(loss) * len(idx)
    return total


@torch.no_grad()
def evaluate_model(
    model: torch.nn.Module,
    data_path: str | Path,
    *,
    max_seq_len: int,
    batch_size: int,
    max_batches: int | None = None,
    split: str | None = None,
    dtype: str = "fp32",
    vocab_hash: str | None = None,
    tokenizer_name: str = "gpt2",
    token_dtype: str | None = None,
) -> EvalResult:
    """Mean loss of `model` over windows of `data_path` (see the module docstring).

    max_batches: at most this many batches of `batch_size` windows, spread evenly over the split
    (None: every window). dtype: training.dtype (auto, bf16, fp32), resolved for the model's device as
    the trainer resolves it (model/precision.py), so the numbers are the trainer's; an explicit bf16 on a
    device without native bf16 is warned about.
    Raises DataError for a missing/incompatible dataset or one too short for a single window.
    """
    from mamba3lite.data import PretrainDataset

    if batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {batch_size}")
    if max_batches is not None and max_batches < 1:
        raise ConfigError(f"--max-batches must be >= 1, got {max_batches}")
    cfg = model.cfg
    split = pick_split(data_path, split, max_seq_len)
    ds = PretrainDataset(data_path, max_seq_len, cfg.vocab_size, split=split, dtype=token_dtype)
    if ds.manifest is not None:
        ds.manifest.identity.compatible_with(
            DataIdentity(tokenizer_name, vocab_hash, cfg.vocab_size, cfg.eos_id)
        )
    n = len(ds)
    total = n if max_batches is None else min(n, max_batches * batch_size)
    picks = spread_picks(n, total)
    device = next(model.parameters()).device
    precision = resolve_precision(dtype, device)
    if precision.warning:
        warnings.warn(precision.warning, stacklevel=2)
    was_training = model.training
    model.eval()
    try:
        loss_sum = window_loss_sum(model, ds, picks, batch_size, device, precision.dtype is not None)
    finally:
        model.train(was_training)
    loss = loss_sum / total
    bpb = loss / math.log(2) / ds.bytes_per_token if ds.bytes_per_token else None
    return EvalResult(
        loss=loss,
        perplexity=math.exp(min(loss, 700.0)),
        bits_per_byte=bpb,
        tokens=total * max_seq_len,
        windows=total,
        max_seq_len=max_seq_len,
        split=split,
        data_path=str(data_path),
    )
