"""Accelerator peak FLOP/s, the denominator of MFU (model FLOPs utilisation).

`peak_flops(device, override_tflops)` is one accelerator's dense bf16 tensor-core peak: the override
when it is > 0 (`training.peak_tflops`), else a lookup of the CUDA device's name in `PEAK_BF16_FLOPS`,
else None (a CPU, or a GPU not in the table: MFU is then left out of the metrics rows). The numerator,
model FLOPs per token, is `model/flops.py`'s.
"""

from __future__ import annotations

from typing import Any

# Dense bf16 tensor-core peaks (FLOP/s) by device-name fragment. The first fragment found in the name
# wins, so a name comes before any fragment of it ("NVIDIA L40S" holds "L4").
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 125e12,
    "L4": 121e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
    "V100": 125e12,
}


def peak_flops(device: Any, override_tflops: float = 0.0) -> float | None:
    """Peak FLOP/s for MFU: the override if > 0, else a lookup of the CUDA device name; None on CPU."""
    if override_tflops > 0:
        return override_tflops * 1e12
    import torch

    if getattr(device, "type", str(device)) != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)
