"""May this command write into that directory? One rule for every command that writes a directory.

A command writes only into a directory that is new, empty, or already its own (a run directory for
`train`, a dataset for `prepare`): a directory of the user's files is refused before anything is
written, because `train` writes config.yaml, run.json and metrics.jsonl by name and would replace the
user's own files of those names. A path naming a file is refused with a message saying so (mkdir's
"File exists" does not say which thing is wrong).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from mamba3lite import rundir
from mamba3lite.checkpoint.run_dir import RunDir
from mamba3lite.errors import ConfigError


def check_may_write(
    path: str | Path,
    *,
    flag: str,
    is_ours: Callable[[Path], bool] | None,
    what: str = "",
    ignore: Iterable[str] = (),
) -> None:
    """Refuse (ConfigError naming `flag` and `path`) unless `path` does not exist, is an empty directory
    (entries in `ignore` do not count), or `is_ours(path)`: the command's own kind of directory, `what`
    in the message. `is_ours=None`: no existing directory is the command's own (one that replaces its
    output whole, as `import` and `export` do)."""
    path = Path(path)
    if not path.exists():
        if path.is_symlink():
            raise ConfigError(f"{flag} {path} is a broken symbolic link; point it at a directory")
        return
    if not path.is_dir():
        raise ConfigError(f"{flag} {path} is a file, not a directory; choose a new or empty directory")
    skip = set(ignore)
    others = sorted(p.name for p in path.iterdir() if p.name not in skip)
    if not others or (is_ours is not None and is_ours(path)):
        return
    shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
    whose = f" and is not {what}" if is_ours is not None else ""
    raise ConfigError(
        f"{flag} {path} is not empty ({shown}){whose}; its files could be overwritten: "
        "choose a new or empty directory"
    )


def is_run_dir(path: Path) -> bool:
    """Whether `path` holds what `train` writes: the one rule, `RunDir.is_run` (a checkpoint, run.json,
    the metrics log, or a config.yaml that is a run's resolved config)."""
    return RunDir(path).is_run()


def check_run_dir(path: str | Path, flag: str = "--checkpoint-dir") -> None:
    """`train`'s use of the rule: a new or empty directory, or a run directory."""
    check_may_write(
        path, flag=flag, is_ours=is_run_dir, what="a run directory", ignore=rundir.NEUTRAL_ENTRIES
    )
