"""User-facing errors.

Everything that is the user's to fix (a path, a config value, a corrupt file) raises a subclass of
`Mamba3LiteError` whose message says what is wrong, where, and how to fix it. The CLI prints such an
error as one line and exits non-zero without a traceback; library users catch it like any exception.
Internal invariants are `assert`s, not these (docs/architecture.md §6 rule 6).
"""

from __future__ import annotations

from collections.abc import Iterable


class Mamba3LiteError(Exception):
    """Base class: a problem with the user's input, files or environment."""

    exit_code = 2


class ConfigError(Mamba3LiteError, ValueError):
    """A config value, key or override is invalid. The message names the field."""


class DataError(Mamba3LiteError, ValueError):
    """A dataset, shard or manifest is missing, corrupt or inconsistent. The message names the file."""


class DataNotFoundError(DataError, FileNotFoundError):
    """A dataset path does not exist."""


class CheckpointError(Mamba3LiteError, RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or does not match the model."""


class TransientError(Mamba3LiteError, RuntimeError):
    """A failure that may not happen again (a network error while streaming a dataset): unlike bad input,
    the work done so far is kept, and the same command resumes it."""

    exit_code = 1


class StorageAccessError(Mamba3LiteError, PermissionError):
    """An object store refused the request (no permission on the bucket, wrong or missing credentials).
    The message names the URL and where the credentials come from."""


class StorageUnreachableError(TransientError):
    """The object store's endpoint cannot be reached (network down, a wrong endpoint URL): the same
    command may work later; the message names the URL and the endpoint setting."""


class ObjectChangedError(DataError):
    """An object changed (size or etag) between the listing that planned the work and the read."""


class TrainingError(Mamba3LiteError, RuntimeError):
    """Training cannot continue (e.g. non-finite losses with no checkpoint to roll back to)."""


# How close a misspelt key must be to a known one to be suggested (difflib's similarity ratio).
DID_YOU_MEAN_CUTOFF = 0.5


def close_words(word: str, known: Iterable[str], n: int = 1) -> list[str]:
    """Up to `n` known words closest to `word` (a misspelt config key, preset, task or backend name),
    best first; empty when none is close enough to be worth suggesting. The one cutoff for every
    "did you mean" the project prints."""
    import difflib

    return difflib.get_close_matches(str(word), [str(k) for k in known], n=n, cutoff=DID_YOU_MEAN_CUTOFF)


def did_you_mean(word: str, known: Iterable[str]) -> str | None:
    """The known word closest to `word`, or None when none is close enough to be worth suggesting."""
    close = close_words(word, known)
    return close[0] if close else None


def did_you_mean_hint(word: str, known: Iterable[str], otherwise: str = "") -> str:
    """The tail of an error message about an unknown name: "; did you mean `x`?" for the known word
    closest to `word`, else `otherwise`."""
    close = did_you_mean(word, known)
    return f"; did you mean `{close}`?" if close else otherwise
