"""The attention layer of hybrids (model/attention.py): the official MHA's signature and state_dict, the
layer against the official forward restated, SDPA against the written-out reference (float64, every
option), packed documents equal documents run alone, decode equals forward for rows at different lengths,
the decode state's protocol, and bad arguments."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch.nn.functional as F

from mamba3lite.errors import ConfigError
from mamba3lite.model.attention import MHA, AttentionState, rotary

F64 = torch.float64
D_MODEL = 16

# Every official option, each set to a value that changes the math.
OPTIONS = {
    "plain": {},
    "gqa": {"num_heads_kv": 2},
    "mqa": {"num_heads_kv": 1},
    "rotary_halves": {"rotary_emb_dim": 4},
    "rotary_interleaved": {"rotary_emb_dim": 4, "rotary_emb_interleaved": True},
    "rotary_partial_gqa": {"rotary_emb_dim": 2, "num_heads_kv": 2, "rotary_emb_base": 100.0},
    "no_biases": {"qkv_proj_bias": False, "out_proj_bias": False},
    "softmax_scale": {"softmax_scale": 0.7},
    "d_conv": {"d_conv": 3},
    "mlp_dim": {"mlp_dim": 20},
    "head_dim": {"num_heads": 3, "head_dim": 6, "rotary_emb_dim": 6},
    "everything": {
        "num_heads_kv": 2, "rotary_emb_dim": 4, "rotary_emb_interleaved": True, "d_conv": 4,
        "mlp_dim": 300, "softmax_scale": 0.4, "qkv_proj_bias": False,
    },
}  # fmt: skip


def make_layer(seed=0, causal=True, **kw) -> MHA:
    """A tiny float64 layer (4 heads of 4 unless told) with every parameter perturbed off its init."""
    torch.manual_seed(seed)
    layer = MHA(D_MODEL, kw.pop("num_heads", 4), causal=causal, **kw).to(F64)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return layer


def inputs(B=2, T=11, seed=1):
    return torch.randn(B, T, D_MODEL, generator=torch.Generator().manual_seed(seed), dtype=F64)


def resets(B=2, T=11):
    """Documents starting inside the window (and one row with a reset at t = 0, which changes nothing)."""
    reset_BT = torch.zeros(B, T, dtype=torch.bool)
    reset_BT[0, [T // 2 - 1, T - 2]] = True
    reset_BT[-1, [0, T // 2 + 1]] = True
    return reset_BT


def assert_close(a, b, tol=1e-10):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


# ---- the official layout ----
OFFICIAL_SIGNATURE = [
    ("embed_dim", inspect.Parameter.empty), ("num_heads", inspect.Parameter.empty), ("num_heads_kv", None),
    ("head_dim", None), ("mlp_dim", 0), ("qkv_proj_bias", True), ("out_proj_bias", True),
    ("softmax_scale", None), ("causal", False), ("layer_idx", None), ("d_conv", 0), ("rotary_emb_dim", 0),
    ("rotary_emb_base", 10000.0), ("rotary_emb_interleaved", False), ("device", None), ("dtype", None),
]  # fmt: skip


def test_the_constructor_is_the_official_one():
    params = list(inspect.signature(MHA.__init__).parameters.values())[1:]
    assert [(p.name, p.default) for p in params] == OFFICIAL_SIGNATURE


def official_shapes(D, H, G=None, P=None, mlp_dim=0, qkv_bias=True, out_bias=True, d_conv=0):
    """The official mha.py's parameters, by hand: in_proj (P·(H + 2G) + m, D) with m = mlp_dim rounded up
    to 256; a depthwise conv1d (Q, 1, W) with bias over the qkv part; out_proj (D, P·H + m/2)."""
    G = G or H
    P = P or D // H
    m = math.ceil(mlp_dim / 256) * 256
    Q = P * (H + 2 * G)
    shapes = {"in_proj.weight": (Q + m, D), "out_proj.weight": (D, P * H + m // 2)}
    if qkv_bias:
        shapes["in_proj.bias"] = (Q + m,)
    if out_bias:
        shapes["out_proj.bias"] = (D,)
    if d_conv:
        shapes |= {"conv1d.weight": (Q, 1, d_conv), "conv1d.bias": (Q,)}
    return shapes


@pytest.mark.parametrize(
    "kw, expected",
    [
        ({}, official_shapes(16, 4)),
        ({"num_heads_kv": 2, "rotary_emb_dim": 4}, official_shapes(16, 4, G=2)),
        ({"num_heads_kv": 1, "head_dim": 8, "mlp_dim": 300}, official_shapes(16, 4, G=1, P=8, mlp_dim=300)),
        (
            {"qkv_proj_bias": False, "out_proj_bias": False, "d_conv": 4},
            official_shapes(16, 4, qkv_bias=False, out_bias=False, d_conv=4),
        ),
    ],
)
def test_the_official_state_dict_loads_strictly(kw, expected):
    layer = MHA(16, 4, causal=True, **kw)
    assert {k: tuple(v.shape) for k, v in layer.state_dict().items()} == expected
    official = {k: torch.randn(shape) for k, shape in expected.items()}
    layer.load_state_dict(official, strict=True)
    assert all(torch.equal(layer.state_dict()[k], v) for k, v in official.items())
    assert layer.mlp_dim == math.ceil(kw.get("mlp_dim", 0) / 256) * 256


# ---- the official forward, restated independently ----
def rotate_as_complex(x_BTHP, r, base, interleaved):
    """RoPE as complex multiplication: the pairs (halves, or interleaved) of the first r dims are complex
    numbers turned by e^{i·t·base^(−2j/r)}, t the position in the sequence."""
    T = x_BTHP.shape[1]
    omega = base ** (-torch.arange(0, r, 2, dtype=F64) / r)
    turn_TJ = torch.polar(torch.ones(T, r // 2, dtype=F64), torch.arange(T, dtype=F64)[:, None] * omega)
    head = x_BTHP[..., :r]
    if interleaved:
        z = torch.view_as_complex(head.unflatten(-1, (r // 2, 2)).contiguous())
        turned = torch.view_as_real(z * turn_TJ[:, None]).flatten(-2)
    else:
        z = torch.complex(head[..., : r // 2], head[..., r // 2 :])
        w = z * turn_TJ[:, None]
        turned = torch.cat((w.real, w.imag), -1)
    return torch.cat((turned, x_BTHP[..., r:]), -1)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("r", [2, 4, 8])
def test_rotary_turns_the_channels_flash_attn_pairs(r, interleaved):
    """Channel by channel (the layer's output alone cannot tell: permuting q's and k's channels alike
    leaves every score unchanged, but the cached keys and an official cache would differ)."""
    x = torch.randn(2, 7, 3, 8, dtype=F64)
    pos_BT = torch.arange(7).expand(2, 7)
    assert_close(rotary(x, pos_BT, r, 500.0, interleaved), rotate_as_complex(x, r, 500.0, interleaved))


def official_forward(layer: MHA, u_BTD):
    """mha.py's forward without a cache, from its description: the conv as nn.Conv1d padded W − 1 and cut
    back, the kv part laid out (2, G, P), K/V repeated per query head, causal SDPA."""
    H, G, P, m = layer.num_heads, layer.num_heads_kv, layer.head_dim, layer.mlp_dim
    qkv, x_mlp = layer.in_proj(u_BTD).split([layer.qkv_dim, m], -1)
    up, gate = x_mlp.chunk(2, dim=-1) if m else (x_mlp, x_mlp)
    if layer.d_conv:
        qkv = layer.conv1d(qkv.transpose(1, 2))[..., : -(layer.d_conv - 1)].transpose(1, 2)
    q, kv = qkv.split([H * P, 2 * G * P], -1)
    q, kv = q.unflatten(-1, (H, P)), kv.unflatten(-1, (2, G, P))
    k, v = kv.unbind(-3)
    if layer.rotary_emb_dim:
        r, base, inter = layer.rotary_emb_dim, layer.rotary_emb_base, layer.rotary_emb_interleaved
        q, k = rotate_as_complex(q, r, base, inter), rotate_as_complex(k, r, base, inter)
    k, v = (x.repeat_interleave(H // G, dim=2) for x in (k, v))
    ctx = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=layer.causal,
        scale=layer.softmax_scale,
    ).transpose(1, 2)  # fmt: skip
    ctx = ctx.flatten(2)
    if m:
        ctx = torch.cat((ctx, up * F.silu(gate)), -1)
    return layer.out_proj(ctx)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name", OPTIONS)
def test_the_layer_is_the_official_forward(name, causal):
    layer = make_layer(causal=causal, **OPTIONS[name])
    u = inputs()
    expected = official_forward(layer, u)
    for impl in ("reference", "sdpa"):
        layer.set_attention_impl(impl)
        assert_close(layer(u), expected)


# ---- the fast path against the specification ----
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name", OPTIONS)
def test_sdpa_equals_the_reference(name, causal):
    """Outputs and gradients, whole windows and packed ones, and through a state (prefill, then extend)."""
    layer = make_layer(causal=causal, **OPTIONS[name])
    u = inputs().requires_grad_()
    runs = {}
    for impl in ("reference", "sdpa"):
        layer.set_attention_impl(impl)
        layer.zero_grad()
        u.grad = None
        out = torch.cat((layer(u), layer(u, reset_BT=resets())), 1)
        out.pow(2).sum().backward()
        state = layer.allocate_state(2)
        with torch.no_grad():
            ext = [layer(u[:, :4], state, resets()[:, :4]), layer(u[:, 4:], state, resets()[:, 4:])]
        grads = [u.grad.clone()] + [p.grad.clone() for p in layer.parameters()]
        runs[impl] = (out, torch.cat(ext, 1), grads)
    (out_r, ext_r, grads_r), (out_s, ext_s, grads_s) = runs["reference"], runs["sdpa"]
    assert_close(out_s, out_r)
    assert_close(ext_s, ext_r)
    for gs, gr in zip(grads_s, grads_r):
        assert_close(gs, gr)


# ---- packed documents ----
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("impl", ["sdpa", "reference"])
@pytest.mark.parametrize("name", ["plain", "rotary_halves", "rotary_interleaved", "d_conv", "everything"])
def test_packed_documents_equal_each_document_alone(name, impl, causal):
    layer = make_layer(causal=causal, **OPTIONS[name])
    layer.set_attention_impl(impl)
    u = inputs(B=2, T=11)
    reset_BT = torch.zeros(2, 11, dtype=torch.bool)
    reset_BT[:, 5] = True
    packed = layer(u, reset_BT=reset_BT)
    assert_close(packed[:, 5:], layer(u[:, 5:]))  # the window's second document, run alone
    assert_close(packed[:, :5], layer(u[:, :5]))
    assert not torch.allclose(packed[:, 5:], layer(u)[:, 5:])  # without the reset it would differ


# ---- decode equals forward ----
DECODE_OPTIONS = ["plain", "gqa", "mqa", "rotary_partial_gqa", "d_conv", "mlp_dim", "everything"]


@pytest.mark.parametrize("max_len", [None, 12])
@pytest.mark.parametrize("name", DECODE_OPTIONS)
def test_decode_equals_forward_for_rows_at_different_lengths(name, max_len):
    """Rows prefilled to 3, 5 and 0 tokens through row views, then stepped together, extended together by
    a chunk of 3, and stepped again: every row's outputs equal the full forward of that row, resets in
    the prompt, in a step and inside the chunk included."""
    layer = make_layer(**OPTIONS[name])
    B, T = 3, 12
    u = inputs(B, T)
    reset_BT = torch.zeros(B, T, dtype=torch.bool)
    reset_BT[0, [2, 5]] = True  # in the prompt, then in a step
    reset_BT[1, 8] = True  # inside the extension chunk
    reset_BT[2, [1, 5]] = True
    expected = layer(u, reset_BT=reset_BT)
    state = layer.allocate_state(B, max_len)
    lengths = [3, 5, 0]
    got = [[] for _ in range(B)]
    for b, n in enumerate(lengths):
        got[b].append(layer(u[b : b + 1, :n], state.rows(b, b + 1), reset_BT[b : b + 1, :n])[0])
    assert state.length_B.tolist() == lengths

    def feed(n):
        at_BT = torch.tensor(lengths)[:, None] + torch.arange(n)
        rows = torch.arange(B)[:, None]
        if n == 1:
            out = layer.step(u[rows, at_BT][:, 0], state, reset_BT[rows, at_BT][:, 0])[:, None]
        else:
            out = layer(u[rows, at_BT], state, reset_BT[rows, at_BT])
        for b in range(B):
            got[b].append(out[b])
            lengths[b] += n

    for n in (1, 1, 3, 1, 1):
        feed(n)
    for b in range(B):
        assert_close(torch.cat(got[b]), expected[b, : lengths[b]])
    assert state.length_B.tolist() == lengths == [10, 12, 7]


def test_decode_from_an_empty_state_step_by_step_equals_forward():
    layer = make_layer(**OPTIONS["everything"])
    u, reset_BT = inputs(B=2, T=9), resets(B=2, T=9)
    state = layer.allocate_state(2)
    steps = [layer.step(u[:, t], state, reset_BT[:, t]) for t in range(9)]
    assert_close(torch.stack(steps, 1), layer(u, reset_BT=reset_BT))


# ---- the decode state's protocol ----
def prefilled(layer, B=3, lengths=(4, 2, 5), max_len=None, seed=1):
    state = layer.allocate_state(B, max_len)
    u = inputs(B, max(lengths), seed=seed)
    for b, n in enumerate(lengths):
        layer(u[b : b + 1, :n], state.rows(b, b + 1))
    return state


def test_rows_write_through_even_when_the_buffer_grows():
    layer = make_layer(**OPTIONS["d_conv"])
    state = layer.allocate_state(3)
    layer(inputs(3, 2), state)
    before = state.k_BGCP[0].clone()
    view = state.rows(1, 3)
    layer(inputs(2, 40, seed=5), view)  # past the capacity: the shared buffer grows
    assert state.capacity == view.capacity >= 42
    assert state.length_B.tolist() == [2, 42, 42]
    assert torch.equal(state.k_BGCP[1:], view.k_BGCP)
    assert torch.equal(state.k_BGCP[0, :, :2], before[:, :2])  # row 0 untouched
    assert torch.equal(state.conv_BWQ[1:], view.conv_BWQ)
    inner = view.rows(1, 2)  # a view of a view
    layer.step(inputs(1, 1, seed=6)[:, 0], inner)
    assert state.length_B.tolist() == [2, 42, 43]


def test_select_gives_the_rows_in_any_order_with_repeats():
    layer = make_layer(**OPTIONS["everything"])
    state = prefilled(layer)
    x = inputs(3, 1, seed=7)[:, 0]
    picked = state.select(torch.tensor([2, 0, 0]))
    assert picked.length_B.tolist() == [5, 4, 4]
    expected = layer.step(x, state.snapshot())
    got = layer.step(x[[2, 0, 0]], picked)
    assert_close(got, expected[[2, 0, 0]])
    assert state.length_B.tolist() == [4, 2, 5]  # the source is not moved on


def test_a_snapshot_is_independent_and_load_restores_it():
    layer = make_layer(**OPTIONS["everything"])
    state = prefilled(layer)
    snap = state.snapshot()
    x = inputs(3, 1, seed=7)[:, 0]
    first = layer.step(x, state)
    layer.step(x, state)  # the state moves on, the snapshot does not
    assert snap.length_B.tolist() == [4, 2, 5] and snap.capacity == 5
    again = layer.step(x, snap.snapshot())
    assert_close(again, first)
    state.load_(snap)  # back to the prefix, in place
    assert_close(layer.step(x, state), first)
    target = layer.allocate_state(3, max_len=8)  # a fixed state of another capacity
    target.load_(snap)
    assert_close(layer.step(x, target), first)


def test_load_into_a_smaller_fixed_state_is_refused_and_changes_nothing():
    layer = make_layer(**OPTIONS["d_conv"])
    src = prefilled(layer, lengths=(4, 2, 5))
    small = layer.allocate_state(3, max_len=3)
    with pytest.raises(ConfigError, match="max_len"):
        small.load_(src)
    assert small.length_B.tolist() == [0, 0, 0]


def test_a_fixed_state_refuses_to_overflow_and_changes_nothing():
    layer = make_layer(**OPTIONS["d_conv"])
    state = layer.allocate_state(2, max_len=4)
    layer(inputs(2, 3), state)
    saved = state.snapshot()
    with pytest.raises(ConfigError, match="larger max_len"):
        layer(inputs(2, 2, seed=3), state)
    assert state.length_B.tolist() == [3, 3] and state.capacity == 4
    assert torch.equal(state.conv_BWQ, saved.conv_BWQ)
    assert torch.equal(state.k_BGCP[:, :, :3], saved.k_BGCP)


def test_nbytes_counts_the_buffers_and_grows_with_capacity():
    layer = make_layer(**OPTIONS["gqa"])  # G = 2 K/V heads of P = 4
    B, G, P = 3, 2, 4
    fixed = {n: layer.allocate_state(B, max_len=n).nbytes() for n in (8, 16)}
    assert fixed[8] == 2 * B * G * 8 * P * 8 + 2 * B * 8  # K and V in float64; lengths, starts in int64
    assert fixed[16] - fixed[8] == 2 * B * G * 8 * P * 8
    growing = layer.allocate_state(B)
    empty = growing.nbytes()
    layer(inputs(B, 20), growing)
    assert growing.capacity >= 20 and growing.nbytes() == empty + 2 * B * G * growing.capacity * P * 8
    assert growing.rows(0, 1).nbytes() * B == growing.nbytes()


def test_the_state_is_an_attention_state_on_the_layer_device_and_dtype():
    layer = make_layer()
    state = layer.allocate_state(2, max_len=5)
    assert isinstance(state, AttentionState)
    assert state.k_BGCP.dtype == F64 and state.k_BGCP.shape == (2, 4, 5, 4)
    assert state.conv_BWQ is None
    assert layer.allocate_state(2, dtype=torch.float32).v_BGCP.dtype == torch.float32


# ---- dtypes ----
def test_a_bf16_layer_takes_fp32_inputs_and_runs_under_autocast():
    torch.manual_seed(0)
    layer = MHA(D_MODEL, 4, causal=True, rotary_emb_dim=4, mlp_dim=8, d_conv=2)
    u = torch.randn(2, 6, D_MODEL)
    full = layer(u)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(u, reset_BT=resets(2, 6))
        state = layer.allocate_state(2)
        layer(u[:, :3], state)
        stepped = layer.step(u[:, 3], state)
    assert out.dtype == stepped.dtype == torch.bfloat16
    torch.testing.assert_close(stepped.float(), full[:, 3], atol=5e-2, rtol=5e-2)
    cast = layer.to(torch.bfloat16)
    assert cast(u).dtype == torch.bfloat16  # fp32 inputs (an RMSNorm's) into a bf16 layer


# ---- bad arguments ----
@pytest.mark.parametrize(
    "kw, words",
    [
        ({"num_heads": 4, "num_heads_kv": 3}, "divisible by num_heads_kv"),
        ({"num_heads": 5}, "set head_dim"),
        ({"rotary_emb_dim": 3}, "must be even"),
        ({"rotary_emb_dim": 8}, "at most head_dim"),
        ({"num_heads": 0}, "MHA num_heads must be an integer >= 1"),
        ({"d_conv": -1}, "MHA d_conv must be an integer >= 0"),
        ({"softmax_scale": 0.0}, "MHA softmax_scale must be > 0"),
        ({"head_dim": 0}, "MHA head_dim must be an integer >= 1"),
        ({"rotary_emb_base": -1.0}, "MHA rotary_emb_base must be > 0"),
    ],
)
def test_bad_arguments_get_one_clear_error(kw, words):
    kw = {"num_heads": 4, **kw}
    with pytest.raises(ConfigError, match=words):
        MHA(D_MODEL, kw.pop("num_heads"), **kw)


def test_bad_state_sizes_and_implementation_names_are_refused():
    layer = make_layer()
    with pytest.raises(ConfigError, match="max_len must be a positive"):
        layer.allocate_state(2, max_len=0)
    with pytest.raises(ConfigError, match="batch_size"):
        layer.allocate_state(-1)
    with pytest.raises(ConfigError, match="did you mean `sdpa`"):
        layer.set_attention_impl("spda")
    assert layer.attn_impl == "sdpa"
