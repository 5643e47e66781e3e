"""Keep freed memory in the process (glibc), so CPU training does not page-fault its tensors in afresh.

PyTorch's CPU allocator is plain malloc. glibc serves every request above its mmap threshold (dynamic,
128 KB growing to at most 32 MB) with fresh pages from the kernel and unmaps them again on free, so a
training step that makes hundreds of 1-30 MB intermediate tensors faults every page of them in anew,
every step. Fixing the threshold at its 32 MB maximum and never trimming the heap lets freed blocks be
reused. Measured on the 2-core development VM, one thread, forward + backward at T = 2048 of the
benchmark's small model: the chunked scan alone 50 -> 36 ms, the whole model with its LM loss
1187 -> 920 ms (benchmarks/RESULTS.md). The price: the process keeps its peak heap until it exits.

The same settings as environment variables (read by glibc at start-up, for any program):
    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=2147483647 MALLOC_TOP_PAD_=268435456
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

# mallopt parameters (glibc malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 32 * 2**20  # glibc's maximum on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD = 2**31 - 1  # an int: never give the top of the heap back
TOP_PAD = 256 * 2**20  # grow the heap in large steps

_done = False


def keep_freed_memory() -> bool:
    """Apply the settings above once per process. True if applied; False where libc is not glibc
    (macOS, musl, Windows), which is harmless: only speed is at stake."""
    global _done
    if _done:
        return True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settings = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD))
    ok = all(mallopt(param, value) == 1 for param, value in settings)
    _done = ok
    return ok
