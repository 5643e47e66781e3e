"""Compile the Triton scan kernels for a GPU on a machine without one: `python tests/triton_aot.py`.

The interpreter runs kernels the compiler may still reject (block shapes, layouts, dtypes); this builds
the real thing — Triton IR, PTX, and a cubin by the ptxas that ships with triton — for a CUDA target
(default sm_90, the H100/H200), at the presets' shapes, and prints one line per kernel with its
registers, spill stack and shared memory (from cuobjdump, also bundled). Exit status 1 if any failed.
Run by tests/test_scan_triton.py in a subprocess, since a process that has built the kernels for the
interpreter cannot build them for a GPU.

The compiles are independent and CPU-bound (LLVM and ptxas), so they run in worker processes, one per
CPU (--jobs), the longest first: the fp32 backward chunk kernel alone takes most of the time (its fp32
matmuls are unrolled FMA loops, with spills), and the others compile beside it. The lines come out in
the cases' order all the same.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

os.environ.pop("TRITON_INTERPRET", None)

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from mamba3lite.model import _scan_triton_kernels as kernels
from mamba3lite.model import scan_triton
from mamba3lite.train.threads import usable_cpus

MM_POINTERS = {"q_ptr", "k_ptr", "v_ptr", "y_ptr", "starts_ptr", "dy_ptr", "dq_ptr", "dk_ptr", "dv_ptr"}
KERNELS = {  # name: (kernel, kind: a state kernel's P block is scan_triton.STATE_BLOCK_P)
    "state_fwd": (kernels.state_fwd_kernel, "state"),
    "chunk_fwd": (kernels.chunk_fwd_kernel, "chunk"),
    "state_bwd": (kernels.state_bwd_kernel, "state"),
    "chunk_bwd": (kernels.chunk_bwd_kernel, "chunk"),
    "rotate_fwd": (kernels.rotate_fwd_kernel, "rotate"),
    "rotate_bwd": (kernels.rotate_bwd_kernel, "rotate"),
    "step": (kernels.step_kernel, "step"),
}
# the kernels launched at a fixed number of warps (triton's default for the step kernel)
FIXED_WARPS = {"rotate": scan_triton.ROTATE_WARPS, "step": 4}


def signature(kernel, dtype: str, has_reset: bool, constexprs: dict) -> dict:
    """Triton's argument types: the matmul operands in `dtype`, scalars and states fp32, seg int32."""
    out = {}
    for name in kernel.arg_names:
        if name in constexprs:
            out[name] = "constexpr"
        elif name in MM_POINTERS:
            out[name] = f"*{dtype}"
        elif name == "gends_ptr":  # the state's gradient per chunk, fp32
            out[name] = "*fp32"
        elif name in ("seg_ptr", "reset_ptr"):
            out[name] = "*i32" if has_reset else "*fp32"
        else:
            out[name] = "*fp32" if name.endswith("_ptr") else "i32"
    return out


def compile_one(
    which: str, dtype: str, R: int, L: int, N: int, P: int, warps: int, stages: int, arch: int
) -> str:
    kernel, kind = KERNELS[which]
    block = lambda n: max(16, 1 << (n - 1).bit_length())  # noqa: E731 (as scan_triton._block)
    constexprs = {
        "L": L, "R": R, "N": N, "P": P, "BLOCK_LR": block(L * R), "BLOCK_N": block(N),
        "HAS_RESET": True, "PRECISION": "ieee" if dtype == "fp32" else "tf32",
    }  # fmt: skip
    if kind == "state":
        constexprs["BLOCK_PS"] = min(block(P), scan_triton.STATE_BLOCK_P)
    elif kind == "chunk":
        constexprs["BLOCK_P"] = block(P)
    elif kind == "step":  # decode: L is 1
        constexprs = {
            "R": R, "N": N, "P": P, "BLOCK_N": block(N), "BLOCK_P": scan_triton.STEP_BLOCK_P,
            "HAS_RESET": True,
        }  # fmt: skip
    else:  # the presets' RoPE: half the pairs turn; MIMO pairs split halves
        constexprs = {
            "R": R, "N": N, "S": N // 4, "BLOCK_T": scan_triton.ROTATE_BLOCK_T, "BLOCK_N": block(N),
            "HAS_THETA": True, "HALVES": R > 1,
        }  # fmt: skip
    src = ASTSource(kernel, signature(kernel, dtype, True, constexprs), constexprs)
    if kind in ("rotate", "step"):  # launched at a fixed number of warps, not autotuned
        warps, stages = FIXED_WARPS[kind], 1
    compiled = triton.compile(
        src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "num_stages": stages}
    )
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    usage = "?"
    if os.path.exists(cuobjdump):
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            out = subprocess.run(
                [cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True
            ).stdout
        m = re.search(r"REG:(\d+) STACK:(\d+)", out)
        usage = f"registers {m.group(1)}, spill stack {m.group(2)} B" if m else "?"
    return f"{usage}, shared {compiled.metadata.shared} B"


def _compile_or_error(*args) -> tuple[bool, str]:
    """compile_one's line in a worker: (True, usage) or (False, the error), never an exception that
    would have to cross the process boundary."""
    try:
        return True, compile_one(*args)
    except Exception as e:  # a compile error: reported, the rest go on
        return False, f"{type(e).__name__}: {str(e)[:2000]}"


def _longest_first(job: tuple) -> tuple[bool, bool]:
    """Sort key: the backward chunk kernels first, fp32 before bf16 (the fp32 one is by far the longest)."""
    dtype, which = job[0], job[5]
    return which != "chunk_bwd", dtype != "fp32"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability ×10 (90: H100/H200)")
    ap.add_argument("--warps", type=int, default=8)
    ap.add_argument(
        "--stages", type=int, default=1, help="software-pipeline stages (the autotune list has 1, 2)"
    )
    ap.add_argument(
        "--jobs", type=int, default=usable_cpus(), help="compiles at once (default: one per usable CPU)"
    )
    args = ap.parse_args(argv)
    cases = [  # (dtype, R, L, N, P): the 440M presets' layer shapes, SISO and MIMO, and fp32 SISO
        ("bf16", 1, 64, 128, 64),
        ("bf16", 4, 16, 128, 64),
        ("fp32", 1, 64, 128, 64),
    ]
    jobs = [(dtype, R, L, N, P, which) for dtype, R, L, N, P in cases for which in KERNELS]
    # fork where there is one: the workers start with this process's imports (it touches no GPU)
    context = multiprocessing.get_context("fork" if sys.platform == "linux" else None)
    failed = False
    with ProcessPoolExecutor(max_workers=max(1, min(args.jobs, len(jobs))), mp_context=context) as pool:
        futures = {
            job: pool.submit(_compile_or_error, job[5], *job[:5], args.warps, args.stages, args.arch)
            for job in sorted(jobs, key=_longest_first)
        }
        for job in jobs:
            dtype, R, L, N, P, which = job
            kind = KERNELS[which][1]
            warps = FIXED_WARPS.get(kind, args.warps)
            stages = 1 if kind in FIXED_WARPS else args.stages
            name = f"{which} {dtype} R={R} L={L} N={N} P={P} sm_{args.arch} warps={warps} stages={stages}"
            try:
                ok, text = futures[job].result()
            except BrokenProcessPool:  # the compiler aborted a worker (as triton 3.2's does on one kernel)
                ok, text = False, "the compiler process died"
            failed |= not ok
            print(f"{name}: {'ok, ' if ok else 'FAILED '}{text}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
