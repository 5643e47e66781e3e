"""The Mamba-3 recurrence three ways: sequential reference, chunked parallel scan, single decode step.

All three compute, per batch row and head, with h_{-1} = 0 unless a state is given (docs/model.md §2.3, §3):

    α_t = exp(ΔA_t)                   (`adt` = Δ_t·A_t ≤ 0)
    β_t = (1 − λ_t) Δ_t α_t            (the trapezoid's "previous token" weight)
    γ_t = λ_t Δ_t                      (the "current token" weight)
    h_t = α_t h_{t−1} + β_t Σ_r v_{t−1,r} k_{t−1,r}ᵀ + γ_t Σ_r v_{t,r} k_{t,r}ᵀ        h_t ∈ R^{P×N}
    y_{t,r} = h_t q_{t,r}

The inputs are already prepared by the mixer: q (= C̄) and k (= B̄) are biased and rotated, v is the
value (x, or x ⊙ mimo_x for MIMO), λ is σ(a^λ) (or 1 for the exponential-Euler ablation). The D·x skip,
gate and output projection are the mixer's. SISO is R = 1.

Reset: `reset_BT[b, t]` true means token t starts a fresh state (α_t = β_t = 0), used for packed
documents. Shapes: B batch, T time, R MIMO rank, H heads, P head dim, N state size, L chunk length.
Layout is head-major, (B, H, T, R, ·), so that the chunked scan's chunk view needs no copy; the decode
state uses the official cache layout (k_prev (B, R, H, N), v_prev (B, R, H, P), h (B, H, P, N)).

Dtypes: decay exponents, cumulative sums and states are kept in at least fp32 (float64 when the inputs
are float64); the chunked scan's matmuls run in the autocast dtype, else in the inputs' dtype promoted
to the state dtype. Inside a chunk the carried state is (N, P), the transpose of h.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor


def _state_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast computes matmuls in on this device type, or None when autocast is off."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


# Exponents below this give exactly 0 in the chunked scan (e^-40 ≈ 4e-18: under float64's resolution of
# the O(1) sums these weights enter). exp on CPU takes a ~15x slower path for fp32 inputs below −87 and
# ~2x for −inf, and tiny products become denormals (slow on many CPUs); zeros are fast everywhere.
EXP_FLOOR = -40.0
_EXP_FLOOR_VALUE = math.exp(EXP_FLOOR) * 1.5  # above e^FLOOR after rounding in any dtype, still ~0


def _exp_nonpos(x: Tensor, inplace: bool = False) -> Tensor:
    """e^x for x ≤ 0 (larger x are clamped to 0), exactly 0 for x < EXP_FLOOR; `inplace` overwrites x
    (outside autograd only)."""
    if inplace:
        return torch.nn.functional.threshold_(x.clamp_(EXP_FLOOR, 0.0).exp_(), _EXP_FLOOR_VALUE, 0.0)
    return torch.nn.functional.threshold(x.clamp(EXP_FLOOR, 0.0).exp(), _EXP_FLOOR_VALUE, 0.0)


def scan_step(
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
    """One token of the recurrence (decode, docs/model.md §4 step 3-4). Returns (y_BHRP, new h_BHPN).

    O(1) in the context length; h is returned as a new tensor (the caller stores it).
    """
    sd = _state_dtype(h_BHPN.dtype)
    adt, dt, lam = adt_BH.to(sd), dt_BH.to(sd), lam_BH.to(sd)
    alpha = torch.exp(adt)
    beta = (1 - lam) * dt * alpha
    if reset_B is not None:
        keep = (~reset_B).to(sd)[:, None]
        alpha, beta = alpha * keep, beta * keep
    prev_BHPN = torch.einsum("brhp,brhn->bhpn", v_prev_BRHP.to(sd), k_prev_BRHN.to(sd))
    cur_BHPN = torch.einsum("bhrp,bhrn->bhpn", v_BHRP.to(sd), k_BHRN.to(sd))
    h = alpha[..., None, None] * h_BHPN.to(sd) + beta[..., None, None] * prev_BHPN
    h = h + (lam * dt)[..., None, None] * cur_BHPN
    y_BHRP = torch.einsum("bhpn,bhrn->bhrp", h, q_BHRN.to(sd))
    return y_BHRP, h


class _DecayWeights(torch.autograd.Function):
    """The intra-chunk weights W[t, s] = e^{cs_t − cs_s}·mask[t, s]·scale_s − [s = t]·bn_t, cast to
    `out_dtype` (the autocast dtype under autocast: they then scale bf16 scores, as in flash-style
    kernels). The exponent is clamped to ≤ 0 before exp (no e^{positive} is ever formed; where it was
    positive, s > t, the mask zeroes it) and to EXP_FLOOR from below. `mask` is None for the plain
    causal (lower-triangular) mask.

    Written as a Function because its backward is one product, one matrix-vector product and one
    column sum: with M = gW ⊙ e^{…}, ∂scale_s = Σ_t M[t, s] and ∂cs_t = Σ_s M[t, s]·scale_s − scale_t·∂scale_t
    (the gradient of cs_t − cs_s from both sides), where autograd's chain through sub / mask / exp / mul /
    diagonal / cast makes ~8 passes over the (L, L) blocks.
    """

    @staticmethod
    def forward(ctx, cs, scale, bn, mask, out_dtype):
        decay = _exp_nonpos(cs[..., :, None] - cs[..., None, :], inplace=True)
        decay = decay.tril_() if mask is None else decay.mul_(mask)
        W = torch.mul(
            decay, scale[..., None, :], out=torch.empty(decay.shape, dtype=out_dtype, device=cs.device)
        )
        W.diagonal(dim1=-2, dim2=-1).copy_(scale - bn)  # γ_t = scale_t − bn_t (the decay is 1 there)
        ctx.save_for_backward(decay, scale)
        return W

    @staticmethod
    def backward(ctx, gW):
        decay, scale = ctx.saved_tensors
        M = gW * decay  # in the state dtype (type promotion)
        d_scale = M.sum(-2)
        d_cs = torch.einsum("...ts,...s->...t", M, scale) - scale * d_scale
        d_bn = -gW.diagonal(dim1=-2, dim2=-1).to(scale.dtype)
        return d_cs, d_scale, d_bn, None, None


def eager_or_traced(function: type[torch.autograd.Function], plain: Callable) -> Callable:
    """`function.apply` in eager mode, `plain` (the same math in plain out-of-place autograd ops) while
    torch.compile traces. The custom Functions save memory and passes in eager; under compile the
    compiler fuses and chooses what to keep itself, and torch 2.11 compiles a Function whose forward
    works in place to wrong gradients (right loss; found on the H200, benchmarks/RESULTS.md GPU section)."""
    return plain if torch.compiler.is_compiling() else function.apply


def _decay_weights_autograd(cs: Tensor, scale: Tensor, bn: Tensor, mask: Tensor | None, out_dtype) -> Tensor:
    """`_DecayWeights` in plain, out-of-place autograd ops: the form torch.compile traces."""
    L = cs.shape[-1]
    if mask is None:
        mask = torch.ones(L, L, dtype=torch.bool, device=cs.device).tril()
    decay = torch.where(mask, _exp_nonpos(cs[..., :, None] - cs[..., None, :]), 0.0)
    return (decay * scale[..., None, :] - torch.diag_embed(bn)).to(out_dtype)


def _carry(
    decay_BHc: Tensor, dS_BHcNP: Tensor, S0_BHNP: Tensor, out_dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """The carry between chunks: starts[c] = S before chunk c, S ← decay_c·S + dS_c from S = S0, in the
    state dtype of S0 (fp32 or wider) whatever the dtype of dS. Returns (starts in `out_dtype`, final S).
    Each step writes into one preallocated output (autograd would stack per-chunk tensors)."""
    starts = torch.empty(dS_BHcNP.shape, dtype=out_dtype, device=dS_BHcNP.device)
    S = S0_BHNP
    for c in range(dS_BHcNP.shape[2]):
        starts[:, :, c] = S
        S = torch.addcmul(dS_BHcNP[:, :, c], decay_BHc[:, :, c, None, None], S)
    return starts, S


def _carry_backward(
    decay_BHc: Tensor, starts: Tensor, g_starts: Tensor, g_hT: Tensor, dS_dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    """The carry's backward, the same loop reversed. With g_c the gradient of S after chunk c:
    ∂dS_c = g_c, ∂decay_c = ⟨g_c, starts[c]⟩ (taken while g_c is in cache), g_(c−1) = decay_c·g_c +
    ∂starts[c]. Returns (∂decay, ∂dS in `dS_dtype`, ∂S0)."""
    d_dS = torch.empty(starts.shape, dtype=dS_dtype, device=starts.device)
    d_decay = torch.empty_like(decay_BHc)
    g = g_hT.to(decay_BHc.dtype)
    for c in range(starts.shape[2] - 1, -1, -1):
        d_dS[:, :, c] = g
        d_decay[:, :, c] = (g * starts[:, :, c]).sum((-2, -1))
        g = torch.addcmul(g_starts[:, :, c], decay_BHc[:, :, c, None, None], g)
    return d_decay, d_dS, g


def _carry_unrolled(
    decay_BHc: Tensor, dS_BHcNP: Tensor, S0_BHNP: Tensor, out_dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """`_carry` in plain autograd ops (used under torch.compile, where the compiler fuses the loop, and
    loops over slices of one buffer compile badly)."""
    starts = []
    S = S0_BHNP
    # unbind, not dS[:, :, c]: each indexing op's backward materialises a zero tensor of the full dS
    # and adds it up, O(nc²) memory traffic.
    for decay_BH, dS_BHNP in zip(decay_BHc.unbind(2), dS_BHcNP.unbind(2)):
        starts.append(S)
        S = decay_BH[:, :, None, None] * S + dS_BHNP
    return torch.stack(starts, dim=2).to(out_dtype), S


def _weigh(x: Tensor, W_LL: Tensor, R: int) -> Tensor:
    """(…, L·R, L·R) blocks ⊙ the (…, L, L) weights, repeated over the R×R rank pairs."""
    if R == 1:
        return x * W_LL
    *lead, LR, _ = x.shape
    L = LR // R
    return (x.view(*lead, L, R, L, R) * W_LL[..., :, None, :, None]).view(x.shape)


def _rows(x: Tensor, w_L: Tensor, R: int) -> Tensor:
    """(…, L·R, D) rows ⊙ a per-token weight (…, L), repeated over the R ranks, in x's dtype."""
    *lead, LR, D = x.shape
    return (x.view(*lead, LR // R, R, D) * w_L[..., None, None].to(x.dtype)).view(x.shape)


def _addmm_(out: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """out += a @ b over any leading batch dims, accumulated by the matmul itself (no separate add)."""
    out.view(-1, *out.shape[-2:]).baddbmm_(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]))
    return out


def _chunk_core_autograd(q_c, k_c, v_c, W, w_vw, chunk_decay, S0, w_start):
    """The chunked scan's matmul core in plain autograd ops: the reference for `_ChunkCore` and the form
    torch.compile traces. Shapes, per chunk c of L tokens and R ranks (flattened to L·R rows):
    q_c, k_c (B, H, nc, L·R, N), v_c (B, H, nc, L·R, P) and W (B, H, nc, L, L) in the matmul dtype;
    w_vw (the weight of token s in its chunk's state increment), w_start (of the carried state in
    token t's output), both (B, H, nc, L); chunk_decay (B, H, nc); S0 (B, H, N, P) in the state dtype.
    Returns (y (B, H, nc, L·R, P) in the matmul dtype, final state (B, H, N, P)):
        y = (q kᵀ ⊙ W) v + w_start ⊙ q·starts,   starts = carry(chunk_decay, kᵀ (v ⊙ w_vw), S0).
    """
    R = q_c.shape[-2] // W.shape[-1]
    y = _weigh(q_c @ k_c.mT, W, R) @ v_c
    dS = k_c.mT @ _rows(v_c, w_vw, R)
    starts, h_T = _carry_unrolled(chunk_decay, dS, S0, q_c.dtype)
    return y + _rows(q_c @ starts, w_start, R), h_T


class _ChunkCore(torch.autograd.Function):
    """`_chunk_core_autograd` with a hand-written backward: each gradient that two matmuls feed (q, k,
    v) is accumulated by the second matmul into the first's output (baddbmm), where autograd would add
    two full-size tensors, one often in transposed layout; the masked products (q kᵀ ⊙ W) and v ⊙ w_vw
    are recomputed instead of stored. Runs with autocast off: the caller casts to the matmul dtype.
    """

    @staticmethod
    def forward(ctx, q_c, k_c, v_c, W, w_vw, chunk_decay, S0, w_start):
        R = q_c.shape[-2] // W.shape[-1]
        with torch.autocast(q_c.device.type, enabled=False):
            scores = q_c @ k_c.mT
            y = _weigh(scores, W, R) @ v_c
            dS = k_c.mT @ _rows(v_c, w_vw, R)
            starts, h_T = _carry(chunk_decay, dS, S0, q_c.dtype)
            qS = q_c @ starts
            lead, LR, P = qS.shape[:-2], qS.shape[-2], qS.shape[-1]
            w = w_start[..., None, None].to(y.dtype)
            y.view(*lead, LR // R, R, P).addcmul_(qS.view(*lead, LR // R, R, P), w)
        ctx.save_for_backward(q_c, k_c, v_c, W, w_vw, chunk_decay, w_start, scores, starts, qS)
        return y, h_T

    @staticmethod
    def backward(ctx, dy, dh_T):
        q_c, k_c, v_c, W, w_vw, chunk_decay, w_start, scores, starts, qS = ctx.saved_tensors
        R = q_c.shape[-2] // W.shape[-1]
        with torch.autocast(q_c.device.type, enabled=False):
            dy = dy.to(q_c.dtype)
            # y += w_start ⊙ q·starts
            lead, LR, P = dy.shape[:-2], dy.shape[-2], dy.shape[-1]
            d_w_start = (dy * qS).view(*lead, LR // R, R * P).sum(-1, dtype=w_start.dtype)
            d_qS = _rows(dy, w_start, R)
            dq = d_qS @ starts.mT
            d_chunk_decay, d_dS, dS0 = _carry_backward(chunk_decay, starts, q_c.mT @ d_qS, dh_T, q_c.dtype)
            # dS = kᵀ (v ⊙ w_vw)
            dk = _rows(v_c, w_vw, R) @ d_dS.mT
            d_vw = k_c @ d_dS
            dv = _rows(d_vw, w_vw, R)
            d_w_vw = (d_vw * v_c).view(*lead, LR // R, R * P).sum(-1, dtype=w_vw.dtype)
            # y = (q kᵀ ⊙ W) v
            _addmm_(dv, _weigh(scores, W, R).mT, dy)
            d_sw = dy @ v_c.mT
            d_scores = _weigh(d_sw, W, R)
            dW = d_sw.mul_(scores)
            if R > 1:
                L = LR // R
                dW = dW.view(*lead, L, R, L, R).sum((-3, -1))
            _addmm_(dq, d_scores, k_c)
            _addmm_(dk, d_scores.mT, q_c)
        return dq, dk, dv, dW, d_w_vw, d_chunk_decay, dS0, d_w_start


def sequential_scan(
    q_BHTRN: Tensor,
    k_BHTRN: Tensor,
    v_BHTRP: Tensor,
    adt_BHT: Tensor,
    dt_BHT: Tensor,
    lam_BHT: Tensor,
    *,
    h0_BHPN: Tensor | None = None,
    k_prev_BRHN: Tensor | None = None,
    v_prev_BRHP: Tensor | None = None,
    reset_BT: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The executable definition: a loop over time of the equations in the module docstring.

    Returns (y_BHTRP in the state dtype, final state h_BHPN). `h0`, `k_prev`, `v_prev` are the decode
    state before token 0 (zeros when None). Slow (T Python iterations): tests and benchmarks only.
    """
    Bsz, H, T, R, N = q_BHTRN.shape
    P = v_BHTRP.shape[-1]
    sd = _state_dtype(adt_BHT.dtype)
    dev = q_BHTRN.device
    h = torch.zeros(Bsz, H, P, N, dtype=sd, device=dev) if h0_BHPN is None else h0_BHPN.to(sd)
    if k_prev_BRHN is None:
        k_prev = torch.zeros(Bsz, H, R, N, dtype=sd, device=dev)
        v_prev = torch.zeros(Bsz, H, R, P, dtype=sd, device=dev)
    else:
        assert v_prev_BRHP is not None
        k_prev, v_prev = k_prev_BRHN.transpose(1, 2).to(sd), v_prev_BRHP.transpose(1, 2).to(sd)
    adt, dt, lam = adt_BHT.to(sd), dt_BHT.to(sd), lam_BHT.to(sd)
    ys = []
    for t in range(T):
        alpha_BH = torch.exp(adt[:, :, t])
        beta_BH = (1 - lam[:, :, t]) * dt[:, :, t] * alpha_BH
        gamma_BH = lam[:, :, t] * dt[:, :, t]
        if reset_BT is not None:
            keep = (~reset_BT[:, t]).to(sd)[:, None]
            alpha_BH, beta_BH = alpha_BH * keep, beta_BH * keep
        k_t, v_t, q_t = k_BHTRN[:, :, t].to(sd), v_BHTRP[:, :, t].to(sd), q_BHTRN[:, :, t].to(sd)
        h = (
            alpha_BH[..., None, None] * h
            + beta_BH[..., None, None] * torch.einsum("bhrp,bhrn->bhpn", v_prev, k_prev)
            + gamma_BH[..., None, None] * torch.einsum("bhrp,bhrn->bhpn", v_t, k_t)
        )
        ys.append(torch.einsum("bhpn,bhrn->bhrp", h, q_t))
        k_prev, v_prev = k_t, v_t
    y = torch.stack(ys, dim=2) if ys else q_BHTRN.new_zeros(Bsz, H, 0, R, P, dtype=sd)
    return y, h


def matmul_dtype(
    device_type: str, q_dtype: torch.dtype, v_dtype: torch.dtype, sd: torch.dtype
) -> torch.dtype:
    """The chunked form's matmul dtype: autocast's, else the inputs' promoted with the state dtype sd
    (at least fp32)."""
    return autocast_dtype(device_type) or torch.promote_types(torch.promote_types(q_dtype, v_dtype), sd)


def token_weights(
    dt_BHT: Tensor, lam_BHT: Tensor, reset_BT: Tensor | None, sd: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    """The chunked form's per-token weights in the state dtype sd: (γ = λΔ; β/α = (1 − λ)Δ, 0 on a
    token that starts a fresh state; boa_next, the next token's β/α, 0 past the end). A weight within
    a chunk is scale_s = γ_s + boa_next_s (the `chunked_scan` docstring)."""
    lam, dt = lam_BHT.to(sd), dt_BHT.to(sd)
    gamma = lam * dt
    boa = (1 - lam) * dt
    if reset_BT is not None:
        boa = boa * (~reset_BT).to(sd)[:, None, :]
    return gamma, boa, torch.nn.functional.pad(boa[:, :, 1:], (0, 1))


def chunk_segments(reset_BT: Tensor, nc: int, L: int) -> Tensor:
    """(B, nc, L) int32: the number of resets in the chunk up to and including each token (tokens past
    the end, zero-padded, start none)."""
    rs = torch.nn.functional.pad(reset_BT, (0, nc * L - reset_BT.shape[1])).view(-1, nc, L)
    return torch.cumsum(rs.to(torch.int32), dim=-1, dtype=torch.int32)


def start_state(
    h0_BHPN: Tensor | None,
    k_prev_BRHN: Tensor | None,
    v_prev_BRHP: Tensor | None,
    boa_BHT: Tensor,
    N: int,
    P: int,
) -> Tensor:
    """The carried matrix before token 0, (B, H, N, P) in boa's dtype: h0ᵀ (zeros when None), plus on a
    resume the first token's β term without its α (docs/model.md §2.4), which `boa_BHT` (from
    `token_weights`) carries."""
    Bsz, H = boa_BHT.shape[:2]
    sd = boa_BHT.dtype
    S = torch.zeros(Bsz, H, N, P, dtype=sd, device=boa_BHT.device) if h0_BHPN is None else h0_BHPN.to(sd).mT
    if k_prev_BRHN is not None:
        assert v_prev_BRHP is not None
        prev_BHNP = torch.einsum("brhp,brhn->bhnp", v_prev_BRHP.to(sd), k_prev_BRHN.to(sd))
        S = S + boa_BHT[:, :, 0, None, None] * prev_BHNP
    return S


def chunked_scan(
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
    """Chunked parallel form of the recurrence (docs/model.md §2.4, §3); same contract as `sequential_scan`,
    except that under autocast y is returned in the autocast dtype (the state h_T stays ≥ fp32).

    Any T (the last chunk is zero-padded: padded tokens have ΔA = 0 and zero weights, so they change
    neither the outputs nor the final state). Cost per token: O(L·R²·(N+P)) for the intra-chunk
    quadratic form plus O(R·P·N) for state passing; memory O(T·L) for the masks, never (T, T).

    Algorithm. Within a chunk, with cs_t = Σ_{r≤t} ΔA_r (inclusive, chunk-local):
      y_t = Σ_{s≤t} e^{cs_t − cs_s} w_{t,s} (q_t·k_s) v_s + e^{cs_t} S q_t,
      w_{t,t} = γ_t,  w_{t,s<t} = scale_s = γ_s + (1 − λ_{s+1}) Δ_{s+1},
    where S is the carried matrix at the chunk start. Folding the next token's β term (without its α)
    into scale_s makes the carry S = h_end + (1 − λ_next) Δ_next v_end k_endᵀ, which a single
    multiply-add per chunk propagates: S ← e^{cs_last} S + Σ_s e^{cs_last − cs_s} scale_s v_s k_sᵀ.
    At the sequence end "next" is past the end (weight 0), so the returned state is the true h_T.
    Resets cut the decay mask between segments (no (−inf) log-decay ever enters a subtraction).
    Under autocast the (L, L) weights are cast to the autocast dtype before they scale the scores, as
    flash-style kernels do; exponents, cumulative sums and the carried state stay fp32.
    """
    Bsz, H, T, R, N = q_BHTRN.shape
    P = v_BHTRP.shape[-1]
    init = {"h0_BHPN": h0_BHPN, "k_prev_BRHN": k_prev_BRHN, "v_prev_BRHP": v_prev_BRHP}
    if T == 0:  # nothing to scan: the state is returned unchanged
        return sequential_scan(q_BHTRN, k_BHTRN, v_BHTRP, adt_BHT, dt_BHT, lam_BHT, reset_BT=reset_BT, **init)
    L = max(1, min(chunk_size, T))
    nc = -(-T // L)
    sd = _state_dtype(adt_BHT.dtype)
    dev = q_BHTRN.device
    gamma, boa, boa_next = token_weights(dt_BHT, lam_BHT, reset_BT, sd)
    cs_BHcL = torch.cumsum(split_chunks(adt_BHT.to(sd), nc, L), dim=-1)
    scale_BHcL = split_chunks(gamma + boa_next, nc, L)
    boa_next_BHcL = split_chunks(boa_next, nc, L)
    q_c = split_chunks(q_BHTRN, nc, L, R, N).reshape(Bsz, H, nc, L * R, N)
    k_c = split_chunks(k_BHTRN, nc, L, R, N).reshape(Bsz, H, nc, L * R, N)
    v_c = split_chunks(v_BHTRP, nc, L, R, P).reshape(Bsz, H, nc, L * R, P)
    segments = None if reset_BT is None else segment_masks(reset_BT, nc, L)
    mm_dtype = matmul_dtype(dev.type, q_BHTRN.dtype, v_BHTRP.dtype, sd)
    decay_weights = eager_or_traced(_DecayWeights, _decay_weights_autograd)
    mask = None if segments is None else segments[0]  # None: causal only (lower-triangular)
    W_BHcLL = decay_weights(cs_BHcL, scale_BHcL, boa_next_BHcL, mask, mm_dtype)
    to_end_BHcL, chunk_decay_BHc, from_start = carry_decays(cs_BHcL, segments)
    S = start_state(h0_BHPN, k_prev_BRHN, v_prev_BRHP, boa, N, P)
    core = eager_or_traced(_ChunkCore, _chunk_core_autograd)
    q_c, k_c, v_c = (x.to(mm_dtype) for x in (q_c, k_c, v_c))
    # Under autocast y stays in the autocast dtype (the mixer's gate and out_proj would cast it there).
    y, h_T = core(q_c, k_c, v_c, W_BHcLL, scale_BHcL * to_end_BHcL, chunk_decay_BHc, S, from_start)
    return y.view(Bsz, H, nc * L, R, P)[:, :, :T], h_T.mT.contiguous()


def split_chunks(x: Tensor, nc: int, L: int, *inner: int) -> Tensor:
    """(B, H, T, *inner) -> (B, H, nc, L, *inner), the last chunk zero-padded past T (a free view when
    T = nc·L and x is contiguous)."""
    pad = nc * L - x.shape[2]
    if pad:
        x = torch.nn.functional.pad(x, (0, 0) * len(inner) + (0, pad))
    return x.reshape(*x.shape[:2], nc, L, *inner)


def segment_masks(reset_BT: Tensor, nc: int, L: int) -> tuple[Tensor, Tensor, Tensor]:
    """The masks of a scan with resets, from seg_t (the number of resets in the chunk up to t):
    (mask (B, 1, nc, L, L): s ≤ t in the same segment; from_start (B, 1, nc, L): no reset between the
    chunk start and t, inclusive; to_end (B, 1, nc, L): no reset in (s, chunk end])."""
    seg_B1cL = chunk_segments(reset_BT, nc, L)[:, None]
    causal = torch.ones(L, L, dtype=torch.bool, device=reset_BT.device).tril()
    mask = causal & (seg_B1cL[..., :, None] == seg_B1cL[..., None, :])
    return mask, seg_B1cL == 0, seg_B1cL == seg_B1cL[..., -1:]


def carry_decays(
    cs_BHcL: Tensor, segments: tuple[Tensor, Tensor, Tensor] | None
) -> tuple[Tensor, Tensor, Tensor]:
    """The decays of state passing, from the chunk-local cumulative log-decay cs: (to_end (B, H, nc, L):
    e^{cs_last − cs_s}, each token's weight in its chunk's contribution dS_c = Σ_s e^{cs_last − cs_s}
    scale_s v_s k_sᵀ; chunk_decay (B, H, nc): e^{cs_last}, the carry's decay over a chunk; from_start
    (B, H, nc, L): e^{cs_t}, the carry's decay up to t). With resets (`segment_masks`), a decay across a
    reset is 0. dS_c is kept transposed, (N, P): Kᵀ·V writes it and q·S reads it without a transpose,
    and the per-token weight goes on v (P wide), not on k (N wide)."""
    to_end_BHcL = _exp_nonpos(cs_BHcL[..., -1:] - cs_BHcL)
    chunk_decay_BHc = _exp_nonpos(cs_BHcL[..., -1])
    from_start = _exp_nonpos(cs_BHcL)
    if segments is not None:
        _, from_start_B1cL, to_end_B1cL = segments
        to_end_BHcL = to_end_BHcL * to_end_B1cL
        chunk_decay_BHc = chunk_decay_BHc * from_start_B1cL[..., -1]
        from_start = from_start * from_start_B1cL
    return to_end_BHcL, chunk_decay_BHc, from_start
