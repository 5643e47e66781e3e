"""The --out directory of `import` and `export`: built whole beside its final place, then renamed in.

An existing non-empty --out is refused before anything is written (the one rule of
mamba3lite/outdir.py: no existing directory is these commands' own, since the new one replaces --out
whole); a failure half-way (bad weights, disk full, Ctrl-C) leaves no partial directory behind, and
--out as it was.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from mamba3lite.atomicfile import fsync_dir
from mamba3lite.outdir import check_may_write


def check_out_dir(out: Path) -> None:
    """ConfigError naming --out unless `out` is absent or an empty directory."""
    check_may_write(out, flag="--out", is_ours=None)


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
        fsync_dir(out.parent)  # make the rename durable where the OS allows
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
