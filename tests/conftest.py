"""Shared fixtures. Tests run on CPU; anything slower than a few seconds is marked `slow`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_cli(
    *args: str, cwd: str | os.PathLike | None = None, timeout: float = 600, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run `python -m mamba3lite ARGS` in a subprocess, as a user would; returns the completed process."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "mamba3lite", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def cli():
    return run_cli
