"""Smoke runs of every script in benchmarks/ at its smallest budget (gpu_model.py on the CPU), so none rots.

Each runs as a subprocess with the smallest budget its flags allow and must exit 0 and print its tables
(the header rows and one data row per measured case). Timing values are not checked: they are the
machine's business, never a test's.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"


def run_script(name: str, *args: str, timeout: float = 300) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run(
        [sys.executable, str(BENCH / name), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, f"{name} failed (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.mark.slow
def test_bench_model_quick_prints_its_tables():
    out = run_script(
        "bench_model.py", "--quick", "--threads", "1", "--seq-lens", "32,64", "--dtypes", "fp32",
        "--contexts", "8,64", "--decode-tokens", "3", "--scan-len", "64",
    )  # fmt: skip
    assert "| T | dtype | Mamba-3 chunked | Mamba-3 sequential |" in out
    for T in (32, 64):  # one training row per T, with numbers in every column
        assert re.search(rf"^\| {T} \| fp32 \| \d+ \| \d+ \| [\d.]+x \| \d+ \| [\d.]+x \|", out, re.M), out
    scan = re.search(r"^\| fp32 \| \d+ \| [\d.]+ [MG] \| ([\d.]+)% \| [\d.]+% \| ([\d.]+)% \|$", out, re.M)
    assert scan and float(scan.group(2)) < float(scan.group(1)), out  # the causal half: fewer FLOPs
    for ctx in (8, 64):
        assert re.search(rf"^\| {ctx} \| [\d.]+ \| [\d.]+ \| [\d.]+x \|$", out, re.M), out
    assert "target flat decode" in out


@pytest.mark.slow
def test_bench_model_estimates_the_sequential_scan_above_its_limit_and_prints_the_head_ceiling():
    out = run_script(
        "bench_model.py", "--quick", "--threads", "1", "--seq-lens", "32,2048", "--seq-max-len", "32",
        "--dtypes", "fp32", "--contexts", "8,16", "--decode-tokens", "2", "--scan-len", "32",
    )  # fmt: skip
    assert re.search(r"^\| 32 \| fp32 \| \d+ \| \d+ \| [\d.]+x \|", out, re.M), out
    assert re.search(r"^\| 2048 \| fp32 \| \d+ \| \d+ est\. \| [\d.]+x est\. \|", out, re.M), out
    # The whole-LM target line carries the ceiling the shared head sets: Transformer FLOPs / head FLOPs.
    sys.path.insert(0, str(BENCH))
    try:
        from bench_model import QUICK, transformer_flops_per_token
    finally:
        sys.path.remove(str(BENCH))
    from mamba3lite.model import ModelConfig

    cfg = ModelConfig(**QUICK)
    ceiling = 3 * transformer_flops_per_token(cfg, 2048) / (3 * 2 * cfg.d_model * cfg.vocab_size)
    line = re.search(
        r"^target Mamba-3 / Transformer >= 1x at T=2048 \(fp32\): .*ceiling.*: ([\d.]+)x\)$", out, re.M
    )
    assert line and float(line.group(1)) == pytest.approx(ceiling, abs=0.006), out


@pytest.mark.slow
@pytest.mark.parametrize(
    ("activation", "recipe"), [(None, []), ("heavy_tail", []), (None, ["--loss", "ce", "--final-norm"])]
)
def test_parity_tiny_budget_prints_its_table(activation, recipe):
    extra = (["--a-activation", activation] if activation else []) + recipe
    out = run_script(
        "parity.py", "--steps", "4", "--threads", "1", "--batch", "8", "--d-model", "16", "--d-state", "16",
        "--headdim", "8", "--train-len", "6", "--eval-len", "12", "--eval-batch", "8", *extra,
    )  # fmt: skip
    assert f"A = -{activation or 'softplus'}(a)" in out  # the paper's softplus by default
    readout = (
        "readout RMSNorm -> linear, loss cross-entropy" if recipe else "readout linear, loss margin MSE (+-4)"
    )
    assert readout in out
    assert "| model | acc t<=6 | acc t>6 | acc all 12 | acc last | scaled t>6 | exact t>6 |" in out
    for label in ("Mamba-3 (trapezoid + RoPE)", "Mamba-3, no RoPE", "Mamba-2-style (Euler, no RoPE)"):
        pct = r" ([\d.]+)% \|"
        row = re.search(
            rf"^\| {re.escape(label)} \|{pct * 4} -?[\d.]+ \|{pct} [\d.]+ \| ([^|]+) \| ([^|]+) \|", out, re.M
        )
        assert row, out
        assert all(0 <= float(a) <= 100 for a in row.groups()[:5])
        rotation, decay = row.groups()[5:]
        assert (rotation == "-") == (label != "Mamba-3 (trapezoid + RoPE)")  # per-bit angles only with RoPE
        alphas = [float(a) for head in decay.split() for a in head.split("/")]  # α = e^{AΔ}, 2 per head
        assert len(alphas) == 2 * 4 and all(0 < a <= 1 for a in alphas)


def test_parity_margin_loss_is_zero_exactly_at_the_target_margins():
    """The default loss regresses logit_1 − logit_0 onto ±margin at supervised positions (BOS ignored);
    `ce` is plain cross-entropy."""
    import argparse

    import torch

    sys.path.insert(0, str(BENCH))
    try:
        import parity
    finally:
        sys.path.remove(str(BENCH))
    targets = torch.tensor([[-100, 1, 0, 1]])
    args = argparse.Namespace(loss="margin", margin=4.0, smoothing=0.0)
    exact = torch.tensor([[[9.0, -9.0], [0.0, 4.0], [1.0, -3.0], [-2.0, 2.0]]])
    assert parity.parity_loss(exact, targets, args).item() == 0.0
    off = exact.clone()
    off[0, 2, 0] += 1.0  # the 0-bit position's margin is 5, not 4: squared error 1, mean over 3
    assert parity.parity_loss(off, targets, args).item() == pytest.approx(1 / 3)
    args.loss = "ce"
    want = torch.nn.functional.cross_entropy(off[0, 1:], targets[0, 1:])
    assert parity.parity_loss(off, targets, args).item() == pytest.approx(want.item())


@pytest.mark.slow
def test_parity_rejects_an_unknown_variant():
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run(
        [sys.executable, str(BENCH / "parity.py"), "--variants", "mamba4"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "unknown variant" in proc.stderr and "mamba3" in proc.stderr


@pytest.mark.slow
def test_gpu_model_runs_on_the_cpu_and_prints_its_table(tmp_path):
    """The GPU check falls back to the CPU (tiny preset, short T): one row per model and mode, and JSON."""
    out_json = tmp_path / "rows.json"
    out = run_script(
        "gpu_model.py", "--presets", "tiny", "--seq-len", "32", "--batch", "2", "--steps", "1",
        "--warmup", "0", "--modes", "eager", "--baseline", "--json", str(out_json),
    )  # fmt: skip
    assert "CPU (no CUDA" in out
    for kind in ("mamba3", "transformer"):
        assert re.search(rf"^\| {kind} \| tiny \| eager \| [\d.]+ M \| 2 \| [\d,]+ \|", out, re.M), out
    assert re.search(r"^\| mamba3 \| tiny \| eager \|( [^|]+ \|){5} [\d.]+ \|", out, re.M), out  # est GiB
    assert re.search(r"^\| tiny \| eager \| \d+\.\d\dx \|$", out, re.M), out  # the ratio table
    import json

    rows = json.loads(out_json.read_text())["rows"]
    assert [(r["model"], r["mode"]) for r in rows] == [("mamba3", "eager"), ("transformer", "eager")]
    assert all(r["tokens_per_s"] > 0 and "error" not in r for r in rows)


def test_gpu_model_halves_the_batch_after_out_of_memory(monkeypatch):
    import argparse

    import torch

    monkeypatch.syspath_prepend(str(BENCH))
    import gpu_model

    calls = []

    def fake_case(kind, preset, mode, args, dev, peak):
        calls.append(args.batch)
        if args.batch > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
        return {"batch": args.batch}

    monkeypatch.setattr(gpu_model, "run_case", fake_case)
    args = argparse.Namespace(batch=8)
    row = gpu_model.guarded_case("mamba3", "p", "eager", args, torch.device("cpu"), 1.0, {})
    assert calls == [8, 4, 2] and row == {"batch": 2, "note": "batch 8 ran out of memory"}

    def broken(kind, preset, mode, args, dev, peak):
        raise ValueError("a compile failure")

    monkeypatch.setattr(gpu_model, "run_case", broken)
    cpu = torch.device("cpu")
    row = gpu_model.guarded_case("mamba3", "p", "compiled", args, cpu, 1.0, {"mode": "compiled"})
    assert row == {"mode": "compiled", "error": "ValueError: a compile failure"}


@pytest.mark.slow
def test_bench_data_prints_its_three_cases():
    out = run_script("bench_data.py", "--seconds", "0.05", "--repeats", "1")
    for case in ("(a) 4 shards x 2M tokens", "(b) 400 shards x 1,000 tokens", "(c) 1 file x 8M tokens"):
        assert re.search(rf"^{re.escape(case)}\s+\d+\s+[\d.]+\s+[\d.]+\s+[\d.]+x", out, re.M), out


@pytest.mark.slow
def test_bench_prepare_prints_its_ratio():
    out = run_script("bench_prepare.py", "--max-docs", "10", "--repeats", "1", "--workers", "1")
    assert re.search(r"^prepare end-to-end\s+[\d,]+\s+[\d.]+\s+[\d,]+\s+[\d.]+$", out, re.M), out
    assert re.search(r"^pipeline / raw tiktoken = [\d.]+", out, re.M), out


@pytest.mark.slow
def test_bench_checkpoint_prints_its_table(tmp_path):
    out = run_script("bench_checkpoint.py", "--preset", "tiny", "--repeat", "1", "--dir", str(tmp_path))
    assert re.search(r"^ours \(3 atomic files \+ sha256\)\s+\d+\s+[\d.]+", out, re.M), out
    assert re.search(r"^ours save bandwidth / raw = [\d.]+", out, re.M), out


@pytest.mark.slow
def test_chaos_smallest_campaign_survives():
    out = run_script(
        "chaos.py", "--kill-trials", "1", "--sigterm-trials", "1", "--no-corruption", "--no-lock"
    )
    assert re.search(r"^\| kill -9 at random moments, then resume\s+\|\s+1 \|\s+1 \|\s+0 \|$", out, re.M), out
    assert re.search(r"^\| SIGTERM .*\|\s+1 \|\s+1 \|\s+0 \|$", out, re.M), out


@pytest.mark.slow
def test_bench_eval_tiny_budget_prints_its_table():
    pytest.importorskip("lm_eval", reason="the eval extra (lm-eval) is not installed")
    out = run_script("bench_eval.py", "--tasks", "hellaswag,piqa", "--items", "3", "--repeat", "1")
    for task in ("hellaswag", "piqa"):
        row = re.search(
            rf"^\| {task} \| 3 \| \d+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+x \|.*\| (\S+) \|$",
            out,
            re.M,
        )
        assert row and float(row.group(1)) < 1e-3, out  # the two paths agree
