"""The model on a CUDA device: the same contracts as the CPU tests, on the GPU code paths (the eager scan's
custom autograd Functions, bf16 autocast on CUDA, a compiled layer, decode and seeded sampling with a
generator on the device), and the Triton scan == the chunked scan in fp32 and bf16, values and every
gradient, alone and through the LM (eager, compiled, checkpointed); those skip until
mamba3lite/model/scan_triton.py exists. Every test here needs CUDA and is skipped without it: the CPU
suite proves the same contracts on the CPU (tests/test_scan.py, tests/test_transformer.py, the Triton
kernels under TRITON_INTERPRET=1 in tests/test_scan_triton.py); these are run on a lent GPU machine
(`pytest -m gpu`, benchmarks/gpu_check.sh) and their last results are in benchmarks/RESULTS.md, GPU
section."""

from __future__ import annotations

import pytest
import torch

from mamba3lite.model import Mamba3Transformer
from mamba3lite.model.scan import chunked_scan, sequential_scan
from test_scan import make_inputs, make_state
from test_transformer import EOS, ids, make_model, tiny_cfg

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def no_tf32():
    """fp32 matmuls in full precision (TF32 would need looser tolerances than the contracts state)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.parametrize("R", [1, 2])
@pytest.mark.parametrize("chunk", [7, 64])
def test_chunked_equals_sequential_on_cuda_values_and_gradients(R, chunk):
    """float64 on the GPU: the eager chunked scan (its autograd Functions) == the sequential reference,
    outputs, final state and the gradients of every input, from a given state and with resets; and the
    GPU result == the CPU reference."""
    tensors, reset = make_inputs(R=R, T=45, resets=True, requires_grad=True)
    state = make_state(R=R)
    cpu_y, cpu_h = sequential_scan(*tensors, reset_BT=reset, **state)
    gpu_in = [t.detach().to(CUDA).requires_grad_() for t in tensors]
    gpu_state = {k: v.to(CUDA) for k, v in state.items()}
    reset = reset.to(CUDA)
    y_ref, h_ref = sequential_scan(*gpu_in, reset_BT=reset, **gpu_state)
    y, h = chunked_scan(*gpu_in, chunk_size=chunk, reset_BT=reset, **gpu_state)
    assert y.device.type == "cuda"
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(h, h_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(y.cpu(), cpu_y, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(h.cpu(), cpu_h, rtol=1e-10, atol=1e-10)
    g = torch.Generator().manual_seed(5)
    gy = torch.randn(y.shape, generator=g, dtype=y.dtype).to(CUDA)
    gh = torch.randn(h.shape, generator=g, dtype=h.dtype).to(CUDA)
    want = torch.autograd.grad((y_ref * gy).sum() + (h_ref * gh).sum(), gpu_in)
    got = torch.autograd.grad((y * gy).sum() + (h * gh).sum(), gpu_in)
    for name, a, b in zip(["q", "k", "v", "adt", "dt", "lam"], got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=lambda m, n=name: f"d{n}: {m}")


def test_model_on_cuda_equals_cpu_fp32():
    """The tiny LM's loss and every parameter's gradient agree between the CPU and the GPU (fp32)."""
    model = make_model(dtype=torch.float32)
    x, y = ids(), ids(seed=2)
    loss_cpu = model(x, y)
    grads_cpu = torch.autograd.grad(loss_cpu, list(model.parameters()))
    model.to(CUDA)
    loss_gpu = model(x.to(CUDA), y.to(CUDA))
    grads_gpu = torch.autograd.grad(loss_gpu, list(model.parameters()))
    torch.testing.assert_close(loss_gpu.cpu(), loss_cpu, rtol=1e-5, atol=1e-5)
    for (name, _), a, b in zip(model.named_parameters(), grads_gpu, grads_cpu):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_bf16_autocast_on_cuda():
    """bf16 autocast on the GPU, as the trainer runs: fp32 loss close to the fp32 model's, finite
    gradients in fp32 on fp32 weights."""
    torch.manual_seed(0)
    model = Mamba3Transformer(tiny_cfg(d_model=64, d_state=32, headdim=16, chunk_size=16)).to(CUDA)
    x, y = ids(T=40).to(CUDA), ids(T=40, seed=2).to(CUDA)
    ref = model(x, y)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(x, y)
    loss.backward()
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert abs(loss.item() - ref.item()) < 0.05
    assert all(p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("kw", [{}, {"is_mimo": True, "mimo_rank": 2, "chunk_size": 4}])
def test_teacher_forced_decode_equals_forward_on_cuda(kw):
    """float64 on the GPU: prefill(k) + step × (T − k) == forward(T), SISO and MIMO, with EOS resets."""
    model = make_model(reset_at_eos=True, **kw).to(CUDA)
    x = ids(T=25)
    x[:, 9] = EOS  # a document boundary inside the prefill and one inside the decoded steps
    x[:, 17] = EOS
    x = x.to(CUDA)
    logits = model(x)
    for k in (1, 11):
        cache = model.allocate_cache(2, dtype=torch.float64)
        first, _ = model.prefill(x[:, :k], cache)
        steps = [first] + [model.step(x[:, t], cache) for t in range(k, 25)]
        torch.testing.assert_close(torch.stack(steps, dim=1), logits[:, k - 1 :], rtol=1e-10, atol=1e-10)


def test_generate_on_cuda_seeded_and_greedy():
    """Sampling with a generator on the device is reproducible; greedy decode == forward argmax."""
    model = make_model(dtype=torch.float32).to(CUDA)
    x = ids(T=7).to(CUDA)

    def run(seed):
        gen = torch.Generator(device=CUDA).manual_seed(seed)
        return torch.stack(list(model.generate(x, 8, temperature=1.0, top_k=20, top_p=0.9, generator=gen)))

    a = run(0)
    assert a.device.type == "cuda" and a.shape == (8, 2) and int(a.max()) < 61
    assert torch.equal(a, run(0))
    seq = x
    for token in model.generate(x, 5, temperature=0):
        assert torch.equal(token, model(seq)[:, -1].argmax(-1))
        seq = torch.cat([seq, token[:, None]], dim=1)


@pytest.mark.parametrize("kw", [{}, {"is_mimo": True, "mimo_rank": 2}])
def test_compiled_layers_on_cuda_match_eager(kw):
    """Each layer compiled (as benchmarks/gpu_model.py and the trainer's compile switch do): the same
    loss and gradients as eager, fp32 and under bf16 autocast, SISO and MIMO."""
    torch.manual_seed(0)
    model = Mamba3Transformer(tiny_cfg(d_model=64, d_state=32, headdim=16, chunk_size=16, **kw)).to(CUDA)
    x, y = ids(T=40).to(CUDA), ids(T=40, seed=2).to(CUDA)
    params = list(model.parameters())
    eager = model(x, y)
    grads = torch.autograd.grad(eager, params)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        eager_bf16 = model(x, y)
    for block in model.layers:
        block.compile()
    loss = model(x, y)
    got = torch.autograd.grad(loss, params)
    torch.testing.assert_close(loss, eager, rtol=1e-4, atol=1e-4)
    for (name, _), a, b in zip(model.named_parameters(), got, grads):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss_bf16 = model(x, y)
    loss_bf16.backward()
    assert abs(loss_bf16.item() - eager_bf16.item()) < 0.02
    assert all(torch.isfinite(p.grad).all() for p in params)


# ---- the Triton scan (mamba3lite/model/scan_triton.py) on the GPU: == the chunked scan ----
def triton_scan():
    """The kernels' entry point, or a skip until the module (and its function) exists."""
    module = pytest.importorskip("mamba3lite.model.scan_triton")
    if not hasattr(module, "triton_chunked_scan"):
        pytest.skip("mamba3lite.model.scan_triton has no triton_chunked_scan")
    reason = module.triton_unavailable_reason(CUDA)
    if reason is not None:
        pytest.fail(f"the Triton scan cannot run on this CUDA device: {reason}")
    return module


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| / max |b|: an error relative to the tensor's scale (bf16 and TF32 round relatively)."""
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def scan_inputs(B, H, T, R, N, P, dtype, seed=0):
    """Inputs as the mixer hands them to the scan: q, k RMS-normed (unit scale) in `dtype`, v in `dtype`,
    adt, dt, λ in fp32; a state, and resets for packed documents."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, H, T, R, N, generator=g) for _ in range(2))
    v = torch.randn(B, H, T, R, P, generator=g)
    dt = torch.rand(B, H, T, generator=g) * 0.1 + 1e-3
    adt = -(torch.rand(B, H, T, generator=g) * 2 + 0.01) * dt
    lam = torch.rand(B, H, T, generator=g)
    state = {
        "h0_BHPN": torch.randn(B, H, P, N, generator=g),
        "k_prev_BRHN": torch.randn(B, R, H, N, generator=g).to(dtype),
        "v_prev_BRHP": torch.randn(B, R, H, P, generator=g).to(dtype),
    }
    reset = torch.rand(B, T, generator=g) < 0.01
    tensors = [q.to(dtype), k.to(dtype), v.to(dtype), adt, dt, lam]
    return [t.to(CUDA) for t in tensors], {n: s.to(CUDA) for n, s in state.items()}, reset.to(CUDA)


def values_and_grads(scan, tensors, state, reset, chunk, autocast):
    """y, h and the gradients of every input and state under fixed random cotangents."""
    inputs = [t.detach().clone().requires_grad_() for t in tensors]
    st = {n: s.detach().clone().requires_grad_() for n, s in state.items()}
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        y, h = scan(*inputs, chunk_size=chunk, reset_BT=reset, **st)
    g = torch.Generator(device=CUDA).manual_seed(7)
    gy = torch.randn(y.shape, generator=g, device=CUDA, dtype=torch.float32)
    gh = torch.randn(h.shape, generator=g, device=CUDA, dtype=torch.float32)
    grads = torch.autograd.grad((y.float() * gy).sum() + (h.float() * gh).sum(), inputs + list(st.values()))
    return [y, h, *grads]


NAMES = ["y", "h", "dq", "dk", "dv", "dadt", "ddt", "dlam", "dh0", "dk_prev", "dv_prev"]


@pytest.mark.parametrize(
    ("R", "N", "P", "chunk", "T"),
    [(1, 128, 64, 64, 1000), (1, 64, 64, 64, 256), (2, 128, 64, 32, 333), (4, 64, 32, 16, 200)],
)
def test_triton_equals_chunked_on_cuda_fp32_values_and_gradients(R, N, P, chunk, T):
    """fp32 (TF32 off here; the kernels may still round their dots to TF32): y, the final state and every
    gradient within 2e-3 of the chunked scan, relative to each tensor's scale; SISO and MIMO, a ragged
    last chunk, from a state, with resets."""
    module = triton_scan()
    if not module.triton_supports(R, N, P, chunk):
        pytest.skip(f"triton_supports({R}, {N}, {P}, {chunk}) is false")
    tensors, state, reset = scan_inputs(2, 4, T, R, N, P, torch.float32)
    want = values_and_grads(chunked_scan, tensors, state, reset, chunk, autocast=False)
    got = values_and_grads(module.triton_chunked_scan, tensors, state, reset, chunk, autocast=False)
    for name, a, b in zip(NAMES, got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert rel_err(a, b) < 2e-3, f"{name}: relative error {rel_err(a, b):.2e}"


@pytest.mark.parametrize(("R", "N", "P", "chunk"), [(1, 128, 64, 64), (2, 128, 64, 32)])
def test_triton_bf16_is_as_accurate_as_chunked_bf16_on_cuda(R, N, P, chunk):
    """bf16 autocast, as the trainer runs: against the fp64 chunked scan of the same (bf16-rounded)
    inputs, the Triton scan's outputs and gradients are no more than 2x the chunked scan's bf16 error
    (+1e-3), and both are under 5%. Output dtypes match the chunked path's."""
    module = triton_scan()
    if not module.triton_supports(R, N, P, chunk):
        pytest.skip(f"triton_supports({R}, {N}, {P}, {chunk}) is false")
    tensors, state, reset = scan_inputs(2, 4, 777, R, N, P, torch.bfloat16)
    exact = values_and_grads(
        chunked_scan,
        [t.double() for t in tensors],
        {n: s.double() for n, s in state.items()},
        reset,
        chunk,
        False,
    )
    chunked = values_and_grads(chunked_scan, tensors, state, reset, chunk, autocast=True)
    got = values_and_grads(module.triton_chunked_scan, tensors, state, reset, chunk, autocast=True)
    for name, a, c, e in zip(NAMES, got, chunked, exact):
        assert a.dtype == c.dtype, f"{name}: {a.dtype} != chunked's {c.dtype}"
        err, ref = rel_err(a, e), rel_err(c, e)
        assert err <= 2 * ref + 1e-3 and err < 0.05, f"{name}: triton {err:.2e}, chunked {ref:.2e}"


@pytest.mark.parametrize("kw", [{}, {"is_mimo": True, "mimo_rank": 2, "chunk_size": 8}, {"ngroups": 2}])
def test_lm_with_triton_equals_chunked_on_cuda(kw):
    """The tiny LM on the GPU with scan_impl=triton: loss and every parameter's gradient == the chunked
    path (fp32), eager, compiled layers, and with (non-reentrant) gradient checkpointing; bf16 autocast
    close and finite."""
    module = triton_scan()
    torch.manual_seed(0)
    model = Mamba3Transformer(tiny_cfg(d_model=64, d_state=32, headdim=16, chunk_size=16, **kw)).to(CUDA)
    mixer = model.layers[0].mixer
    if not module.triton_supports(mixer.mimo_rank, mixer.d_state, mixer.headdim, mixer.chunk_size):
        pytest.skip("the Triton scan does not support the tiny test shape")
    x, y = ids(T=40).to(CUDA), ids(T=40, seed=2).to(CUDA)
    params = list(model.parameters())
    model.set_scan_impl("chunked", CUDA)
    want_loss = model(x, y)
    want = torch.autograd.grad(want_loss, params)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want_bf16 = model(x, y)
    model.set_scan_impl("triton", CUDA)
    assert model.scan_impl == "triton"

    def check(what):
        loss = model(x, y)
        got = torch.autograd.grad(loss, params)
        torch.testing.assert_close(loss, want_loss, rtol=1e-4, atol=1e-4, msg=lambda m: f"{what}: {m}")
        for (name, _), a, b in zip(model.named_parameters(), got, want):
            assert rel_err(a, b) < 2e-3, f"{what} {name}: relative error {rel_err(a, b):.2e}"

    check("eager")
    model.grad_checkpointing = True
    check("checkpointed")
    model.grad_checkpointing = False
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss_bf16 = model(x, y)
    loss_bf16.backward()
    assert abs(loss_bf16.item() - want_bf16.item()) < 0.02
    assert all(torch.isfinite(p.grad).all() for p in params)
    for block in model.layers:
        block.compile()
    check("compiled")


@pytest.mark.parametrize("halves", [False, True], ids=["siso pairs", "mimo halves"])
def test_prologue_kernels_equal_rotation_py_on_cuda(halves):
    """The fused path's prologue kernels (per-head q, k from the per-group normed ones, biases and
    angles; and their five gradients) == rotation.py's PyTorch math on the GPU, fp32, at the 440M
    layer's widths (N = 128, 32 of 64 pairs turning) with 2 groups and a ragged last token block."""
    module = triton_scan()
    from mamba3lite.model.rotation import bias_rotate, bias_rotate_grads

    g = torch.Generator().manual_seed(11)
    B, G, H, T, R, N, S = 2, 2, 8, 203, 2 if halves else 1, 128, 32
    k_hat, q_hat = (torch.randn(B, G, T, R, N, generator=g).to(CUDA) for _ in range(2))
    k_bias, q_bias = (torch.randn(H, R, N, generator=g).to(CUDA) for _ in range(2))
    theta = (torch.rand(B, H, T, S, generator=g) * 6.28).to(CUDA)
    q, k = module._prologue(q_hat, k_hat, q_bias, k_bias, theta, halves, torch.float32)
    k_ref, q_ref = bias_rotate(k_hat, q_hat, k_bias, q_bias, theta, halves, torch.float32)
    assert rel_err(q, q_ref) < 1e-5 and rel_err(k, k_ref) < 1e-5
    dq, dk = (torch.randn(B, H, T, R, N, generator=g).to(CUDA) for _ in range(2))
    got = module._prologue_grads(q_hat, k_hat, q_bias, k_bias, theta, halves, dq, dk)
    dk_ref, dq_ref, dkb_ref, dqb_ref, dth_ref = bias_rotate_grads(
        theta, k_ref, q_ref, dk, dq, halves, G, torch.float32
    )
    for name, a, b in zip(
        ["dq_hat", "dk_hat", "dq_bias", "dk_bias", "dtheta"], got, (dq_ref, dk_ref, dqb_ref, dkb_ref, dth_ref)
    ):
        assert rel_err(a, b) < 1e-5, f"{name}: relative error {rel_err(a, b):.2e}"


@pytest.mark.parametrize("halves", [False, True], ids=["siso pairs", "mimo halves"])
def test_rotated_scan_bf16_is_as_accurate_as_the_unfused_chunked_path_on_cuda(halves):
    """triton_rotated_scan under bf16 autocast (the mixer's training path) against the fp64 unfused
    composition (bias_rotate, then the chunked scan): outputs and the gradients of all nine inputs no
    more than 2x the unfused bf16 chunked path's error (+1e-3), and both under 5%."""
    module = triton_scan()
    from mamba3lite.model.mamba3 import _bias_rotate_autograd

    R, L = (2, 32) if halves else (1, 64)
    g = torch.Generator().manual_seed(12)
    B, G, H, T, N, P, S = 2, 1, 4, 333, 128, 64, 32
    tensors = [
        *(torch.randn(B, G, T, R, N, generator=g) for _ in range(2)),  # k̂, q̂ (unit RMS, as normed)
        *(torch.randn(H, R, N, generator=g) * 0.5 + 1 for _ in range(2)),  # the biases (init 1)
        torch.rand(B, H, T, S, generator=g) * 6.28,
        torch.randn(B, H, T, R, P, generator=g),
    ]
    dt = torch.rand(B, H, T, generator=g) * 0.1 + 1e-3
    tensors += [-(torch.rand(B, H, T, generator=g) * 2 + 0.01) * dt, dt, torch.rand(B, H, T, generator=g)]
    reset = (torch.rand(B, T, generator=g) < 0.01).to(CUDA)
    tensors = [t.to(CUDA) for t in tensors]

    def unfused(k_hat, q_hat, kb, qb, theta, v, adt, dt, lam, chunk_size, reset_BT):
        out_dtype = torch.bfloat16 if torch.is_autocast_enabled("cuda") else k_hat.dtype
        k, q = _bias_rotate_autograd(k_hat, q_hat, kb, qb, theta, halves, out_dtype)
        return chunked_scan(q, k, v, adt, dt, lam, chunk_size=chunk_size, reset_BT=reset_BT)

    def fused(k_hat, q_hat, kb, qb, theta, v, adt, dt, lam, chunk_size, reset_BT):
        return module.triton_rotated_scan(
            k_hat, q_hat, kb, qb, theta, halves, v, adt, dt, lam, chunk_size=chunk_size, reset_BT=reset_BT
        )

    def run(fn, inputs, autocast):
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            y, h = fn(*leaves, L, reset)
        gen = torch.Generator(device=CUDA).manual_seed(7)
        gy = torch.randn(y.shape, generator=gen, device=CUDA)
        gh = torch.randn(h.shape, generator=gen, device=CUDA)
        return [y, h, *torch.autograd.grad((y.float() * gy).sum() + (h.float() * gh).sum(), leaves)]

    exact = run(unfused, [t.double() for t in tensors], False)
    chunked = run(unfused, tensors, True)
    got = run(fused, tensors, True)
    names = ["y", "h", "dk_hat", "dq_hat", "dk_bias", "dq_bias", "dtheta", "dv", "dadt", "ddt", "dlam"]
    for name, a, c, e in zip(names, got, chunked, exact):
        assert a.dtype == c.dtype, f"{name}: {a.dtype} != the unfused path's {c.dtype}"
        err, ref = rel_err(a, e), rel_err(c, e)
        assert err <= 2 * ref + 1e-3 and err < 0.05, f"{name}: fused {err:.2e}, unfused chunked {ref:.2e}"


@pytest.mark.parametrize("R", [1, 4])
def test_triton_decode_step_equals_scan_step_on_cuda(R):
    """The fused decode kernel at the 440M widths (32 heads, N 128, P 64), SISO and MIMO rank 4, with a
    reset row, == scan.scan_step to fp32 rounding in its dtypes: from fp32 inputs, and from bf16 ones with
    an fp32 state as the cache holds them (both compute in fp32 from the same bf16 values)."""
    module = triton_scan()
    (q, k, v, adt, dt, lam), state, _ = scan_inputs(3, 32, 1, R, 128, 64, torch.float32)
    inputs = [q[:, :, 0], k[:, :, 0], v[:, :, 0], adt[..., 0], dt[..., 0], lam[..., 0], *state.values()]
    reset = torch.tensor([False, True, False], device=CUDA)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-5)):
        cast = [x.to(dtype) if i in (0, 1, 2, 7, 8) else x for i, x in enumerate(inputs)]
        with torch.no_grad():
            want = module.scan_step(*cast, reset)
            got = module.triton_scan_step(*cast, reset)
        for name, a, b in zip(("y", "h"), got, want):
            assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape, name
            assert rel_err(a, b) < tol, f"{dtype} {name}: relative error {rel_err(a, b):.2e}"


@pytest.mark.parametrize("kw", [{}, {"is_mimo": True, "mimo_rank": 2, "chunk_size": 8}])
def test_teacher_forced_decode_with_triton_equals_forward_on_cuda(kw):
    """scan_impl=triton on the GPU (fp32): prefill (the Triton scan from a cache) + the fused step kernel
    token by token, across EOS resets, == the chunked forward's logits."""
    module = triton_scan()
    model = make_model(reset_at_eos=True, dtype=torch.float32, **kw).to(CUDA)
    x = ids(T=25)
    x[:, 9] = x[:, 17] = EOS
    x = x.to(CUDA)
    model.set_scan_impl("chunked", CUDA)
    with torch.no_grad():
        logits = model(x)
        model.set_scan_impl("triton", CUDA)
        calls = []
        step = module.triton_scan_step
        module.triton_scan_step = lambda *a: calls.append(1) or step(*a)
        try:
            cache = model.allocate_cache(2)
            first, _ = model.prefill(x[:, :11], cache)
            steps = [first] + [model.step(x[:, t], cache) for t in range(11, 25)]
        finally:
            module.triton_scan_step = step
    assert len(calls) == 14 * len(model.layers)
    assert rel_err(torch.stack(steps, dim=1), logits[:, 10:]) < 1e-4
