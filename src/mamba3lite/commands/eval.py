"""`mamba3lite eval`: loss, perplexity and bits per byte of a checkpoint on a dataset.

    mamba3lite eval --checkpoint-dir mamba3lite-quickstart/run --data-path mamba3lite-quickstart/data/stdlib
    mamba3lite eval --checkpoint-dir runs/x --step 4000 --data-path data/other --max-batches 50 --json

Evaluates the dataset's val split when it has one (else train; `--split` chooses) in windows of the
run's max_seq_len, batches of its micro_batch_size, in its compute dtype: the numbers match the
trainer's validation rows for the same windows. Refuses a dataset made with another tokenizer.
`--json` prints one JSON object (and nothing else) on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys

from mamba3lite.commands.options import add_checkpoint_options
from mamba3lite.config import TOKEN_DTYPES

HELP = "loss, perplexity and bits per byte of a checkpoint on a dataset"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_checkpoint_options(parser)
    parser.add_argument(
        "--data-path",
        required=True,
        metavar="P",
        help="a prepared dataset directory (or a seed-format token file)",
    )
    parser.add_argument(
        "--split", choices=("train", "val"), default=None, help="which split (default: val when present)"
    )
    parser.add_argument(
        "--max-batches",
        type=int,
        default=None,
        metavar="N",
        help="at most N batches, spread evenly over the split (default: all windows)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        metavar="B",
        help="windows per batch (default: the run's micro_batch_size)",
    )
    parser.add_argument(
        "--token-dtype",
        choices=TOKEN_DTYPES,
        default=None,
        help="dtype of raw token files without a manifest (default: the run's data.token_dtype)",
    )
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")


def run(args: argparse.Namespace) -> int:
    from mamba3lite.evaluate import evaluate_model
    from mamba3lite.pretrained import load_pretrained, resolve_device

    loaded = load_pretrained(args.checkpoint_dir, args.step, device=resolve_device(args.device))
    for note in loaded.notes:
        print(f"note: {note}", file=sys.stderr)
    tc = loaded.config.training
    result = evaluate_model(
        loaded.model,
        args.data_path,
        max_seq_len=tc.max_seq_len,
        batch_size=tc.micro_batch_size if args.batch_size is None else args.batch_size,
        max_batches=args.max_batches,
        split=args.split,
        dtype=tc.dtype,
        vocab_hash=loaded.vocab_hash,
        tokenizer_name=loaded.tokenizer_name,
        token_dtype=args.token_dtype or loaded.config.data.token_dtype,
    )
    if args.json:
        out = {"checkpoint_dir": str(loaded.run_dir), "step": loaded.step, **result.to_dict()}
        print(json.dumps(out))
        return 0
    bpb = f"{result.bits_per_byte:.4f}" if result.bits_per_byte is not None else "n/a (no byte counts)"
    print(
        f"checkpoint  {loaded.run_dir} step {loaded.step} ({loaded.tokens_seen:,} tokens seen)\n"
        f"data        {result.data_path} [{result.split}], "
        f"{result.windows:,} windows of {result.max_seq_len} tokens\n"
        f"loss        {result.loss:.4f} nats/token\n"
        f"perplexity  {result.perplexity:,.2f}\n"
        f"bits/byte   {bpb}\n"
        f"tokens      {result.tokens:,}"
    )
    return 0
