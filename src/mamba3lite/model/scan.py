"""The Mamba-3 recurrence three ways: sequential reference, chunked parallel scan, single decode step.

All three compute, per batch row and head, with h_{-1} = 0 unless a state is given (MAMBA3.md §2.3, §3):

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
are float64); the matmuls run in the inputs' dtype or the autocast dtype.
"""

from __future__ import annotations

import math

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


def _mm(a: Tensor, b: Tensor) -> Tensor:
    """Matmul; under autocast the dtypes are autocast's business, otherwise promote to a common dtype."""
    if a.dtype != b.dtype and autocast_dtype(a.device.type) is None:
        common = torch.promote_types(a.dtype, b.dtype)
        a, b = a.to(common), b.to(common)
    return a @ b


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
    """One token of the recurrence (decode, MAMBA3.md §4 step 3-4). Returns (y_BHRP, new h_BHPN).

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

    Written as a Function because its backward is one product and three reductions,
    d cs_t = Σ_s G[t, s] − Σ_s' G[s', t] with G = gW ⊙ e^{…} ⊙ scale, where autograd's chain through
    sub / masked_fill / exp / mul / diagonal / cast makes ~8 passes over the (L, L) blocks.
    """

    @staticmethod
    def forward(ctx, cs, scale, bn, mask, out_dtype):
        decay = _exp_nonpos(cs[..., :, None] - cs[..., None, :], inplace=True)
        decay = decay.tril_() if mask is None else decay.mul_(mask)
        W = decay * scale[..., None, :]
        W.diagonal(dim1=-2, dim2=-1).sub_(bn)  # diagonal weight γ_t = scale_t − bn_t (decay 1 there)
        ctx.save_for_backward(decay, scale)
        return W.to(out_dtype)

    @staticmethod
    def backward(ctx, gW):
        decay, scale = ctx.saved_tensors
        M = gW * decay  # in the state dtype (type promotion)
        d_scale = M.sum(-2)
        G = M.mul_(scale[..., None, :])
        d_cs = G.sum(-1) - G.sum(-2)
        d_bn = -gW.diagonal(dim1=-2, dim2=-1).to(scale.dtype)
        return d_cs, d_scale, d_bn, None, None


class _StatePassing(torch.autograd.Function):
    """The carry between chunks: starts[c] = S before chunk c, S ← decay_c·S + dS_c from S = S0. The
    carry runs in the state dtype (fp32 or wider) whatever the dtype of dS (the autocast dtype under
    autocast). Returns (starts in `out_dtype`, the final S in the state dtype). Layout-agnostic: the
    scan keeps S as (B, H, nc, N, P), the layout in which both matmuls that read and write it (q·S and
    Kᵀ·V) produce and take contiguous blocks, so no gradient arrives transposed.

    A Function because the loop is nc tiny steps: autograd would record ~3 nodes per chunk and stack
    the starts (and, backward, the per-chunk gradients) with a full copy each way. Here each step writes
    into a preallocated output in the dtype its reader wants, and the backward is the same loop
    reversed: with g_c the gradient of S after chunk c, ∂dS_c = g_c, g_(c−1) = decay_c·g_c + ∂starts[c],
    and ∂decay_c = ⟨g_c, starts[c]⟩, each taken while g_c is fresh in cache.
    """

    @staticmethod
    def forward(ctx, decay_BHc, dS_BHcXY, S0_BHXY, out_dtype):
        nc = dS_BHcXY.shape[2]
        starts = torch.empty(dS_BHcXY.shape, dtype=out_dtype, device=dS_BHcXY.device)
        S = S0_BHXY
        for c in range(nc):
            starts[:, :, c] = S
            S = torch.addcmul(dS_BHcXY[:, :, c], decay_BHc[:, :, c, None, None], S)
        ctx.save_for_backward(decay_BHc, starts)
        ctx.dS_dtype = dS_BHcXY.dtype
        return starts, S

    @staticmethod
    def backward(ctx, g_starts, g_hT):
        decay, starts = ctx.saved_tensors
        nc = starts.shape[2]
        d_dS = torch.empty(starts.shape, dtype=ctx.dS_dtype, device=starts.device)
        d_decay = torch.empty_like(decay)
        g = (
            torch.zeros(starts[:, :, 0].shape, dtype=decay.dtype, device=starts.device)
            if g_hT is None
            else g_hT
        )
        for c in range(nc - 1, -1, -1):
            d_dS[:, :, c] = g
            d_decay[:, :, c] = torch.linalg.vecdot(g.flatten(-2), starts[:, :, c].flatten(-2).to(g.dtype))
            g = (
                g * decay[:, :, c, None, None]
                if g_starts is None
                else torch.addcmul(g_starts[:, :, c], decay[:, :, c, None, None], g)
            )
        return d_decay, d_dS, g, None


def state_passing_unrolled(
    decay_BHc: Tensor, dS_BHcPN: Tensor, S0_BHPN: Tensor, out_dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """`_StatePassing` in plain autograd ops (used under torch.compile, where the compiler fuses the
    loop; eagerly it costs stack/unbind copies and ~3 autograd nodes per chunk)."""
    starts = []
    S = S0_BHPN
    # unbind, not dS[:, :, c]: each indexing op's backward materialises a zero tensor of the full dS
    # and adds it up, O(nc²) memory traffic.
    for decay_BH, dS_BHPN in zip(decay_BHc.unbind(2), dS_BHcPN.unbind(2)):
        starts.append(S)
        S = decay_BH[:, :, None, None] * S + dS_BHPN
    return torch.stack(starts, dim=2).to(out_dtype), S


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
    """Chunked parallel form of the recurrence (MAMBA3.md §2.4, §3); same contract as `sequential_scan`,
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
    pad = nc * L - T
    sd = _state_dtype(adt_BHT.dtype)
    dev = q_BHTRN.device
    amp_dtype = autocast_dtype(dev.type)

    lam, dt = lam_BHT.to(sd), dt_BHT.to(sd)
    gamma = lam * dt
    boa = (1 - lam) * dt  # β/α = (1 − λ)Δ
    if reset_BT is not None:
        boa = boa * (~reset_BT).to(sd)[:, None, :]
    boa_next = torch.nn.functional.pad(boa[:, :, 1:], (0, 1))
    scale = gamma + boa_next

    def chunks(x: Tensor, *inner: int) -> Tensor:
        # (B, H, T, *inner) -> (B, H, nc, L, *inner); a free view when T = nc·L and x is contiguous.
        if pad:
            x = torch.nn.functional.pad(x, (0, 0) * len(inner) + (0, pad))
        return x.reshape(Bsz, H, nc, L, *inner)

    cs_BHcL = torch.cumsum(chunks(adt_BHT.to(sd)), dim=-1)
    scale_BHcL = chunks(scale)
    boa_next_BHcL = chunks(boa_next)
    q_c = chunks(q_BHTRN, R, N).reshape(Bsz, H, nc, L * R, N)
    k_c = chunks(k_BHTRN, R, N)
    v_c = chunks(v_BHTRP, R, P).reshape(Bsz, H, nc, L * R, P)

    # Masks: causal (s ≤ t) and, with resets, same segment. seg_t = number of resets in the chunk up to t.
    if reset_BT is not None:
        rs = torch.nn.functional.pad(reset_BT, (0, pad)).view(Bsz, 1, nc, L).to(torch.int32)
        seg_B1cL = torch.cumsum(rs, dim=-1)
        mask = torch.ones(L, L, dtype=torch.bool, device=dev).tril() & (
            seg_B1cL[..., :, None] == seg_B1cL[..., None, :]
        )
        from_start_B1cL = seg_B1cL == 0  # no reset between the chunk start and t (inclusive)
        to_end_B1cL = seg_B1cL == seg_B1cL[..., -1:]  # no reset in (s, chunk end]
    else:
        mask = None  # causal only: lower-triangular
    out_dtype = amp_dtype or sd
    W_BHcLL = _DecayWeights.apply(cs_BHcL, scale_BHcL, boa_next_BHcL, mask, out_dtype)

    scores = _mm(q_c, k_c.reshape(Bsz, H, nc, L * R, N).transpose(-1, -2))  # (B, H, nc, L·R, L·R)
    if R == 1:
        scores = scores * W_BHcLL
    else:
        scores = (scores.view(Bsz, H, nc, L, R, L, R) * W_BHcLL[..., :, None, :, None]).view(
            Bsz, H, nc, L * R, L * R
        )
    y_intra = _mm(scores, v_c)

    # State passing. dS_c = Σ_s e^{cs_last − cs_s} scale_s v_s k_sᵀ (the chunk's own contribution).
    to_end_BHcL = _exp_nonpos(cs_BHcL[..., -1:] - cs_BHcL)
    chunk_decay_BHc = _exp_nonpos(cs_BHcL[..., -1])
    if reset_BT is not None:
        to_end_BHcL = to_end_BHcL * to_end_B1cL
        chunk_decay_BHc = chunk_decay_BHc * from_start_B1cL[..., -1]
    # The per-token weight goes on v (P wide), not on k (N wide): half the elementwise work and memory.
    w_BHcL = scale_BHcL * to_end_BHcL
    vw = (v_c.view(Bsz, H, nc, L, R, P) * w_BHcL[..., None, None].to(v_c.dtype)).view(Bsz, H, nc, L * R, P)
    # The carried state is kept transposed, (N, P): Kᵀ·V writes it and q·S reads it without a transpose.
    dS_BHcNP = _mm(k_c.reshape(Bsz, H, nc, L * R, N).transpose(-1, -2), vw)

    S = torch.zeros(Bsz, H, N, P, dtype=sd, device=dev) if h0_BHPN is None else h0_BHPN.to(sd).mT
    if k_prev_BRHN is not None:
        assert v_prev_BRHP is not None
        # Resume: fold the first token's β term (without α) into the carried matrix (MAMBA3.md §2.4).
        prev_BHNP = torch.einsum("brhp,brhn->bhnp", v_prev_BRHP.to(sd), k_prev_BRHN.to(sd))
        S = S + boa[:, :, 0, None, None] * prev_BHNP
    if torch.compiler.is_compiling():  # traced loops over slices of one buffer compile badly
        S_BHcNP, h_T = state_passing_unrolled(chunk_decay_BHc, dS_BHcNP, S, out_dtype)
    else:
        S_BHcNP, h_T = _StatePassing.apply(chunk_decay_BHc, dS_BHcNP, S, out_dtype)

    from_start = _exp_nonpos(cs_BHcL)
    if reset_BT is not None:
        from_start = from_start * from_start_B1cL
    qS = _mm(q_c, S_BHcNP).view(Bsz, H, nc, L, R, P)
    # (qS in its own dtype times the fp32 factor: autograd keeps the bf16 qS, not an fp32 copy.)
    # Under autocast y stays in the autocast dtype (the mixer's gate and out_proj would cast it there).
    w_start = from_start[..., None, None].to(amp_dtype or from_start.dtype)
    y = torch.addcmul(y_intra.view(Bsz, H, nc, L, R, P), qS, w_start)
    return y.view(Bsz, H, nc * L, R, P)[:, :, :T], h_T.mT.contiguous()
