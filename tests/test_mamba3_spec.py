"""The Mamba-3 layer against docs/model.md read literally: an official layer's state_dict must give the
official outputs (issue 4), which the names-and-shapes test alone cannot show.

`spec_forward` below is written from the text of docs/model.md §1.3, §2 and §3 only, one token,
one head and one rank at a time, sharing no code with `mamba3lite.model`: the split order and sizes of
`in_proj`, the rank-major B/C layout, the group each head reads, RMSNorm then bias then rotation, the
cumulative angles, the two pairing conventions, the exponential-trapezoidal update, D, the MIMO
expansions, the optional pre-gate grouped norm and the SiLU gate. The layer's other tests check its
three scans against each other; they share the layer's own projection and preprocessing, so a swapped
z/x, a B/C mix-up, a wrong pairing or a misplaced bias would pass them all and fail here.
"""

from __future__ import annotations

import math

import pytest
import torch

from mamba3lite.model.mamba3 import Mamba3

F64 = torch.float64


def rms_norm(v: torch.Tensor, w: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return v / torch.sqrt(v.pow(2).mean() + eps) * w


def silu(v: torch.Tensor) -> torch.Tensor:
    return v * torch.sigmoid(v)


def rotate(v: torch.Tensor, theta: torch.Tensor, halves: bool) -> torch.Tensor:
    """(a, b) -> (a cos - b sin, a sin + b cos) on pair i < S: channels (2i, 2i+1) (SISO) or (i, i+N/2)
    (MIMO); the other channels pass through."""
    out = v.clone()
    N = v.shape[0]
    for i in range(theta.shape[0]):
        ia, ib = (i, i + N // 2) if halves else (2 * i, 2 * i + 1)
        a, b, c, s = v[ia], v[ib], torch.cos(theta[i]), torch.sin(theta[i])
        out[ia], out[ib] = a * c - b * s, a * s + b * c
    return out


def spec_forward(
    sd: dict,
    u: torch.Tensor,
    *,
    N: int,
    P: int,
    G: int,
    R: int,
    mimo: bool,
    outnorm: bool,
    rope_fraction: float,
    activation: str,
    A_floor: float,
) -> torch.Tensor:
    """The official layer's output for u (B, T, D), from its state_dict, per docs/model.md."""
    Bsz, T = u.shape[:2]
    E = sd["out_proj.weight"].shape[1]
    H = E // P
    split = int(N * rope_fraction)
    split -= split % 2
    S = split // 2
    proj = u @ sd["in_proj.weight"].T
    sizes = [E, E, N * G * R, N * G * R, H, H, H, S]
    assert proj.shape[-1] == sum(sizes)
    z, x, Bt, Ct, a_dt, a_A, a_lam, a_theta = proj.split(sizes, dim=-1)
    Bt, Ct = Bt.reshape(Bsz, T, R, G, N), Ct.reshape(Bsz, T, R, G, N)  # rank-major
    if activation == "heavy_tail":
        f = torch.where(a_A >= 0, 1 + a_A, 1 / (1 - a_A))
    else:
        f = torch.nn.functional.softplus(a_A)
    out = torch.zeros(Bsz, T, E, dtype=u.dtype)
    for b in range(Bsz):
        for h in range(H):
            g = h // (H // G)
            hs = slice(h * P, (h + 1) * P)
            state = torch.zeros(P, N, dtype=u.dtype)
            theta = torch.zeros(S, dtype=u.dtype)
            x_prev = [torch.zeros(P, dtype=u.dtype)] * R
            k_prev = [torch.zeros(N, dtype=u.dtype)] * R
            for t in range(T):
                dt = torch.nn.functional.softplus(a_dt[b, t, h] + sd["dt_bias"][h])
                A = -torch.clamp(f[b, t, h], min=A_floor)
                lam = torch.sigmoid(a_lam[b, t, h])
                alpha = torch.exp(A * dt)
                beta = (1 - lam) * dt * alpha
                gamma = lam * dt
                theta = theta + math.pi * torch.tanh(a_theta[b, t]) * dt
                xs, ks, qs, zs = [], [], [], []
                for r in range(R):
                    k = rms_norm(Bt[b, t, r, g], sd["B_norm.weight"]) + sd["B_bias"][h, r]
                    q = rms_norm(Ct[b, t, r, g], sd["C_norm.weight"]) + sd["C_bias"][h, r]
                    ks.append(rotate(k, theta, halves=mimo))
                    qs.append(rotate(q, theta, halves=mimo))
                    xs.append(x[b, t, hs] * sd["mimo_x"][h, r] if mimo else x[b, t, hs])
                    zs.append(z[b, t, hs] * sd["mimo_z"][h, r] if mimo else z[b, t, hs])
                state = alpha * state
                for r in range(R):
                    state = (
                        state + beta * torch.outer(x_prev[r], k_prev[r]) + gamma * torch.outer(xs[r], ks[r])
                    )
                y_h = torch.zeros(P, dtype=u.dtype)
                for r in range(R):
                    y = state @ qs[r] + sd["D"][h] * xs[r]
                    if outnorm:
                        y = rms_norm(y, sd["norm.weight"][hs])
                    y = y * silu(zs[r])
                    y_h = y_h + (sd["mimo_o"][h, r] * y if mimo else y)
                out[b, t, hs] = y_h
                x_prev, k_prev = xs, ks
    return out @ sd["out_proj.weight"].T


CASES = [
    {},
    {"is_outproj_norm": True},
    {"ngroups": 2},
    {"rope_fraction": 1.0, "a_activation": "softplus"},
    {"is_mimo": True, "mimo_rank": 2},
    {"is_mimo": True, "mimo_rank": 3, "is_outproj_norm": True, "ngroups": 2},
]


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "siso")
def test_layer_equals_the_specification_read_literally(kw):
    N, P, D = 16, 4, 8
    torch.manual_seed(0)
    layer = Mamba3(D, d_state=N, headdim=P, chunk_size=4, **kw).to(F64)
    with torch.no_grad():  # perturb every parameter: no bias stays 1, no norm weight stays 1
        for p in layer.parameters():
            p.add_(0.3 * torch.randn_like(p))
    sd = {k: v.detach() for k, v in layer.state_dict().items()}
    u = torch.randn(2, 11, D, dtype=F64)  # 11 tokens: two full chunks of 4 and a ragged one
    want = spec_forward(
        sd,
        u,
        N=N,
        P=P,
        G=kw.get("ngroups", 1),
        R=kw.get("mimo_rank", 4) if kw.get("is_mimo") else 1,
        mimo=kw.get("is_mimo", False),
        outnorm=kw.get("is_outproj_norm", False),
        rope_fraction=kw.get("rope_fraction", 0.5),
        activation=kw.get("a_activation", "heavy_tail"),
        A_floor=1e-4,
    )
    with torch.no_grad():
        got = layer(u)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
