"""The border: every file mamba3lite reads from disk enters through this module.

A file on disk is the user's input like a flag is, and it can be anything: a named pipe (reading it
blocks until a writer appears, and SIGTERM cannot interrupt that read), `/dev/zero` behind a symlink
(endless), a 5,000-digit integer (Python refuses to convert it: ValueError), 100,000 nested `[`
(RecursionError), `NaN` in JSON, bytes that are not UTF-8, or valid JSON of the wrong shape. Each of
those becomes one error here, of the class that fits the kind of file, in the project's usual form

    FILE is not valid JSON (<problem, where>); expected a <kind of file>; <fix>
    FILE is not a valid <kind of file>: <field> must be <type>, got <value>; <fix>

so the CLI prints one line and no caller needs its own `except` list.

The rules, in order:
1. `os.stat` first (it follows symlinks, so a link to a device is judged by its target): only a
   regular file is opened, so a FIFO, a device or a socket is never opened at all.
2. The file is opened with O_NONBLOCK and checked again with `fstat`: a path swapped for a pipe between
   the stat and the open still cannot block.
3. A size cap per kind of file (`FileKind.max_bytes`), checked on the stat and again while reading
   (a file that grows while read is cut at the cap, not followed).
4. Decoding: UTF-8 (strict), then JSON (integers of more than `MAX_INT_DIGITS` digits, NaN/Infinity
   and floats that overflow to infinity refused, unless the kind is the user's documents) or YAML (the
   project's strict loader, defined here: duplicate keys refused); a nesting depth beyond Python's
   recursion limit is an error, not a RecursionError. Line files (JSONL, and their `.gz`) are read in
   bounded pieces (`iter_lines`): a line past its cap is never read whole, a damaged .gz is one error.
5. The top-level type and, with `expect`, the fields: the schema helpers below are the checks that
   manifest, meta, run.json, metrics rows and mixture files share.
"""

from __future__ import annotations

import functools
import gzip
import json
import math
import os
import re
import stat
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

from mamba3lite.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    DataNotFoundError,
    Mamba3LiteError,
)

MiB = 1 << 20
# No integer mamba3lite writes has more digits than this (the widest: 128-bit RNG words, 39 digits).
# Python itself refuses to convert more than 4,300 (a ValueError); a bound far below that keeps a
# pasted 4,000-digit number from reaching arithmetic that was written for counts.
MAX_INT_DIGITS = 100


@dataclass(frozen=True)
class FileKind:
    """One kind of file the project reads: what it is called in messages, how big it may be, which
    error class reports it, and what the user should do when it is bad."""

    what: str  # "dataset manifest", as in "FILE is not a valid dataset manifest"
    max_bytes: int  # larger files are refused before they are read
    error: type[Mamba3LiteError]  # the class every problem with this kind of file raises
    fix: str  # the advice that ends the message
    missing: type[Mamba3LiteError] | None = None  # raised when the file does not exist (default: error)
    finite_only: bool = True  # JSON NaN/Infinity refused (False where our own writer may emit them)
    bounded_ints: bool = True  # JSON integers of more than MAX_INT_DIGITS digits refused (False: the
    # user's documents, where only Python's own 4,300-digit limit applies)

    def fail(self, message: str) -> Mamba3LiteError:
        """The error for `message`, with the fix appended."""
        return self.error(f"{message}; {self.fix}" if self.fix else message)


_PREPARE = "re-run `mamba3lite prepare`"
_RESTORE = "restore the file from a backup or resume from another step (`--resume N`)"

MANIFEST = FileKind("dataset manifest", 256 * MiB, DataError, _PREPARE, missing=DataNotFoundError)
META = FileKind("checkpoint meta file", 64 * MiB, CheckpointError, _RESTORE, finite_only=False)
RUN_INFO = FileKind("run record (run.json)", 16 * MiB, CheckpointError, "delete it to start a fresh record")
METRICS = FileKind(
    "metrics log (metrics.jsonl)", 2048 * MiB, DataError, "metrics.jsonl is the log `mamba3lite train` writes"
)
CONFIG = FileKind("YAML config", 4 * MiB, ConfigError, "fix the file or use a preset name")
MIXTURE = FileKind("mixture file", 16 * MiB, ConfigError, "see `mamba3lite prepare --help` for its format")
SAFETENSORS_HEADER = FileKind(
    "safetensors header", 100 * MiB, CheckpointError, "the weights file is damaged or not safetensors"
)
# prepare's own records in OUT/.prepare/ (state.json, commit.json) and the binary files they describe:
# a bad one is not the user's error, the snapshot is just not restored (prepare starts afresh).
STAGE_STATE = FileKind("prepare staging record", 64 * MiB, DataError, "delete OUT/.prepare to start afresh")
STAGE_DATA = FileKind("prepare staging file", 1 << 40, DataError, "delete OUT/.prepare to start afresh")
# torch.save archives: their size is vouched for by the meta's record (size, sha256) before they are
# loaded; the cap only keeps a sparse file of exabytes from being opened.
OPTIMIZER_STATE = FileKind("optimizer state file", 1 << 40, CheckpointError, _RESTORE)
TOKENIZER = FileKind(
    "tokenizer file",
    512 * MiB,
    ConfigError,
    "pass the tokenizer.json / vocabulary the data was prepared with",
)
OFFICIAL_CONFIG = FileKind(
    "model config (config.json of the official mamba_ssm format)",
    16 * MiB,
    CheckpointError,
    "pass a directory in the official mamba_ssm format, or fetch the model again",
)
SAFETENSORS_INDEX = FileKind(
    "safetensors index (model.safetensors.index.json)", 64 * MiB, CheckpointError, "fetch the model again"
)
# prepare's inputs: a text file is one document, read whole into a tokenizer worker; a JSONL line too.
SOURCE_DOCUMENT = FileKind(
    "text source file (one document)",
    512 * MiB,
    DataError,
    "split it into smaller files, or write it as .jsonl with one document per line",
)
MAX_SOURCE_LINE_BYTES = 64 * MiB
# A .jsonl / .jsonl.gz source: any size (read line by line, each line capped); its lines are the user's
# documents, so NaN and long integers in them are fine (only a line Python cannot parse is bad).
SOURCE_JSONL = FileKind(
    "JSON-lines source file",
    1 << 62,
    DataError,
    "re-create the file (a .gz cut short by an interrupted download or copy cannot be read to its end)",
    finite_only=False,
    bounded_ints=False,
)
TOKEN_FILE = FileKind(
    "token file", 1 << 62, DataError, "pass a dataset directory written by `mamba3lite prepare`"
)
# A metrics row is a few hundred bytes; a longer line is damage (or no line at all: a sparse file).
MAX_JSONL_LINE_BYTES = 1 * MiB


# ------------------------------------------------------------------------------------- regular files


def describe_mode(mode: int) -> str:
    """What a file of `st_mode` `mode` is, in words ("a named pipe (FIFO)"), for messages."""
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a named pipe (FIFO)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def torch_load_refusal(e: Exception) -> str:
    """Why torch.load(..., weights_only=True) refused a file, in one clause. For a file its weights-only
    unpickler rejects (not a pickle of tensors: garbage, another format, or a pickle that would run
    code), torch's paragraph opens with advice to load with weights_only=False, i.e. to run whatever
    the file holds: only its reason is kept. Other errors (a truncated archive): their first line."""
    text = str(e)
    reason = re.search(r"WeightsUnpickler error:\s*(.+?)(?:\n\s*\n|Check the documentation|$)", text, re.S)
    if reason:  # its first sentence (the rest is advice on allowing more globals)
        why = " ".join(reason.group(1).split()).split(". ")[0].rstrip(".")[:200]
        return (
            f"it holds more than tensors, or is not a PyTorch file: {why}; mamba3lite reads it without "
            "running pickled code, so a damaged or foreign file stops here"
        )
    first = text.strip().splitlines()[0][:200] if text.strip() else type(e).__name__
    return f"{first}; the file is damaged or incomplete"


def regular_file_size(path: str | os.PathLike, kind: FileKind) -> int:
    """The size of `path` after checking that it is (a symlink to) an existing regular file within the
    kind's cap. Opens nothing. Raises the kind's errors naming the path."""
    path = os.fspath(path)
    try:
        st = os.stat(path)  # follows symlinks: a link to /dev/zero is judged by /dev/zero
    except FileNotFoundError:
        raise (kind.missing or kind.error)(f"{path} does not exist; {kind.fix}") from None
    except OSError as e:
        raise kind.error(f"{path}: cannot read the {kind.what} ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise kind.fail(f"{path} is {describe_mode(st.st_mode)}; a {kind.what} must be a regular file")
    if st.st_size > kind.max_bytes:
        raise kind.fail(
            f"{path} is {st.st_size / MiB:,.1f} MiB, more than a {kind.what} can be "
            f"({kind.max_bytes / MiB:,.0f} MiB)"
        )
    return st.st_size


def open_regular(path: str | os.PathLike, kind: FileKind) -> BinaryIO:
    """Open a regular file for binary reading; never blocks on the open, whatever the path names."""
    regular_file_size(path, kind)
    try:
        # O_NONBLOCK: a path swapped for a FIFO after the stat still cannot hang the open.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise kind.error(f"{path}: cannot read the {kind.what} ({e.strerror or e})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise kind.fail(f"{path} is {describe_mode(mode)}; a {kind.what} must be a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bytes_capped(path: str | os.PathLike, kind: FileKind, *, limit: int | None = None) -> bytes:
    """The bytes of a regular file, at most `limit` (default: the kind's cap; more is an error)."""
    cap = kind.max_bytes if limit is None else limit
    with open_regular(path, kind) as f:
        data = f.read(cap + 1)
    if len(data) > cap:  # it grew after the stat
        raise kind.fail(f"{path} holds more than the {cap / MiB:,.0f} MiB a {kind.what} can be")
    return data


def read_prefix(path: str | os.PathLike, kind: FileKind, n_bytes: int) -> bytes:
    """The first `n_bytes` bytes of a regular file (fewer if it is shorter): for magic numbers and
    headers, without the kind's size cap."""
    with open_regular(path, FileKind(kind.what, 1 << 62, kind.error, kind.fix, kind.missing)) as f:
        return f.read(n_bytes)


def decode_utf8(data: bytes, where: str, kind: FileKind) -> str:
    """Strict UTF-8 (a BOM is dropped): a binary file or another encoding is the kind's error."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise kind.fail(
            f"{where} is not a UTF-8 text file ({e.reason} at byte {e.start}); expected a {kind.what}"
        ) from None


def read_text_capped(path: str | os.PathLike, kind: FileKind) -> str:
    """A regular file's text: capped, strict UTF-8."""
    return decode_utf8(read_bytes_capped(path, kind), str(path), kind)


# --------------------------------------------------------------------------------------------- JSON


class _Refused(ValueError):
    """A number the JSON hooks refuse; the message says what."""


def _parse_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise _Refused(f"an integer of {digits:,} digits (more than any field holds)")
    return int(text)


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"the number {text[:40]} is too large for a float")
    return value


def _refuse_constant(name: str) -> float:
    raise _Refused(f"{name} is not a finite number")


def json_problem(text: str, kind: FileKind) -> tuple[Any, str | None]:
    """(value, None) for valid JSON, else (None, what is wrong in a clause): json.loads by the kind's
    number rules, every failure (syntax, huge integers, NaN/Infinity, depth) as the clause. For readers
    that decide per line what a bad one means; `parse_json` raises it."""
    hooks: dict[str, Any] = {"parse_int": _parse_int} if kind.bounded_ints else {}
    if kind.finite_only:
        hooks |= {"parse_float": _parse_float, "parse_constant": _refuse_constant}
    try:
        return json.loads(text, **hooks), None
    except json.JSONDecodeError as e:
        return None, f"{e.msg} (line {e.lineno}, column {e.colno})"
    except _Refused as e:
        return None, str(e)
    except ValueError as e:  # Python's own int-string limit (bounded_ints off, or a hook bypassed)
        return None, " ".join(str(e).split())[:120]
    except RecursionError:
        return None, "nested too deeply"


def parse_json(text: str, where: str, kind: FileKind) -> Any:
    """json.loads with every failure (syntax, huge integers, NaN/Infinity, depth) as the kind's error."""
    value, problem = json_problem(text, kind)
    if problem is not None:
        raise kind.fail(f"{where} is not valid JSON ({problem}); expected a {kind.what}")
    return value


def read_json(path: str | os.PathLike, kind: FileKind, *, top: type | None = dict) -> Any:
    """A regular file's JSON, every problem the kind's error naming the file; `top` is the type the
    top-level value must have (None: any)."""
    obj = parse_json(read_text_capped(path, kind), str(path), kind)
    if top is not None:
        expect_type(obj, top, where=str(path), kind=kind, what="its top level")
    return obj


@dataclass
class JsonlLine:
    """One line of a JSONL file: its number (from 1), the value, or why it could not be read."""

    lineno: int
    value: Any = None
    problem: str | None = None


def iter_lines(
    path: str | os.PathLike, kind: FileKind, *, max_line_bytes: int
) -> Iterator[tuple[int, bytes | None]]:
    """(number from 1, raw bytes) of each non-blank line of a regular file, gunzipped first when its name
    ends in `.gz`. Lines are read with bounded reads, never whole: a line longer than `max_line_bytes`
    comes as (number, None), the rest of it skipped. More than the kind's cap in all (a file that grows,
    a small .gz that inflates without end), a damaged or truncated .gz, or a read error: the kind's
    error naming the file."""
    with open_regular(path, kind) as raw:
        yield from iter_stream_lines(raw, str(path), kind, max_line_bytes=max_line_bytes)


def iter_stream_lines(
    raw: BinaryIO, path: str, kind: FileKind, *, max_line_bytes: int
) -> Iterator[tuple[int, bytes | None]]:
    """`iter_lines` over a binary file already open (an object in a store, data/store.py), named `path`
    in messages and gunzipped when that name ends in `.gz`: the same lines, numbers and errors."""
    f = gzip.GzipFile(fileobj=raw) if path.lower().endswith(".gz") else raw
    total = 0
    try:
        for lineno, line in enumerate(iter(lambda: f.readline(max_line_bytes + 1), b""), 1):
            total += len(line)
            too_long = len(line) > max_line_bytes
            # skip the rest of a long line, bounded per read and by the cap (a .gz of no newlines)
            while too_long and line and not line.endswith(b"\n") and total <= kind.max_bytes:
                line = f.readline(max_line_bytes + 1)
                total += len(line)
            if total > kind.max_bytes:  # checked before the line is handed out: cut, not followed
                raise kind.fail(
                    f"{path} holds more than the {kind.max_bytes / MiB:,.0f} MiB a {kind.what} can be"
                )
            if too_long:
                yield lineno, None
            elif line.strip():
                yield lineno, line
    except Mamba3LiteError:
        raise
    except (OSError, EOFError, zlib.error) as e:  # a truncated or damaged .gz, an I/O error
        raise kind.fail(f"cannot read {path}: {e or type(e).__name__}") from None


def iter_jsonl(path: str | os.PathLike, kind: FileKind) -> Iterator[JsonlLine]:
    """The lines of a regular JSONL file (blank lines skipped; gunzipped as `iter_lines` does). A line
    that is not valid (not UTF-8, not JSON, a refused number, too long) comes with `problem` set instead
    of raising: logs end in a torn line after a crash, and each reader decides what a bad line means to
    it. A file that cannot be read at all raises the kind's error."""
    limit = MAX_JSONL_LINE_BYTES
    for lineno, raw in iter_lines(path, kind, max_line_bytes=limit):
        where = f"{path} line {lineno}"
        if raw is None:
            yield JsonlLine(lineno, problem=f"{where} is longer than {limit // MiB} MiB")
            continue
        try:
            yield JsonlLine(lineno, parse_json(decode_utf8(raw, where, kind), where, kind))
        except Mamba3LiteError as e:
            yield JsonlLine(lineno, problem=str(e))


# --------------------------------------------------------------------------------------------- YAML


@functools.cache
def _strict_loader() -> type:
    import yaml

    class StrictLoader(yaml.SafeLoader):
        """SafeLoader that refuses a key given twice in one mapping."""

    def construct_mapping(loader, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=deep)
            if not isinstance(key, (str, int, float, bool)):  # (an unhashable key: PyYAML's own error)
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {key!r} is given twice (the second would silently win)",
                    key_node.start_mark,
                )
            seen.add(key)
        return yaml.SafeLoader.construct_mapping(loader, node, deep)

    StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    return StrictLoader


def yaml_error_line(e: Exception) -> str:
    """A YAMLError as one line: what is wrong and where (PyYAML's own text spans several lines)."""
    problem, mark = getattr(e, "problem", None), getattr(e, "problem_mark", None)
    if not problem:
        return " ".join(str(e).split())
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    context = getattr(e, "context", None)
    return f"{context + ': ' if context else ''}{problem}{where}"


def strict_yaml_load(text: str) -> Any:
    """yaml.safe_load, but a key given twice in one mapping is a YAMLError: PyYAML keeps the last one
    silently, so a second `training:` block would replace the whole first one."""
    import yaml

    return yaml.load(text, Loader=_strict_loader())  # a SafeLoader subclass: no arbitrary objects


def parse_yaml(text: str, where: str, kind: FileKind) -> Any:
    """The project's strict YAML loader (duplicate keys refused; safe: no objects) with every failure,
    huge integers and nesting depth included, as the kind's error."""
    import yaml

    try:
        return strict_yaml_load(text)
    except yaml.YAMLError as e:
        problem = yaml_error_line(e)
    except ValueError as e:  # Python's int-string limit inside PyYAML's int constructor
        problem = "an integer too long to read" if "digits" in str(e) else " ".join(str(e).split())[:120]
    except RecursionError:
        problem = "nested too deeply"
    raise kind.fail(f"{where} is not valid YAML ({problem}); expected a {kind.what}") from None


def read_yaml(path: str | os.PathLike, kind: FileKind) -> Any:
    """A regular file's YAML (capped, strict UTF-8, strict loader), every problem the kind's error."""
    return parse_yaml(read_text_capped(path, kind), str(path), kind)


# ------------------------------------------------------------------------------------- schema helpers

_TYPE_NAMES = {dict: "an object", list: "a list", str: "a string", int: "an integer", float: "a number"}
_TYPE_NAMES |= {bool: "true or false", type(None): "null"}


def _type_name(types: type | tuple[type, ...]) -> str:
    types = types if isinstance(types, tuple) else (types,)
    return " or ".join(_TYPE_NAMES.get(t, t.__name__) for t in types)


def _is(value: Any, types: type | tuple[type, ...]) -> bool:
    """isinstance, where `int` never matches a bool, and `float` means any finite number."""
    for t in types if isinstance(types, tuple) else (types,):
        if t is bool:
            if isinstance(value, bool):
                return True
        elif t is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return True
        elif t is float:
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                return True
        elif isinstance(value, t):
            return True
    return False


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def expect_type(value: Any, types: type | tuple[type, ...], *, where: str, kind: FileKind, what: str) -> Any:
    """`value` itself if it has one of `types` (see `_is`), else the kind's error naming `what`."""
    if not _is(value, types):
        raise kind.fail(
            f"{where} is not a valid {kind.what}: {what} must be {_type_name(types)}, got {_short(value)}"
        )
    return value


def expect(
    obj: Any,
    schema: Mapping[str, type | tuple[type, ...]],
    *,
    where: str,
    kind: FileKind,
    optional: tuple[str, ...] = (),
    prefix: str = "",
) -> dict:
    """Check that `obj` is an object whose keys in `schema` have the types given (`int` excludes bool,
    `float` is any finite number, a tuple is "one of"); keys in `optional` may be absent. Keys not in
    the schema are left alone (files carry free-form extras). Returns `obj`."""
    expect_type(obj, dict, where=where, kind=kind, what=prefix.rstrip(".") or "its top level")
    for key, types in schema.items():
        if key not in obj:
            if key in optional:
                continue
            raise kind.fail(f"{where} is not a valid {kind.what}: {prefix}{key} is missing")
        expect_type(obj[key], types, where=where, kind=kind, what=f"{prefix}{key}")
    return obj


def as_number(value: Any, *, where: str, error: type[Mamba3LiteError] = ConfigError) -> float:
    """A finite float from a number or a numeric string, as the CLI's flags read one: YAML 1.1 reads
    `5e-1` and `1e6` (no dot) as strings, so a schema that wants a number coerces them here."""
    if isinstance(value, bool):
        raise error(f"{where} must be a number, got {value!r}")
    try:
        number = float(value.replace("_", "")) if isinstance(value, str) else float(value)
    except (TypeError, ValueError):
        raise error(f"{where} must be a number, got {_short(value)}") from None
    except OverflowError:  # an integer of hundreds of digits
        raise error(f"{where} is too large for a number, got {_short(value)}") from None
    if not math.isfinite(number):
        raise error(f"{where} must be a finite number, got {_short(value)}")
    return number


def as_count(value: Any, *, where: str, error: type[Mamba3LiteError] = ConfigError, minimum: int = 0) -> int:
    """An integer >= `minimum` from an int, an integral float or a numeric string (`1e6`, `20_000_000`)."""
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    else:
        f = as_number(value, where=where, error=error)
        if not f.is_integer():
            raise error(f"{where} must be a whole number, got {_short(value)}")
        number = int(f)
    if number < minimum:
        raise error(f"{where} must be an integer >= {minimum}, got {_short(value)}")
    if number >= 2**63:
        raise error(f"{where} is impossibly large, got {_short(value)}")
    return number
