"""CLI options that several subcommands share, defined once so their spelling and help agree."""

from __future__ import annotations

import argparse


def add_checkpoint_options(parser: argparse.ArgumentParser) -> None:
    """--checkpoint-dir D (required), --step N and --device DEV: which checkpoint of which run to load,
    onto which device."""
    parser.add_argument(
        "--checkpoint-dir", required=True, metavar="D", help="the run directory of a training run"
    )
    parser.add_argument(
        "--step", type=int, default=None, metavar="N", help="checkpoint step (default: newest verified)"
    )
    parser.add_argument(
        "--device",
        default="auto",
        metavar="DEV",
        help="auto (cuda if available, else cpu), cpu, cuda or cuda:N",
    )


def add_override_option(
    parser: argparse.ArgumentParser,
    help: str = "override any config field, e.g. --set training.lr=3e-4 (repeatable)",
) -> None:
    """--set SECTION.KEY=VALUE (repeatable) into `args.overrides`: typed config overrides."""
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE", help=help
    )
