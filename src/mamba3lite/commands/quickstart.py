"""`mamba3lite quickstart [--minutes M] [--workdir DIR] [--source S]`: the whole pipeline on this machine,
in M minutes.

Prepares the source (the stdlib corpus by default) with a tokenizer fit to it, chooses the model by
measuring this machine, trains it for what is left of the budget, evaluates before and after (beside
zlib and xz on the same text), prints a sample and writes the loss plot; re-running continues in the same
--workdir. See `mamba3lite.quickstart` for the recipe and how the time budget is planned.
"""

from __future__ import annotations

import argparse

from mamba3lite.commands.options import add_override_option

HELP = "prepare a corpus (stdlib), train the model that fits the time budget, evaluate, sample, plot"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from mamba3lite.quickstart import CONTROLLED_FIELDS, DEFAULT_PROMPT, DEFAULT_WORKDIR

    parser.add_argument(
        "--minutes",
        type=float,
        default=5.0,
        metavar="M",
        help="wall-clock budget for everything, data preparation included (default 5)",
    )
    parser.add_argument(
        "--workdir",
        default=DEFAULT_WORKDIR,
        metavar="DIR",
        help=f"where the dataset and the run go; re-running continues there (default ./{DEFAULT_WORKDIR})",
    )
    parser.add_argument(
        "--config",
        default="auto",
        metavar="auto|FILE|PRESET",
        help="auto (default): the recipe, its model shape chosen by measuring this "
        "machine; a preset or file: that config as it is (e.g. tiny)",
    )
    _add_data_arguments(parser)
    add_override_option(
        parser,
        help="override a config field, e.g. --set training.lr=3e-4 (repeatable); refused for the fields "
        f"the quickstart sets itself: {', '.join(CONTROLLED_FIELDS)}; training.warmup_steps and "
        "training.log_every are upper limits",
    )
    parser.add_argument(
        "--prompt", default=DEFAULT_PROMPT, metavar="TEXT", help=f"sample prompt (default {DEFAULT_PROMPT!r})"
    )
    parser.add_argument(
        "--sample-tokens", type=int, default=100, metavar="N", help="sample length (default 100)"
    )
    parser.add_argument(
        "--no-token-healing",
        dest="token_healing",
        action="store_false",
        help="sample without backing up the prompt's last token (see generate --help)",
    )


def _add_data_arguments(parser: argparse.ArgumentParser) -> None:
    """What to train on and how it is tokenized."""
    parser.add_argument(
        "--source",
        default="stdlib",
        metavar="S",
        help="the text to train on: any source `prepare` accepts (files, directories, "
        "globs, .jsonl, hf:NAME); default stdlib",
    )
    parser.add_argument(
        "--tokenizer",
        choices=("trained", "gpt2"),
        default="trained",
        help="trained (default): a byte-level BPE fit to the source's train split; gpt2: GPT-2's 50,257 ids",
    )
    parser.add_argument(
        "--vocab",
        type=int,
        default=None,
        metavar="N",
        help="ids of the trained tokenizer (default: the recipe's, 4096)",
    )
    parser.add_argument(
        "--max-docs",
        type=int,
        default=None,
        metavar="N",
        help="use only the first N files of the source (a small slice, for a smoke test)",
    )


def run(args: argparse.Namespace) -> int:
    from mamba3lite.quickstart import QuickstartOptions, run_quickstart, summary_text

    if args.sample_tokens < 1:
        from mamba3lite.errors import ConfigError

        raise ConfigError(f"--sample-tokens must be >= 1, got {args.sample_tokens}")

    def log(text: str) -> None:
        print(text, flush=True)

    result = run_quickstart(
        QuickstartOptions(
            minutes=args.minutes,
            workdir=args.workdir,
            config=args.config,
            overrides=list(args.overrides),
            max_docs=args.max_docs,
            prompt=args.prompt,
            sample_tokens=args.sample_tokens,
            source=args.source,
            tokenizer=args.tokenizer,
            vocab=args.vocab,
            token_healing=args.token_healing,
        ),
        log=log,
    )
    print(summary_text(result), flush=True)
    return 0
