"""The chunked scan as fused Triton kernels: `triton_chunked_scan` has exactly the contract of
`scan.chunked_scan` (same arguments, outputs and dtypes), computed by two kernels each way — a state
kernel that passes the state (or its gradient) across the chunks and a chunk kernel that does every
chunk's quadratic form at once (model/_scan_triton_kernels.py, whose docstring has the math).

Split of the work. The per-token scalars, O(B·H·T), are prepared here in plain PyTorch (autograd
differentiates them): γ = λΔ, scale_s = γ_s + (1 − λ_{s+1})Δ_{s+1} (the next token's β without its α,
as in chunked_scan), the chunk-local cumulative ΔA, the chunk-local reset count and the starting state
(h0ᵀ plus the k_prev/v_prev term of the first token). Everything of size O(T·L·R²·(N+P)) — the masked
quadratic form within chunks and the state passing between them — runs in the kernels, wrapped in one
custom op (`mamba3lite::triton_scan`) with a registered autograd formula. The forward saves only its
inputs, not even the chunk-start states: the backward reruns the state kernel for them (a light pass),
then recomputes the rest, never an (L, L) block.

`triton_rotated_scan` is the mixer's training path: the same op, given the per-group normed keys and
queries, their per-head biases and the angles, builds the per-head q, k itself (rotation.bias_rotate)
and again in its backward, so that the layer never keeps them (its largest tensors) for the backward.

The custom op is opaque to torch.compile (a fake implementation gives its shapes) and saves tensors
through ctx.save_for_backward, so it works under non-reentrant gradient checkpointing.

Where it runs: CUDA with `triton` installed, or the CPU under the Triton interpreter (TRITON_INTERPRET=1
set before the first use: triton reads it when the kernels are built; fp32 only, slow, for tests).
Accumulation is fp32; on a GPU the matmul operands are in the matmul dtype of chunked_scan (the
autocast dtype, else fp32). The outputs always have chunked_scan's dtypes, but float64 inputs are
computed at fp32 precision (Triton has no float64 matmul on most GPUs), so the float64 reference checks
this path to fp32 tolerance. The op gets its operands in the matmul dtype on every device, so it keeps
on the CPU what it keeps on a GPU; under the interpreter the kernels compute on them in fp32 (numpy has
no bf16) and cast y back.
"""

from __future__ import annotations

import importlib
import os
import re
from types import ModuleType

import torch
from torch import Tensor

from mamba3lite.errors import ConfigError
from mamba3lite.model.rotation import bias_rotate
from mamba3lite.model.scan import (
    _state_dtype,
    chunk_segments,
    matmul_dtype,
    scan_step,
    sequential_scan,
    start_state,
    token_weights,
)

# The largest shapes the kernels are built for: one program holds the (N, P) state, (L·R, N) and
# (L·R, P) tiles and (L·R, L·R) score blocks in registers / shared memory.
MAX_RANK = 4
MAX_CHUNK_ROWS = 64  # L·R: the official chunk sizes (64 SISO, 64/R MIMO)
MAX_STATE = 256  # N
MAX_HEADDIM = 128  # P
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_kernels_interpreted: bool | None = None  # the TRITON_INTERPRET the kernels were built under


def _interpret_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


# The oldest triton the kernels build with: triton 3.2's compiler aborts the process (an assertion in
# its layout code) on the backward chunk kernel in bf16; 3.3 and later build all of them for sm_90.
MIN_TRITON = (3, 3)


def _version(text: str) -> tuple[int, ...]:
    """(major, minor) of a version string such as 3.3.1 or 3.4.0+git1234 ((0, 0) if unreadable)."""
    m = re.match(r"(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _installed_triton_problem() -> str | None:
    """Why the installed triton cannot build the kernels (missing, too old), or None. Checked on every
    forward and decode step (`_check_runs`), so the answer is kept once it is None."""
    global _triton_ok
    if _triton_ok:
        return None
    try:
        import triton
    except ImportError:
        return "the Triton scan needs the `triton` package; fix: pip install triton"
    found = getattr(triton, "__version__", "?")
    if _version(found) < MIN_TRITON:
        need = ".".join(map(str, MIN_TRITON))
        return (
            f"the Triton scan needs triton >= {need}, found {found}; fix: a newer torch (2.7 or later "
            f"ships triton >= {need}) or pip install 'triton>={need}'"
        )
    _triton_ok = True
    return None


_triton_ok = False  # set by _installed_triton_problem once triton imported and was new enough


def triton_unavailable_reason(device: torch.device) -> str | None:
    """None when the Triton scan can run on `device`, else one line naming the fix."""
    if (problem := _installed_triton_problem()) is not None:
        return problem
    device = torch.device(device)
    if device.type == "cuda":
        if _kernels_interpreted:
            return "the Triton kernels were built for the interpreter (TRITON_INTERPRET=1); unset it, restart"
        return None
    if device.type == "cpu":
        if not _interpret_requested():
            return "set TRITON_INTERPRET=1 to run the Triton kernels on the CPU (slow; for tests)"
        if _kernels_interpreted is False:
            return "TRITON_INTERPRET=1 was set after the Triton kernels were built; set it before first use"
        return None
    return f"the Triton scan runs on CUDA (or the CPU with TRITON_INTERPRET=1), not on {device.type}"


def triton_supports(R: int, N: int, P: int, chunk_size: int) -> bool:
    """Whether the kernels are built for this shape: MIMO rank ≤ 4, chunk_size·R ≤ 64 rows per chunk,
    state N ≤ 256, head dim P ≤ 128 (a shorter sequence only shrinks the chunk)."""
    rows = chunk_size * R
    return 1 <= R <= MAX_RANK and 1 <= rows <= MAX_CHUNK_ROWS and N <= MAX_STATE and P <= MAX_HEADDIM


def _kernels() -> ModuleType:
    """The kernel module, imported (and so decorated by triton) on first use."""
    global _kernels_interpreted
    module = importlib.import_module("mamba3lite.model._scan_triton_kernels")
    if _kernels_interpreted is None:
        _kernels_interpreted = module.INTERPRETED
    return module


def _block(n: int) -> int:
    """A tl.dot block dimension: a power of two ≥ 16."""
    return max(16, 1 << (n - 1).bit_length())


STATE_BLOCK_P = 32  # the P columns one state-kernel program carries (more programs, fewer registers)


def _launch_meta(q: Tensor, v: Tensor, chunk_size: int) -> tuple[dict, dict]:
    """The constexprs of (the state kernels, the chunk kernels)."""
    R, N, P = q.shape[3], q.shape[4], v.shape[4]
    both = {
        "L": chunk_size, "R": R, "N": N, "P": P, "BLOCK_LR": _block(chunk_size * R), "BLOCK_N": _block(N),
        # fp32 operands at full precision (chunked_scan's fp32 matmuls do not use TF32 either)
        "PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
    }  # fmt: skip
    return {**both, "BLOCK_PS": min(_block(P), STATE_BLOCK_P)}, {**both, "BLOCK_P": _block(P)}


def _grids(Bsz: int, H: int, P: int, nc: int, state_meta: dict) -> tuple[tuple, tuple]:
    """The grids of (the state kernels: batch row·head × column block, the chunk kernels: batch
    row·head·chunk, on the first axis, the only one with room for more than 65,535 programs)."""
    return (Bsz * H, -(-P // state_meta["BLOCK_PS"])), (Bsz * H * nc,)


def _work_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernels read a `dtype` tensor in: itself on a GPU; fp32 under the interpreter, which
    computes in numpy (it has no bf16: it would return garbage, silently)."""
    return dtype if device.type == "cuda" else torch.float32


def _work(x: Tensor) -> Tensor:
    """x as the kernels read it (`_work_dtype`): no copy on a GPU, nor of an fp32 tensor."""
    return x.to(_work_dtype(x.device, x.dtype))


def _run_forward(
    q: Tensor, k: Tensor, v: Tensor, cs, scale, gamma, seg, S0, chunk_size: int, *, with_y: bool
):
    """Launch the state kernel (and with `with_y` the chunk kernel): (y or None, h_T (B, H, P, N) fp32,
    starts (B, H, nc, N, P)), y and starts in the kernels' dtype (_work of q's)."""
    q, k, v = _work(q), _work(k), _work(v)
    Bsz, H, T, R, N = q.shape
    P = v.shape[-1]
    Tp = cs.shape[-1]
    nc = Tp // chunk_size
    h_T = torch.empty(Bsz, H, P, N, dtype=torch.float32, device=q.device)
    starts = torch.empty(Bsz, H, nc, N, P, dtype=q.dtype, device=q.device)
    has_reset, seg = seg is not None, cs if seg is None else seg  # an unread stand-in without resets
    state_meta, chunk_meta = _launch_meta(q, v, chunk_size)
    state_grid, chunk_grid = _grids(Bsz, H, P, nc, state_meta)
    kernels, common = _kernels(), (T, Tp, nc, H)
    kernels.state_fwd[state_grid](
        k, v, cs, scale, seg, S0, starts, h_T, *common, HAS_RESET=has_reset, **state_meta
    )
    if not with_y:
        return None, h_T, starts
    y = torch.empty(Bsz, H, T, R, P, dtype=q.dtype, device=q.device)
    kernels.chunk_fwd[chunk_grid](
        q, k, v, cs, scale, gamma, seg, starts, y, *common, HAS_RESET=has_reset, **chunk_meta
    )
    return y, h_T, starts


def _run_backward(q: Tensor, k: Tensor, v: Tensor, cs, scale, gamma, seg, S0, dy, dh, chunk_size: int):
    """The backward kernels, after the state kernel recomputes the chunk-start states (a light pass:
    one (N, L·R)·(L·R, P) product per chunk; saving them instead costs N·P per chunk per head of
    activation memory, about as much as the rotated keys). Returns (dq, dk, dv in the kernels' dtype,
    d_cs, d_scale, d_γ (B, H, Tp) fp32 summed over ranks, dS0 (B, H, N, P) fp32)."""
    q, k, v = _work(q), _work(k), _work(v)
    dy = _work(dy).to(q.dtype).contiguous()
    _, _, starts = _run_forward(q, k, v, cs, scale, gamma, seg, S0, chunk_size, with_y=False)
    Bsz, H, T, R, N = q.shape
    P = v.shape[-1]
    Tp = cs.shape[-1]
    nc = Tp // chunk_size
    dev = q.device
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    rows = [torch.empty(Bsz, H, Tp, R, dtype=torch.float32, device=dev) for _ in range(3)]
    dS0 = torch.empty(Bsz, H, N, P, dtype=torch.float32, device=dev)
    g_ends = torch.empty(Bsz, H, nc, N, P, dtype=torch.float32, device=dev)  # the gradient of each S_{c+1}
    has_reset, seg = seg is not None, cs if seg is None else seg
    state_meta, chunk_meta = _launch_meta(q, v, chunk_size)
    state_grid, chunk_grid = _grids(Bsz, H, P, nc, state_meta)
    kernels, common = _kernels(), (T, Tp, nc, H)
    kernels.state_bwd[state_grid](
        q, dy, cs, scale, seg, dh.float().contiguous(), g_ends, dS0,
        *common, HAS_RESET=has_reset, **state_meta,
    )  # fmt: skip
    kernels.chunk_bwd[chunk_grid](
        q, k, v, cs, scale, gamma, seg, starts, g_ends, dy, dq, dk, dv, *rows,
        *common, HAS_RESET=has_reset, **chunk_meta,
    )  # fmt: skip
    d_cs, d_scale, d_gamma = (r.sum(-1) for r in rows)  # the R rows of each token
    return dq, dk, dv, d_cs, d_scale, d_gamma, dS0


ROTATE_BLOCK_T, ROTATE_WARPS = 8, 4  # the prologue kernels' tokens per program, warps: no spills


def _prologue(q_in, k_in, q_bias, k_bias, theta, halves: bool, mm_dtype) -> tuple[Tensor, Tensor]:
    """The scan's per-head q, k in `mm_dtype`: q_in, k_in themselves without biases (they are per head),
    else the prologue kernel on the per-group normed q̂, k̂ (rotation.bias_rotate's function)."""
    if q_bias is None:
        return q_in.to(mm_dtype), k_in.to(mm_dtype)
    Bsz, G, T, R, N = q_in.shape
    H = q_bias.shape[0]
    work = _work_dtype(q_in.device, mm_dtype)
    q, k = (torch.empty(Bsz, H, T, R, N, dtype=work, device=q_in.device) for _ in range(2))
    grid = (Bsz * H, -(-T // ROTATE_BLOCK_T))
    _kernels().rotate_fwd[grid](
        *_prologue_operands(q_in, k_in, q_bias, k_bias, theta), q, k, T, H, G,
        **_rotate_meta(R, N, theta, halves), num_warps=ROTATE_WARPS,
    )  # fmt: skip
    return q.to(mm_dtype), k.to(mm_dtype)


def _prologue_operands(q_in, k_in, q_bias, k_bias, theta) -> list[Tensor]:
    """q̂, k̂, the biases and θ as the prologue kernels read them (θ: an unread stand-in when None)."""
    operands = [_work(x).contiguous() for x in (q_in, k_in, q_bias, k_bias)]
    return [*operands, operands[0] if theta is None else _work(theta).contiguous()]


def _rotate_meta(R: int, N: int, theta: Tensor | None, halves: bool) -> dict:
    return {
        "R": R, "N": N, "S": 1 if theta is None else theta.shape[-1], "BLOCK_T": ROTATE_BLOCK_T,
        "BLOCK_N": 1 << (N - 1).bit_length(), "HAS_THETA": theta is not None, "HALVES": halves,
    }  # fmt: skip


def _prologue_grads(q_in, k_in, q_bias, k_bias, theta, halves: bool, dq: Tensor, dk: Tensor):
    """The prologue's backward kernel: (dq̂, dk̂, dC_bias, dB_bias, dθ or None), each in its input's dtype,
    from the gradients dq, dk (B, H, T, R, N) of the per-head q, k."""
    Bsz, G, T, R, N = q_in.shape
    H = q_bias.shape[0]
    dev = q_in.device
    n_tb = -(-T // ROTATE_BLOCK_T)
    dqh, dkh = (torch.empty(Bsz, G, T, R, N, dtype=torch.float32, device=dev) for _ in range(2))
    dqb, dkb = (torch.empty(Bsz, n_tb, H, R, N, dtype=torch.float32, device=dev) for _ in range(2))
    # dθ per rank (the kernel writes it only with angles; without, dqh stands in unwritten)
    d_theta = (
        dqh if theta is None else torch.empty(R, Bsz, H, T, theta.shape[-1], dtype=torch.float32, device=dev)
    )
    _kernels().rotate_bwd[(Bsz * G, n_tb)](
        *_prologue_operands(q_in, k_in, q_bias, k_bias, theta),
        _work(dq).contiguous(), _work(dk).contiguous(), dqh, dkh, dqb, dkb, d_theta,
        T, H, G, n_tb, **_rotate_meta(R, N, theta, halves), num_warps=ROTATE_WARPS,
    )  # fmt: skip
    d_theta = None if theta is None else d_theta.sum(0).to(theta.dtype)
    d_qb, d_kb = dqb.sum((0, 1)).to(q_bias.dtype), dkb.sum((0, 1)).to(k_bias.dtype)
    return dqh.to(q_in.dtype), dkh.to(k_in.dtype), d_qb, d_kb, d_theta


def _op_values(v_in: Tensor, v_scale: Tensor | None) -> Tensor:
    """The scan's v: v_in itself, or (MIMO) the raw x (B, H, T, 1, P) times its per-rank scale (H, R, P),
    in v_in's dtype, as the mixer's `_values`."""
    if v_scale is None:
        return v_in
    return (v_in * v_scale[:, None].to(v_in.dtype)).contiguous()


def _shape_BHTRP(v_in: Tensor, v_scale: Tensor | None) -> tuple[int, int, int, int, int]:
    Bsz, H, T, R, P = v_in.shape
    return Bsz, H, T, R if v_scale is None else v_scale.shape[1], P


@torch.library.custom_op("mamba3lite::triton_scan", mutates_args=())
def _triton_scan(
    q_in: Tensor,
    k_in: Tensor,
    q_bias_HRN: Tensor | None,
    k_bias_HRN: Tensor | None,
    theta_BHTS: Tensor | None,
    halves: bool,
    v_in: Tensor,
    v_scale_HRP: Tensor | None,
    cs_BHT: Tensor,
    scale_BHT: Tensor,
    gamma_BHT: Tensor,
    seg_BT: Tensor | None,
    S0_BHNP: Tensor,
    chunk_size: int,
    mm_dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:
    """The forward kernels on q, k = `_prologue(...)` and v = `_op_values(v_in, v_scale)`: either per-head
    q, k (B, H, T, R, N) with no biases, or the per-group normed q̂, k̂ (B, G, T, R, N) with their per-head
    biases (H, R, N) and angles θ (or None), rotated here; v (B, H, T, R, P) itself, or MIMO's raw x
    (B, H, T, 1, P) with mimo_x (H, R, P). cs/scale/γ (fp32) and seg (int32, or None without resets) are
    padded to whole chunks (Tp = nc·L); q, k, v are not. Returns (y (B, H, T, R, P) in mm_dtype,
    h_T (B, H, P, N) fp32)."""
    q, k = _prologue(q_in, k_in, q_bias_HRN, k_bias_HRN, theta_BHTS, halves, mm_dtype)
    v = _op_values(v_in, v_scale_HRP)
    y, h_T, _ = _run_forward(q, k, v, cs_BHT, scale_BHT, gamma_BHT, seg_BT, S0_BHNP, chunk_size, with_y=True)
    return y.to(mm_dtype), h_T


@_triton_scan.register_fake
def _(q_in, k_in, q_bias_HRN, k_bias_HRN, theta_BHTS, halves, v_in, v_scale_HRP, cs_BHT, scale_BHT,
      gamma_BHT, seg_BT, S0_BHNP, chunk_size, mm_dtype):  # fmt: skip
    Bsz, H, T, R, P = _shape_BHTRP(v_in, v_scale_HRP)
    N = q_in.shape[-1]
    return v_in.new_empty(Bsz, H, T, R, P, dtype=mm_dtype), S0_BHNP.new_empty(Bsz, H, P, N)


@torch.library.custom_op("mamba3lite::triton_scan_backward", mutates_args=())
def _triton_scan_backward(
    q_in: Tensor,
    k_in: Tensor,
    q_bias_HRN: Tensor | None,
    k_bias_HRN: Tensor | None,
    theta_BHTS: Tensor | None,
    halves: bool,
    v_in: Tensor,
    v_scale_HRP: Tensor | None,
    cs_BHT: Tensor,
    scale_BHT: Tensor,
    gamma_BHT: Tensor,
    seg_BT: Tensor | None,
    S0_BHNP: Tensor,
    dy_BHTRP: Tensor,
    dh_BHPN: Tensor,
    chunk_size: int,
    mm_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The backward: q, k and v recomputed, then the kernels, then (with biases) the prologue's backward
    kernel and (with v_scale) the values' chain rule. Returns the gradients of (q_in, k_in, q_bias,
    k_bias, θ, v_in, v_scale, cs, scale, γ, S0), each in its input's dtype; those of absent inputs are
    empty (0,) tensors."""
    q, k = _prologue(q_in, k_in, q_bias_HRN, k_bias_HRN, theta_BHTS, halves, mm_dtype)
    v = _op_values(v_in, v_scale_HRP)
    dq, dk, dv, d_cs, d_scale, d_gamma, dS0 = _run_backward(
        q, k, v, cs_BHT, scale_BHT, gamma_BHT, seg_BT, S0_BHNP, dy_BHTRP, dh_BHPN, chunk_size
    )

    def none() -> Tensor:  # one per absent gradient (outputs of a custom op may not alias)
        return q_in.new_empty(0)

    if q_bias_HRN is None:
        d_q, d_k, d_qb, d_kb, d_theta = dq.to(q_in.dtype), dk.to(k_in.dtype), none(), none(), none()
    else:
        d_q, d_k, d_qb, d_kb, d_theta = _prologue_grads(
            q_in, k_in, q_bias_HRN, k_bias_HRN, theta_BHTS, halves, dq, dk
        )
        d_theta = none() if d_theta is None else d_theta
    if v_scale_HRP is None:
        d_v, d_vs = dv.to(v_in.dtype), none()
    else:  # v = x ⊙ scale, x broadcast over the ranks
        dvf = dv.float()
        d_v = (dvf * v_scale_HRP[:, None].float()).sum(3, keepdim=True).to(v_in.dtype)
        d_vs = (dvf * v_in.float()).sum((0, 2)).to(v_scale_HRP.dtype)
    return d_q, d_k, d_qb, d_kb, d_theta, d_v, d_vs, d_cs, d_scale, d_gamma, dS0


@_triton_scan_backward.register_fake
def _(q_in, k_in, q_bias_HRN, k_bias_HRN, theta_BHTS, halves, v_in, v_scale_HRP, cs_BHT, scale_BHT,
      gamma_BHT, seg_BT, S0_BHNP, dy_BHTRP, dh_BHPN, chunk_size, mm_dtype):  # fmt: skip
    def like(x):
        return q_in.new_empty(0) if x is None else torch.empty_like(x)

    per_token = [torch.empty_like(cs_BHT) for _ in range(3)]
    prologue = [like(q_bias_HRN), like(k_bias_HRN), like(theta_BHTS)]
    values = [torch.empty_like(v_in), like(v_scale_HRP)]
    return torch.empty_like(q_in), torch.empty_like(k_in), *prologue, *values, *per_token, \
        torch.empty_like(S0_BHNP)  # fmt: skip


def _setup_context(ctx, inputs, output) -> None:
    *tensors, chunk_size, mm_dtype = inputs
    halves = tensors.pop(5)
    ctx.save_for_backward(*tensors)
    ctx.halves, ctx.chunk_size, ctx.mm_dtype = halves, chunk_size, mm_dtype


def _backward(ctx, dy, dh):
    q_in, k_in, q_bias, k_bias, theta, v_in, v_scale, cs, scale, gamma, seg, S0 = ctx.saved_tensors
    # an unused output's gradient may arrive as None
    Bsz, H, T, R, P = _shape_BHTRP(v_in, v_scale)
    dy = v_in.new_zeros(Bsz, H, T, R, P, dtype=ctx.mm_dtype) if dy is None else dy
    dh = S0.new_zeros(Bsz, H, P, S0.shape[2]) if dh is None else dh
    grads = list(_triton_scan_backward(
        q_in, k_in, q_bias, k_bias, theta, ctx.halves, v_in, v_scale, cs, scale, gamma, seg, S0, dy, dh,
        ctx.chunk_size, ctx.mm_dtype,
    ))  # fmt: skip
    for i, given in ((2, q_bias), (3, k_bias), (4, theta), (6, v_scale)):
        grads[i] = None if given is None else grads[i]
    d_q, d_k, d_qb, d_kb, d_theta, d_v, d_vs, d_cs, d_scale, d_gamma, dS0 = grads
    return d_q, d_k, d_qb, d_kb, d_theta, None, d_v, d_vs, d_cs, d_scale, d_gamma, None, dS0, None, None


_triton_scan.register_autograd(_backward, setup_context=_setup_context)


def _check_runs(dev: torch.device, R: int, N: int, P: int, L: int) -> None:
    """ConfigError unless the kernels can run on `dev` for this shape."""
    reason = triton_unavailable_reason(dev)
    if reason is not None:
        raise ConfigError(f"scan_impl 'triton': {reason}")
    if not triton_supports(R, N, P, L):
        raise ConfigError(
            f"scan_impl 'triton' does not support MIMO rank {R}, d_state {N}, headdim {P}, chunk_size {L} "
            f"(limits: rank ≤ {MAX_RANK}, chunk_size·rank ≤ {MAX_CHUNK_ROWS}, d_state ≤ {MAX_STATE}, "
            f"headdim ≤ {MAX_HEADDIM}); fix: a smaller chunk_size, or scan_impl 'chunked'"
        )


def _scalars(adt_BHT, dt_BHT, lam_BHT, reset_BT, h0_BHPN, k_prev_BRHN, v_prev_BRHP, N: int, P: int, L: int):
    """The per-token scalars as chunked_scan forms them (scan.token_weights), padded to whole chunks
    (padded tokens: ΔA = 0 and zero weights, so the cumulative ΔA stays flat and they change nothing),
    and the starting state (scan.start_state): (cs, scale, γ (B, H, nc·L) fp32, seg (B, nc·L) int32 or
    None, S0 (B, H, N, P) fp32)."""
    Bsz, H, T = adt_BHT.shape
    nc = -(-T // L)
    sd = _state_dtype(adt_BHT.dtype)
    gamma, boa, boa_next = token_weights(dt_BHT, lam_BHT, reset_BT, sd)
    cs = torch.cumsum(torch.nn.functional.pad(adt_BHT.to(sd), (0, nc * L - T)).view(Bsz, H, nc, L), -1)
    seg = None if reset_BT is None else chunk_segments(reset_BT, nc, L).view(Bsz, nc * L)
    S0 = start_state(h0_BHPN, k_prev_BRHN, v_prev_BRHP, boa, N, P)

    def f32(x: Tensor) -> Tensor:  # (B, H, T or nc·L) -> (B, H, nc·L) fp32, zero-padded
        x = x.reshape(Bsz, H, -1)
        return torch.nn.functional.pad(x, (0, nc * L - x.shape[-1])).to(torch.float32).contiguous()

    return f32(cs), f32(gamma + boa_next), f32(gamma), seg, S0.to(torch.float32).contiguous()


def _op_dtype(mm_dtype: torch.dtype) -> torch.dtype:
    """The dtype the op's q, k, v and y have: the matmul dtype where the kernels take it (float64
    inputs are computed at fp32: Triton has no float64 matmul on most GPUs)."""
    return mm_dtype if mm_dtype in _KERNEL_DTYPES else torch.float32


def triton_chunked_scan(
    q_BHTRN: Tensor,
    k_BHTRN: Tensor,
    v_BHTRP: Tensor,
    adt_BHT: Tensor,
    dt_BHT: Tensor,
    lam_BHT: Tensor,
    *,
    chunk_size: int,
    h0_BHPN: Tensor | None = None,
    k_prev_BRHN: Tensor | None = None,
    v_prev_BRHP: Tensor | None = None,
    reset_BT: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """`scan.chunked_scan` on the Triton kernels: (y_BHTRP in the matmul dtype — the autocast dtype
    under autocast, else the inputs' promoted to ≥ fp32 — and the final state h_BHPN in the state dtype).

    Raises ConfigError when the kernels cannot run on the inputs' device (no triton; a CPU tensor
    without TRITON_INTERPRET=1) or the shape is beyond `triton_supports`.
    """
    T, R, N = q_BHTRN.shape[2:]
    P = v_BHTRP.shape[-1]
    dev = q_BHTRN.device
    init = {"h0_BHPN": h0_BHPN, "k_prev_BRHN": k_prev_BRHN, "v_prev_BRHP": v_prev_BRHP}
    if T == 0:  # nothing to scan: the state is returned unchanged
        return sequential_scan(q_BHTRN, k_BHTRN, v_BHTRP, adt_BHT, dt_BHT, lam_BHT, reset_BT=reset_BT, **init)
    L = max(1, min(chunk_size, T))
    _check_runs(dev, R, N, P, L)
    sd = _state_dtype(adt_BHT.dtype)
    mm_dtype = matmul_dtype(dev.type, q_BHTRN.dtype, v_BHTRP.dtype, sd)
    op_dtype = _op_dtype(mm_dtype)
    scalars = _scalars(adt_BHT, dt_BHT, lam_BHT, reset_BT, **init, N=N, P=P, L=L)
    with torch.autocast(dev.type, enabled=False):
        q, k, v = (x.to(op_dtype).contiguous() for x in (q_BHTRN, k_BHTRN, v_BHTRP))
        y, h_T = _triton_scan(q, k, None, None, None, False, v, None, *scalars, L, op_dtype)
    return y.to(mm_dtype), h_T.to(sd)


def triton_rotated_scan(
    k_hat_BGTRN: Tensor,
    q_hat_BGTRN: Tensor,
    k_bias_HRN: Tensor,
    q_bias_HRN: Tensor,
    theta_BHTS: Tensor | None,
    halves: bool,
    v_BHTRP: Tensor,
    adt_BHT: Tensor,
    dt_BHT: Tensor,
    lam_BHT: Tensor,
    *,
    chunk_size: int,
    reset_BT: Tensor | None = None,
    v_scale_HRP: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The mixer's bias + rotation (rotation.bias_rotate) and `triton_chunked_scan` from a zero state in
    one op that saves the per-group normed q̂, k̂ (B, G, T, R, N) and the angles for its backward and
    recomputes the per-head q, k there: those are the largest tensors of the layer (H/G copies of the
    keys and the queries), which the unfused pair keeps for the backward. With `v_scale_HRP` (MIMO's
    mimo_x), v_BHTRP is the raw x (B, H, T, 1, P) and the op forms v = x ⊙ mimo_x per rank itself, also
    recomputed in the backward. Same outputs and errors as `triton_chunked_scan(q, k, v, ...)` with
    `k, q = bias_rotate(...)` in the matmul dtype (and that v)."""
    T, R, P = v_BHTRP.shape[2:]
    R = R if v_scale_HRP is None else v_scale_HRP.shape[1]
    N = k_hat_BGTRN.shape[-1]
    dev = v_BHTRP.device
    sd = _state_dtype(adt_BHT.dtype)
    mm_dtype = matmul_dtype(dev.type, k_hat_BGTRN.dtype, v_BHTRP.dtype, sd)
    if T == 0:
        k, q = bias_rotate(k_hat_BGTRN, q_hat_BGTRN, k_bias_HRN, q_bias_HRN, theta_BHTS, halves, mm_dtype)
        v = _op_values(v_BHTRP, v_scale_HRP)
        return triton_chunked_scan(q, k, v, adt_BHT, dt_BHT, lam_BHT, chunk_size=chunk_size)
    L = max(1, min(chunk_size, T))
    _check_runs(dev, R, N, P, L)
    op_dtype = _op_dtype(mm_dtype)
    scalars = _scalars(adt_BHT, dt_BHT, lam_BHT, reset_BT, None, None, None, N=N, P=P, L=L)
    with torch.autocast(dev.type, enabled=False):
        y, h_T = _triton_scan(
            q_hat_BGTRN.contiguous(), k_hat_BGTRN.contiguous(), q_bias_HRN, k_bias_HRN, theta_BHTS, halves,
            v_BHTRP.to(op_dtype).contiguous(), v_scale_HRP, *scalars, L, op_dtype,
        )  # fmt: skip
    return y.to(mm_dtype), h_T.to(sd)


STEP_BLOCK_P = 16  # state rows per step program: B·H·P/16 programs, so one row of decode fills the GPU


def triton_scan_step(
    q_BHRN: Tensor,
    k_BHRN: Tensor,
    v_BHRP: Tensor,
    adt_BH: Tensor,
    dt_BH: Tensor,
    lam_BH: Tensor,
    h_BHPN: Tensor,
    k_prev_BRHN: Tensor,
    v_prev_BRHP: Tensor,
    reset_B: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """`scan.scan_step` (one token of decode) as one Triton kernel: the same arguments, outputs and
    dtypes (y_BHRP and the new h_BHPN in the state dtype; float64 is computed at fp32 precision).

    An inference kernel: where autograd records (grad mode on and an input that requires grad) it is
    `scan.scan_step` itself, the differentiable spec, so a step is never silently cut from the graph.
    Raises ConfigError where the kernels cannot run (`triton_chunked_scan`'s errors).
    """
    inputs = (q_BHRN, k_BHRN, v_BHRP, adt_BH, dt_BH, lam_BH, h_BHPN, k_prev_BRHN, v_prev_BRHP)
    if torch.is_grad_enabled() and any(x.requires_grad for x in inputs):
        return scan_step(*inputs, reset_B)
    Bsz, H, R, N = q_BHRN.shape
    P = v_BHRP.shape[-1]
    dev = q_BHRN.device
    _check_runs(dev, R, N, P, 1)
    sd = _state_dtype(h_BHPN.dtype)
    y = torch.empty(Bsz, H, R, P, device=dev, dtype=sd)
    h = torch.empty(Bsz, H, P, N, device=dev, dtype=sd)
    if y.numel() == 0:
        return y, h
    work = [_work(x).contiguous() for x in inputs]
    reset = work[0] if reset_B is None else reset_B.to(torch.int32).contiguous()
    # (the kernels store in the outputs' dtype; under the interpreter a float64 one gets an fp32 buffer)
    out = [x if _work_dtype(dev, sd) == sd else torch.empty_like(x, dtype=torch.float32) for x in (y, h)]
    grid = (Bsz * H, -(-P // STEP_BLOCK_P))
    _kernels().step[grid](
        *work, reset, *out, H, R=R, N=N, P=P, BLOCK_N=_block(N), BLOCK_P=STEP_BLOCK_P,
        HAS_RESET=reset_B is not None,
    )  # fmt: skip
    return tuple(x if x is buf else x.copy_(buf) for x, buf in zip((y, h), out))
