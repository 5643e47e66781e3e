"""train/plan.py `memory_plan`: the compute dtype the run will use on the device planned for is one line
of the plan, and the per-rank activations are estimated at it (fp32 keeps ~1.8x bf16's bytes). The
probe (`native_bf16`) and CUDA's presence are monkeypatched, so every case runs on any machine."""

from __future__ import annotations

import pytest
import torch

from mamba3lite.config import load_config
from mamba3lite.model import precision
from mamba3lite.model.memory import per_rank_memory
from mamba3lite.train.plan import memory_plan

GIB = 2**30
# windows long enough that fp32's and bf16's activations differ in the plan's two decimals of GiB
CFG = load_config("tiny").replace("training", micro_batch_size=8, max_seq_len=2048, global_batch_size=8)


def parts(compute: torch.dtype | None, cfg=CFG) -> str:
    """The plan's per-rank line for one process at compute dtype `compute`."""
    est = per_rank_memory(cfg.model, cfg.training, compute=compute)
    return "per rank (GiB): " + " | ".join(f"{k} {v:,.2f}" for k, v in est.parts_gib().items())


def test_auto_on_a_cpu_without_native_bf16_plans_fp32_activations(monkeypatch):
    cfg = CFG.replace("training", device="cpu", dtype="auto")
    cpu = f"this CPU ({torch.backends.cpu.get_cpu_capability()})"
    monkeypatch.setattr(precision, "native_bf16", lambda device: False)
    lines = memory_plan(cfg).splitlines()
    assert lines[2] == f"compute: auto -> fp32: {cpu} has no native bf16"
    assert lines[3] == parts(None)
    monkeypatch.setattr(precision, "native_bf16", lambda device: True)
    lines = memory_plan(cfg).splitlines()
    assert lines[2] == f"compute: auto -> bf16: {cpu} computes bf16 natively"
    assert lines[3] == parts(torch.bfloat16) != parts(None)


def test_fp32_activations_make_the_plan_larger():
    fp32 = per_rank_memory(CFG.model, CFG.training, compute=None)
    bf16 = per_rank_memory(CFG.model, CFG.training, compute=torch.bfloat16)
    assert 1.6 * bf16.activations < fp32.activations < 2.0 * bf16.activations
    assert fp32.total - bf16.total == pytest.approx(fp32.activations - bf16.activations)


@pytest.mark.parametrize(
    ("dtype", "line", "compute"),
    [
        (
            "auto",
            "compute: auto: bf16 on a CUDA device of compute capability 8.0 or newer, else fp32; planned as "
            "bf16 (no CUDA device here to ask)",
            torch.bfloat16,
        ),
        (
            "bf16",
            "compute: bf16 (training.dtype): native on a CUDA device of compute capability 8.0 or newer, "
            "emulated (slow) on older ones",
            torch.bfloat16,
        ),
        ("fp32", "compute: fp32 (training.dtype)", None),
    ],
)
def test_a_cuda_run_planned_without_cuda_says_what_the_dtype_does_there(monkeypatch, dtype, line, compute):
    """A plan made on a login node for a CUDA run: the device cannot be asked, so the line says what
    auto does on CUDA devices (not a wrong "auto -> fp32") and plans for one with native bf16."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = CFG.replace("training", device="cuda", dtype=dtype)
    lines = memory_plan(cfg, device_bytes=80 * GIB).splitlines()
    assert lines[2] == line
    assert lines[3] == parts(compute)
    assert lines[4].startswith("device planned for: 80.0 GiB")
