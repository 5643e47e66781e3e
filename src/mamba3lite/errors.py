"""User-facing errors.

Everything that is the user's to fix (a path, a config value, a corrupt file) raises a subclass of
`Mamba3LiteError` whose message says what is wrong, where, and how to fix it. The CLI prints such an
error as one line and exits non-zero without a traceback; library users catch it like any exception.
Internal invariants are `assert`s, not these (STYLE.md rule 6).
"""


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


class TrainingError(Mamba3LiteError, RuntimeError):
    """Training cannot continue (e.g. non-finite losses with no checkpoint to roll back to)."""
