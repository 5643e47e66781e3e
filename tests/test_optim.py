"""Parameter groups (decay / no decay, tied once) and the warmup + cosine schedule."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn

from mamba3lite.config import TrainingConfig
from mamba3lite.train.optim import apply_optimizer_settings, build_optimizer, lr_at, param_groups, set_lr


class Stand(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.in_proj = nn.Linear(4, 8, bias=True)
        self.B_bias = nn.Parameter(torch.ones(2, 1, 4))  # 3-D, but a bias
        self.dt_bias = nn.Parameter(torch.zeros(2))
        self.dt_bias._no_weight_decay = True
        self.flagged = nn.Parameter(torch.zeros(3, 3))
        self.flagged._no_weight_decay = True  # a matrix explicitly excluded
        self.norm = nn.LayerNorm(4)
        self.lm_head = nn.Linear(4, 10, bias=False)
        self.lm_head.weight = self.embed.weight


def test_groups_split_decay_and_count_tied_once():
    groups = param_groups(Stand(), weight_decay=0.1)
    decay, no_decay = groups
    assert decay["names"] == ["in_proj.weight"] and decay["weight_decay"] == 0.1
    assert set(no_decay["names"]) == {
        "embed.weight",
        "in_proj.bias",
        "B_bias",
        "dt_bias",
        "flagged",
        "norm.weight",
        "norm.bias",
    }
    assert no_decay["weight_decay"] == 0.0
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(Stand().parameters()))


def test_optimizer_applies_decay_only_to_decay_group():
    torch.manual_seed(0)
    m = Stand()
    opt = build_optimizer(m, lr=0.1, weight_decay=0.5, betas=(0.9, 0.95))
    before_w, before_e = m.in_proj.weight.detach().clone(), m.embed.weight.detach().clone()
    opt.step()  # no gradients: only decoupled decay could move a parameter (and AdamW skips grad-less ones)
    for p in m.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    assert torch.allclose(m.in_proj.weight, before_w * (1 - 0.1 * 0.5))
    assert torch.equal(m.embed.weight, before_e)


def test_schedule_warmup_cosine_floor():
    kw = dict(lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=110)
    assert lr_at(0, **kw) == pytest.approx(0.1)  # first step already moves
    assert lr_at(9, **kw) == pytest.approx(1.0)
    assert lr_at(10, **kw) == pytest.approx(1.0)
    assert lr_at(60, **kw) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(110, **kw) == pytest.approx(0.1) and lr_at(10_000, **kw) == pytest.approx(0.1)
    values = [lr_at(s, **kw) for s in range(10, 111)]
    assert all(a >= b for a, b in itertools.pairwise(values))  # monotone decay
    assert lr_at(5, lr=1.0, min_lr=0.0, warmup_steps=0, max_steps=10) == pytest.approx(
        0.5 * (1 + math.cos(math.pi / 2))
    )


def test_cpu_optimizer_is_fused_and_steps_like_the_reference():
    """On CPU the fused AdamW kernel is used, and its steps match the default implementation's."""
    torch.manual_seed(0)
    a, b = Stand(), Stand()
    b.load_state_dict(a.state_dict())
    opt_a = build_optimizer(a, lr=0.01, weight_decay=0.1, betas=(0.9, 0.95))
    groups = param_groups(b, 0.1)
    for g in groups:
        g.pop("names")
    opt_b = torch.optim.AdamW(groups, lr=0.01, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    assert opt_a.defaults["fused"] is True
    for step in range(5):
        for m in (a, b):
            for i, p in enumerate(m.parameters()):
                p.grad = torch.sin(torch.arange(p.numel(), dtype=p.dtype) + step + i).view_as(p)
        opt_a.step()
        opt_b.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


def test_set_lr_puts_the_schedules_lr_on_every_adamw_group():
    opt = build_optimizer(Stand(), lr=0.1, weight_decay=0.1, betas=(0.9, 0.95))
    set_lr(opt, 0.0123)
    assert [g["lr"] for g in opt.param_groups] == [0.0123, 0.0123]


def test_config_settings_win_over_the_groups_after_a_load():
    opt = build_optimizer(Stand(), lr=0.1, weight_decay=0.1, betas=(0.9, 0.95))
    tc = TrainingConfig(weight_decay=0.2, betas=(0.8, 0.9), eps=1e-6)
    assert apply_optimizer_settings(opt, tc) == [
        "weight_decay 0.1 -> 0.2",
        "betas (0.9, 0.95) -> (0.8, 0.9)",
        "eps 1e-08 -> 1e-06",
    ]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.2, 0.0]
    assert apply_optimizer_settings(opt, tc) == []
