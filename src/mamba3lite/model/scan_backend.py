"""Which scan runs a mixer's forward: the backend names, the `auto` rule and the Triton availability check.

Every backend implements `scan.chunked_scan`'s contract (same inputs, outputs and dtypes), and has a
decode step with `scan.scan_step`'s (`step_function`: triton's is one fused kernel):

    sequential   the reference recurrence (the spec; slow)
    chunked      the pure-PyTorch chunked parallel scan (every device)
    triton       fused Triton kernels (`mamba3lite.model.scan_triton`): CUDA with `triton` installed,
                 or the CPU under TRITON_INTERPRET=1 (the interpreter, for tests)
    auto         `triton` on CUDA when it can run there and supports the layer's shape, else `chunked`,
                 but only once AUTO_PREFERS_TRITON is on (below)

The choice depends on the device, known only once the model is where it will run, so it is made by
`resolve_scan_impl(requested, device, R, N, P, chunk_size)`, a function of those arguments and of what
is installed (triton, TRITON_INTERPRET), called
when the mixer is bound to a device (`Mamba3.set_scan_impl(name, device)`, the trainer does it right after
moving the model) or at the first forward on a new device type. `triton` where it cannot run is one
`ConfigError` that names the fix, raised there, never a traceback from inside triton.

The Triton module is imported lazily, here only: the CPU path never needs triton installed.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from types import ModuleType

import torch

from mamba3lite.errors import ConfigError
from mamba3lite.model.config import SCAN_IMPLS, check_scan_impl
from mamba3lite.model.scan import chunked_scan, scan_step, sequential_scan

__all__ = [
    "AUTO_PREFERS_TRITON",
    "SCAN_IMPLS",
    "check_scan_impl",
    "resolve_scan_impl",
    "scan_function",
    "step_function",
]

# `auto` picks `triton` only while this is True. It stays False until a GPU run has shown the Triton path
# equal to `chunked` (tests/test_cuda.py) and faster (benchmarks/gpu_model.py); it flips in the commit
# that records those numbers in benchmarks/RESULTS.md (issue 16).
AUTO_PREFERS_TRITON = False

TRITON_MODULE = "mamba3lite.model.scan_triton"


_triton: ModuleType | None = None


def _triton_module() -> ModuleType:
    """The Triton scan module (imported on first use: importing it imports triton). Kept in a global:
    torch.compile traces through a call of this (the mixer's `rotated_scan`) without a graph break
    once it is set, where an import_module call on every forward would break the graph there."""
    global _triton
    if _triton is None:
        _triton = importlib.import_module(TRITON_MODULE)
    return _triton


def triton_unavailable_reason(device: torch.device) -> str | None:
    """None when the Triton scan can run on `device`, else one line saying why and what to do."""
    try:
        module = _triton_module()
    except ModuleNotFoundError as e:
        if e.name == TRITON_MODULE:
            return "this mamba3lite has no Triton scan (mamba3lite/model/scan_triton.py is missing)"
        if e.name and e.name.split(".")[0] == "triton":
            return "the `triton` package is not installed (pip install triton; CUDA builds of torch ship it)"
        return f"the Triton scan cannot be imported: {e}"
    except ImportError as e:  # triton present but broken (a version mismatch with torch)
        return f"the Triton scan cannot be imported: {' '.join(str(e).split())}"
    return module.triton_unavailable_reason(device)


def triton_supports(R: int, N: int, P: int, chunk_size: int) -> bool:
    """Whether the Triton kernels handle this layer shape (call only where the module imports)."""
    return bool(_triton_module().triton_supports(R, N, P, chunk_size))


def resolve_scan_impl(requested: str, device: torch.device, R: int, N: int, P: int, chunk_size: int) -> str:
    """The backend that runs for `requested` on `device` for a layer of MIMO rank R, state size N, head
    dim P and chunk length `chunk_size`: `chunked` or `sequential` as asked; `triton` as asked where it
    can run and supports the shape (else a ConfigError that names the reason and the fix); `auto`: `triton`
    on CUDA when AUTO_PREFERS_TRITON and it can run and supports the shape, else `chunked`."""
    check_scan_impl(requested)
    device = torch.device(device)
    if requested == "auto":
        # (`and` short-circuits: triton is never imported while the switch is off or off CUDA.)
        prefers = AUTO_PREFERS_TRITON and device.type == "cuda"
        if prefers and triton_unavailable_reason(device) is None and triton_supports(R, N, P, chunk_size):
            return "triton"
        return "chunked"
    if requested == "triton":
        reason = triton_unavailable_reason(device)
        if reason is not None:
            raise ConfigError(
                f"model.scan_impl=triton cannot run on {device.type}: {reason}; "
                "set model.scan_impl=auto or chunked (the pure-PyTorch scan, any device)"
            )
        if not triton_supports(R, N, P, chunk_size):
            raise ConfigError(
                f"model.scan_impl=triton does not support this layer shape (mimo rank {R}, d_state {N}, "
                f"headdim {P}, chunk_size {chunk_size}); set model.scan_impl=auto or chunked"
            )
    return requested


def scan_function(resolved: str, chunk_size: int) -> Callable:
    """The scan callable of a resolved backend name, with `scan.chunked_scan`'s signature less
    chunk_size (bound here)."""
    assert resolved in ("chunked", "sequential", "triton"), resolved
    if resolved == "sequential":
        return sequential_scan
    if resolved == "triton":
        return functools.partial(_triton_module().triton_chunked_scan, chunk_size=chunk_size)
    return functools.partial(chunked_scan, chunk_size=chunk_size)


def step_function(resolved: str) -> Callable:
    """The decode step of a resolved backend, with `scan.scan_step`'s contract: the fused Triton step
    kernel for `triton`, `scan.scan_step` for the others."""
    return _triton_module().triton_scan_step if resolved == "triton" else scan_step


def rotated_scan(*args, **kwargs):
    """`scan_triton.triton_rotated_scan`: the mixer's bias + rotation fused with the Triton scan (the
    `triton` backend's training path; its arguments are documented there)."""
    return _triton_module().triton_rotated_scan(*args, **kwargs)
