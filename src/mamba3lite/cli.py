"""The `mamba3lite` command line.

Each subcommand lives in `mamba3lite/commands/<name>.py` and exposes

    HELP: str                                   one line for `mamba3lite --help`
    add_arguments(parser: ArgumentParser)       its flags
    run(args: Namespace) -> int                 a thin call into the library; returns the exit code

Command modules import nothing heavy at module level, so `mamba3lite --help` stays fast (no torch).
Errors the user can fix (`Mamba3LiteError`) print one line and exit non-zero without a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import keyword
import os
import re
import signal
import sys
import threading
import warnings
from pathlib import Path
from typing import NoReturn

from mamba3lite import __version__
from mamba3lite.errors import ConfigError, Mamba3LiteError
from mamba3lite.malloc import keep_freed_memory

# The subcommands, in the order of the pipeline. Each module's HELP is its line in `--help`.
COMMANDS: tuple[str, ...] = (
    "quickstart", "prepare", "train", "lighthouse", "eval", "generate", "serve", "inspect", "plot", "import",
    "export",
)  # fmt: skip
# Commands whose work must not end when their console output can no longer be written (`train | head`):
# the run goes on, its rows are in RUN/metrics.jsonl. `generate | head` stops, as a reader expects.
KEEP_RUNNING_WITHOUT_STDOUT = ("quickstart", "prepare", "train")


class _StdoutThatMayClose:
    """sys.stdout, until a write finds the pipe closed (the reader exited): then one note on stderr and
    every later write is dropped; fd 1 goes to /dev/null so that the interpreter's flush at exit cannot
    fail either. Everything else is the real stream's."""

    def __init__(self, stream) -> None:
        self._stream = stream
        self.closed_by_reader = False

    def _lost(self) -> None:
        self.closed_by_reader = True
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        print("note: standard output was closed by its reader; carrying on without it", file=sys.stderr)

    def write(self, text: str) -> int:
        if not self.closed_by_reader:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._lost()
        return len(text)

    def flush(self) -> None:
        if not self.closed_by_reader:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._lost()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def command_module(name: str):
    """`mamba3lite.commands.<name>` (`<name>_` for a Python keyword: `import_`): cheap to import (heavy
    imports live inside its `run`)."""
    return importlib.import_module(f"mamba3lite.commands.{name}{'_' if keyword.iskeyword(name) else ''}")


class _Parser(argparse.ArgumentParser):
    """argparse that raises a usage mistake (an unknown flag, `--step abc`, a 5,000-digit `--seed`) as a
    ConfigError, so that it reaches the one printer as one `error:` line with a pointer to --help, like
    every other bad input, and an in-process caller of `main` gets exit code 2 instead of SystemExit.
    A value quoted in the message is shortened: argparse would echo all of it."""

    def error(self, message: str) -> NoReturn:
        message = re.sub(r"'([^']{40})[^']{20,}'", lambda m: f"'{m.group(1)}…'", message)
        raise ConfigError(f"{self.prog}: {message}; see `{self.prog} --help`")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with `command` (one of COMMANDS) only that subcommand gets its flags, the
    others their names and help lines. Some flags' defaults come from the library (the quickstart's and
    prepare's import their packages, ~0.1 s on a quiet 2-core machine), which a run of another command
    need not pay for."""
    assert command is None or command in COMMANDS, command
    parser = _Parser(
        prog="mamba3lite",
        description="Pretrain small Mamba-3 language models: prepare -> train -> eval / generate.",
    )
    parser.add_argument("--version", action="version", version=f"mamba3lite {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        module = command_module(name)
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        if command in (None, name):
            module.add_arguments(p)
            p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    code = _run_command(argv)
    if argv is None and threading.current_thread() is threading.main_thread():
        # The process's own command line (the console script, `python -m mamba3lite`), and the command is
        # over (a training run has saved everything): a SIGTERM during interpreter shutdown, which takes a
        # while after torch, must not turn a finished run into exit -15. (Not for in-process callers.)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # imported only by commands that train
    dist = sys.modules.get("mamba3lite.train.parallel.process_group")
    if dist is not None and dist.left_process_group:
        # A distributed worker whose run is over and written: skip interpreter finalization, which can
        # abort a gloo process (see train/parallel/process_group.py `teardown`).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    """Warnings as the CLI's other messages: `warning: ...`, without Python's file:line and source line."""
    kind = "" if category is UserWarning else f" ({category.__name__})"
    return f"warning{kind}: {message}\n"


def _os_error_line(e: OSError) -> str:
    """An OSError that no command turned into its own error, as one line naming the path. The two that
    a user's path causes get a fix: a file where a directory was needed on the way (`--out a.txt/run`
    gives ENOTDIR, or EEXIST from mkdir), said in those words instead of "File exists"."""
    if not e.filename:
        return str(e)
    path = e.filename
    if e.errno == errno.ENOTDIR or (
        e.errno == errno.EEXIST and os.path.lexists(path) and not os.path.isdir(path)
    ):
        blocker = next((p for p in _ancestors(path) if os.path.lexists(p) and not os.path.isdir(p)), path)
        where = "" if blocker == path else f"{path}: "
        return f"{where}{blocker} is a file, not a directory; choose a path whose directories can be made"
    return f"{e.strerror or e} ({path})"


def _ancestors(path: str) -> list[str]:
    """`path` and each directory above it, outermost first: a/b/c -> [a, a/b, a/b/c]."""
    return list(reversed([str(p) for p in (Path(path), *Path(path).parents) if str(p) not in ("", ".")]))


def _run_command(argv: list[str] | None) -> int:
    argv_given_none = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv_given_none:  # the process's own output (an in-process caller keeps Python's format)
        warnings.formatwarning = _one_line_warning
    # the command is the first argument (the only options before it are --help and --version)
    parser = build_parser(argv[0] if argv and argv[0] in COMMANDS else None)
    try:
        args = parser.parse_args(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    if args.command is None:
        parser.print_help()
        return 2
    # The process's own command line (the console script, `python -m mamba3lite`), not an in-process
    # caller: a command may then leave process-wide state (signal handlers) as the process's exit needs.
    args.own_process = argv_given_none
    keep_freed_memory()  # CPU speed: see mamba3lite/malloc.py
    stdout = sys.stdout
    if args.command in KEEP_RUNNING_WITHOUT_STDOUT and not isinstance(stdout, _StdoutThatMayClose):
        sys.stdout = _StdoutThatMayClose(stdout)
    try:
        return int(args._run(args) or 0)
    except BrokenPipeError:  # `mamba3lite generate ... | head`
        return 0
    except Mamba3LiteError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except OSError as e:  # unwritable directory, disk full, ...: the message names the path
        print(f"error: {_os_error_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        sys.stdout = stdout


if __name__ == "__main__":
    sys.exit(main())
