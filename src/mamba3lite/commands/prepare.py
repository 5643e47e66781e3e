"""`mamba3lite prepare`: raw text → verified token shards, GPT-2's or a BPE fit to the corpus (a thin
call into `data.prepare`)."""

from __future__ import annotations

import argparse
import math
import os
import sys

HELP = "turn raw text into verified token shards (manifest.json + shard files [+ tokenizer.json])"

EPILOG = """\
sources (repeat --source; --weight applies to the --source just before it):
  FILE                 .txt .md .py (other files are read as UTF-8 text), .jsonl, .jsonl.gz, .parquet
  DIR                  every file below it (hidden files and __pycache__ skipped; binary files skipped
                       and counted)
  'GLOB'               e.g. 'corpus/**/*.md' (quote it)
  stdlib               this Python's standard-library .py files (no tests, idlelib, encodings, site-packages)
  hf:NAME[:CONFIG]     a Hugging Face dataset, streamed (pip install 'mamba3lite[hf]')

examples:
  mamba3lite prepare --source stdlib --out data/stdlib --val-fraction 0.02
  mamba3lite prepare --source stdlib --out data/stdlib-8k --val-fraction 0.02 --train-tokenizer 8192
  mamba3lite prepare --source web/ --weight 0.7 --source stdlib --weight 0.3 \\
      --target-tokens 5e6 --out data/mix
  mamba3lite prepare --mixture mixture.yaml --out data/mix
  mamba3lite prepare --source /shared/corpus --out /shared/data/corpus --ray auto
  mamba3lite prepare --source s3://corpus/notes/ --out s3://datasets/notes/
"""


class _SourceAction(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        items = list(getattr(namespace, self.dest) or [])
        items.append([values, None])
        setattr(namespace, self.dest, items)


class _WeightAction(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        items = namespace.sources or []
        if not items:
            parser.error("--weight must follow the --source it applies to")
        if items[-1][1] is not None:
            parser.error(f"--source {items[-1][0]} has two --weight values")
        items[-1][1] = values


def _count(text: str) -> int:
    """An integer that may be written 5e6 or 50_000_000."""
    try:
        value = float(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    if value != int(value):
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}")
    return int(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    _add_source_options(parser)
    _add_output_options(parser)
    _add_dataset_options(parser)
    _add_compute_options(parser)
    _add_reading_options(parser)


def _add_source_options(parser: argparse.ArgumentParser) -> None:
    """What is read: --source (with --weight), or a --mixture file."""
    parser.add_argument(
        "--source",
        dest="sources",
        action=_SourceAction,
        metavar="SRC",
        default=[],
        help="a text source (repeatable); see below",
    )
    parser.add_argument(
        "--weight",
        action=_WeightAction,
        type=float,
        metavar="W",
        help="mixing weight of the preceding --source (default 1): with --target-tokens, source i gets "
        "W_i/sum(W) of the tokens; without a target every document is used and sources are spread over "
        "the shards by size",
    )
    parser.add_argument(
        "--mixture",
        metavar="FILE.yaml",
        help="a YAML mixture: `sources: [{source: SRC, weight: W}, ...]`, optional `target_tokens:`",
    )


def _add_output_options(parser: argparse.ArgumentParser) -> None:
    """Where the dataset is written (a directory, or a URL through a local staging directory)."""
    parser.add_argument(
        "--out",
        required=True,
        metavar="DIR|URL",
        help="the dataset directory to write, or a URL (s3://bucket/prefix/, any fsspec URL): built in "
        "--stage-dir, then uploaded with manifest.json last (pip install 'mamba3lite[s3]')",
    )
    parser.add_argument(
        "--stage-dir",
        default=None,
        metavar="DIR",
        help="with an --out URL: the local directory the dataset is built in before its upload, removed "
        "after it (needs room for the whole dataset; with --ray a path every node sees; default "
        "~/.cache/mamba3lite/prepare/<hash of the URL>, which a re-run finds to resume)",
    )


def _add_dataset_options(parser: argparse.ArgumentParser) -> None:
    """What is written: tokenized how, in which shards and splits, cleaned how."""
    from mamba3lite.data.prepare import DEFAULT_MIN_CHARS, DEFAULT_SHARD_TOKENS, DEFAULT_VAL_FRACTION

    parser.add_argument(
        "--tokenizer",
        default=None,
        help="'gpt2' (default, offline) or a path to a Hugging Face tokenizer.json",
    )
    parser.add_argument(
        "--train-tokenizer",
        type=_count,
        default=None,
        metavar="N",
        help="instead of GPT-2, fit a byte-level BPE of exactly N ids to the train split (never to val) and "
        "save it as DIR/tokenizer.json; N counts the 256 byte symbols and EOS (<|endoftext|>, id 0), so "
        "N - 257 merges, N >= 258 (e.g. 8192); deterministic; not with --tokenizer",
    )
    parser.add_argument(
        "--shard-tokens",
        type=_count,
        default=DEFAULT_SHARD_TOKENS,
        metavar="N",
        help=f"tokens per shard (default {DEFAULT_SHARD_TOKENS:_}); documents are never split",
    )
    parser.add_argument(
        "--val-fraction",
        type=float,
        default=DEFAULT_VAL_FRACTION,
        metavar="F",
        help=f"fraction of documents in the val split, chosen by content hash "
        f"(default {DEFAULT_VAL_FRACTION})",
    )
    parser.add_argument(
        "--min-chars",
        type=int,
        default=DEFAULT_MIN_CHARS,
        metavar="N",
        help=f"drop documents shorter than N characters after cleaning (default {DEFAULT_MIN_CHARS})",
    )
    parser.add_argument(
        "--dedup-partitions",
        type=int,
        default=0,
        metavar="P",
        help="for a corpus whose dedup set would not fit this machine's memory (~90 bytes a kept "
        "document): first compute every unit, then find the repeated digests in P tasks, so that only "
        "those are remembered; the output is the same (default 0: one set here)",
    )
    parser.add_argument(
        "--no-dedup",
        dest="dedup",
        action="store_false",
        help="keep exact duplicate documents (default: drop them)",
    )


def _add_compute_options(parser: argparse.ArgumentParser) -> None:
    """Where the work units are computed: local processes or a Ray cluster (the output is the same)."""
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="tokenizer processes (default min(4, CPUs); 0 = in this process); the output "
        "is the same for any value",
    )
    parser.add_argument(
        "--unit-mb",
        type=float,
        default=None,
        metavar="MB",
        help="MiB of source text in each work unit, the task a worker computes (default 1); the output "
        "is the same for any size: larger units mean less driver work per token, for hundreds of "
        "workers; smaller ones finer balance and resume",
    )
    parser.add_argument(
        "--ray",
        metavar="ADDRESS",
        default=None,
        help="compute the work units as tasks on a Ray cluster: HOST:PORT of its head, or auto on a node "
        "of it (pip install 'mamba3lite[ray]'); every node must see the sources and --out at the same "
        "paths; the output is the same as without it",
    )


def _add_reading_options(parser: argparse.ArgumentParser) -> None:
    """How much is read and how: the token target, a slice, the JSON field, bad lines; and whether an
    existing dataset in --out may be replaced, and the split's salt."""
    parser.add_argument(
        "--target-tokens",
        type=_count,
        default=None,
        metavar="N",
        help="stop after about N tokens, split between sources by weight",
    )
    parser.add_argument(
        "--max-docs",
        type=_count,
        default=None,
        metavar="N",
        help="read at most N documents from each source (a quick slice)",
    )
    parser.add_argument(
        "--text-field",
        default="text",
        help="the text field of .jsonl / .parquet / hf sources (default: text)",
    )
    parser.add_argument(
        "--skip-bad-lines",
        action="store_true",
        help="skip and count malformed JSONL lines instead of stopping at the first",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a different dataset in --out (kept intact until the new one is done)",
    )
    parser.add_argument("--seed", type=int, default=0, help="salts the train/val split hash (default 0)")


def run(args: argparse.Namespace) -> int:
    from mamba3lite.data.prepare import PrepareOptions, prepare
    from mamba3lite.errors import ConfigError

    sources = [(spec, 1.0 if weight is None else weight) for spec, weight in args.sources]
    if args.tokenizer is not None and args.train_tokenizer is not None:
        raise ConfigError(
            f"--train-tokenizer fits a new tokenizer and --tokenizer {args.tokenizer} names one: pass one "
            "of the two"
        )
    options = PrepareOptions(
        tokenizer=args.tokenizer or "gpt2",
        train_tokenizer=args.train_tokenizer,
        workers=args.workers,
        shard_tokens=args.shard_tokens,
        val_fraction=args.val_fraction,
        min_chars=args.min_chars,
        dedup=args.dedup,
        target_tokens=args.target_tokens,
        text_field=args.text_field,
        skip_bad_lines=args.skip_bad_lines,
        overwrite=args.overwrite,
        seed=args.seed,
        max_docs=args.max_docs,
        ray=args.ray,
        dedup_partitions=args.dedup_partitions,
        unit_mb=args.unit_mb,
        stage_dir=args.stage_dir,
        progress=sys.stderr.isatty() and not os.environ.get("MAMBA3LITE_NO_PROGRESS"),
    )
    summary = prepare(sources, args.out, options, mixture=args.mixture)
    print(summary.table())
    return 0
