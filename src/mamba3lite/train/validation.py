"""The trainer's validation: mean loss over a fixed, evenly spread set of validation windows.

    validation_loss_sum(model, val_data, tc, dist, autocast) -> (sum of window losses, windows), all
        ranks together; each rank scores its share of the picks (evaluate.spread_picks: the same windows
        at every evaluation, whatever the world size)
    eval_row(val_loss, windows, bytes_per_token, split_windows) -> {"val_loss", "val_ppl", "val_windows"
        (windows scored), "val_split_windows" (windows in the whole validation set)[, "val_bpb"]}
    validate(...)   the two together: the evaluation's row

A damaged validation shard on any rank is a DataError on every rank (one rank raising alone would
leave the others waiting in the next collective).
"""

from __future__ import annotations

import math

from mamba3lite.errors import DataError
from mamba3lite.evaluate import spread_picks, window_loss_sum
from mamba3lite.train.parallel import process_group as D


def validation_loss_sum(
    model, val_data, tc, dist: D.DistInfo, use_autocast: bool, sharded: bool = False
) -> tuple[float, float]:
    """(sum of window losses, windows) over all ranks of `tc.eval_batches` micro-batches of windows;
    the model is put back in train mode. `sharded`: the model's forward is a collective (fsdp/hsdp),
    so every rank scores every pick (the same forwards on all ranks) and nothing is summed across."""
    n = len(val_data)
    total = min(tc.eval_batches * tc.micro_batch_size, n)
    picks = spread_picks(n, total)
    mine = picks if sharded else picks[dist.rank :: dist.world_size]
    model.eval()
    bad: DataError | None = None
    try:
        loss_sum = window_loss_sum(model, val_data, mine, tc.micro_batch_size, dist.device, use_autocast)
    except DataError as e:  # a damaged val shard
        loss_sum, bad = 0.0, e
    finally:
        model.train()
    if D.any_rank(bad is not None, dist):
        raise bad or DataError("another rank's validation batch is damaged (its log names the shard)")
    if sharded:
        return loss_sum, float(len(mine))
    loss_sum, count = D.sum_across([loss_sum, float(len(mine))], dist)
    return loss_sum, count


def eval_row(
    val_loss: float, windows: float, bytes_per_token: float | None, split_windows: int | None = None
) -> dict:
    """The evaluation's numbers: loss (nats/token), perplexity, the windows scored and (when given) the
    windows of the whole validation set they were picked from, so that a reader can tell a subset's
    number from the whole set's, and bits per byte when the dataset knows its bytes per token."""
    out = {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 700.0)), "val_windows": int(windows)}
    if split_windows is not None:
        out["val_split_windows"] = int(split_windows)
    if bytes_per_token:
        out["val_bpb"] = val_loss / math.log(2) / bytes_per_token
    return out


def validate(model, val_data, tc, dist: D.DistInfo, use_autocast: bool, sharded: bool = False) -> dict:
    """The evaluation's row (eval_row) over all ranks; its val_loss may be non-finite (a diverging model,
    or an overflow in the evaluation's dtype): see nonfinite_note."""
    loss_sum, count = validation_loss_sum(model, val_data, tc, dist, use_autocast, sharded)
    bytes_per_token = getattr(val_data, "bytes_per_token", None)
    return eval_row(loss_sum / max(count, 1), count, bytes_per_token, split_windows=len(val_data))


def nonfinite_note(val_loss: float, step: int) -> str:
    """What the run says instead of recording a non-finite evaluation."""
    return (
        f"validation loss is {val_loss} at step {step} (the model may be diverging); not recorded as an "
        "evaluation"
    )
