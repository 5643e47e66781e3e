"""benchmarks/bench_serve.py at its smallest budget, so it does not rot: it exits 0 and prints a row per
measurement (timings are the machine's business, not checked)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("fastapi")


@pytest.mark.slow
def test_bench_serve_smallest_budget_prints_its_table():
    args = ["--tokens", "2", "--prompt-tokens", "300", "--streams", "1,2", "--repeat", "1"]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    script = str(ROOT / "benchmarks" / "bench_serve.py")
    proc = subprocess.run(
        [sys.executable, script, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    names = ("decode tokens/s, 1 vs 2 streams", "miss vs full hit", "generate vs 1 server stream",
             "decode tokens/s at 2 streams, pure vs hybrid")  # fmt: skip
    for name in names:
        assert any(line.startswith(f"| {name}") or name in line for line in proc.stdout.splitlines()), (
            proc.stdout
        )
    assert "prefix cache: " in proc.stdout
