"""The Triton kernels behind `scan_triton.triton_chunked_scan` (imported on first use: needs triton).

One program per (batch row, head) walks the chunks in order (forward) or in reverse (backward), holding
the carried state S (N, P) in fp32 registers. Per chunk c of L tokens and R ranks, flattened to L·R rows
i = (token, rank), with the per-token scalars prepared by the wrapper (cs chunk-local inclusive cumsum of
ΔA, scale, γ, seg the chunk-local count of resets; module docstring of scan.py for their meaning):

    W[i, j]  = e^{cs_i − cs_j}·scale_j    for tok_i > tok_j in the same segment
             = γ_i                        for tok_i = tok_j (every rank pair of a token)
    Y        = (Q Kᵀ ⊙ W) V + w_start ⊙ (Q S_c)     w_start_i = e^{cs_i}·[no reset in the chunk up to i]
    S_{c+1}  = decay_c·S_c + Kᵀ (V ⊙ w_vw)          w_vw_j = scale_j·e^{cs_last − cs_j}·[j in the last seg.]
                                                     decay_c = e^{cs_last}·[no reset in the chunk]

The forward writes S_c at every chunk start (in the matmul dtype, as the chunked scan keeps them); the
backward recomputes Q Kᵀ, W and the products from Q, K, V and S_c, so no (L, L) block is ever stored.
Backward, with g the gradient of S_{c+1} (from the final state's gradient at the last chunk):

    dV = (Q Kᵀ ⊙ W)ᵀ dY + w_vw ⊙ (K g)        dQ = (dY Vᵀ ⊙ W) K + w_start ⊙ (dY S_cᵀ)
    dK = (dY Vᵀ ⊙ W)ᵀ Q + w_vw ⊙ (V gᵀ)       g ← decay_c·g + Qᵀ (w_start ⊙ dY)
    dW = dY Vᵀ ⊙ Q Kᵀ, and from W, w_start, w_vw, decay_c the per-row gradients of cs, scale and γ
    (summed over ranks by the wrapper; the chain from cs, scale, γ back to ΔA, Δ, λ is autograd's).

Block sizes are powers of two ≥ 16 (tl.dot's minimum) with masked loads and stores; all accumulation
is fp32, the matmul operands are in the inputs' dtype (fp32 at IEEE precision, or bf16/fp16). Triton
reads TRITON_INTERPRET when the kernels are decorated, i.e. when this module is first imported.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mamba3lite.model.scan import _EXP_FLOOR_VALUE, EXP_FLOOR

_FLOOR = tl.constexpr(EXP_FLOOR)
_FLOOR_VALUE = tl.constexpr(_EXP_FLOOR_VALUE)


@triton.jit
def _exp_nonpos(x):
    """e^x for x ≤ 0 (larger x clamped to 0), exactly 0 below the floor: the same numbers as
    scan._exp_nonpos, so that strong decays give zeros, never subnormals."""
    e = tl.exp(tl.minimum(tl.maximum(x, _FLOOR), 0.0))
    return tl.where(e > _FLOOR_VALUE, e, 0.0)


@triton.jit
def _sum(x, axis: tl.constexpr):
    """tl.sum spelled as the reduction it is (the same combine function, so the same code on a GPU).
    Triton's own @jit helpers (tl.sum, tl.zeros_like, ...) are decorated when triton is imported, and
    under an interpreter enabled after that import (as the tests do) they cannot be called; the
    interpreter runs this reduction with numpy (it recognises the combine function) instead."""
    return tl.reduce(x, axis, tl.standard._sum_combine)


@triton.jit
def _tile_offsets(base, t0, rows, cols, T, L: tl.constexpr, R: tl.constexpr, D: tl.constexpr):
    """Offsets and mask of the (L·R, D) tile of chunk rows starting at token t0 in a contiguous
    (T, R, D) slab at `base`; rows past the chunk or past T are masked (they read 0)."""
    ok = (rows < L * R) & (t0 + rows // R < T)
    offs = base + (t0 * R + rows)[:, None] * D + cols[None, :]
    return offs, ok[:, None] & (cols[None, :] < D)


@triton.jit
def _chunk_scalars(
    cs_ptr, scale_ptr, gamma_ptr, seg_ptr, pid, b, t0, rows, Tp, L: tl.constexpr, R: tl.constexpr,
    HAS_RESET: tl.constexpr,
):  # fmt: skip
    """The chunk's weights: (decay, W, scale, w_start, to_end, decay_c); decay (L·R, L·R) is e^{cs_i − cs_j}
    on the strictly causal same-segment pairs (0 elsewhere), to_end_j = e^{cs_last − cs_j}·[same segment
    as the last token] (so w_vw = scale ⊙ to_end)."""
    tok = rows // R
    row_in = rows < L * R
    off = pid * Tp + t0 + tok
    cs = tl.load(cs_ptr + off, mask=row_in, other=0.0)
    scale = tl.load(scale_ptr + off, mask=row_in, other=0.0)
    gamma = tl.load(gamma_ptr + off, mask=row_in, other=0.0)
    cs_last = tl.load(cs_ptr + pid * Tp + t0 + L - 1)
    pair_in = row_in[:, None] & row_in[None, :]
    strict = (tok[:, None] > tok[None, :]) & pair_in
    same_tok = (tok[:, None] == tok[None, :]) & pair_in
    if HAS_RESET:
        seg = tl.load(seg_ptr + b * Tp + t0 + tok, mask=row_in, other=0)
        seg_last = tl.load(seg_ptr + b * Tp + t0 + L - 1)
        strict = strict & (seg[:, None] == seg[None, :])
        from_start = (seg == 0).to(tl.float32)
        to_end = (seg == seg_last).to(tl.float32)
        open_chunk = (seg_last == 0).to(tl.float32)
    else:
        # cs·0 + 1, not tl.zeros_like (a triton @jit helper: see _sum)
        from_start = cs * 0.0 + 1.0
        to_end = cs * 0.0 + 1.0
        open_chunk = 1.0
    decay = tl.where(strict, _exp_nonpos(cs[:, None] - cs[None, :]), 0.0)
    W = decay * scale[None, :] + tl.where(same_tok, gamma[:, None], 0.0)
    w_start = _exp_nonpos(cs) * from_start
    to_end = _exp_nonpos(cs_last - cs) * to_end
    decay_c = _exp_nonpos(cs_last) * open_chunk
    return decay, W, scale, w_start, to_end, decay_c


@triton.jit
def scan_fwd_kernel(
    q_ptr, k_ptr, v_ptr, cs_ptr, scale_ptr, gamma_ptr, seg_ptr, s0_ptr, y_ptr, starts_ptr, hT_ptr,
    T, Tp, nc, H,
    L: tl.constexpr, R: tl.constexpr, N: tl.constexpr, P: tl.constexpr,
    BLOCK_LR: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
    HAS_RESET: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)  # b·H + h; int64: offsets of long sequences pass 2³¹
    b = pid // H
    rows = tl.arange(0, BLOCK_LR)
    n = tl.arange(0, BLOCK_N)
    p = tl.arange(0, BLOCK_P)
    np_mask = (n[:, None] < N) & (p[None, :] < P)
    np_offs = n[:, None] * P + p[None, :]
    S = tl.load(s0_ptr + pid * N * P + np_offs, mask=np_mask, other=0.0)  # fp32 (N, P)
    for c in range(nc):
        t0 = c * L
        qk_offs, qk_mask = _tile_offsets(pid * T * R * N, t0, rows, n, T, L, R, N)
        v_offs, v_mask = _tile_offsets(pid * T * R * P, t0, rows, p, T, L, R, P)
        Q = tl.load(q_ptr + qk_offs, mask=qk_mask, other=0.0)
        K = tl.load(k_ptr + qk_offs, mask=qk_mask, other=0.0)
        V = tl.load(v_ptr + v_offs, mask=v_mask, other=0.0)
        S_mm = S.to(Q.dtype)
        tl.store(starts_ptr + (pid * nc + c) * N * P + np_offs, S_mm, mask=np_mask)
        _, W, scale, w_start, to_end, decay_c = _chunk_scalars(
            cs_ptr, scale_ptr, gamma_ptr, seg_ptr, pid, b, t0, rows, Tp, L, R, HAS_RESET
        )
        w_vw = scale * to_end
        scores = tl.dot(Q, tl.trans(K), input_precision=PRECISION)
        y = tl.dot((scores * W).to(V.dtype), V, input_precision=PRECISION)
        y += w_start[:, None] * tl.dot(Q, S_mm, input_precision=PRECISION)
        tl.store(y_ptr + v_offs, y.to(y_ptr.dtype.element_ty), mask=v_mask)
        dS = tl.dot(tl.trans(K), (V * w_vw[:, None]).to(V.dtype), input_precision=PRECISION)
        S = decay_c * S + dS
    # the final state leaves as h = Sᵀ, (P, N)
    tl.store(hT_ptr + pid * N * P + p[None, :] * N + n[:, None], S, mask=np_mask)


@triton.jit
def scan_bwd_kernel(
    q_ptr, k_ptr, v_ptr, cs_ptr, scale_ptr, gamma_ptr, seg_ptr, starts_ptr, dy_ptr, dhT_ptr,
    dq_ptr, dk_ptr, dv_ptr, dcs_ptr, dscale_ptr, dgamma_ptr, ds0_ptr,
    T, Tp, nc, H,
    L: tl.constexpr, R: tl.constexpr, N: tl.constexpr, P: tl.constexpr,
    BLOCK_LR: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
    HAS_RESET: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    b = pid // H
    rows = tl.arange(0, BLOCK_LR)
    row_in = rows < L * R
    n = tl.arange(0, BLOCK_N)
    p = tl.arange(0, BLOCK_P)
    np_mask = (n[:, None] < N) & (p[None, :] < P)
    np_offs = n[:, None] * P + p[None, :]
    g = tl.load(dhT_ptr + pid * N * P + p[None, :] * N + n[:, None], mask=np_mask, other=0.0)
    for i in range(nc):
        c = nc - 1 - i
        t0 = c * L
        qk_offs, qk_mask = _tile_offsets(pid * T * R * N, t0, rows, n, T, L, R, N)
        v_offs, v_mask = _tile_offsets(pid * T * R * P, t0, rows, p, T, L, R, P)
        Q = tl.load(q_ptr + qk_offs, mask=qk_mask, other=0.0)
        K = tl.load(k_ptr + qk_offs, mask=qk_mask, other=0.0)
        V = tl.load(v_ptr + v_offs, mask=v_mask, other=0.0)
        dY = tl.load(dy_ptr + v_offs, mask=v_mask, other=0.0).to(Q.dtype)
        S_c = tl.load(starts_ptr + (pid * nc + c) * N * P + np_offs, mask=np_mask, other=0.0)
        decay, W, scale, w_start, to_end, decay_c = _chunk_scalars(
            cs_ptr, scale_ptr, gamma_ptr, seg_ptr, pid, b, t0, rows, Tp, L, R, HAS_RESET
        )
        w_vw = scale * to_end
        g_mm = g.to(Q.dtype)
        # Ordered so that each (L·R, ·) block dies soon after it is made (register pressure).
        scores = tl.dot(Q, tl.trans(K), input_precision=PRECISION)
        dV = tl.dot(tl.trans((scores * W).to(Q.dtype)), dY, input_precision=PRECISION)
        Kg = tl.dot(K, g_mm, input_precision=PRECISION)  # (L·R, P)
        dV += w_vw[:, None] * Kg
        tl.store(dv_ptr + v_offs, dV.to(dv_ptr.dtype.element_ty), mask=v_mask)
        d_w_vw = _sum(V.to(tl.float32) * Kg, 1)
        dYV = tl.dot(dY, tl.trans(V), input_precision=PRECISION)
        # Scalar gradients, per row (the wrapper sums the R rows of a token).
        dW = dYV * scores
        d_gamma = _sum(tl.where(rows[:, None] // R == rows[None, :] // R, dW, 0.0), 1)
        M = dW * decay  # ∂ of the e^{cs_i − cs_j}·scale_j entries
        M_col = _sum(M, 0)
        d_cs = _sum(M * scale[None, :], 1) - M_col * scale - d_w_vw * w_vw
        d_scale = M_col + d_w_vw * to_end
        d_scores = (dYV * W).to(Q.dtype)
        dQ = tl.dot(d_scores, K, input_precision=PRECISION)
        dQ += w_start[:, None] * tl.dot(dY, tl.trans(S_c), input_precision=PRECISION)
        tl.store(dq_ptr + qk_offs, dQ.to(dq_ptr.dtype.element_ty), mask=qk_mask)
        dK = tl.dot(tl.trans(d_scores), Q, input_precision=PRECISION)
        dK += w_vw[:, None] * tl.dot(V, tl.trans(g_mm), input_precision=PRECISION)
        tl.store(dk_ptr + qk_offs, dK.to(dk_ptr.dtype.element_ty), mask=qk_mask)
        QS = tl.dot(Q, S_c, input_precision=PRECISION)
        d_w_start = _sum(dY.to(tl.float32) * QS, 1)
        d_cs += d_w_start * w_start
        d_decay_c = _sum(_sum(g * S_c.to(tl.float32), 1), 0)
        d_cs_last = _sum(d_w_vw * w_vw, 0) + d_decay_c * decay_c
        d_cs += tl.where(rows == (L - 1) * R, d_cs_last, 0.0)
        row_offs = pid * Tp * R + t0 * R + rows
        tl.store(dcs_ptr + row_offs, d_cs, mask=row_in)
        tl.store(dscale_ptr + row_offs, d_scale, mask=row_in)
        tl.store(dgamma_ptr + row_offs, d_gamma, mask=row_in)
        g = decay_c * g + tl.dot(tl.trans((Q * w_start[:, None]).to(Q.dtype)), dY, input_precision=PRECISION)
    tl.store(ds0_ptr + pid * N * P + np_offs, g, mask=np_mask)


def _tuned(kernel):
    """The kernel with a small explicit autotune list on a GPU (warps × software-pipeline stages of the
    chunk loop; chosen once per shape and dtype, at the first call); under the interpreter, which has
    no timing to choose by, the kernel itself at 4 warps. Re-running a launch is harmless (every output
    is overwritten, nothing accumulates), so the tuner needs no reset between its trials."""
    if triton.knobs.runtime.interpret:
        return kernel
    configs = [triton.Config({}, num_warps=w, num_stages=s) for w in (4, 8) for s in (1, 2)]
    return triton.autotune(configs=configs, key=["L", "R", "N", "P", "HAS_RESET", "PRECISION"])(kernel)


scan_fwd = _tuned(scan_fwd_kernel)
scan_bwd = _tuned(scan_bwd_kernel)
