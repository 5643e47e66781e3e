"""The recurrence three ways (model/scan.py): chunked and single-step are proved equal to the sequential
reference in float64, outputs, final states and gradients (docs/architecture.md §6 rule 4)."""

from __future__ import annotations

import pytest
import torch

from mamba3lite.model.scan import chunked_scan, scan_step, sequential_scan

F64 = torch.float64


def make_inputs(B=2, H=3, T=29, R=1, N=8, P=4, resets=False, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, R, N, generator=g, dtype=F64)
    k = torch.randn(B, H, T, R, N, generator=g, dtype=F64)
    v = torch.randn(B, H, T, R, P, generator=g, dtype=F64)
    dt = torch.rand(B, H, T, generator=g, dtype=F64) * 0.5 + 0.01
    A = -(torch.rand(B, H, T, generator=g, dtype=F64) * 2 + 0.01)
    lam = torch.rand(B, H, T, generator=g, dtype=F64)
    reset = (torch.rand(B, T, generator=g) < 0.15) if resets else None
    tensors = [q, k, v, A * dt, dt, lam]
    if requires_grad:
        tensors = [t.detach().requires_grad_() for t in tensors]
    return tensors, reset


def make_state(B=2, H=3, R=1, N=8, P=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {
        "h0_BHPN": torch.randn(B, H, P, N, generator=g, dtype=F64),
        "k_prev_BRHN": torch.randn(B, R, H, N, generator=g, dtype=F64),
        "v_prev_BRHP": torch.randn(B, R, H, P, generator=g, dtype=F64),
    }


@pytest.mark.parametrize("R", [1, 3])
@pytest.mark.parametrize("chunk", [1, 7, 16, 64])
@pytest.mark.parametrize("T", [29, 32, 5])
def test_chunked_equals_sequential(R, chunk, T):
    (q, k, v, adt, dt, lam), _ = make_inputs(R=R, T=T)
    y_ref, h_ref = sequential_scan(q, k, v, adt, dt, lam)
    y, h = chunked_scan(q, k, v, adt, dt, lam, chunk_size=chunk)
    assert y.shape == y_ref.shape == (2, 3, T, R, 4)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(h, h_ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("R", [1, 2])
@pytest.mark.parametrize("chunk", [1, 7, 16])
def test_chunked_equals_sequential_from_state_with_resets(R, chunk):
    (q, k, v, adt, dt, lam), reset = make_inputs(R=R, T=37, resets=True)
    reset[0, 0] = True  # a reset on the very first token drops the given state
    reset[1, :3] = False
    state = make_state(R=R)
    y_ref, h_ref = sequential_scan(q, k, v, adt, dt, lam, reset_BT=reset, **state)
    y, h = chunked_scan(q, k, v, adt, dt, lam, chunk_size=chunk, reset_BT=reset, **state)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(h, h_ref, rtol=1e-10, atol=1e-10)
    # The state matters (else the test above would be vacuous) and the first row's does not at t=0.
    y0, _ = sequential_scan(q, k, v, adt, dt, lam, reset_BT=reset)
    assert (y0[1] - y_ref[1]).abs().max() > 1e-3
    torch.testing.assert_close(y0[0, :, 0], y_ref[0, :, 0])


def test_sequential_is_the_written_recurrence():
    """Hand-unrolled first two tokens of h_t = α h + β v_{t−1} k_{t−1}ᵀ + γ v_t k_tᵀ, y = h q."""
    (q, k, v, adt, dt, lam), _ = make_inputs(B=1, H=1, T=2)
    y, h = sequential_scan(q, k, v, adt, dt, lam)
    a, d, lm = adt[0, 0].exp(), dt[0, 0], lam[0, 0]
    outer = [torch.outer(v[0, 0, t, 0], k[0, 0, t, 0]) for t in range(2)]
    h0 = lm[0] * d[0] * outer[0]
    h1 = a[1] * h0 + (1 - lm[1]) * d[1] * a[1] * outer[0] + lm[1] * d[1] * outer[1]
    torch.testing.assert_close(y[0, 0, 0, 0], h0 @ q[0, 0, 0, 0])
    torch.testing.assert_close(y[0, 0, 1, 0], h1 @ q[0, 0, 1, 0])
    torch.testing.assert_close(h[0, 0], h1)


@pytest.mark.parametrize("R", [1, 2])
def test_step_loop_equals_sequential(R):
    (q, k, v, adt, dt, lam), reset = make_inputs(R=R, T=11, resets=True)
    state = make_state(R=R)
    y_ref, h_ref = sequential_scan(q, k, v, adt, dt, lam, reset_BT=reset, **state)
    h, k_prev, v_prev = state["h0_BHPN"], state["k_prev_BRHN"], state["v_prev_BRHP"]
    for t in range(11):
        y_t, h = scan_step(
            q[:, :, t], k[:, :, t], v[:, :, t], adt[:, :, t], dt[:, :, t], lam[:, :, t],
            h, k_prev, v_prev, reset[:, t],
        )  # fmt: skip
        k_prev, v_prev = k[:, :, t].transpose(1, 2), v[:, :, t].transpose(1, 2)
        torch.testing.assert_close(y_t, y_ref[:, :, t])
    torch.testing.assert_close(h, h_ref)


def test_chunked_final_state_resumes_exactly():
    """Scanning [0, k) then [k, T) from the returned state (plus the last k, v) equals one scan of [0, T)."""
    (q, k, v, adt, dt, lam), _ = make_inputs(R=2, T=40)
    y_full, h_full = chunked_scan(q, k, v, adt, dt, lam, chunk_size=16)
    cut = 13
    first = [t[:, :, :cut] for t in (q, k, v, adt, dt, lam)]
    second = [t[:, :, cut:] for t in (q, k, v, adt, dt, lam)]
    y1, h1 = chunked_scan(*first, chunk_size=16)
    state = {
        "h0_BHPN": h1,
        "k_prev_BRHN": k[:, :, cut - 1].transpose(1, 2),
        "v_prev_BRHP": v[:, :, cut - 1].transpose(1, 2),
    }
    y2, h2 = chunked_scan(*second, chunk_size=16, **state)
    torch.testing.assert_close(torch.cat([y1, y2], dim=2), y_full)
    torch.testing.assert_close(h2, h_full)


@pytest.mark.parametrize("R", [1, 2])
def test_gradients_chunked_equal_sequential(R):
    (q, k, v, adt, dt, lam), reset = make_inputs(R=R, T=23, resets=True, requires_grad=True)
    state = {name: t.requires_grad_() for name, t in make_state(R=R).items()}
    leaves = [q, k, v, adt, dt, lam, *state.values()]
    w = torch.randn(2, 3, 23, R, 4, dtype=F64)
    wh = torch.randn(2, 3, 4, 8, dtype=F64)

    def loss(fn, **kw):
        y, h = fn(q, k, v, adt, dt, lam, reset_BT=reset, **state, **kw)
        return (y * w).sum() + (h * wh).sum()

    g_ref = torch.autograd.grad(loss(sequential_scan), leaves)
    g = torch.autograd.grad(loss(chunked_scan, chunk_size=8), leaves)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("R", [1, 2])
def test_compiled_form_of_the_scan_equals_sequential(R, monkeypatch):
    """The plain-ops form torch.compile traces (no custom Functions: they gave wrong gradients when
    compiled on CUDA), here run eagerly: outputs, state and all gradients == the reference."""
    from mamba3lite.model import scan

    used = []
    for name in ("_decay_weights_autograd", "_chunk_core_autograd"):
        fn = getattr(scan, name)
        monkeypatch.setattr(scan, name, lambda *a, _fn=fn, _n=name: used.append(_n) or _fn(*a))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    test_gradients_chunked_equal_sequential(R)
    assert sorted(set(used)) == ["_chunk_core_autograd", "_decay_weights_autograd"]


def test_gradcheck_chunked():
    (q, k, v, adt, dt, lam), reset = make_inputs(
        B=1, H=2, T=6, R=2, N=4, P=3, resets=True, requires_grad=True
    )
    reset[0, 3] = True

    def fn(q, k, v, adt, dt, lam):
        y, h = chunked_scan(q, k, v, adt, dt, lam, chunk_size=4, reset_BT=reset)
        return y, h

    assert torch.autograd.gradcheck(fn, (q, k, v, adt, dt, lam), fast_mode=True)


def test_chunked_no_nan_with_strong_decay():
    """Very negative ΔA (α ≈ 0) must not produce inf·0 in the masked exponent."""
    (q, k, v, adt, dt, lam), _ = make_inputs(T=70)
    adt = adt * 500
    y_ref, h_ref = sequential_scan(q, k, v, adt, dt, lam)
    y, h = chunked_scan(q, k, v, adt, dt, lam, chunk_size=64)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(h, h_ref)


def test_chunked_bf16_autocast_close_to_fp32():
    (q, k, v, adt, dt, lam), _ = make_inputs(T=50, R=2)
    args32 = [t.float() for t in (q, k, v, adt, dt, lam)]
    y32, h32 = chunked_scan(*args32, chunk_size=16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y16, h16 = chunked_scan(*args32, chunk_size=16)
    # y leaves in the autocast dtype (the mixer's gate and out_proj run there); the state stays fp32
    assert y16.dtype == torch.bfloat16 and h16.dtype == torch.float32
    assert (y16.float() - y32).abs().max() / y32.abs().max() < 0.03
    assert (h16 - h32).abs().max() / h32.abs().max() < 0.03


def core_inputs(R, dtype=F64, B=2, H=3, nc=4, L=5, N=6, P=4, seed=5):
    """Random inputs of the chunked scan's matmul core (`_ChunkCore`), shapes as its reference documents."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, H, nc, L * R, N, generator=g, dtype=F64) for _ in range(2))
    v = torch.randn(B, H, nc, L * R, P, generator=g, dtype=F64)
    W = torch.randn(B, H, nc, L, L, generator=g, dtype=F64).tril()
    w_vw, w_start = (torch.rand(B, H, nc, L, generator=g, dtype=F64) for _ in range(2))
    decay = torch.rand(B, H, nc, generator=g, dtype=F64)
    S0 = torch.randn(B, H, N, P, generator=g, dtype=F64)
    mm = [x.to(dtype) for x in (q, k, v, W)]
    return [x.requires_grad_() for x in (*mm, w_vw, decay, S0, w_start)]


@pytest.mark.parametrize("R", [1, 2])
@pytest.mark.parametrize("use", ["both", "y", "h"])
def test_chunk_core_function_equals_plain_autograd(R, use):
    """The hand-written backward (baddbmm accumulation, recomputed products, the carry loop reversed)
    against autograd through the same math: values and the gradient of all 8 inputs, including when
    one output is unused (autograd then hands the Function zeros)."""
    from mamba3lite.model.scan import _chunk_core_autograd, _ChunkCore

    inputs = core_inputs(R)
    g = torch.Generator().manual_seed(9)
    w_y = torch.randn(2, 3, 4, 5 * R, 4, generator=g, dtype=F64)
    results = []
    for fn in (_ChunkCore.apply, _chunk_core_autograd):
        y, h = fn(*inputs)
        loss = {"both": (y * w_y).sum() + h.square().sum(), "y": (y * w_y).sum(), "h": h.square().sum()}[use]
        grads = torch.autograd.grad(loss, inputs, allow_unused=True, materialize_grads=True)
        results.append((y, h, *grads))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)


def test_chunk_core_gradcheck():
    from mamba3lite.model.scan import _ChunkCore

    inputs = core_inputs(R=2, B=1, H=1, nc=3, L=2, N=3, P=2)
    assert torch.autograd.gradcheck(_ChunkCore.apply, inputs)


def test_chunk_core_bf16_matmuls_carry_fp32_state():
    """bf16 matmul inputs (the autocast dtype): the carried state stays fp32, outputs and gradients come
    back in each input's dtype and close to the float64 run."""
    from mamba3lite.model.scan import _ChunkCore

    results = []
    for dtype in (torch.bfloat16, F64):
        inputs = core_inputs(R=1, dtype=dtype, L=16, N=16, P=8)
        if dtype == torch.bfloat16:  # the state dtype is fp32 under autocast
            inputs = [x.detach().float().requires_grad_() if x.dtype == F64 else x for x in inputs]
        y, h = _ChunkCore.apply(*inputs)
        assert y.dtype == dtype and h.dtype == (torch.float32 if dtype == torch.bfloat16 else F64)
        grads = torch.autograd.grad(y.double().square().sum() + h.double().square().sum(), inputs)
        assert [gr.dtype for gr in grads] == [x.dtype for x in inputs]
        results.append((y, h, *grads))
    for lo, hi in zip(*results):
        assert ((lo.double() - hi).abs().max() / hi.abs().max()).item() < 0.03


def test_exp_nonpos_is_exp_down_to_the_floor_then_exact_zero():
    from mamba3lite.model.scan import EXP_FLOOR, _exp_nonpos

    x = torch.tensor([0.0, -1.0, -39.0, EXP_FLOOR + 0.5, EXP_FLOOR - 0.5, -100.0, -1e4, float("-inf"), 3.0])
    want = torch.tensor([0.0, -1.0, -39.0, EXP_FLOOR + 0.5]).exp().tolist() + [0.0] * 4 + [1.0]
    for inplace in (False, True):
        got = _exp_nonpos(x.clone(), inplace=inplace)
        torch.testing.assert_close(got, torch.tensor(want), rtol=1e-6, atol=0)


def test_strong_decay_makes_no_subnormal_weights():
    """Within-chunk decays below e^-87 are fp32 subnormals (and e^x on CPU takes a ~15x slower path for
    such x); the weights are exact zeros there instead, and the scan still equals the reference."""
    from mamba3lite.model.scan import _DecayWeights

    (q, k, v, adt, dt, lam), reset = make_inputs(T=64, resets=True)
    adt = adt * 40  # up to −80 per token: the chunk spans exponents far below −87
    cs = torch.cumsum(adt.float().view(2, 3, 1, 64), -1)
    scale = dt.float().view(2, 3, 1, 64)
    causal = torch.ones(64, 64, dtype=torch.bool).tril()
    for mask in (causal, None):  # None: the causal mask without resets
        W = _DecayWeights.apply(cs, scale, torch.zeros_like(scale), mask, torch.float32)
        tiny = torch.finfo(torch.float32).tiny
        assert not ((W != 0) & (W.abs() < tiny)).any()
        assert (W == 0).float().mean() > 0.6  # most of the lower triangle decayed to nothing
    y_ref, h_ref = sequential_scan(q, k, v, adt, dt, lam, reset_BT=reset)
    y, h = chunked_scan(q, k, v, adt, dt, lam, chunk_size=16, reset_BT=reset)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(h, h_ref)
