"""The bias and rotation that turn the normed per-group keys and queries k̂, q̂ (B, G, T, R, N) into the
scan's per-head k, q (B, H, T, R, N) (docs/model.md §2.3): k = R(θ)(k̂ + B_bias), q = R(θ)(q̂ + C_bias), head h
reading group h // (H / G), with the data-dependent angles θ (B, H, T, S) on the first S channel pairs.

`bias_rotate` is the forward and `bias_rotate_grads` its backward in closed form (the inverse rotation
of the output gradient, its sums over heads and over batch and time, the angles' gradient). Both run
outside autograd: the mixer's `_BiasRotate` Function and the Triton scan's fused prologue
(scan_triton.py: it recomputes k, q in its backward instead of saving them) are built on them.
SISO rotates interleaved channel pairs (2i, 2i+1); MIMO rotates split halves (i, i + N/2), as the
official kernels.
"""

from __future__ import annotations

import torch
from torch import Tensor


def pair_views(x: Tensor, n_angles: int, halves: bool) -> tuple[Tensor, Tensor]:
    """Views (a, b) of x (.., N): the two channels of each of the first `n_angles` rotating pairs,
    (.., S) each. SISO pairs are interleaved (2i, 2i+1); MIMO pairs are split halves (i, i + N/2)."""
    N = x.shape[-1]
    if halves:
        v = x.unflatten(-1, (2, N // 2))
        return v[..., 0, :n_angles], v[..., 1, :n_angles]
    v = x.unflatten(-1, (N // 2, 2))
    return v[..., :n_angles, 0], v[..., :n_angles, 1]


def rotation_factors(theta: Tensor, halves: bool) -> Tensor | tuple[Tensor, Tensor]:
    """What `rotate_` multiplies by, from θ (.., S): e^{iθ} (SISO) or (cos θ, sin θ) (MIMO)."""
    cos, sin = torch.cos(theta), torch.sin(theta)
    return (cos, sin) if halves else torch.complex(cos, sin)


def rotate_(
    x: Tensor, factors: Tensor | tuple[Tensor, Tensor], halves: bool, inverse: bool = False
) -> Tensor:
    """R(θ)x in place (R(−θ)x if `inverse`): each of the first S pairs (a, b) ->
    (a·cosθ − b·sinθ, a·sinθ + b·cosθ), the other channels unchanged. `factors` from `rotation_factors`
    broadcast against x (.., N); x is fp32 or float64.

    Interleaved pairs are complex numbers in memory, so SISO is one in-place complex product
    (a + ib)·e^{iθ} over the first 2S channels; MIMO's halves are two contiguous runs per row."""
    if not halves:
        e = factors.conj() if inverse else factors
        torch.view_as_complex(x.unflatten(-1, (-1, 2))[..., : e.shape[-1], :]).mul_(e)
        return x
    cos, sin = factors
    sin = -sin if inverse else sin
    a, b = pair_views(x, cos.shape[-1], halves)
    new_a = torch.addcmul(a * cos, b, sin, value=-1)
    b.mul_(cos).addcmul_(a, sin)
    a.copy_(new_a)
    return x


def angle_grad(g: Tensor, out: Tensor, S: int, halves: bool) -> Tensor:
    """dL/dθ (.., S) per pair from the output gradient g (fp32/float64) and the rotated output: a rotated
    pair (a', b') has d(a', b')/dθ = (−b', a'), so dL/dθ = g_b·a' − g_a·b' (= Im(g·conj(out)) as complex)."""
    if not halves:
        o = torch.view_as_complex(out[..., : 2 * S].to(g.dtype).unflatten(-1, (-1, 2)))
        gc = torch.view_as_complex(g.unflatten(-1, (-1, 2))[..., :S, :])
        return (gc * o.conj()).imag
    ga, gb = pair_views(g, S, halves)
    oa, ob = pair_views(out, S, halves)
    return gb * oa - ga * ob


def per_head(x_BGTRN: Tensor, bias_HRN: Tensor) -> Tensor:
    """x + bias per head (B, H, T, R, N) from per-group x (B, G, T, R, N): head h reads group h // (H / G);
    one broadcast add makes the per-head copy."""
    Bsz, G, T, R, N = x_BGTRN.shape
    H = bias_HRN.shape[0]
    return (x_BGTRN[:, :, None] + bias_HRN.view(G, H // G, 1, R, N).to(x_BGTRN.dtype)).view(Bsz, H, T, R, N)


def bias_rotate(
    k_BGTRN: Tensor,
    q_BGTRN: Tensor,
    k_bias_HRN: Tensor,
    q_bias_HRN: Tensor,
    theta_BHTS: Tensor | None,
    halves: bool,
    out_dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:
    """(k, q) per head in `out_dtype`, rotated by θ (not rotated when θ is None), computed in the inputs'
    dtype (fp32 or float64)."""
    if theta_BHTS is None:
        return per_head(k_BGTRN, k_bias_HRN).to(out_dtype), per_head(q_BGTRN, q_bias_HRN).to(out_dtype)
    rot = rotation_factors(theta_BHTS.to(k_BGTRN.dtype)[:, :, :, None], halves)  # broadcast over R
    k, q = (
        rotate_(per_head(x, bias), rot, halves).to(out_dtype)
        for x, bias in ((k_BGTRN, k_bias_HRN), (q_BGTRN, q_bias_HRN))
    )
    return k, q


def bias_rotate_grads(
    theta_BHTS: Tensor | None,
    k_BHTRN: Tensor,
    q_BHTRN: Tensor,
    g_k: Tensor | None,
    g_q: Tensor | None,
    halves: bool,
    G: int,
    in_dtype: torch.dtype,
) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """The gradients (dk̂, dq̂, dB_bias, dC_bias, dθ) in `in_dtype` (θ's own dtype for dθ) from the output
    gradients g_k, g_q (None: no gradient) and the outputs k, q of `bias_rotate` (they give dθ)."""
    Bsz, H, T, R, N = k_BHTRN.shape
    rot = d_theta = None
    if theta_BHTS is not None:
        rot = rotation_factors(theta_BHTS.to(in_dtype)[:, :, :, None], halves)
        d_theta = torch.zeros(*theta_BHTS.shape, dtype=in_dtype, device=theta_BHTS.device)
    grads = []
    for g, out in ((g_k, k_BHTRN), (g_q, q_BHTRN)):
        if g is None:
            grads.append((None, None))
            continue
        gx = g.to(in_dtype, memory_format=torch.contiguous_format, copy=True)
        if rot is not None:
            d_theta += angle_grad(gx, out, theta_BHTS.shape[-1], halves).sum(3)
            rotate_(gx, rot, halves, inverse=True)  # R(θ)ᵀ = R(−θ)
        grads.append((gx.view(Bsz, G, H // G, T, R, N).sum(2), gx.sum((0, 2))))
    (dk, dkb), (dq, dqb) = grads
    return dk, dq, dkb, dqb, None if d_theta is None else d_theta.to(theta_BHTS.dtype)
