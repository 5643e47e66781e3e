"""The compute precision a device runs at: `training.dtype` (auto, bf16, fp32) resolved for one device.

    native_bf16(device)               does the device compute bf16 at full speed?
    resolve_precision(dtype, device)  -> Precision: the autocast dtype (torch.bfloat16, or None for
                                      fp32), the matmul dtype of Muon's Newton-Schulz, a one-line reason,
                                      and a warning when an explicit bf16 will be slow here
    planned_precision(dtype, device)  the same for a run planned, not run: a CUDA device this machine
                                      cannot ask (`train --plan` on a login node) is planned as one with
                                      native bf16 (planned_cuda_precision), the reason saying so

`auto` is bf16 where the device computes it natively and fp32 elsewhere. A CPU without a bf16 path (AVX2
only: most AMD Zen 2/3, Intel before Skylake-SP) runs bf16 through slow fallback kernels: a 1024^3
matmul takes ~100x as long as in fp32, a training step under bf16 autocast ~10x (the weights stay fp32
either way, so the few activation bytes saved are not worth it). An explicit `bf16` is kept there (the
user asked for it) and warned about by whoever reads the config at its border (the trainer's start,
`eval`).

The rule lives here, beside hardware.py's peak FLOP/s table, because it is a fact about a device that
every layer above reads: the trainer (autocast), the sharded strategies (FSDP's parameter dtype), the
optimizer (Muon's Newton-Schulz), evaluate.py, the downstream harness and the quickstart's timing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The CUDA devices that compute bf16 natively (Ampere, Hopper, ...), in the words a reason uses.
CUDA_NATIVE_BF16 = "a CUDA device of compute capability 8.0 or newer"


def native_bf16(device: torch.device | str) -> bool:
    """True where `device` computes bf16 at full speed.

    CUDA: `torch.cuda.is_bf16_supported(including_emulation=False)` (compute capability 8.0 and up:
    Ampere, Hopper, ...). CPU: torch's own test for oneDNN's bf16 kernels,
    `torch.ops.mkldnn._is_mkldnn_bf16_supported()` (AVX-512 BW/VL/DQ, with AVX512-BF16 or AMX the
    native instructions, or an Arm core with BF16); false on an AVX2-only CPU. Any other device: False.
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    if dev.type == "cpu":
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


@dataclass(frozen=True)
class Precision:
    """`training.dtype` as resolved for one device."""

    requested: str
    """training.dtype as configured: auto, bf16 or fp32"""
    dtype: torch.dtype | None
    """the autocast compute dtype: torch.bfloat16, or None for fp32 (no autocast)"""
    reason: str
    """one line: what was asked, what runs, and why (e.g. "auto -> fp32: this CPU (AVX2) has no native
    bf16")"""
    warning: str | None = None
    """an explicit bf16 on a device without native bf16: the cost and the fix, else None"""

    @property
    def name(self) -> str:
        """What runs: "bf16" or "fp32"."""
        return "fp32" if self.dtype is None else "bf16"

    @property
    def matmul_dtype(self) -> torch.dtype:
        """The dtype of the optimizer's own matrix products (Muon's Newton-Schulz): the compute dtype."""
        return torch.float32 if self.dtype is None else self.dtype


def _device_words(device: torch.device) -> str:
    """The device as the reason names it: "this CPU (AVX2)", "NVIDIA A100-SXM4-80GB", "mps"."""
    if device.type == "cpu":
        return f"this CPU ({torch.backends.cpu.get_cpu_capability()})"
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return str(device)


def resolve_precision(dtype: str, device: torch.device | str) -> Precision:
    """`dtype` (training.dtype: auto, bf16 or fp32) for `device`: auto -> bf16 where
    `native_bf16(device)`, else fp32; bf16 and fp32 as given, bf16 with a warning where the device has no
    native bf16."""
    assert dtype in ("auto", "bf16", "fp32"), f"training.dtype {dtype!r} passed the config's validation"
    dev = torch.device(device)
    if dtype == "fp32":
        return Precision(dtype, None, "fp32 (training.dtype)")
    native, where = native_bf16(dev), _device_words(dev)
    if dtype == "auto":
        if native:
            return Precision(dtype, torch.bfloat16, f"auto -> bf16: {where} computes bf16 natively")
        return Precision(dtype, None, f"auto -> fp32: {where} has no native bf16")
    if native:
        return Precision(dtype, torch.bfloat16, "bf16 (training.dtype)")
    return Precision(
        dtype,
        torch.bfloat16,
        f"bf16 (training.dtype), emulated: {where} has no native bf16",
        f"training.dtype is bf16, but {where} has no native bf16: every bf16 matmul is emulated, a "
        "training step takes ~10x as long as in fp32; use --set training.dtype=auto (or fp32)",
    )


def planned_cuda_precision(dtype: str) -> Precision:
    """`dtype` (training.dtype) for a CUDA device that is planned for but cannot be asked (no CUDA on
    this machine, or a table for an accelerator of some size): planned as one with native bf16, the
    accelerators the presets are sized for, so auto and bf16 -> bf16, fp32 -> fp32. The reason says what
    auto and bf16 do on an older device rather than a guess at it."""
    if dtype == "fp32":
        return resolve_precision(dtype, "cuda")  # asks nothing
    if dtype == "auto":
        reason = f"auto: bf16 on {CUDA_NATIVE_BF16}, else fp32; planned as bf16 (no CUDA device here to ask)"
    else:
        reason = f"bf16 (training.dtype): native on {CUDA_NATIVE_BF16}, emulated (slow) on older ones"
    return Precision(dtype, torch.bfloat16, reason)


def planned_precision(dtype: str, device: torch.device | str) -> Precision:
    """`dtype` as a run on `device` will resolve it (`resolve_precision`), for a plan made before the run:
    a CUDA device where this machine has none (a plan made on a login node) is `planned_cuda_precision`,
    not the fp32 that a device nobody can ask would resolve to."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        return planned_cuda_precision(dtype)
    return resolve_precision(dtype, dev)
