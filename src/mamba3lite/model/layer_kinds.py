"""The layer-kind seam: what each kind of mixer supplies to the model, one entry per kind.

A model is a stack of blocks (norm → mixer → residual, then the MLP); layer i's mixer is of kind
`cfg.layer_kind(i)`: "mamba3" everywhere except the indices in `attn_layer_idx`, which are "attention"
(mamba_ssm's create_block does the same). Each kind lives in its own module (kind_mamba3.py,
kind_attention.py) and supplies, through its `LayerKind`:

    build(cfg, layer_idx, device, dtype)   its mixer: forward(u_BTD, state=None, reset_BT=None),
                                           step(u_BD, state, reset_B=None) and allocate_state(batch_size,
                                           max_len=None, device=None, dtype=None), whose state follows
                                           the protocol of model/decode_state.py
    parameters(cfg)                        its parameter count, for model/flops.py and model/memory.py
    flops_per_token(cfg, seq_len)          forward FLOPs per token by part, a function of the length
    activations_grow_with_length           whether the bytes it keeps for backward per token grow with
                                           the length (model/memory.py then measures at the run's length)
    scans                                  whether it has a scan backend (`set_scan_impl` applies)
    set_context_parallel(mixer, cp)        its part in context parallelism (also how model/memory.py
                                           measures what a rank of the group keeps: `MeasuredRank`)

The model, memory.py and flops.py iterate over layers by kind through this table; nothing else branches
on a kind.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from mamba3lite.model.config import ATTENTION_KIND, MAMBA3_KIND, ModelConfig
from mamba3lite.model.kind_attention import (
    attention_flops_per_token,
    attention_parameters,
    attention_set_context_parallel,
    build_attention,
)
from mamba3lite.model.kind_mamba3 import (
    build_mamba3,
    mamba3_flops_per_token,
    mamba3_parameters,
    mamba3_set_context_parallel,
)


@dataclass(frozen=True)
class LayerKind:
    """What one kind of mixer supplies (module docstring)."""

    name: str
    build: Callable[..., nn.Module]
    parameters: Callable[[ModelConfig], int]
    flops_per_token: Callable[[ModelConfig, int], dict[str, float]]
    activations_grow_with_length: bool
    scans: bool
    set_context_parallel: Callable[[nn.Module, object], None]


LAYER_KINDS: dict[str, LayerKind] = {
    MAMBA3_KIND: LayerKind(
        MAMBA3_KIND, build_mamba3, mamba3_parameters, mamba3_flops_per_token,
        activations_grow_with_length=False, scans=True,
        set_context_parallel=mamba3_set_context_parallel,
    ),
    ATTENTION_KIND: LayerKind(
        ATTENTION_KIND, build_attention, attention_parameters, attention_flops_per_token,
        activations_grow_with_length=True, scans=False,
        set_context_parallel=attention_set_context_parallel,
    ),
}  # fmt: skip


def kind_of_layer(cfg: ModelConfig, layer_idx: int) -> LayerKind:
    """The kind of layer `layer_idx` of the model `cfg` describes."""
    return LAYER_KINDS[cfg.layer_kind(layer_idx)]


def layers_by_kind(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """{kind name: (number of layers of that kind, index of its first layer)} for the kinds present, in
    the order of their first layer. Without a loop over the layers: n_layers may be absurd (a typo)
    and is checked by its parameter count before anything is built."""
    attn = sorted(cfg.attn_layer_idx)
    first_mamba = next(i for i in range(len(attn) + 1) if i >= len(attn) or attn[i] != i)
    out = {}
    if cfg.n_layers > len(attn):
        out[MAMBA3_KIND] = (cfg.n_layers - len(attn), first_mamba)
    if attn:
        out[ATTENTION_KIND] = (len(attn), attn[0])
    return dict(sorted(out.items(), key=lambda kv: kv[1][1]))


def build_mixer(cfg: ModelConfig, layer_idx: int, device=None, dtype=None) -> nn.Module:
    """The mixer of layer `layer_idx`: its kind's."""
    return kind_of_layer(cfg, layer_idx).build(cfg, layer_idx, device=device, dtype=dtype)
