"""The Triton scan (model/scan_triton.py) under the Triton interpreter on the CPU: forward, final state
and every gradient == the sequential reference (the spec), for SISO and MIMO, several chunk sizes,
ragged T, from a state, with resets, ngroups-2 inputs; through the mixer and the whole LM; under
gradient checkpointing and torch.compile. The compiled kernels on a GPU are tests/test_cuda.py's.

Tolerance. The kernels compute in fp32 (the interpreter has no other float), the reference in float64,
so results agree to fp32 rounding: each output is a sum of at most L·R·(N + P) products, which gives
relative errors around 1e-7..1e-6 of the largest value (measured). `close` asks for 2e-5 of the
largest value elementwise: 20x margin over that, while any missing or wrong term (a dropped decay, a
mask off by one token, a gradient through one path only) is off by 1e-3 or more.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch

pytest.importorskip("triton")

from mamba3lite.errors import ConfigError
from mamba3lite.model import (
    Mamba3Transformer,
    ModelConfig,
    scan_triton,
)
from mamba3lite.model.mamba3 import Mamba3, _bias_rotate_autograd
from mamba3lite.model.scan import chunked_scan, scan_step, sequential_scan
from mamba3lite.model.scan_triton import triton_chunked_scan, triton_supports, triton_unavailable_reason
from test_scan import make_inputs, make_state

F64 = torch.float64
CPU = torch.device("cpu")


@pytest.fixture(autouse=True, scope="module")
def interpreter():
    """TRITON_INTERPRET=1 for this module's tests only (triton reads it when the kernels are first
    built). With CUDA present the kernels are the compiled ones (test_cuda.py); one process cannot hold
    both, so these tests skip there."""
    if torch.cuda.is_available():
        pytest.skip("interpreter tests run on CPU-only machines; tests/test_cuda.py checks the GPU kernels")
    import triton

    if scan_triton._version(triton.__version__) < (3, 7):  # a GPU build still works from 3.3 on
        pytest.fail(
            f"the Triton interpreter of triton {triton.__version__} cannot run these kernels under numpy "
            "2.4 (it converts 1-element arrays to scalars, which numpy now refuses); the tests need "
            "triton >= 3.7, as the dev extra pins: pip install 'triton>=3.7'"
        )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        reason = triton_unavailable_reason(CPU)
        if reason is not None:
            pytest.skip(reason)
        yield


def close(actual: torch.Tensor, expected: torch.Tensor, what: str = "", rel: float = 2e-5) -> None:
    """Equal to fp32 rounding (module docstring): elementwise within `rel` of the largest |expected|."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    scale = expected.abs().max().item()
    torch.testing.assert_close(
        actual, expected, rtol=0, atol=rel * max(scale, 1e-30), msg=lambda m: f"{what}: {m}"
    )


def scan_and_grads(fn, R, T, resets, from_state, H=3, N=8, P=4, **kw):
    (q, k, v, adt, dt, lam), reset = make_inputs(R=R, T=T, H=H, N=N, P=P, resets=resets, requires_grad=True)
    if resets:
        reset[0, 0] = True  # a reset on the very first token drops the given state (row 0)
        reset[1, :3] = False  # row 1 uses it
    state = make_state(R=R, H=H, N=N, P=P) if from_state else {}
    state = {name: t.requires_grad_() for name, t in state.items()}
    leaves = [q, k, v, adt, dt, lam, *state.values()]
    g = torch.Generator().manual_seed(3)
    w_y = torch.randn(2, H, T, R, P, generator=g, dtype=F64)
    w_h = torch.randn(2, H, P, N, generator=g, dtype=F64)
    y, h = fn(q, k, v, adt, dt, lam, reset_BT=reset, **state, **kw)
    grads = torch.autograd.grad((y * w_y).sum() + (h * w_h).sum(), leaves)
    return y, h, grads


CASES = [  # (R, chunk, T, resets, from_state)
    (1, 8, 29, False, False),
    (1, 16, 37, True, True),
    (1, 64, 70, True, True),
    (1, 64, 20, False, True),  # one chunk, shorter than chunk_size
    (2, 8, 23, True, True),
    (2, 32, 45, False, False),  # the official MIMO chunk 64/R
    (4, 16, 40, True, True),
]


@pytest.mark.parametrize("R, chunk, T, resets, from_state", CASES)
def test_forward_state_and_every_gradient_equal_sequential(R, chunk, T, resets, from_state):
    y, h, grads = scan_and_grads(
        functools.partial(triton_chunked_scan, chunk_size=chunk), R, T, resets, from_state
    )
    y_ref, h_ref, grads_ref = scan_and_grads(sequential_scan, R, T, resets, from_state)
    close(y, y_ref)
    close(h, h_ref)
    names = ["q", "k", "v", "adt", "dt", "lam", "h0", "k_prev", "v_prev"]
    for name, a, b in zip(names, grads, grads_ref):
        assert b.abs().max() > 1e-3, name  # every input matters, else its check would be vacuous
        close(a, b, name)


def test_head_dim_split_over_several_state_programs_equals_sequential():
    """P = 40 > STATE_BLOCK_P: the state kernels split the columns over two programs per (row, head), the
    second partly masked; N = 24 is not a power of two either (masked rows of the state)."""
    assert scan_triton.STATE_BLOCK_P < 40 < 2 * scan_triton.STATE_BLOCK_P
    shape = {"R": 2, "T": 21, "resets": True, "from_state": True, "H": 2, "N": 24, "P": 40}
    y, h, grads = scan_and_grads(functools.partial(triton_chunked_scan, chunk_size=8), **shape)
    y_ref, h_ref, grads_ref = scan_and_grads(sequential_scan, **shape)
    close(y, y_ref)
    close(h, h_ref)
    for name, a, b in zip(["q", "k", "v", "adt", "dt", "lam", "h0", "k_prev", "v_prev"], grads, grads_ref):
        close(a, b, name)


def test_ngroups_2_inputs_equal_sequential():
    """q, k shared by the heads of a group (the mixer expands them per head before the scan): the
    gradients of the group tensors sum over their heads in both paths."""
    (_, _, v, adt, dt, lam), reset = make_inputs(H=4, T=27, resets=True)
    g = torch.Generator().manual_seed(4)
    qg, kg = (torch.randn(2, 2, 27, 1, 8, generator=g, dtype=F64).requires_grad_() for _ in range(2))
    results = []
    for fn in (functools.partial(triton_chunked_scan, chunk_size=8), sequential_scan):
        q, k = (x.repeat_interleave(2, dim=1) for x in (qg, kg))  # group G -> heads 2G, 2G+1
        y, h = fn(q, k, v, adt, dt, lam, reset_BT=reset)
        loss = (y * torch.linspace(-1, 1, y.numel(), dtype=F64).view_as(y)).sum() + h.square().sum()
        results.append((y, h, *torch.autograd.grad(loss, (qg, kg))))
    for a, b in zip(*results):
        close(a, b)


@pytest.mark.parametrize("use", ["y", "h"])
def test_one_output_unused(use):
    """When the loss uses only y or only h, autograd hands the op no gradient for the other."""
    (q, k, v, adt, dt, lam), _ = make_inputs(T=19, requires_grad=True)
    results = []
    for fn in (functools.partial(triton_chunked_scan, chunk_size=8), sequential_scan):
        y, h = fn(q, k, v, adt, dt, lam)
        out = y if use == "y" else h
        grads = torch.autograd.grad(out.square().sum(), (q, k, v, adt, dt, lam), allow_unused=True)
        results.append([torch.zeros_like(q) if gr is None else gr for gr in grads])  # h needs no q
    for a, b in zip(*results):
        close(a, b)


def test_strong_decay_and_fp32_inputs():
    """fp32 inputs give fp32 outputs (chunked_scan's dtypes); ΔA of −hundreds (α ≈ 0) gives no NaN."""
    (q, k, v, adt, dt, lam), reset = make_inputs(T=50, R=2, resets=True)
    adt = adt * 200
    args = [x.float() for x in (q, k, v, adt, dt, lam)]
    y, h = triton_chunked_scan(*args, chunk_size=16, reset_BT=reset)
    y_ref, h_ref = chunked_scan(*args, chunk_size=16, reset_BT=reset)
    assert y.dtype == y_ref.dtype == torch.float32 and h.dtype == h_ref.dtype == torch.float32
    assert torch.isfinite(y).all() and torch.isfinite(h).all()
    y64, h64 = sequential_scan(q, k, v, adt, dt, lam, reset_BT=reset)
    close(y.double(), y64, "y", rel=1e-5)
    close(h.double(), h64, "h", rel=1e-5)


def test_bf16_autocast_dtypes_and_values():
    """Under autocast y leaves in the autocast dtype and the state in fp32 (chunked_scan's contract).
    The op gets q, k, v in bf16, as the kernels do on a GPU; the interpreter computes on them in fp32
    (numpy has no bf16), so y is exactly the fp32 result on the bf16-rounded inputs, rounded to bf16."""
    (q, k, v, adt, dt, lam), reset = make_inputs(T=50, R=2, resets=True)
    args = [x.float() for x in (q, k, v, adt, dt, lam)]
    rounded = [x.to(torch.bfloat16).float() for x in args[:3]] + args[3:]
    y32, h32 = triton_chunked_scan(*rounded, chunk_size=16, reset_BT=reset)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, h = triton_chunked_scan(*args, chunk_size=16, reset_BT=reset)
        y_ref, h_ref = chunked_scan(*args, chunk_size=16, reset_BT=reset)
    assert y.dtype == y_ref.dtype == torch.bfloat16 and h.dtype == h_ref.dtype == torch.float32
    torch.testing.assert_close(y, y32.to(torch.bfloat16), rtol=0, atol=0)
    torch.testing.assert_close(h, h32, rtol=0, atol=0)
    assert (y.float() - y_ref.float()).abs().max() / y_ref.float().abs().max() < 0.03  # bf16 matmuls there


def test_empty_and_single_token():
    state = make_state()
    (q, k, v, adt, dt, lam), _ = make_inputs(T=0)
    y, h = triton_chunked_scan(q, k, v, adt, dt, lam, chunk_size=8, **state)
    assert y.shape == (2, 3, 0, 1, 4)
    torch.testing.assert_close(h, state["h0_BHPN"])  # nothing scanned: the state comes back
    (q, k, v, adt, dt, lam), _ = make_inputs(T=1)
    y, h = triton_chunked_scan(q, k, v, adt, dt, lam, chunk_size=8, **state)
    y_ref, h_ref = sequential_scan(q, k, v, adt, dt, lam, **state)
    close(y, y_ref)
    close(h, h_ref)


def test_availability_and_supported_shapes(monkeypatch):
    assert triton_unavailable_reason(CPU) is None  # the fixture set TRITON_INTERPRET=1
    monkeypatch.delenv("TRITON_INTERPRET")
    reason = triton_unavailable_reason(CPU)
    assert reason is not None and "TRITON_INTERPRET=1" in reason
    (q, k, v, adt, dt, lam), _ = make_inputs(T=5)
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        triton_chunked_scan(q, k, v, adt, dt, lam, chunk_size=8)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_supports(1, 128, 64, 64) and triton_supports(4, 128, 64, 16)
    assert not triton_supports(4, 128, 64, 64)  # 256 rows per chunk
    assert not triton_supports(5, 16, 16, 8) and not triton_supports(1, 512, 64, 64)
    (q, k, v, adt, dt, lam), _ = make_inputs(T=40, R=2)
    with pytest.raises(ConfigError, match="chunk_size"):
        triton_chunked_scan(q, k, v, adt, dt, lam, chunk_size=64)


def test_device_reasons(monkeypatch):
    assert "CUDA" in triton_unavailable_reason(torch.device("meta"))
    import triton

    for version in ("3.2.0", "2.3.1", "garbage"):  # older than the kernels build with (3.2 aborts)
        monkeypatch.setattr(triton, "__version__", version)
        monkeypatch.setattr(scan_triton, "_triton_ok", False)  # (kept once found good: look again)
        reason = triton_unavailable_reason(CPU)
        assert reason and f"triton >= 3.3, found {version}" in reason, reason
    for version in ("3.3.1", "3.10.0+git5bd3f2a"):
        monkeypatch.setattr(triton, "__version__", version)
        assert triton_unavailable_reason(CPU) is None
    monkeypatch.setattr(scan_triton, "_triton_ok", False)
    monkeypatch.setitem(__import__("sys").modules, "triton", None)  # as if not installed
    assert "pip install triton" in triton_unavailable_reason(CPU)


# ---- through the mixer and the LM ----


def use_triton(model: torch.nn.Module) -> None:
    """Put every mixer on the Triton backend, bound for the CPU now (set_scan_impl with a device), so
    that no first forward can re-resolve it to another backend; and check that it took."""
    model.set_scan_impl("triton", torch.device("cpu"))
    mixers = [m for m in model.modules() if isinstance(m, Mamba3)]
    assert mixers and all(m.scan_impl == "triton" for m in mixers)


MIXERS = [
    {},
    {"is_outproj_norm": True},
    {"is_mimo": True, "mimo_rank": 2, "chunk_size": 8},
    {"is_mimo": True, "mimo_rank": 4, "is_outproj_norm": True, "chunk_size": 4},
    {"ngroups": 2},
    {"rope": False},  # the fused op with biases and no rotation
]


def mixer_id(kw: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in kw.items()) or "siso"


@pytest.mark.parametrize("kw", MIXERS, ids=mixer_id)
def test_mixer_output_and_every_parameter_gradient_equal_sequential(kw):
    """The layer (4 heads of 8: 2 per group with ngroups 2), output and every parameter's gradient, and
    from a cache (prefill, then the rest with a reset), triton == sequential."""
    torch.manual_seed(0)
    layer = Mamba3(16, **{"d_state": 16, "headdim": 8, "chunk_size": 8, **kw}).to(F64)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.2 * torch.randn_like(p))
    u = torch.randn(2, 21, 16, generator=torch.Generator().manual_seed(1), dtype=F64)
    reset = torch.zeros(2, 21, dtype=torch.bool)
    reset[0, 6] = reset[1, 15] = True
    w = torch.randn(2, 21, 16, generator=torch.Generator().manual_seed(2), dtype=F64)
    results = []
    for impl in ("triton", "sequential"):
        if impl == "triton":
            use_triton(layer)
        else:
            layer.set_scan_impl("sequential")
        out = layer(u, reset_BT=reset)
        params = dict(layer.named_parameters())
        grads = torch.autograd.grad((out * w).sum(), list(params.values()))
        with torch.no_grad():  # from a state, as after a prefill (the cache is updated in place)
            cache = layer.allocate_state(2, dtype=F64)
            layer(u[:, :5], state=cache)
            resumed = layer(u[:, 5:], state=cache, reset_BT=reset[:, 5:])
        results.append((out, resumed, cache.ssm_BHPN, dict(zip(params, grads))))
    (out, resumed, h, grads), (out_ref, resumed_ref, h_ref, grads_ref) = results
    close(out, out_ref, "out")
    close(resumed, resumed_ref, "out from a cache")
    close(h, h_ref, "final state")
    for name in grads_ref:
        close(grads[name], grads_ref[name], name)


def tiny_lm(**kw) -> Mamba3Transformer:
    cfg = {
        "vocab_size": 61, "d_model": 16, "n_layers": 2, "d_intermediate": 40, "mlp_multiple_of": 8,
        "d_state": 16, "headdim": 8, "chunk_size": 8, "eos_id": 3, **kw,
    }  # fmt: skip
    torch.manual_seed(0)
    model = Mamba3Transformer(ModelConfig(**cfg)).to(F64)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def lm_loss_and_grads(model, ids_BT):
    loss = model(ids_BT[:, :-1], ids_BT[:, 1:])
    names, params = zip(*model.named_parameters())
    return loss, dict(zip(names, torch.autograd.grad(loss, params)))


@pytest.mark.parametrize("checkpointing", [False, True])
def test_lm_loss_and_gradients_equal_the_chunked_path(checkpointing, monkeypatch):
    """The whole LM with packed documents (EOS resets): loss and every gradient, triton == chunked;
    also with non-reentrant gradient checkpointing (each layer's scan runs again in the backward)."""
    ids_BT = torch.randint(4, 61, (2, 22), generator=torch.Generator().manual_seed(1))
    ids_BT[0, 9] = ids_BT[1, 17] = 3  # EOS: the next token starts a fresh state (chunks 1 and 2 of 3)
    model = tiny_lm(reset_at_eos=True)
    loss_ref, grads_ref = lm_loss_and_grads(model, ids_BT)
    use_triton(model)
    calls = []  # the forward kernels' launches: checkpointing runs each layer's twice
    run_forward = scan_triton._run_forward
    monkeypatch.setattr(
        scan_triton, "_run_forward", lambda *a, **kw: calls.append(kw["with_y"]) or run_forward(*a, **kw)
    )
    model.grad_checkpointing = checkpointing
    model.train()
    loss, grads = lm_loss_and_grads(model, ids_BT)
    # 2 layers; each backward also reruns the state kernel (with_y False) for the chunk-start states
    assert calls.count(True) == 2 * (2 if checkpointing else 1) and calls.count(False) == 2
    close(loss, loss_ref)
    for name in grads_ref:
        close(grads[name], grads_ref[name], name)


def step_inputs(B=3, H=2, R=1, N=24, P=40, seed=0) -> list[torch.Tensor]:
    """scan_step's inputs at T = 1 (float64): the last token of make_inputs, and a state."""
    (q, k, v, adt, dt, lam), _ = make_inputs(B=B, H=H, T=1, R=R, N=N, P=P, seed=seed)
    state = make_state(B=B, H=H, R=R, N=N, P=P, seed=seed + 1)
    return [q[:, :, 0], k[:, :, 0], v[:, :, 0], adt[..., 0], dt[..., 0], lam[..., 0], *state.values()]


STEPS = [  # (R, N, P): P = 40 spans three 16-row blocks of the state, the last one partial
    (1, 24, 40),
    (2, 8, 5),
    (4, 16, 16),
]


@pytest.mark.parametrize("R, N, P", STEPS)
@pytest.mark.parametrize("resets", [False, True])
def test_step_kernel_equals_scan_step(R, N, P, resets):
    """One decode token: y and the new state == scan.scan_step, in its dtypes (float64 here, computed
    at fp32), with a reset row (its state and the previous token's term dropped)."""
    inputs = step_inputs(R=R, N=N, P=P)
    reset = torch.tensor([True, False, False]) if resets else None
    y_ref, h_ref = scan_step(*inputs, reset)
    y, h = scan_triton.triton_scan_step(*inputs, reset)
    close(y, y_ref, "y")
    close(h, h_ref, "h")
    # every term matters (else the check above would be vacuous): drop one input's contribution
    for i, name in ((6, "h"), (7, "k_prev"), (2, "v")):
        dropped = [torch.zeros_like(x) if j == i else x for j, x in enumerate(inputs)]
        assert (scan_step(*dropped, reset)[1] - h_ref).abs().max() > 1e-2 * h_ref.abs().max(), name


def test_step_kernel_dtypes_and_grad_mode():
    """bf16 inputs with an fp32 state: y and h in fp32, as scan_step. Where autograd records, the step
    is scan_step itself (differentiable); without grad the kernel runs (no graph)."""
    inputs = step_inputs()
    mixed = [x.to(torch.bfloat16) if i in (0, 1, 2, 7, 8) else x.float() for i, x in enumerate(inputs)]
    y_ref, h_ref = scan_step(*mixed)
    y, h = scan_triton.triton_scan_step(*mixed)
    close(y, y_ref, "y")
    close(h, h_ref, "h")
    leaves = [x.detach().requires_grad_() for x in inputs]
    y, h = scan_triton.triton_scan_step(*leaves)
    grads = torch.autograd.grad(y.sum() + h.sum(), leaves)
    grads_ref = torch.autograd.grad(sum(t.sum() for t in scan_step(*leaves)), leaves)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b)
    with torch.no_grad():
        assert scan_triton.triton_scan_step(*leaves)[0].grad_fn is None


@pytest.mark.parametrize("kw", MIXERS[:4], ids=mixer_id)
def test_mixer_decode_steps_run_the_step_kernel_and_equal_sequential(kw, monkeypatch):
    """Prefill, then token-by-token decode (a reset on one row midway): the Triton backend's step is
    the fused kernel, and its outputs and final state == the sequential backend's."""
    torch.manual_seed(0)
    layer = Mamba3(32, **{"d_state": 16, "headdim": 8, "chunk_size": 8, **kw}).to(F64)
    u = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(1), dtype=F64)
    launches = []
    step = scan_triton.triton_scan_step
    monkeypatch.setattr(scan_triton, "triton_scan_step", lambda *a: launches.append(1) or step(*a))
    results = []
    for impl in ("triton", "sequential"):
        layer.set_scan_impl(impl, CPU)
        with torch.no_grad():
            cache = layer.allocate_state(2, dtype=F64)
            outs = [layer(u[:, :4], state=cache)]
            for t in range(4, 9):
                reset = torch.tensor([t == 6, False])
                outs.append(layer.step(u[:, t], cache, reset)[:, None])
        results.append((torch.cat(outs, 1), cache.ssm_BHPN.clone()))
    assert len(launches) == 5
    close(results[0][0], results[1][0], "outputs")
    close(results[0][1], results[1][1], "final state")


def rotated_scan_inputs(T=21, R=2, H=4, G=2, N=8, P=4, S=3):
    """Inputs of triton_rotated_scan (fp32, all requiring grad but the resets): per-group q̂, k̂, per-head
    biases, angles, v and the per-token scalars."""
    (_, _, v, adt, dt, lam), reset = make_inputs(T=T, R=R, H=H, N=N, P=P, resets=True)
    g = torch.Generator().manual_seed(6)
    k_hat, q_hat = (torch.randn(2, G, T, R, N, generator=g) for _ in range(2))
    k_bias, q_bias = (torch.randn(H, R, N, generator=g) for _ in range(2))
    theta = torch.rand(2, H, T, S, generator=g) * 6
    tensors = [k_hat, q_hat, k_bias, q_bias, theta, v.float(), adt.float(), dt.float(), lam.float()]
    return [t.detach().requires_grad_() for t in tensors], reset


@pytest.mark.parametrize("fused", [False, True], ids=["triton_chunked_scan", "triton_rotated_scan"])
def test_op_under_torch_compile(fused):
    """torch.compile traces through the wrapper; the kernels are one opaque custom op (its fake
    implementation gives the shapes), forward and backward; with the fused bias + rotation too.
    aot_eager: no C++ compiler needed. Two chunks, the second ragged, and 2 heads on 1 group: the
    smallest shapes where the fake implementation's shapes (per head, not per group) can be wrong."""
    if fused:
        args, reset = rotated_scan_inputs(T=9, H=2, G=1)
        halves = True
        fn = functools.partial(scan_triton.triton_rotated_scan, chunk_size=8, reset_BT=reset)
        fn_args = lambda a: (*a[:5], halves, *a[5:])  # noqa: E731
    else:
        (q, k, v, adt, dt, lam), reset = make_inputs(T=9, R=2, H=2, resets=True, requires_grad=True)
        args = [x.detach().float().requires_grad_() for x in (q, k, v, adt, dt, lam)]
        fn = functools.partial(triton_chunked_scan, chunk_size=8, reset_BT=reset)
        fn_args = lambda a: a  # noqa: E731
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    results = []
    for f in (fn, compiled):
        y, h = f(*fn_args(args))
        results.append((y, h, *torch.autograd.grad(y.square().sum() + h.sum(), args)))
    for a, b in zip(*results):
        close(a, b, rel=1e-6)


@pytest.mark.parametrize(
    "kw", [{}, pytest.param({"is_mimo": True, "mimo_rank": 2}, marks=pytest.mark.slow)], ids=["siso", "mimo"]
)
def test_a_block_with_the_triton_scan_compiles_as_one_graph(kw):
    """What the trainer compiles (each block, training.compile): with the triton backend, forward and
    backward in one graph (fullgraph=True: any graph break is an error), in fp32 equal to the eager
    block, and under bf16 autocast as the trainer runs it. A break per layer (once: an import on every
    call) splits the compiled layer and stops the fusion of the ops around the op. aot_eager: no C++
    compiler needed."""
    model = tiny_lm(n_layers=1, headdim=16, reset_at_eos=True, **kw).float()  # 2 heads
    use_triton(model)
    block = model.layers[0]
    x = torch.randn(2, 13, 16, generator=torch.Generator().manual_seed(4), requires_grad=True)
    reset = torch.zeros(2, 13, dtype=torch.bool)  # two chunks, the second ragged
    reset[0, 5] = True
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    results = []
    for f in (block, compiled):
        out = f(x, reset)
        results.append((out, *torch.autograd.grad(out.square().sum(), [x, *block.parameters()])))
    for a, b in zip(*results):
        close(a, b, rel=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = compiled(x, reset)
    grads = torch.autograd.grad(out.float().square().sum(), [x, *block.parameters()])
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("halves", [False, True], ids=["siso pairs", "mimo halves"])
def test_rotated_scan_equals_bias_rotate_then_the_scan(halves):
    """triton_rotated_scan == rotation.bias_rotate then the sequential scan, output, state and the
    gradients of all nine inputs (ngroups 2: the per-group gradients sum over their heads), and its
    autograd graph keeps no per-head (B, H, T, R, N) tensor."""
    args, reset = rotated_scan_inputs()
    y, h = scan_triton.triton_rotated_scan(*args[:5], halves, *args[5:], chunk_size=8, reset_BT=reset)
    grads = torch.autograd.grad((y * y.detach().sin()).sum() + h.square().sum(), args)
    k_hat, q_hat, k_bias, q_bias, theta, *rest = [a.double() for a in args]
    k, q = _bias_rotate_autograd(k_hat, q_hat, k_bias, q_bias, theta, halves, F64)
    y_ref, h_ref = sequential_scan(q, k, *rest, reset_BT=reset)
    grads_ref = torch.autograd.grad(
        (y_ref * y.detach().double().sin()).sum() + h_ref.square().sum(),
        [k_hat, q_hat, k_bias, q_bias, theta, *rest],
    )
    close(y, y_ref.float())
    close(h, h_ref.float())
    names = ["k_hat", "q_hat", "k_bias", "q_bias", "theta", "v", "adt", "dt", "lam"]
    for name, a, b in zip(names, grads, grads_ref):
        assert b.abs().max() > 1e-3, name
        close(a, b.float(), name, rel=2e-5)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        scan_triton.triton_rotated_scan(*args[:5], halves, *args[5:], chunk_size=8, reset_BT=reset)
    per_head = (2, 4, 21, 2, 8)
    assert saved and per_head not in [tuple(s) for s in saved], saved


@pytest.mark.parametrize("halves", [False, True], ids=["siso pairs", "mimo halves"])
@pytest.mark.parametrize("with_theta", [True, False], ids=["rotated", "no rope"])
def test_prologue_kernels_equal_rotation_py(halves, with_theta):
    """The prologue's kernels == rotation.bias_rotate and bias_rotate_grads, values and all five
    gradients, at a shape that masks everywhere: N = 24 channels in a 32-wide block, 3 ranks, 5 of 12
    pairs turning, T = 19 tokens in blocks of 8, 6 heads in 2 groups."""
    from mamba3lite.model.rotation import bias_rotate, bias_rotate_grads

    g = torch.Generator().manual_seed(8)
    B, G, H, T, R, N, S = 2, 2, 6, 19, 3, 24, 5
    k_hat, q_hat = (torch.randn(B, G, T, R, N, generator=g) for _ in range(2))
    k_bias, q_bias = (torch.randn(H, R, N, generator=g) for _ in range(2))
    theta = torch.rand(B, H, T, S, generator=g) * 6 if with_theta else None
    q, k = scan_triton._prologue(q_hat, k_hat, q_bias, k_bias, theta, halves, torch.float32)
    k_ref, q_ref = bias_rotate(k_hat, q_hat, k_bias, q_bias, theta, halves, torch.float32)
    close(q, q_ref, "q")
    close(k, k_ref, "k")
    dq, dk = (torch.randn(B, H, T, R, N, generator=g) for _ in range(2))
    got = scan_triton._prologue_grads(q_hat, k_hat, q_bias, k_bias, theta, halves, dq, dk)
    dk_ref, dq_ref, dkb_ref, dqb_ref, dth_ref = bias_rotate_grads(
        theta, k_ref, q_ref, dk, dq, halves, G, torch.float32
    )
    for name, a, b in zip(
        ["dq_hat", "dk_hat", "dq_bias", "dk_bias"], got, (dq_ref, dk_ref, dqb_ref, dkb_ref)
    ):
        close(a, b, name)
    assert (got[4] is None) == (dth_ref is None)
    if with_theta:
        close(got[4], dth_ref, "dtheta")


@pytest.mark.parametrize("prologue", [False, True], ids=["per-head q k v", "bias, rotation, mimo values"])
def test_custom_ops_pass_opcheck(prologue):
    """torch.library.opcheck: the ops' schemas, fake implementations (the shapes, dtypes and strides
    torch.compile plans with) and autograd registration agree with the real kernels; with per-head
    q, k and v (triton_chunked_scan) and with per-group q̂, k̂, biases, angles and MIMO's raw x with its
    per-rank scale (triton_rotated_scan)."""
    B, H, T, R, N, P, L = 1, 2, 11, 2, 16, 16, 8
    nc = 2  # the second chunk ragged (T < nc·L)
    g = torch.Generator().manual_seed(0)
    G = 1 if prologue else H
    q, k = (torch.randn(B, G, T, R, N, generator=g).requires_grad_() for _ in range(2))
    biases_theta = (None, None, None)
    if prologue:
        theta = torch.rand(B, H, T, 4, generator=g) * 6
        biases_theta = (*(torch.randn(H, R, N, generator=g).requires_grad_() for _ in range(2)), theta)
    v = torch.randn(B, H, T, 1 if prologue else R, P, generator=g).requires_grad_()  # MIMO's raw x
    v_scale = torch.randn(H, R, P, generator=g).requires_grad_() if prologue else None
    cs = -torch.rand(B, H, nc, L, generator=g).cumsum(-1).reshape(B, H, nc * L)
    scale, gamma = (torch.rand(B, H, nc * L, generator=g).requires_grad_() for _ in range(2))
    seg = torch.zeros(B, nc * L, dtype=torch.int32)
    seg[:, 10:16] = 1
    S0 = torch.randn(B, H, N, P, generator=g).requires_grad_()
    args = (
        q,
        k,
        *biases_theta,
        prologue,
        v,
        v_scale,
        cs.requires_grad_(),
        scale,
        gamma,
        seg,
        S0,
        L,
        torch.float32,
    )
    tests = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(scan_triton._triton_scan, args, test_utils=tests)
    dy, dh = torch.randn(B, H, T, R, P, generator=g), torch.randn(B, H, P, N, generator=g)
    detached = [x.detach() if isinstance(x, torch.Tensor) else x for x in args[:-2]]
    bwd_args = (*detached, dy, dh, L, torch.float32)
    torch.library.opcheck(
        scan_triton._triton_scan_backward, bwd_args, test_utils=("test_schema", "test_faketensor")
    )


@pytest.mark.slow
def test_kernels_compile_for_a_gpu():
    """The kernels (the scan's, the prologue's and the decode step's) compile for sm_90 (H100/H200)
    with the ptxas bundled with triton, no GPU needed: the interpreter alone would accept code the GPU
    compiler rejects. A subprocess, since this process built them for the interpreter
    (tests/triton_aot.py; it prints registers and spills per kernel)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("triton_aot.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    compiled = 3 * 7  # three shapes × ((state, chunk, prologue) × (forward, backward) + the decode step)
    assert proc.stdout.count(": ok,") == compiled, proc.stdout
    # and each fits the H100/H200's 227 KiB of shared memory per block at one pipeline stage
    shared = [int(n) for n in re.findall(r"shared (\d+) B", proc.stdout)]
    assert len(shared) == compiled and max(shared) <= 227 * 1024, proc.stdout
