"""benchmarks/bench_vllm.py at its smallest budget prints its side-by-side table (timings unchecked)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_helpers import NO_VLLM

pytest.importorskip("vllm", reason=NO_VLLM)

ROOT = Path(__file__).resolve().parents[2]


def test_bench_vllm_prints_its_table(tmp_path):
    args = ["--tokens", "4", "--prompt-tokens", "64", "--streams", "1,2", "--threads", "1", "--repeat", "1",
            "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_vllm.py"), *args],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert rows[0].split("|")[2].strip() == "mamba3lite serve"
    names = [r.split("|")[1].strip() for r in rows[1:]]
    assert names == [
        "decode tokens/s, 1 stream(s)",
        "decode tokens/s, 2 stream(s)",
        "TTFT s, 64-token prompt",
        "TTFT s, 64-token prompt again (prefix hit)",
    ]
    assert (tmp_path / "bench_vllm.json").is_file()
