"""The Mamba-3 mixer (model/mamba3.py): official names and init, the three scans agree through the whole
layer (float64), decode == forward, ablation switches change the math as specified, bf16 autocast."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mamba3lite.errors import ConfigError
from mamba3lite.model.mamba3 import (
    Mamba3,
    _bias_rotate_autograd,
    _BiasRotate,
    _Gate,
    _gated_out_proj_autograd,
    _GatedOutProj,
    _MimoGate,
    cumulative_angles,
    heavy_tail,
    rotate_,
    rotation_factors,
)

F64 = torch.float64
D_MODEL = 32


def make_layer(seed=0, **kw) -> Mamba3:
    """A tiny float64 layer whose parameters are all perturbed (so no term is trivially 1 or 0)."""
    torch.manual_seed(seed)
    args = {"d_state": 16, "headdim": 8, "chunk_size": 5, **kw}
    layer = Mamba3(D_MODEL, **args).to(F64)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return layer


def inputs(B=2, T=23, seed=1):
    return torch.randn(B, T, D_MODEL, generator=torch.Generator().manual_seed(seed), dtype=F64)


VARIANTS = [
    {},
    {"is_outproj_norm": True},
    {"is_mimo": True, "mimo_rank": 2},
    {"is_mimo": True, "mimo_rank": 3, "is_outproj_norm": True},
    {"ngroups": 2},
    {"rope_fraction": 1.0, "a_activation": "softplus"},
]


def official_keys(mimo: bool, norm: bool) -> set[str]:
    keys = {"in_proj.weight", "dt_bias", "B_bias", "C_bias", "B_norm.weight", "C_norm.weight", "D"}
    keys |= {"out_proj.weight"}
    if mimo:
        keys |= {"mimo_x", "mimo_z", "mimo_o"}
    if norm:
        keys |= {"norm.weight"}
    return keys


@pytest.mark.parametrize("mimo", [False, True])
@pytest.mark.parametrize("norm", [False, True])
def test_official_parameter_names_shapes_and_init(mimo, norm):
    D, N, P = 64, 32, 16
    layer = Mamba3(D, d_state=N, headdim=P, is_mimo=mimo, mimo_rank=4, is_outproj_norm=norm)
    E, H, R, S = 2 * D, 2 * D // P, (4 if mimo else 1), N // 4
    sd = layer.state_dict()
    assert set(sd) == official_keys(mimo, norm)
    assert sd["in_proj.weight"].shape == (2 * E + 2 * N * R + 3 * H + S, D)
    assert sd["out_proj.weight"].shape == (D, E)
    assert sd["dt_bias"].shape == sd["D"].shape == (H,)
    assert sd["B_bias"].shape == sd["C_bias"].shape == (H, R, N)
    assert sd["B_norm.weight"].shape == sd["C_norm.weight"].shape == (N,)
    assert torch.equal(sd["B_bias"], torch.ones(H, R, N)) and torch.equal(sd["D"], torch.ones(H))
    dt0 = F.softplus(sd["dt_bias"])
    assert (dt0 >= 1e-3 - 1e-7).all() and (dt0 <= 0.1 + 1e-7).all()
    if mimo:
        assert sd["mimo_x"].shape == (H, R, P)
        torch.testing.assert_close(sd["mimo_x"], torch.full((H, R, P), 0.25))
        torch.testing.assert_close(sd["mimo_z"], torch.ones(H, R, P))
        torch.testing.assert_close(sd["mimo_o"], torch.full((H, R, P), 0.25))
    if norm:
        assert sd["norm.weight"].shape == (E,)
    no_wd = {name for name, p in layer.named_parameters() if getattr(p, "_no_weight_decay", False)}
    assert no_wd == {"dt_bias", "D"}
    # A state_dict written by one layer loads strictly into another and reproduces its outputs.
    other = Mamba3(D, d_state=N, headdim=P, is_mimo=mimo, mimo_rank=4, is_outproj_norm=norm)
    other.load_state_dict(sd, strict=True)
    u = torch.randn(1, 9, D)
    torch.testing.assert_close(other(u), layer(u))


@pytest.mark.parametrize("kw", VARIANTS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "siso")
def test_forward_chunked_equals_sequential(kw):
    layer = make_layer(**kw)
    u = inputs()
    y = layer(u)
    layer.set_scan_impl("sequential")
    torch.testing.assert_close(y, layer(u), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kw", VARIANTS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "siso")
@pytest.mark.parametrize("k", [1, 9])
def test_prefill_then_steps_equals_forward(kw, k):
    layer = make_layer(**kw)
    u = inputs(T=20)
    reset = torch.zeros(2, 20, dtype=torch.bool)
    reset[0, 4] = reset[1, 12] = reset[1, 13] = True
    y = layer(u, reset_BT=reset)
    cache = layer.allocate_state(2, dtype=F64)
    outs = [layer(u[:, :k], cache, reset[:, :k])]
    outs += [layer.step(u[:, t], cache, reset[:, t])[:, None] for t in range(k, 20)]
    torch.testing.assert_close(torch.cat(outs, dim=1), y, rtol=1e-10, atol=1e-10)


def test_cache_contents_after_prefill():
    """The four cache tensors hold θ_T, h_T, the biased+rotated k̄_T (B, R, H, N) and the raw x_T."""
    layer = make_layer(is_mimo=True, mimo_rank=2)
    u = inputs(T=7)
    cache = layer.allocate_state(2, dtype=F64)
    layer(u, cache)
    _, x, Bp, Cp, _, _, _, dtheta = layer._project(u)
    theta = cumulative_angles(dtheta, None, None)
    _, k = layer._qk(*layer._normed(Bp, Cp), theta)
    torch.testing.assert_close(cache.angle_BHS, theta[:, :, -1])
    torch.testing.assert_close(cache.k_BRHN, k[:, :, -1].transpose(1, 2))
    torch.testing.assert_close(cache.v_BHP, x[:, -1])
    H, P, N = layer.nheads, layer.headdim, layer.d_state
    assert cache.ssm_BHPN.shape == (2, H, P, N) and cache.ssm_BHPN.abs().max() > 0


def test_exponential_euler_ablation_is_mamba2_recurrence():
    """trapezoid=False: λ ≡ 1, i.e. h_t = e^{ΔA} h_{t−1} + Δ_t x_t k̄_tᵀ, and no λ columns in in_proj."""
    layer = make_layer(trapezoid=False)
    ref = make_layer()
    assert layer.in_proj.weight.shape[0] == ref.in_proj.weight.shape[0] - layer.nheads
    u = inputs(T=12)
    z, x, Bp, Cp, dt, A, _, dtheta = layer._project(u)
    q, k = layer._qk(*layer._normed(Bp, Cp), cumulative_angles(dtheta, None, None))
    x1 = layer._raw_values(x)
    v = layer._values(x1)
    h = torch.zeros(2, layer.nheads, layer.headdim, layer.d_state, dtype=F64)
    ys = []
    for t in range(12):
        a = torch.exp(A[:, :, t] * dt[:, :, t])[..., None, None]
        h = a * h + dt[:, :, t, None, None] * torch.einsum("bhp,bhn->bhpn", v[:, :, t, 0], k[:, :, t, 0])
        ys.append(torch.einsum("bhpn,bhn->bhp", h, q[:, :, t, 0]))
    y = torch.stack(ys, dim=2)[:, :, :, None]
    torch.testing.assert_close(layer(u), layer._output(y, x1, z), rtol=1e-10, atol=1e-10)


def test_rope_off_is_no_rotation():
    """rope=False equals the rotating layer whose θ projection is zero (dθ = 0 ⇒ R = I) ..."""
    plain = make_layer(rope=False)
    rot = make_layer()
    S = rot.num_rope_angles
    assert plain.in_proj.weight.shape[0] == rot.in_proj.weight.shape[0] - S
    with torch.no_grad():
        rot.load_state_dict(
            {k: v for k, v in plain.state_dict().items() if k != "in_proj.weight"}, strict=False
        )
        rot.in_proj.weight[:-S] = plain.in_proj.weight
        rot.in_proj.weight[-S:] = 0
    u = inputs()
    torch.testing.assert_close(rot(u), plain(u), rtol=1e-12, atol=1e-12)
    # ... and a nonzero θ projection does change the output (the test above is not vacuous).
    with torch.no_grad():
        rot.in_proj.weight[-S:] = torch.randn(S, D_MODEL, dtype=F64)
    assert (rot(u) - plain(u)).abs().max() > 1e-3


def test_rotation_pairings():
    """SISO rotates (2i, 2i+1); MIMO rotates (i, i + N/2); both by +θ; the rest passes through."""
    N, S = 8, 2
    theta = torch.tensor([0.3, -1.1], dtype=F64)

    x = torch.arange(1.0, N + 1, dtype=F64)
    c, s = torch.cos(theta), torch.sin(theta)
    out = rotate_(x.clone(), rotation_factors(theta, halves=False), halves=False)
    for i in range(S):
        a, b = x[2 * i], x[2 * i + 1]
        torch.testing.assert_close(
            out[2 * i : 2 * i + 2], torch.stack([a * c[i] - b * s[i], a * s[i] + b * c[i]])
        )
    torch.testing.assert_close(out[2 * S :], x[2 * S :])
    out = rotate_(x.clone(), rotation_factors(theta, halves=True), halves=True)
    for i in range(S):
        a, b = x[i], x[N // 2 + i]
        torch.testing.assert_close(
            out[[i, N // 2 + i]], torch.stack([a * c[i] - b * s[i], a * s[i] + b * c[i]])
        )
    torch.testing.assert_close(out[S : N // 2], x[S : N // 2])
    torch.testing.assert_close(out[N // 2 + S :], x[N // 2 + S :])


def test_cumulative_angles_with_start_and_resets():
    g = torch.Generator().manual_seed(0)
    d = torch.randn(2, 3, 15, 4, generator=g, dtype=F64)
    theta0 = torch.randn(2, 3, 4, generator=g, dtype=F64)
    reset = torch.zeros(2, 15, dtype=torch.bool)
    reset[0, 5] = reset[0, 6] = reset[1, 14] = True
    got = cumulative_angles(d, theta0, reset)
    th = theta0.clone()
    for t in range(15):
        th = torch.where(reset[:, t, None, None], 0.0, th) + d[:, :, t]
        want = torch.remainder(th, 2 * math.pi)
        torch.testing.assert_close(got[:, :, t], want)


def test_heavy_tail_and_A_floor():
    a = torch.tensor([-3.0, -1.0, 0.0, 2.0], dtype=F64)
    torch.testing.assert_close(heavy_tail(a), torch.tensor([0.25, 0.5, 1.0, 3.0], dtype=F64))
    layer = make_layer(A_floor=0.7)
    _, _, _, _, _, A, _, _ = layer._project(inputs())
    assert (A <= -0.7).all()


@pytest.mark.parametrize("kw", VARIANTS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "siso")
def test_layer_in_its_compiled_form_equals_eager(kw, monkeypatch):
    """What torch.compile traces (no custom Functions anywhere: torch 2.11 compiles their in-place
    forwards to wrong gradients), run eagerly in float64: the same output and parameter gradients."""
    from mamba3lite.model import mamba3 as mamba3_module
    from mamba3lite.model import scan

    layer = make_layer(**kw)
    u = inputs()
    params = [p for _, p in layer.named_parameters()]
    y = layer(u)
    want = torch.autograd.grad(y.square().sum(), params)
    used = []
    plain = (
        (mamba3_module, "_bias_rotate_autograd"),
        (mamba3_module, "_gate_autograd"),
        (mamba3_module, "_mimo_gate_autograd"),
        (mamba3_module, "_gated_out_proj_autograd"),
        (scan, "_decay_weights_autograd"),
    )
    for module, name in plain:
        fn = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _fn=fn, _n=name: used.append(_n) or _fn(*a))
    functions = (
        mamba3_module._BiasRotate,
        mamba3_module._Gate,
        mamba3_module._MimoGate,
        mamba3_module._GatedOutProj,
    )
    for cls in (*functions, scan._DecayWeights, scan._ChunkCore):
        monkeypatch.setattr(cls, "apply", lambda *a, _c=cls: pytest.fail(f"{_c.__name__} used under compile"))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    y2 = layer(u)
    got = torch.autograd.grad(y2.square().sum(), params)
    torch.testing.assert_close(y2, y, rtol=1e-10, atol=1e-10)
    for (name, _), a, b in zip(layer.named_parameters(), got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")
    gate = "_mimo_gate_autograd" if layer.is_mimo else "_gate_autograd"
    expected = {"_decay_weights_autograd", "_gated_out_proj_autograd", gate}
    expected |= {"_bias_rotate_autograd"} if layer.rope else set()
    assert set(used) == expected


def test_gradients_flow_to_every_parameter():
    for kw in ({}, {"is_mimo": True, "mimo_rank": 2, "is_outproj_norm": True}):
        layer = make_layer(**kw)
        layer(inputs()).square().sum().backward()
        for name, p in layer.named_parameters():
            assert p.grad is not None and p.grad.abs().max() > 0, name


@pytest.mark.parametrize("kw", [{}, {"is_mimo": True, "mimo_rank": 4, "chunk_size": 16}])
def test_bf16_autocast_forward_backward(kw):
    torch.manual_seed(0)
    layer = Mamba3(64, d_state=32, headdim=16, **kw)
    u = torch.randn(2, 70, 64, requires_grad=True)
    ref = layer(u)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(u)
    y.float().square().mean().backward()
    assert torch.isfinite(y).all() and torch.isfinite(u.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters())
    assert all(p.dtype == torch.float32 for p in layer.parameters())
    assert (y.float() - ref).abs().max() < 0.05 * ref.abs().max()


def test_bad_shape_names_the_field():
    with pytest.raises(ConfigError, match="headdim"):
        Mamba3(32, headdim=48)
    with pytest.raises(ValueError, match="scan_impl"):
        Mamba3(32, d_state=16, headdim=8, scan_impl="fast")


@pytest.mark.parametrize("z_ranks", [1, 3], ids=["z broadcast over ranks", "z per rank"])
def test_gate_function_keeps_x_and_z_only_and_matches_autograd(z_ranks):
    """_Gate: x ⊙ SiLU(z) with autograd's values and gradients (gradcheck, float64; z broadcast over
    the rank axis as in SISO), and it saves x and z, not SiLU(z) as the two plain ops do."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 5, 3, 4, dtype=F64, generator=g, requires_grad=True)
    z = torch.randn(2, 3, 5, z_ranks, 4, dtype=F64, generator=g, requires_grad=True)
    torch.autograd.gradcheck(_Gate.apply, (x, z))
    torch.testing.assert_close(_Gate.apply(x, z), x * torch.nn.functional.silu(z))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        _Gate.apply(x, z)
    assert len(saved) == 2 and saved[0] is x and saved[1] is z


@pytest.mark.parametrize("mimo", [False, True], ids=["siso", "mimo"])
def test_gated_out_proj_keeps_no_out_proj_input_and_matches_autograd(mimo):
    """_GatedOutProj: out_proj of the gated output with the plain ops' value and all gradients (gradcheck,
    float64), and under bf16 autocast the same as the plain ops to bf16 rounding; it keeps the gate's
    inputs and the weight, never the (B, T, E) input of out_proj."""
    g = torch.Generator().manual_seed(9)
    B, H, T, R, P, D = 2, 3, 5, 2 if mimo else 1, 4, 7
    y = torch.randn(B, H, T, R, P, dtype=F64, generator=g, requires_grad=True)
    z = torch.randn(B, H, T, 1, P, dtype=F64, generator=g, requires_grad=True)
    mz, mo = (
        torch.randn(H, R, P, dtype=F64, generator=g, requires_grad=True) if mimo else None for _ in range(2)
    )
    w = torch.randn(D, H * P, dtype=F64, generator=g, requires_grad=True)
    args = (y, z, mz, mo, w)
    torch.autograd.gradcheck(_GatedOutProj.apply, args)
    leaves = [a for a in args if a is not None]
    out, ref = _GatedOutProj.apply(*args), _gated_out_proj_autograd(*args)
    torch.testing.assert_close(out, ref)
    for a, b in zip(torch.autograd.grad(out.sum(), leaves), torch.autograd.grad(ref.sum(), leaves)):
        torch.testing.assert_close(a, b)
    f32 = [None if a is None else a.detach().float().requires_grad_() for a in args]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y16 = f32[0].to(torch.bfloat16)  # the mixer casts y to the autocast dtype before the gate
        outs = [fn(y16, *f32[1:]) for fn in (_GatedOutProj.apply, _gated_out_proj_autograd)]
    assert outs[0].dtype == outs[1].dtype == torch.bfloat16
    torch.testing.assert_close(outs[0], outs[1])
    got, want = (
        torch.autograd.grad(o.float().square().sum(), [a for a in f32 if a is not None]) for o in outs
    )
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=0.02, atol=0.02 * b.abs().max().item())
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
        _GatedOutProj.apply(*args)
    assert (B, T, H * P) not in shapes and len(shapes) == len(leaves)


def test_mimo_gate_function_keeps_y_and_z_only_and_matches_autograd():
    """_MimoGate: Σ_r mimo_o ⊙ y ⊙ SiLU(z ⊙ mimo_z) with the plain ops' values and all four gradients
    (gradcheck, float64), saving y and z (and the two parameters), no rank-expanded product."""
    g = torch.Generator().manual_seed(7)
    B, H, T, R, P = 2, 3, 5, 4, 6
    y = torch.randn(B, H, T, R, P, dtype=F64, generator=g, requires_grad=True)
    z = torch.randn(B, H, T, 1, P, dtype=F64, generator=g, requires_grad=True)
    mimo_z, mimo_o = (torch.randn(H, R, P, dtype=F64, generator=g, requires_grad=True) for _ in range(2))
    args = (y, z, mimo_z, mimo_o)
    torch.autograd.gradcheck(_MimoGate.apply, args)
    out = _MimoGate.apply(*args)
    assert out.shape == (B, H, T, P)
    ref = (y * torch.nn.functional.silu(z * mimo_z[:, None]) * mimo_o[:, None]).sum(3)
    torch.testing.assert_close(out, ref)
    for a, b in zip(torch.autograd.grad(out.sum(), args), torch.autograd.grad(ref.sum(), args)):
        torch.testing.assert_close(a, b)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        _MimoGate.apply(*args)
    assert len(saved) == 4 and all(s is a for s, a in zip(saved, args))


@pytest.mark.parametrize("impl", [_BiasRotate.apply, _bias_rotate_autograd], ids=["function", "plain"])
@pytest.mark.parametrize("halves", [False, True])
@pytest.mark.parametrize("G", [1, 2])
def test_bias_rotate_function_matches_autograd_composition(halves, G, impl):
    """The memory-saving Function (eager) and the plain-ops form torch.compile traces both = an
    independent composition (expand to heads, + bias, rotate as complex numbers), values and all five
    gradients; and gradcheck passes on them."""
    g = torch.Generator().manual_seed(3)
    Bsz, H, T, R, N, S = 2, 4, 5, 2, 8, 3
    k = torch.randn(Bsz, G, T, R, N, dtype=F64, generator=g, requires_grad=True)
    q = torch.randn(Bsz, G, T, R, N, dtype=F64, generator=g, requires_grad=True)
    kb = torch.randn(H, R, N, dtype=F64, generator=g, requires_grad=True)
    qb = torch.randn(H, R, N, dtype=F64, generator=g, requires_grad=True)
    theta = (6 * torch.rand(Bsz, H, T, S, dtype=F64, generator=g)).requires_grad_()
    args = (k, q, kb, qb, theta)

    def reference(k, q, kb, qb, theta):
        # An independent formulation: pairs as complex numbers times e^{iθ} (pass-through pairs θ = 0).
        e = torch.polar(torch.ones_like(theta), theta)
        e = torch.nn.functional.pad(torch.view_as_real(e), (0, 0, 0, N // 2 - S), value=0.0)
        e = torch.view_as_complex(e.contiguous())
        e[..., S:] = 1
        outs = []
        for x, b in ((k, kb), (q, qb)):
            xb = x.repeat_interleave(H // G, dim=1) + b[:, None]
            pairs = xb.unflatten(-1, (2, -1)).transpose(-1, -2) if halves else xb.unflatten(-1, (-1, 2))
            rot = torch.view_as_real(torch.view_as_complex(pairs.contiguous()) * e[:, :, :, None])
            outs.append(rot.transpose(-1, -2).flatten(-2) if halves else rot.flatten(-2))
        return tuple(outs)

    got = impl(*args, halves, F64)
    want = reference(*args)
    w = [torch.randn_like(o, generator=g) for o in want]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    g_got = torch.autograd.grad(sum((o * wi).sum() for o, wi in zip(got, w)), args)
    g_want = torch.autograd.grad(sum((o * wi).sum() for o, wi in zip(want, w)), args)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b)
    assert torch.autograd.gradcheck(lambda *a: impl(*a, halves, F64), args)


def test_bias_rotate_keeps_less_for_backward():
    """Under bf16 autocast the layer keeps no fp32 tensor of the full per-head q/k size for backward."""
    layer = Mamba3(64, d_state=32, headdim=16, chunk_size=8)
    u = torch.randn(1, 32, 64, requires_grad=True)
    H, T, N = layer.nheads, 32, layer.d_state
    big_fp32 = []

    def pack(t):
        if t.dtype == torch.float32 and t.numel() >= H * T * N:
            big_fp32.append(tuple(t.shape))
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    with hooks, torch.autocast("cpu", dtype=torch.bfloat16):
        layer(u)
    assert not [s for s in big_fp32 if s[-1] == N], big_fp32
