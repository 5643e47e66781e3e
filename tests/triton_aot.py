"""Compile the Triton scan kernels for a GPU on a machine without one: `python tests/triton_aot.py`.

The interpreter runs kernels the compiler may still reject (block shapes, layouts, dtypes); this builds
the real thing — Triton IR, PTX, and a cubin by the ptxas that ships with triton — for a CUDA target
(default sm_90, the H100/H200), at the presets' shapes, and prints one line per kernel with its
registers, spill stack and shared memory (from cuobjdump, also bundled). Exit status 1 if any failed.
Run by tests/test_scan_triton.py in a subprocess, since a process that has built the kernels for the
interpreter cannot build them for a GPU.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from mamba3lite.model import _scan_triton_kernels as kernels
from mamba3lite.model import scan_triton

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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability ×10 (90: H100/H200)")
    ap.add_argument("--warps", type=int, default=8)
    ap.add_argument(
        "--stages", type=int, default=1, help="software-pipeline stages (the autotune list has 1, 2)"
    )
    args = ap.parse_args(argv)
    cases = [  # (dtype, R, L, N, P): the 440M presets' layer shapes, SISO and MIMO, and fp32 SISO
        ("bf16", 1, 64, 128, 64),
        ("bf16", 4, 16, 128, 64),
        ("fp32", 1, 64, 128, 64),
    ]
    failed = False
    for dtype, R, L, N, P in cases:
        for which in KERNELS:
            kind = KERNELS[which][1]
            warps = FIXED_WARPS.get(kind, args.warps)
            stages = 1 if kind in FIXED_WARPS else args.stages
            name = f"{which} {dtype} R={R} L={L} N={N} P={P} sm_{args.arch} warps={warps} stages={stages}"
            try:
                usage = compile_one(which, dtype, R, L, N, P, args.warps, args.stages, args.arch)
                print(f"{name}: ok, {usage}", flush=True)
            except Exception as e:  # a compile error: report it, go on with the rest
                failed = True
                print(f"{name}: FAILED {type(e).__name__}: {str(e)[:2000]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
