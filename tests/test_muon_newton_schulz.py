"""Muon's Newton-Schulz in the device's dtype (train/optim.py): in bf16 it is torch.optim.Muon exactly,
in fp32 it is nearer the float64 iteration and differs from bf16's only by bf16's rounding; the dtype
follows the resolved training.dtype; torch's optimizer state (an old checkpoint's) loads unchanged."""

from __future__ import annotations

import pytest
import torch

from mamba3lite.model import precision
from mamba3lite.train.optim import FullMatrixMuon, build_optimizer, newton_schulz
from test_muon import muon_training, tiny_model

COEFFS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's defaults
BF16_EPS = 2.0**-7  # bf16 keeps 8 significant bits: the spacing of its numbers in [1, 2)
SETTINGS = {"lr": 0.02, "weight_decay": 0.1, "adjust_lr_fn": "match_rms_adamw"}


def matrices(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(48, 32, generator=g), torch.randn(32, 80, generator=g)]  # a tall one, a wide one


def run(opt_of, steps: int = 4, **settings) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    """The matrices after `steps` Muon steps on seeded gradients, and the optimizer."""
    params = [p.clone().requires_grad_() for p in matrices()]
    opt = opt_of(params, **{**SETTINGS, **settings})
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return params, opt


@pytest.mark.parametrize("nesterov", [True, False])
def test_bf16_is_torchs_muon_bit_for_bit(nesterov):
    ours, ours_opt = run(FullMatrixMuon, nesterov=nesterov)  # ns_dtype's default: torch.bfloat16
    ref, ref_opt = run(torch.optim.Muon, nesterov=nesterov)
    for a, b in zip(ours, ref, strict=True):
        assert torch.equal(a, b)
        assert torch.equal(ours_opt.state[a]["momentum_buffer"], ref_opt.state[b]["momentum_buffer"])
    assert not torch.equal(ours[0], matrices()[0])  # the steps moved the matrices


@pytest.mark.parametrize("shape", [(48, 32), (32, 80)])
def test_fp32_is_nearer_the_float64_iteration_and_bf16_only_rounds(shape):
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    exact = newton_schulz(G, torch.float64, COEFFS, 5, 1e-7)
    fp32 = newton_schulz(G.float(), torch.float32, COEFFS, 5, 1e-7).double()
    bf16 = newton_schulz(G.float(), torch.bfloat16, COEFFS, 5, 1e-7).double()

    def rel(x: torch.Tensor) -> float:
        return ((x - exact).norm() / exact.norm()).item()

    assert rel(fp32) < 1e-5 and rel(fp32) < rel(bf16) / 100
    assert rel(bf16) < 4 * BF16_EPS  # the same update, up to bf16's rounding through 5 iterations
    # it is an orthogonalisation: the singular values land near 1 (torch's coefficients: ~[0.7, 1.2])
    s = torch.linalg.svdvals(fp32)
    assert s.min() > 0.6 and s.max() < 1.25 and min(shape) == len(s)


def test_fp32_steps_are_bf16s_up_to_rounding_and_leave_the_momentum_alone():
    fp32, fp32_opt = run(FullMatrixMuon, ns_dtype=torch.float32, nesterov=False)
    bf16, bf16_opt = run(FullMatrixMuon, nesterov=False)
    start = matrices()
    for a, b, p0 in zip(fp32, bf16, start, strict=True):
        step_a, step_b = a.detach() - p0, b.detach() - p0
        assert 0 < ((step_a - step_b).norm() / step_b.norm()).item() < 4 * BF16_EPS
        # the momentum is computed before the Newton-Schulz: identical (its input was copied, not scaled)
        assert torch.equal(fp32_opt.state[a]["momentum_buffer"], bf16_opt.state[b]["momentum_buffer"])


RESOLVED = [("auto", True, torch.bfloat16), ("auto", False, torch.float32), ("fp32", True, torch.float32),
            ("bf16", False, torch.bfloat16)]  # fmt: skip


@pytest.mark.parametrize(("dtype", "has_native", "ns"), RESOLVED)
def test_build_optimizer_takes_the_newton_schulz_dtype_from_the_resolved_precision(
    monkeypatch, dtype, has_native, ns
):
    monkeypatch.setattr(precision, "native_bf16", lambda device: has_native)
    opt = build_optimizer(tiny_model(), muon_training(dtype=dtype))
    assert opt.muon.ns_dtype == ns
    assert "ns_dtype" not in opt.muon.param_groups[0]  # a property of the device, not of the run's state


def test_an_old_checkpoints_muon_state_loads_and_continues_as_it_would_have():
    """An optimizer state written by torch.optim.Muon (what a checkpoint held before the dtype existed)
    loads into the fp32 FullMatrixMuon, whose state_dict has the same keys, and back."""
    old, old_opt = run(torch.optim.Muon, steps=2)
    saved = old_opt.state_dict()
    params = [p.detach().clone().requires_grad_() for p in old]
    new_opt = FullMatrixMuon(params, ns_dtype=torch.float32, **SETTINGS)
    new_opt.load_state_dict(saved)
    assert new_opt.state_dict().keys() == saved.keys()
    for p, q in zip(params, old, strict=True):
        assert torch.equal(new_opt.state[p]["momentum_buffer"], old_opt.state[q]["momentum_buffer"])
    assert new_opt.state_dict()["param_groups"] == saved["param_groups"]
    for p in params:  # one more step runs on the loaded momentum
        p.grad = torch.ones_like(p)
    new_opt.step()
    assert all(set(new_opt.state[p]) == {"momentum_buffer"} for p in params)
    torch.optim.Muon(old, **SETTINGS).load_state_dict(new_opt.state_dict())  # and back: torch's format
