"""The Triton kernels behind `scan_triton.triton_chunked_scan` (imported on first use: needs triton).

Two passes each way, as the chunked scan splits its work. Per chunk c of L tokens and R ranks, flattened
to L·R rows i = (token, rank), with the per-token scalars prepared by the wrapper (cs chunk-local inclusive
cumsum of ΔA, scale, γ, seg the chunk-local count of resets; module docstring of scan.py for their meaning):

- a *state* kernel, one program per (batch row·head, block of P columns), walks the chunks in order
  (forward) or in reverse (backward), carrying only the (N, P-block) state or its gradient in fp32
  registers and doing one (N, L·R)·(L·R, P) product per chunk; it writes the state at every chunk start
  (forward) or the state's gradient at every chunk end (backward);
- a *chunk* kernel, one program per (batch row·head, chunk), then does the O(L²) work of all chunks at
  once, given those states: B·H·nc programs, so a long sequence with few rows still fills the GPU, and
  no program holds a carried state next to its (L·R, L·R) blocks;
- the *prologue* kernels (`triton_rotated_scan`, the mixer's training path) build the per-head q, k from
  the per-group normed q̂, k̂, the biases and the angles in one pass (and in the backward the gradients
  of all five in one pass over a group's heads), where PyTorch's elementwise ops would make several
  passes over (B, H, T, R, N) fp32 tensors; the math is at their section below;
- a *step* kernel (`triton_scan_step`, decode) does one token of the recurrence in one pass over the
  state (its section below).

The math:

    W[i, j]  = e^{cs_i − cs_j}·scale_j    for tok_i > tok_j in the same segment
             = γ_i                        for tok_i = tok_j (every rank pair of a token)
    Y        = (Q Kᵀ ⊙ W) V + w_start ⊙ (Q S_c)     w_start_i = e^{cs_i}·[no reset in the chunk up to i]
    S_{c+1}  = decay_c·S_c + Kᵀ (V ⊙ w_vw)          w_vw_j = scale_j·e^{cs_last − cs_j}·[j in the last seg.]
                                                     decay_c = e^{cs_last}·[no reset in the chunk]

The forward keeps S_c at every chunk start (in the matmul dtype, as the chunked scan keeps them) for the
backward, which recomputes Q Kᵀ, W and the products from Q, K, V and S_c, so no (L, L) block is ever
stored. Backward, with g the gradient of S_{c+1} (from the final state's gradient at the last chunk; the
state kernel stores it per chunk in fp32, a transient buffer twice the size of bf16 starts):

    dV = (Q Kᵀ ⊙ W)ᵀ dY + w_vw ⊙ (K g)        dQ = (dY Vᵀ ⊙ W) K + w_start ⊙ (dY S_cᵀ)
    dK = (dY Vᵀ ⊙ W)ᵀ Q + w_vw ⊙ (V gᵀ)       g ← decay_c·g + Qᵀ (w_start ⊙ dY)
    dW = dY Vᵀ ⊙ Q Kᵀ, and from W, w_start, w_vw, decay_c the per-row gradients of cs, scale and γ
    (summed over ranks by the wrapper; the chain from cs, scale, γ back to ΔA, Δ, λ is autograd's).

Block sizes are powers of two ≥ 16 (tl.dot's minimum) with masked loads and stores; all accumulation
is fp32, the matmul operands are in the inputs' dtype (fp32 at IEEE precision, or bf16/fp16). Triton
reads TRITON_INTERPRET when the kernels are decorated, i.e. when this module is first imported.
"""

from __future__ import annotations

import os

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
def _row_weights(
    cs_ptr, scale_ptr, seg_ptr, pid, b, t0, rows, Tp,
    L: tl.constexpr, R: tl.constexpr, HAS_RESET: tl.constexpr,
):  # fmt: skip
    """The chunk's per-row weights: (cs, scale, seg, w_start, to_end, decay_c), where to_end_j =
    e^{cs_last − cs_j}·[same segment as the last token] (so w_vw = scale ⊙ to_end) and seg is the
    chunk-local reset count (0 without resets)."""
    tok = rows // R
    row_in = rows < L * R
    off = pid * Tp + t0 + tok
    cs = tl.load(cs_ptr + off, mask=row_in, other=0.0)
    scale = tl.load(scale_ptr + off, mask=row_in, other=0.0)
    cs_last = tl.load(cs_ptr + pid * Tp + t0 + L - 1)
    if HAS_RESET:
        seg = tl.load(seg_ptr + b * Tp + t0 + tok, mask=row_in, other=0)
        seg_last = tl.load(seg_ptr + b * Tp + t0 + L - 1)
        from_start = (seg == 0).to(tl.float32)
        to_end = (seg == seg_last).to(tl.float32)
        open_chunk = (seg_last == 0).to(tl.float32)
    else:
        # cs·0 + 1, not tl.zeros_like (a triton @jit helper: see _sum)
        seg = tok * 0
        from_start = cs * 0.0 + 1.0
        to_end = cs * 0.0 + 1.0
        open_chunk = 1.0
    w_start = _exp_nonpos(cs) * from_start
    to_end = _exp_nonpos(cs_last - cs) * to_end
    decay_c = _exp_nonpos(cs_last) * open_chunk
    return cs, scale, seg, w_start, to_end, decay_c


@triton.jit
def _pair_weights(gamma_ptr, cs, scale, seg, pid, t0, rows, Tp, L: tl.constexpr, R: tl.constexpr):
    """The chunk's (L·R, L·R) weights (decay, W): decay is e^{cs_i − cs_j} on the strictly causal
    same-segment pairs (0 elsewhere), W = decay·scale_j plus γ_i on every rank pair of one token."""
    tok = rows // R
    row_in = rows < L * R
    gamma = tl.load(gamma_ptr + pid * Tp + t0 + tok, mask=row_in, other=0.0)
    pair_in = row_in[:, None] & row_in[None, :]
    strict = (tok[:, None] > tok[None, :]) & pair_in & (seg[:, None] == seg[None, :])
    same_tok = (tok[:, None] == tok[None, :]) & pair_in
    decay = tl.where(strict, _exp_nonpos(cs[:, None] - cs[None, :]), 0.0)
    W = decay * scale[None, :] + tl.where(same_tok, gamma[:, None], 0.0)
    return decay, W


@triton.jit
def state_fwd_kernel(
    k_ptr, v_ptr, cs_ptr, scale_ptr, seg_ptr, s0_ptr, starts_ptr, hT_ptr,
    T, Tp, nc, H,
    L: tl.constexpr, R: tl.constexpr, N: tl.constexpr, P: tl.constexpr,
    BLOCK_LR: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_PS: tl.constexpr,
    HAS_RESET: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """The state passing, one program per (batch row·head, block of P columns): S_c at every chunk start
    into `starts`, S_{c+1} = decay_c·S_c + Kᵀ (V ⊙ w_vw), the final state into hT (as h = Sᵀ)."""
    pid = tl.program_id(0).to(tl.int64)  # b·H + h; int64: offsets of long sequences pass 2³¹
    b = pid // H
    rows = tl.arange(0, BLOCK_LR)
    n = tl.arange(0, BLOCK_N)
    p = tl.program_id(1) * BLOCK_PS + tl.arange(0, BLOCK_PS)
    np_mask = (n[:, None] < N) & (p[None, :] < P)
    np_offs = n[:, None] * P + p[None, :]
    S = tl.load(s0_ptr + pid * N * P + np_offs, mask=np_mask, other=0.0)  # fp32 (N, BLOCK_PS)
    for c in range(nc):
        t0 = c * L
        k_offs, k_mask = _tile_offsets(pid * T * R * N, t0, rows, n, T, L, R, N)
        v_offs, v_mask = _tile_offsets(pid * T * R * P, t0, rows, p, T, L, R, P)
        K = tl.load(k_ptr + k_offs, mask=k_mask, other=0.0)
        V = tl.load(v_ptr + v_offs, mask=v_mask, other=0.0)
        tl.store(starts_ptr + (pid * nc + c) * N * P + np_offs, S.to(K.dtype), mask=np_mask)
        _, scale, _, _, to_end, decay_c = _row_weights(
            cs_ptr, scale_ptr, seg_ptr, pid, b, t0, rows, Tp, L, R, HAS_RESET
        )
        dS = tl.dot(tl.trans(K), (V * (scale * to_end)[:, None]).to(V.dtype), input_precision=PRECISION)
        S = decay_c * S + dS
    tl.store(hT_ptr + pid * N * P + p[None, :] * N + n[:, None], S, mask=np_mask)


@triton.jit
def chunk_fwd_kernel(
    q_ptr, k_ptr, v_ptr, cs_ptr, scale_ptr, gamma_ptr, seg_ptr, starts_ptr, y_ptr,
    T, Tp, nc, H,
    L: tl.constexpr, R: tl.constexpr, N: tl.constexpr, P: tl.constexpr,
    BLOCK_LR: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
    HAS_RESET: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """The outputs of one chunk, one program per (batch row·head, chunk), all chunks at once given
    their start states: Y = (Q Kᵀ ⊙ W) V + w_start ⊙ (Q S_c)."""
    prog = tl.program_id(0).to(tl.int64)  # (b·H + h)·nc + c: one axis, which has room for 2³¹ − 1
    pid = prog // nc
    c = prog % nc
    b = pid // H
    t0 = c * L
    rows = tl.arange(0, BLOCK_LR)
    n = tl.arange(0, BLOCK_N)
    p = tl.arange(0, BLOCK_P)
    np_mask = (n[:, None] < N) & (p[None, :] < P)
    qk_offs, qk_mask = _tile_offsets(pid * T * R * N, t0, rows, n, T, L, R, N)
    v_offs, v_mask = _tile_offsets(pid * T * R * P, t0, rows, p, T, L, R, P)
    Q = tl.load(q_ptr + qk_offs, mask=qk_mask, other=0.0)
    K = tl.load(k_ptr + qk_offs, mask=qk_mask, other=0.0)
    V = tl.load(v_ptr + v_offs, mask=v_mask, other=0.0)
    np_offs = (pid * nc + c) * N * P + n[:, None] * P + p[None, :]
    S_c = tl.load(starts_ptr + np_offs, mask=np_mask, other=0.0)
    cs, scale, seg, w_start, _, _ = _row_weights(
        cs_ptr, scale_ptr, seg_ptr, pid, b, t0, rows, Tp, L, R, HAS_RESET
    )
    _, W = _pair_weights(gamma_ptr, cs, scale, seg, pid, t0, rows, Tp, L, R)
    scores = tl.dot(Q, tl.trans(K), input_precision=PRECISION)
    y = tl.dot((scores * W).to(V.dtype), V, input_precision=PRECISION)
    y += w_start[:, None] * tl.dot(Q, S_c, input_precision=PRECISION)
    tl.store(y_ptr + v_offs, y.to(y_ptr.dtype.element_ty), mask=v_mask)


@triton.jit
def state_bwd_kernel(
    q_ptr, dy_ptr, cs_ptr, scale_ptr, seg_ptr, dhT_ptr, gends_ptr, ds0_ptr,
    T, Tp, nc, H,
    L: tl.constexpr, R: tl.constexpr, N: tl.constexpr, P: tl.constexpr,
    BLOCK_LR: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_PS: tl.constexpr,
    HAS_RESET: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """The state's gradient passed backwards, one program per (batch row·head, block of P columns):
    g, the gradient of S_{c+1}, into `gends` at every chunk c (fp32), then g ← decay_c·g + Qᵀ (w_start ⊙ dY);
    what is left at the start is the gradient of the starting state."""
    pid = tl.program_id(0).to(tl.int64)
    b = pid // H
    rows = tl.arange(0, BLOCK_LR)
    n = tl.arange(0, BLOCK_N)
    p = tl.program_id(1) * BLOCK_PS + tl.arange(0, BLOCK_PS)
    np_mask = (n[:, None] < N) & (p[None, :] < P)
    np_offs = n[:, None] * P + p[None, :]
    g = tl.load(dhT_ptr + pid * N * P + p[None, :] * N + n[:, None], mask=np_mask, other=0.0)
    for i in range(nc):
        c = nc - 1 - i
        t0 = c * L
        q_offs, q_mask = _tile_offsets(pid * T * R * N, t0, rows, n, T, L, R, N)
        dy_offs, dy_mask = _tile_offsets(pid * T * R * P, t0, rows, p, T, L, R, P)
        Q = tl.load(q_ptr + q_offs, mask=q_mask, other=0.0)
        dY = tl.load(dy_ptr + dy_offs, mask=dy_mask, other=0.0).to(Q.dtype)
        tl.store(gends_ptr + (pid * nc + c) * N * P + np_offs, g, mask=np_mask)
        _, _, _, w_start, _, decay_c = _row_weights(
            cs_ptr, scale_ptr, seg_ptr, pid, b, t0, rows, Tp, L, R, HAS_RESET
        )
        g = decay_c * g + tl.dot(tl.trans((Q * w_start[:, None]).to(Q.dtype)), dY, input_precision=PRECISION)
    tl.store(ds0_ptr + pid * N * P + np_offs, g, mask=np_mask)


@triton.jit
def chunk_bwd_kernel(
    q_ptr, k_ptr, v_ptr, cs_ptr, scale_ptr, gamma_ptr, seg_ptr, starts_ptr, gends_ptr, dy_ptr,
    dq_ptr, dk_ptr, dv_ptr, dcs_ptr, dscale_ptr, dgamma_ptr,
    T, Tp, nc, H,
    L: tl.constexpr, R: tl.constexpr, N: tl.constexpr, P: tl.constexpr,
    BLOCK_LR: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
    HAS_RESET: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """The gradients of one chunk, one program per (batch row·head, chunk), all chunks at once given the
    state at their start and the gradient g of the state at their end (module docstring).

    It stays one long body (over the 60 lines the rest of the package keeps to) on purpose: its tiles
    (Q, K, V, dY and the (L·R, L·R) weights built from them) are loaded once and held in registers while
    the gradients of all six inputs are formed from them. Split into several kernels, each would store
    and reload those tiles through global memory, which is the cost this kernel exists to avoid (the
    same backward as a sequence of PyTorch ops pays). The pieces that are shared with the other
    kernels are already @triton.jit helpers (`_tile_offsets`, `_row_weights`, inlined by the compiler);
    what remains is one pass over one chunk's tiles, read top to bottom."""
    prog = tl.program_id(0).to(tl.int64)  # (b·H + h)·nc + c: one axis, which has room for 2³¹ − 1
    pid = prog // nc
    c = prog % nc
    b = pid // H
    t0 = c * L
    rows = tl.arange(0, BLOCK_LR)
    row_in = rows < L * R
    n = tl.arange(0, BLOCK_N)
    p = tl.arange(0, BLOCK_P)
    np_mask = (n[:, None] < N) & (p[None, :] < P)
    np_offs = (pid * nc + c) * N * P + n[:, None] * P + p[None, :]
    qk_offs, qk_mask = _tile_offsets(pid * T * R * N, t0, rows, n, T, L, R, N)
    v_offs, v_mask = _tile_offsets(pid * T * R * P, t0, rows, p, T, L, R, P)
    Q = tl.load(q_ptr + qk_offs, mask=qk_mask, other=0.0)
    K = tl.load(k_ptr + qk_offs, mask=qk_mask, other=0.0)
    V = tl.load(v_ptr + v_offs, mask=v_mask, other=0.0)
    dY = tl.load(dy_ptr + v_offs, mask=v_mask, other=0.0).to(Q.dtype)
    cs, scale, seg, w_start, to_end, decay_c = _row_weights(
        cs_ptr, scale_ptr, seg_ptr, pid, b, t0, rows, Tp, L, R, HAS_RESET
    )
    w_vw = scale * to_end
    # Ordered so that each block dies soon after it is made (register pressure): first the terms of the
    # chunk's start state and of the end state's fp32 gradient, then the (L·R, L·R) blocks, made only
    # when needed, one output at a time (on sm_90 at 8 warps this halves the spill of the first order).
    S_c = tl.load(starts_ptr + np_offs, mask=np_mask, other=0.0)
    g = tl.load(gends_ptr + np_offs, mask=np_mask, other=0.0)
    d_decay_c = _sum(_sum(g * S_c.to(tl.float32), 1), 0)
    g_mm = g.to(Q.dtype)
    QS = tl.dot(Q, S_c, input_precision=PRECISION)
    d_w_start = _sum(dY.to(tl.float32) * QS, 1)
    Kg = tl.dot(K, g_mm, input_precision=PRECISION)  # (L·R, P)
    d_w_vw = _sum(V.to(tl.float32) * Kg, 1)
    decay, W = _pair_weights(gamma_ptr, cs, scale, seg, pid, t0, rows, Tp, L, R)
    scores = tl.dot(Q, tl.trans(K), input_precision=PRECISION)
    dV = tl.dot(tl.trans((scores * W).to(Q.dtype)), dY, input_precision=PRECISION) + w_vw[:, None] * Kg
    tl.store(dv_ptr + v_offs, dV.to(dv_ptr.dtype.element_ty), mask=v_mask)
    dYV = tl.dot(dY, tl.trans(V), input_precision=PRECISION)
    # Scalar gradients, per row (the wrapper sums the R rows of a token).
    dW = dYV * scores
    d_gamma = _sum(tl.where(rows[:, None] // R == rows[None, :] // R, dW, 0.0), 1)
    M = dW * decay  # ∂ of the e^{cs_i − cs_j}·scale_j entries
    M_col = _sum(M, 0)
    d_cs = _sum(M * scale[None, :], 1) - M_col * scale - d_w_vw * w_vw + d_w_start * w_start
    d_scale = M_col + d_w_vw * to_end
    d_scores = (dYV * W).to(Q.dtype)
    dK = tl.dot(tl.trans(d_scores), Q, input_precision=PRECISION)
    dK += w_vw[:, None] * tl.dot(V, tl.trans(g_mm), input_precision=PRECISION)
    tl.store(dk_ptr + qk_offs, dK.to(dk_ptr.dtype.element_ty), mask=qk_mask)
    dQ = tl.dot(d_scores, K, input_precision=PRECISION)
    dQ += w_start[:, None] * tl.dot(dY, tl.trans(S_c), input_precision=PRECISION)
    tl.store(dq_ptr + qk_offs, dQ.to(dq_ptr.dtype.element_ty), mask=qk_mask)
    d_cs_last = _sum(d_w_vw * w_vw, 0) + d_decay_c * decay_c
    d_cs += tl.where(rows == (L - 1) * R, d_cs_last, 0.0)
    row_offs = pid * Tp * R + t0 * R + rows
    tl.store(dcs_ptr + row_offs, d_cs, mask=row_in)
    tl.store(dscale_ptr + row_offs, d_scale, mask=row_in)
    tl.store(dgamma_ptr + row_offs, d_gamma, mask=row_in)


# ---- the prologue: per-head keys and queries from the per-group normed ones (rotation.py's math) ----
#
# q[b, h, t, r] = R(θ[b, h, t]) (q̂[b, g, t, r] + C_bias[h, r]) with g = h // (H / G), the same for k.
# Element n of a row rotates with its partner p(n): interleaved pairs (2i, 2i+1) for SISO, split
# halves (i, i + N/2) for MIMO; pair i turns by θ_i for i < S and not at all past the first S pairs.
# With c, s = cos θ_i, sin θ_i and σ = −1 on the first element of a pair, +1 on the second:
#     out_n = x_n·c + σ·x_p·s            (a' = a·c − b·s, b' = a·s + b·c)
#     dx_n  = g_n·c − σ·g_p·s            (the inverse rotation of the output gradient)
#     dθ_i  = −g_a·b' + g_b·a'           (at the pair's first element, summed over ranks, q and k)
# The partner is read by a second load at the partner's offsets: no shuffle within registers.


@triton.jit
def _pairs(n, N: tl.constexpr, S: tl.constexpr, HALVES: tl.constexpr):
    """For channels n: (partner p(n), pair index i(n), first element of its pair, rotating: i < S)."""
    if HALVES:
        first = n < N // 2
        partner = tl.where(first, n + N // 2, n - N // 2)
        i = tl.where(first, n, n - N // 2)
    else:
        first = n % 2 == 0
        partner = n ^ 1
        i = n // 2
    return partner, i, first, (i < S) & (n < N)


@triton.jit
def _biased(x_ptr, bias_ptr, row_offs, bias_offs, cols, ok, n_ok):
    """x + bias at the (tokens, channels) tile `cols` (the channels or their partners) of rows row_offs,
    the head's bias row at bias_offs; in fp32."""
    x = tl.load(x_ptr + row_offs[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    return x + tl.load(bias_ptr + bias_offs + cols, mask=n_ok, other=0.0).to(tl.float32)[None, :]


@triton.jit
def _turn(theta_ptr, bh, t, T, i, first, turns, S: tl.constexpr):
    """(c, σ·s) of the tile: cos and signed sin of each channel's pair angle (1, 0 past the first S)."""
    theta = tl.load(
        theta_ptr + (bh * T + t)[:, None] * S + i[None, :], mask=(t < T)[:, None] & turns[None, :], other=0.0
    )
    return tl.cos(theta), tl.where(first, -1.0, 1.0)[None, :] * tl.sin(theta)


@triton.jit
def _rotate_one(
    x_ptr, bias_ptr, out_ptr, src, dst, bias, n, partner, ok, n_ok, c, sn, HAS_THETA: tl.constexpr
):
    x = _biased(x_ptr, bias_ptr, src, bias, n, ok, n_ok)
    if HAS_THETA:
        x = x * c + _biased(x_ptr, bias_ptr, src, bias, partner, ok, n_ok) * sn
    tl.store(out_ptr + dst, x.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def rotate_fwd_kernel(
    qh_ptr, kh_ptr, qb_ptr, kb_ptr, theta_ptr, q_ptr, k_ptr,
    T, H, G,
    R: tl.constexpr, N: tl.constexpr, S: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_THETA: tl.constexpr, HALVES: tl.constexpr,
):  # fmt: skip
    """q, k (B, H, T, R, N) in q_ptr's dtype, one program per (batch row·head, block of tokens)."""
    pid = tl.program_id(0).to(tl.int64)  # b·H + h
    b, h = pid // H, pid % H
    g = h // (H // G)
    t = tl.program_id(1).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    n = tl.arange(0, BLOCK_N)
    n_ok = n < N
    partner, i, first, turns = _pairs(n, N, S, HALVES)
    ok = (t < T)[:, None] & n_ok[None, :]
    c = 1.0
    sn = 0.0
    if HAS_THETA:
        c, sn = _turn(theta_ptr, pid, t, T, i, first, turns, S)
    for r in tl.static_range(R):
        src = ((b * G + g) * T + t) * R * N + r * N
        dst = ((pid * T + t) * R + r)[:, None] * N + n[None, :]
        bias = (h * R + r) * N
        _rotate_one(qh_ptr, qb_ptr, q_ptr, src, dst, bias, n, partner, ok, n_ok, c, sn, HAS_THETA)
        _rotate_one(kh_ptr, kb_ptr, k_ptr, src, dst, bias, n, partner, ok, n_ok, c, sn, HAS_THETA)


@triton.jit
def _unrotate_one(
    x_ptr, bias_ptr, d_ptr, db_ptr, src, grad, bias, db_offs, n, partner, ok, n_ok, c, sn,
    HAS_THETA: tl.constexpr,
):  # fmt: skip
    """(dx (tokens, channels) fp32, its dθ contribution at the pairs' first elements), and the tile's
    bias gradient (dx summed over its tokens) stored at db_offs."""
    gx = tl.load(d_ptr + grad[:, None] + n[None, :], mask=ok, other=0.0).to(tl.float32)
    dx = gx
    d_theta = gx * 0.0
    if HAS_THETA:
        gp = tl.load(d_ptr + grad[:, None] + partner[None, :], mask=ok, other=0.0).to(tl.float32)
        dx = gx * c - gp * sn
        x = _biased(x_ptr, bias_ptr, src, bias, n, ok, n_ok)
        xp = _biased(x_ptr, bias_ptr, src, bias, partner, ok, n_ok)
        s = -sn  # at a first element: a = x, b = xp, g_a = gx, g_b = gp, and σ·s = −s
        d_theta = gp * (x * c - xp * s) - gx * (x * s + xp * c)
    tl.store(db_ptr + db_offs + n, _sum(dx, 0), mask=n_ok)
    return dx, d_theta


@triton.jit
def rotate_bwd_kernel(
    qh_ptr, kh_ptr, qb_ptr, kb_ptr, theta_ptr, dq_ptr, dk_ptr,
    dqh_ptr, dkh_ptr, dqb_ptr, dkb_ptr, dtheta_ptr,
    T, H, G, n_tblocks,
    R: tl.constexpr, N: tl.constexpr, S: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_THETA: tl.constexpr, HALVES: tl.constexpr,
):  # fmt: skip
    """The prologue's backward, one program per (batch row·group, block of tokens), over the group's
    heads: dq̂, dk̂ (B, G, T, R, N) fp32 summed over the heads; the biases' gradients summed over the
    block's tokens into (B, n_tblocks, H, R, N) fp32 (the wrapper sums those); dθ per rank into
    (R, B, H, T, S) fp32 (the wrapper sums the ranks)."""
    pid = tl.program_id(0).to(tl.int64)  # b·G + g
    b, g = pid // G, pid % G
    tb = tl.program_id(1).to(tl.int64)
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    n = tl.arange(0, BLOCK_N)
    n_ok = n < N
    partner, i, first, turns = _pairs(n, N, S, HALVES)
    ok = (t < T)[:, None] & n_ok[None, :]
    keep = (t < T)[:, None] & (first & turns)[None, :]
    B = tl.num_programs(0) // G
    heads = H // G
    for r in tl.static_range(R):
        src = (pid * T + t) * R * N + r * N
        acc_q = tl.where(ok, 0.0, 0.0)
        acc_k = tl.where(ok, 0.0, 0.0)
        for hh in range(heads):
            h = g * heads + hh
            bh = b * H + h
            grad = ((bh * T + t) * R + r) * N
            bias = (h * R + r) * N
            db_offs = ((b * n_tblocks + tb) * H + h) * R * N + r * N
            c = 1.0
            sn = 0.0
            if HAS_THETA:
                c, sn = _turn(theta_ptr, bh, t, T, i, first, turns, S)
            at = (src, grad, bias, db_offs, n, partner, ok, n_ok, c, sn)  # what q and k share
            dq, dth_q = _unrotate_one(qh_ptr, qb_ptr, dq_ptr, dqb_ptr, *at, HAS_THETA)
            dk, dth_k = _unrotate_one(kh_ptr, kb_ptr, dk_ptr, dkb_ptr, *at, HAS_THETA)
            acc_q += dq
            acc_k += dk
            if HAS_THETA:
                th_offs = ((r * B + b) * H + h) * T * S + t[:, None] * S + i[None, :]
                tl.store(dtheta_ptr + th_offs, dth_q + dth_k, mask=keep)
        hat = src[:, None] + n[None, :]
        tl.store(dqh_ptr + hat, acc_q, mask=ok)
        tl.store(dkh_ptr + hat, acc_k, mask=ok)


# ---- decode: one token of the recurrence (scan.scan_step), fused ----
#
#     h'  = α·h + β·Σ_r v_prev[r] k_prev[r]ᵀ + γ·Σ_r v[r] k[r]ᵀ      α = e^{ΔA}, β = (1 − λ)Δα, γ = λΔ
#     y_r = h' q_r                                                   (α, β = 0 on a reset row)
#
# PyTorch does this in about a dozen small kernels (casts, three einsums, the update); one program per
# (batch row·head, block of P rows of the state) does it in one pass over the state, in fp32 registers.


@triton.jit
def step_kernel(
    q_ptr, k_ptr, v_ptr, adt_ptr, dt_ptr, lam_ptr, h_ptr, kp_ptr, vp_ptr, reset_ptr, y_ptr, h_out_ptr,
    H,
    R: tl.constexpr, N: tl.constexpr, P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
    HAS_RESET: tl.constexpr,
):  # fmt: skip
    """h' and y for a (BLOCK_P, N) block of one (row, head)'s state. Layouts (contiguous): q, k (B, H,
    R, N); v, y (B, H, R, P); h, h' (B, H, P, N); k_prev (B, R, H, N); v_prev (B, R, H, P); the scalars
    (B, H); reset (B,) int32. Computes in fp32; h' and y are stored in their buffers' dtypes."""
    pid = tl.program_id(0).to(tl.int64)  # b·H + head
    b, head = pid // H, pid % H
    p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_ok, n_ok = p < P, n < N
    ok = p_ok[:, None] & n_ok[None, :]
    adt = tl.load(adt_ptr + pid).to(tl.float32)
    dt = tl.load(dt_ptr + pid).to(tl.float32)
    lam = tl.load(lam_ptr + pid).to(tl.float32)
    alpha = tl.exp(adt)
    beta = (1.0 - lam) * dt * alpha
    if HAS_RESET:
        keep = 1.0 - (tl.load(reset_ptr + b) != 0).to(tl.float32)
        alpha, beta = alpha * keep, beta * keep
    state = pid * P * N + p[:, None] * N + n[None, :]
    h = alpha * tl.load(h_ptr + state, mask=ok, other=0.0).to(tl.float32)
    for r in tl.static_range(R):
        cur_k = tl.load(k_ptr + (pid * R + r) * N + n, mask=n_ok, other=0.0).to(tl.float32)
        cur_v = tl.load(v_ptr + (pid * R + r) * P + p, mask=p_ok, other=0.0).to(tl.float32)
        prev = (b * R + r) * H + head
        prev_k = tl.load(kp_ptr + prev * N + n, mask=n_ok, other=0.0).to(tl.float32)
        prev_v = tl.load(vp_ptr + prev * P + p, mask=p_ok, other=0.0).to(tl.float32)
        h += (beta * prev_v)[:, None] * prev_k[None, :] + (lam * dt * cur_v)[:, None] * cur_k[None, :]
    tl.store(h_out_ptr + state, h.to(h_out_ptr.dtype.element_ty), mask=ok)
    for r in tl.static_range(R):
        q = tl.load(q_ptr + (pid * R + r) * N + n, mask=n_ok, other=0.0).to(tl.float32)
        y = _sum(h * q[None, :], 1)
        tl.store(y_ptr + (pid * R + r) * P + p, y.to(y_ptr.dtype.element_ty), mask=p_ok)


def _interpreted() -> bool:
    """Whether triton builds these kernels for its interpreter: triton.knobs where it has them (triton
    ≥ 3.4), else TRITON_INTERPRET=1 as older versions read it."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


INTERPRETED = _interpreted()  # read once, as the kernels above were decorated: what they are built for


def _tuned(kernel, stages: tuple[int, ...]):
    """The kernel with a small explicit autotune list on a GPU (warps × software-pipeline stages of a
    chunk loop; chosen once per shape and dtype, at the first call); under the interpreter, which has
    no timing to choose by, the kernel itself at 4 warps. Re-running a launch is harmless (every output
    is overwritten, nothing accumulates), so the tuner needs no reset between its trials."""
    if INTERPRETED:
        return kernel
    configs = [triton.Config({}, num_warps=w, num_stages=s) for w in (4, 8) for s in stages]
    return triton.autotune(configs=configs, key=["L", "R", "N", "P", "HAS_RESET", "PRECISION"])(kernel)


# The state kernels loop over the chunks (pipelining their loads pays); the chunk kernels have no loop.
state_fwd = _tuned(state_fwd_kernel, stages=(1, 2))
chunk_fwd = _tuned(chunk_fwd_kernel, stages=(1,))
state_bwd = _tuned(state_bwd_kernel, stages=(1, 2))
chunk_bwd = _tuned(chunk_bwd_kernel, stages=(1,))
# The prologue's kernels are elementwise passes (and a loop over a group's heads): no autotuning.
rotate_fwd = rotate_fwd_kernel
rotate_bwd = rotate_bwd_kernel
step = step_kernel  # one light pass per token: no autotuning either
