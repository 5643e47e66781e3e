"""The memory probe of a train row's `peak_mem_mb`: peak CUDA memory allocated on the training device,
or, on CPU, the process's peak resident set size (what the OS had to give it). NaN where neither can be
read (a platform without `resource`), never an error: a metric must not stop a run."""

from __future__ import annotations

from typing import Any


def peak_memory_mb(device: Any = None) -> float:
    """Peak CUDA memory allocated on `device` in MB, or the process's peak RSS on CPU."""
    import torch

    if device is not None and getattr(device, "type", str(device)) == "cuda" and torch.cuda.is_available():
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    except Exception:
        return float("nan")
