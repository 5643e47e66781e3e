"""The `mamba3lite` command line.

Each subcommand lives in `mamba3lite/commands/<name>.py` and exposes

    HELP: str                                   one line for `mamba3lite --help`
    add_arguments(parser: ArgumentParser)       its flags
    run(args: Namespace) -> int                 a thin call into the library; returns the exit code

Modules are imported only when their command runs, so `mamba3lite --help` stays fast (no torch import).
Errors the user can fix (`Mamba3LiteError`) print one line and exit non-zero without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from mamba3lite import __version__
from mamba3lite.errors import Mamba3LiteError

# name -> one-line help. The order is the order of the pipeline.
COMMANDS: dict[str, str] = {
    "quickstart": "prepare the stdlib corpus, train the tiny preset on CPU, evaluate, sample, plot",
    "prepare": "turn raw text into verified GPT-2 token shards (manifest.json + shard files)",
    "train": "pretrain a Mamba-3 language model from a YAML config",
    "eval": "loss, perplexity and bits per byte of a checkpoint on a dataset",
    "generate": "sample text from a checkpoint (prefill + recurrent decode)",
    "inspect": "describe (and --verify) a dataset directory, a checkpoint directory or a shard file",
    "plot": "plot metrics.jsonl of a run directory to a PNG",
}


def _command_module(name: str):
    return importlib.import_module(f"mamba3lite.commands.{name}")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The full parser. With `only`, just that subcommand's arguments are attached (fast path)."""
    parser = argparse.ArgumentParser(
        prog="mamba3lite",
        description="Pretrain small Mamba-3 language models: prepare -> train -> eval / generate.",
    )
    parser.add_argument("--version", action="version", version=f"mamba3lite {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if only is None or only == name:
            try:
                module = _command_module(name)
            except ModuleNotFoundError as e:  # a command whose module has not landed yet
                if e.name != f"mamba3lite.commands.{name}":
                    raise
                p.set_defaults(_unavailable=True)
                continue
            module.add_arguments(p)
            p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    first = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(only=first if first in COMMANDS else None)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if getattr(args, "_unavailable", False):
        print(f"error: `mamba3lite {args.command}` is not implemented yet", file=sys.stderr)
        return 2
    try:
        return int(args._run(args) or 0)
    except BrokenPipeError:  # `mamba3lite generate ... | head`
        return 0
    except Mamba3LiteError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except OSError as e:  # unwritable directory, disk full, ...: the message names the path
        print(f"error: {e.strerror or e} ({e.filename})" if e.filename else f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
