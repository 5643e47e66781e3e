"""`mamba3lite inspect PATH [--verify]`: describe a dataset directory, a checkpoint directory or a shard file.

What PATH is decides what is shown (`detect_kind`): dataset directories (a `manifest.json` inside) here;
checkpoint (run) directories and single shard files in `mamba3lite.report.inspect_run`.
"""

from __future__ import annotations

import argparse
import codecs
import sys
from pathlib import Path

from mamba3lite import intake
from mamba3lite.config import TOKEN_DTYPES
from mamba3lite.errors import ConfigError, DataError, DataNotFoundError
from mamba3lite.rundir import looks_like_checkpoint_file  # (no torch: a cheap module)

HELP = "describe (and --verify) a dataset directory, a checkpoint directory or a shard file"

DATASET, CHECKPOINT, SHARD_FILE = "dataset", "checkpoint", "shard file"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "path", metavar="PATH", help="a dataset directory, a checkpoint directory or a shard file"
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="dataset: re-hash every shard and check sizes, counts and max token ids against "
        "the manifest; checkpoint directory: every step's files against its meta; shard file: "
        "against its manifest entry. Exit non-zero naming the first bad shard or step",
    )
    parser.add_argument(
        "--token-dtype",
        choices=TOKEN_DTYPES,
        help="a shard file that no manifest lists: read it as this dtype instead of guessing (the seed's "
        "pipeline wrote uint32)",
    )


# Suffixes of files that are text for people (a file named so that decodes as UTF-8 is not token data)
# and of token files (never taken for text, whatever their bytes).
_TEXT_SUFFIXES = frozenset(
    {".txt", ".md", ".rst", ".py", ".json", ".jsonl", ".yaml", ".yml", ".toml", ".cfg", ".ini", ".csv"}
    | {".tsv", ".html", ".xml", ".log", ".sh", ".c", ".h", ".cpp", ".js", ".ts", ".rs", ".go", ".java"}
)
_TOKEN_SUFFIXES = frozenset({".bin", ".pt", ".npy", ".u16", ".u32", ".tokens"})
_TEXT_PROBE_BYTES = 64 * 1024


def _is_text_file(path: Path) -> bool:
    """Whether `path` is plainly a text file: its first 64 KiB decode as UTF-8 and it is named like text,
    or (any name but a token file's) it also has no NUL byte. Token data is neither: uint32 ids below
    2**24 and uint16 ids below 256 (newline, space, punctuation in GPT-2) contain NUL bytes, and random
    high bytes are not valid UTF-8."""
    suffix = path.suffix.lower()
    if suffix in _TOKEN_SUFFIXES:
        return False
    with path.open("rb") as f:
        head = f.read(_TEXT_PROBE_BYTES)
    if not head:
        return False
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)  # a character cut at 64 KiB: ok
    except UnicodeDecodeError:
        return False
    return suffix in _TEXT_SUFFIXES or b"\0" not in head


def _run_dir_of(path: Path) -> Path | None:
    """The directory holding `path` when it is a checkpoint (run) directory, else None."""
    parent = path.parent
    if any(looks_like_checkpoint_file(p.name) for p in parent.glob("*_step_*")):
        return parent
    return None


def detect_kind(path: Path) -> str:
    """DATASET, CHECKPOINT or SHARD_FILE; DataNotFoundError / ConfigError when PATH is none of them."""
    from mamba3lite.data.shards import MANIFEST_NAME, has_manifest

    expected = "expected a dataset directory, a checkpoint directory or a token shard file"
    if not path.exists():
        raise DataNotFoundError(f"{path} does not exist")
    if path.is_file():
        if path.name == MANIFEST_NAME:
            return DATASET
        if looks_like_checkpoint_file(path.name):
            raise ConfigError(
                f"{path} is a checkpoint file; inspect its run directory: mamba3lite inspect {path.parent}"
            )
        run_dir = _run_dir_of(path)
        if run_dir is not None:
            raise ConfigError(
                f"{path} is a file of the run directory {run_dir}, not a token shard; inspect the run: "
                f"mamba3lite inspect {run_dir}"
            )
        if _is_text_file(path):
            raise ConfigError(
                f"{path} is a text file, not token shards; prepare it first: mamba3lite prepare --source "
                f"{path} --out DIR (then inspect DIR)"
            )
        return SHARD_FILE
    if not path.is_dir():
        raise ConfigError(
            f"{path} is {intake.describe_mode(path.stat().st_mode)}, not a file or directory; {expected}"
        )
    if has_manifest(path):
        return DATASET
    if (
        any(path.glob("*.safetensors"))
        or any(path.glob("*.pt"))
        or any(path.glob("checkpoint*"))
        or any(path.glob("step_*"))
        or any(path.glob("dcp_step_*"))  # a sharded run's steps
    ):
        return CHECKPOINT
    raise ConfigError(
        f"{path} is a directory without {MANIFEST_NAME} or checkpoint files; expected a dataset "
        "directory (made by `mamba3lite prepare`), a checkpoint directory or a shard file"
    )


def run(args: argparse.Namespace) -> int:
    path = Path(args.path)
    kind = detect_kind(path)
    if args.token_dtype and kind != SHARD_FILE:
        raise ConfigError(
            f"--token-dtype is for a shard file that no manifest lists; {path} is a {kind} directory, "
            + ("which records its own dtype" if kind == DATASET else "which holds no token files")
            + ": drop --token-dtype"
        )
    handler = {DATASET: _inspect_dataset, CHECKPOINT: _inspect_checkpoint, SHARD_FILE: _inspect_shard_file}[
        kind
    ]
    return handler(path, args)


def _inspect_checkpoint(path: Path, args: argparse.Namespace) -> int:
    from mamba3lite.report.inspect_run import inspect_checkpoint_dir

    return inspect_checkpoint_dir(path, args.verify)


def _inspect_shard_file(path: Path, args: argparse.Namespace) -> int:
    from mamba3lite.report.inspect_run import inspect_shard_file

    return inspect_shard_file(path, args.verify, token_dtype=args.token_dtype)


def describe_dataset(path: Path) -> str:
    """The human-readable description of a dataset directory (its manifest)."""
    from mamba3lite.data.shards import MANIFEST_NAME, Manifest, dataset_dir
    from mamba3lite.data.tables import split_table, stats_lines

    path = dataset_dir(path)
    m = Manifest.load(path)
    lines = [
        f"dataset     {path}",
        f"tokenizer   {m.tokenizer['name']} (vocab hash {m.tokenizer['vocab_hash'][:12]}…)",
        f"vocab       {m.vocab_size:,}   eos id {m.eos_id}   dtype {m.dtype}   format v{m.format_version}",
        "",
        *split_table(m),
    ]
    if "stats" in m.extra:
        lines += stats_lines(m.extra["stats"], where=str(path / MANIFEST_NAME))
    return "\n".join(lines)


def _inspect_dataset(path: Path, args: argparse.Namespace) -> int:
    from mamba3lite.data.shards import Manifest, dataset_dir, verify_dataset

    print(describe_dataset(path))
    if not args.verify:
        return 0
    root = dataset_dir(path)
    problems = verify_dataset(root)
    if problems:
        for p in problems:
            print(f"BAD  {p}", file=sys.stderr)
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise DataError(f"verification failed: {problems[0]}{more}; re-run `mamba3lite prepare`")
    m = Manifest.load(root)
    print(
        f"\nverified: {len(m.shards)} shards, {m.n_tokens():,} tokens — sizes, sha256, max ids and EOS "
        "counts match the manifest"
    )
    return 0
