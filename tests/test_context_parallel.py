"""Context parallelism (model/context_parallel.py): C pieces that pass the state == one whole window.

Fast: the combine math, C pieces simulated in one process against the sequential scan in float64.
Slow: 4 gloo processes training a tiny LM on the pieces of a window, whose loss and every parameter
gradient equal one process's on the whole window (fp32), for SISO/MIMO, the chunked, the sequential and
the Triton (interpreter) scans (the Triton cases against the chunked scan on the same weights), resets
at EOS inside a piece and at a piece boundary, activation checkpointing, a piece that is not a multiple
of the chunk size. Four pieces, because only C > 2 has a
piece that both receives a state and passes one on; C = 2 is the fast tests' one-process exchange and
test_context_parallel_training.py's 2-process training.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist

from gloo_processes import spawn
from mamba3lite.errors import ConfigError
from mamba3lite.model.config import ModelConfig
from mamba3lite.model.context_parallel import (
    combine_angles,
    combine_states,
    cut_window,
    first_token_boa,
    rotated_state_correction,
    state_correction,
    state_weights,
)
from mamba3lite.model.mamba3 import cumulative_angles
from mamba3lite.model.rotation import bias_rotate
from mamba3lite.model.scan import chunked_scan, sequential_scan
from mamba3lite.model.transformer import Mamba3Transformer


def scan_inputs(T: int, R: int, seed: int = 0, B: int = 2, H: int = 3, N: int = 4, P: int = 5):
    g = torch.Generator().manual_seed(seed)
    d = torch.float64
    q = torch.randn(B, H, T, R, N, generator=g, dtype=d)
    k = torch.randn(B, H, T, R, N, generator=g, dtype=d)
    v = torch.randn(B, H, T, R, P, generator=g, dtype=d)
    dt = torch.rand(B, H, T, generator=g, dtype=d) * 0.5 + 0.05
    adt = -dt * (torch.rand(B, H, T, generator=g, dtype=d) + 0.1)
    lam = torch.rand(B, H, T, generator=g, dtype=d)
    return q, k, v, adt, dt, lam


def piecewise_scan(scan, q, k, v, adt, dt, lam, reset_BT, C: int):
    """The exchange of context_parallel.ContextParallel.continue_state, all C pieces in one process."""
    T = q.shape[2]
    L = T // C
    sl = [slice(c * L, (c + 1) * L) for c in range(C)]
    rs = [None if reset_BT is None else reset_BT[:, s] for s in sl]
    local = [scan(q[:, :, s], k[:, :, s], v[:, :, s], adt[:, :, s], dt[:, :, s], lam[:, :, s], reset_BT=r)
             for s, r in zip(sl, rs)]  # fmt: skip
    w = [state_weights(adt[:, :, s], r) for s, r in zip(sl, rs)]
    S_CBHPN = combine_states(
        torch.stack([h for _, h in local]),
        torch.stack([wc[:, :, -1] for wc in w]),
        torch.stack([first_token_boa(dt[:, :, s], lam[:, :, s], r) for s, r in zip(sl, rs)]),
        torch.stack([k[:, :, s.stop - 1] for s in sl]),
        torch.stack([v[:, :, s.stop - 1] for s in sl]),
    )
    ys = [state_correction(y, q[:, :, s], S_CBHPN[c], w[c]) for c, ((y, _), s) in enumerate(zip(local, sl))]
    h_last = S_CBHPN[-1] * w[-1][:, :, -1, None, None] + local[-1][1]
    return torch.cat(ys, dim=2), h_last


RESETS = {
    "none": [],
    "inside": [3, 13],  # inside pieces at C = 2 and 4
    "boundary": [8, 16, 25],  # the first token of a piece (C = 4; 16 also at C = 2) and the one after
}


@pytest.mark.parametrize("C", [2, 4])
@pytest.mark.parametrize("R", [1, 2])
@pytest.mark.parametrize("resets", list(RESETS))
def test_pieces_that_pass_the_state_equal_the_whole_sequence(C, R, resets):
    T = 32
    q, k, v, adt, dt, lam = scan_inputs(T, R)
    reset_BT = None
    if RESETS[resets]:
        reset_BT = torch.zeros(2, T, dtype=torch.bool)
        reset_BT[0, RESETS[resets]] = True
        reset_BT[1, RESETS[resets][-1]] = True
    y_ref, h_ref = sequential_scan(q, k, v, adt, dt, lam, reset_BT=reset_BT)
    for scan in (sequential_scan, lambda *a, **kw: chunked_scan(*a, chunk_size=3, **kw)):
        y, h = piecewise_scan(scan, q, k, v, adt, dt, lam, reset_BT, C)
        torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(h, h_ref, rtol=1e-12, atol=1e-12)


def test_combine_angles_continue_the_running_sum_across_pieces():
    C, T = 4, 32
    g = torch.Generator().manual_seed(1)
    dtheta = torch.rand(2, 3, T, 2, generator=g, dtype=torch.float64) * 2.0
    reset_BT = torch.zeros(2, T, dtype=torch.bool)
    reset_BT[0, [5, 16]] = True  # inside piece 0, the first token of piece 2
    ref = cumulative_angles(dtheta, None, reset_BT)
    L = T // C
    pieces = [(dtheta[:, :, c * L : (c + 1) * L], reset_BT[:, c * L : (c + 1) * L]) for c in range(C)]
    local = [cumulative_angles(d, None, r) for d, r in pieces]
    theta_in = combine_angles(
        torch.stack([t[:, :, -1] for t in local]), torch.stack([r.any(1) for _, r in pieces])
    )
    got = torch.cat([cumulative_angles(d, theta_in[c], r) for c, (d, r) in enumerate(pieces)], dim=2)
    # Angles live on the circle: compare sin and cos (a wrap at 2π is the same angle).
    torch.testing.assert_close(torch.sin(got), torch.sin(ref), rtol=0, atol=1e-12)
    torch.testing.assert_close(torch.cos(got), torch.cos(ref), rtol=0, atol=1e-12)
    assert float(theta_in[1].abs().min()) > 0  # every piece after the first starts from a turned angle


def test_cut_window_gives_contiguous_pieces_and_refuses_a_split_that_does_not_divide():
    x = torch.arange(24).view(2, 12)
    y = x + 100
    pieces = [cut_window(x, y, c, 3) for c in range(3)]
    assert torch.equal(torch.cat([p[0] for p in pieces], dim=1), x)
    assert torch.equal(torch.cat([p[1] for p in pieces], dim=1), y)
    assert pieces[1][0].shape == (2, 4) and int(pieces[1][0][0, 0]) == 4
    with pytest.raises(ConfigError, match="context_parallel=5 does not divide the window of 12"):
        cut_window(x, y, 0, 5)


# ---- multi-process: C gloo ranks == one process ----

T_WINDOW = 32
EOS = 0
# Row 0: EOS inside a piece (3), as the last token of a piece (15: the next piece starts with a reset) and
# as the first token of one (24 at C = 4); row 1: the last token of piece 0 at C = 4 (7) and one inside (20).
EOS_AT = {0: [3, 15, 24], 1: [7, 20]}

CASES = {
    "siso-chunked": dict(is_mimo=False, scan_impl="chunked"),
    "siso-chunked-resets": dict(is_mimo=False, scan_impl="chunked", reset_at_eos=True),
    "siso-chunked-resets-ckpt-chunk6": dict(
        is_mimo=False, scan_impl="chunked", reset_at_eos=True, chunk_size=6
    ),
    "siso-sequential-resets": dict(is_mimo=False, scan_impl="sequential", reset_at_eos=True),
    "mimo-chunked-resets": dict(is_mimo=True, mimo_rank=2, scan_impl="chunked", reset_at_eos=True),
    "siso-triton-resets": dict(is_mimo=False, scan_impl="triton", reset_at_eos=True),
    "mimo-triton-resets": dict(is_mimo=True, mimo_rank=2, scan_impl="triton", reset_at_eos=True),
}


# The one-process reference of a Triton case runs the chunked scan on the same weights (the scan is an
# execution setting): the interpreter's whole-window fp32 run was half this test's time, and
# test_scan_triton.py holds the Triton scan's LM loss and gradients (resets included) equal to the
# chunked path's. The pieces still run the Triton kernels, from and to the states they pass.
REFERENCE_SCAN = {"triton": "chunked"}


def tiny_config(**kw) -> ModelConfig:
    # 2 heads of 16: the Triton kernels run one program per batch row x head (x chunk)
    shape = dict(
        vocab_size=32, d_model=16, n_layers=2, d_intermediate=32, d_state=8, headdim=16, chunk_size=8,
        eos_id=EOS, reset_at_eos=False,
    )  # fmt: skip
    return ModelConfig(**{**shape, **kw})


def window() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(1, 32, (2, T_WINDOW + 1), generator=g)
    for row, positions in EOS_AT.items():
        tokens[row, positions] = EOS
    return tokens[:, :-1], tokens[:, 1:]


def loss_and_grads(model, x, y) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(x, y)
    loss.backward()
    return float(loss), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _worker(rank: int, C: int, out_file: str) -> None:
    os.environ["TRITON_INTERPRET"] = "1"  # read when the Triton kernels are first built
    results = {}
    x, y = window()
    for name, kw in CASES.items():
        torch.manual_seed(0)
        model = Mamba3Transformer(tiny_config(**kw)).train()
        model.grad_checkpointing = "ckpt" in name
        if rank == 0:  # the reference: the whole window in one process
            model.set_scan_impl(REFERENCE_SCAN.get(kw["scan_impl"], kw["scan_impl"]))
            ref = loss_and_grads(model, x, y)
            model.set_scan_impl(kw["scan_impl"])
        else:
            ref = None
        model.set_context_parallel(dist.group.WORLD)
        loss, grads = loss_and_grads(model, *cut_window(x, y, rank, C))
        for g in grads.values():
            dist.all_reduce(g)
            g /= C  # the mean over the pieces, as data-parallel averaging does
        loss = float(model.context_parallel.reduce_loss(torch.tensor(loss)))
        assert model.scan_impl == kw["scan_impl"]  # the pieces ran the case's scan
        results[name] = (ref, (loss, grads))
    if rank == 0:
        torch.save(results, out_file)


@pytest.mark.slow
def test_context_parallel_loss_and_every_gradient_equal_one_process(tmp_path):
    C = 4
    out = tmp_path / "results.pt"
    spawn(C, _worker, str(out))
    results = torch.load(out)
    assert set(results) == set(CASES)
    for name, ((ref_loss, ref_grads), (loss, grads)) in results.items():
        assert math.isclose(loss, ref_loss, rel_tol=1e-5), (name, loss, ref_loss)
        assert set(grads) == set(ref_grads)
        for p, g_ref in ref_grads.items():
            rel = float((grads[p] - g_ref).norm() / g_ref.norm())
            assert g_ref.norm() > 0 and rel <= 1e-5, (name, p, rel)


def test_state_correction_gradients_equal_autograd_of_the_formula():
    g = torch.Generator().manual_seed(2)
    d = torch.float64
    y = torch.randn(2, 3, 7, 2, 5, generator=g, dtype=d, requires_grad=True)
    q = torch.randn(2, 3, 7, 2, 4, generator=g, dtype=d, requires_grad=True)
    S = torch.randn(2, 3, 5, 4, generator=g, dtype=d, requires_grad=True)
    w = torch.rand(2, 3, 7, generator=g, dtype=d, requires_grad=True)
    assert torch.autograd.gradcheck(state_correction, (y, q, S, w))
    ref = y + torch.einsum("bhpn,bhtrn->bhtrp", S, q) * w[..., None, None]
    torch.testing.assert_close(state_correction(y, q, S, w), ref, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("halves", [False, True])
@pytest.mark.parametrize("rope", [True, False])
def test_rotated_state_correction_equals_the_correction_of_the_rotated_queries(halves, rope):
    g = torch.Generator().manual_seed(4)
    d = torch.float64
    B, G, H, T, R, N, P, S = 2, 1, 2, 5, 2, 4, 3, 1
    y = torch.randn(B, H, T, R, P, generator=g, dtype=d, requires_grad=True)
    q_hat = torch.randn(B, G, T, R, N, generator=g, dtype=d, requires_grad=True)
    bias = torch.randn(H, R, N, generator=g, dtype=d, requires_grad=True)
    theta = (torch.rand(B, H, T, S, generator=g, dtype=d) * 6).requires_grad_(rope) if rope else None
    S_BHPN = torch.randn(B, H, P, N, generator=g, dtype=d, requires_grad=True)
    w = torch.rand(B, H, T, generator=g, dtype=d, requires_grad=True)
    q = bias_rotate(q_hat, q_hat, bias, bias, theta, halves, d)[1]
    ref = state_correction(y, q, S_BHPN, w)
    got = rotated_state_correction(y, q_hat, bias, theta, halves, S_BHPN, w)
    torch.testing.assert_close(got, ref, rtol=1e-14, atol=1e-14)
    inputs = (y, q_hat, bias, theta, halves, S_BHPN, w)
    assert torch.autograd.gradcheck(rotated_state_correction, inputs)
