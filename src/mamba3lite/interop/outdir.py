"""The --out directory of `import` and `export`: built whole beside its final place, then renamed in.

An existing non-empty --out is refused before anything is written; a failure half-way (bad weights,
disk full, Ctrl-C) leaves no partial directory behind, and --out as it was.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from mamba3lite.errors import ConfigError


def check_out_dir(out: Path) -> None:
    """ConfigError unless `out` is absent or an empty directory."""
    if out.is_dir() and any(out.iterdir()):
        raise ConfigError(
            f"--out {out} exists and is not empty; choose a new directory (nothing was written)"
        )
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; choose a new directory (nothing was written)")


@contextlib.contextmanager
def staged_dir(out: Path) -> Iterator[Path]:
    """Yield a fresh temporary directory next to `out`; when the block succeeds it becomes `out`."""
    check_out_dir(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        yield tmp
        check_out_dir(out)  # something else may have written there meanwhile
        if out.is_dir():
            out.rmdir()
        os.replace(tmp, out)
        with contextlib.suppress(OSError):  # make the rename durable where the OS allows
            fd = os.open(out.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
