"""The attention layer kind (model/layer_kinds.py): the official MHA layout (mamba_ssm's
`mamba_ssm/modules/mha.py`), at the layer indices in `ModelConfig.attn_layer_idx`, built from `attn_cfg`.

    in_proj:  D -> qkv + mlp       qkv = head_dim · (num_heads + 2 · num_heads_kv), mlp = mlp_dim rounded
                                   up to a multiple of 256 (bias: qkv_proj_bias)
    conv1d:   depthwise causal over qkv, d_conv taps, with bias (only when d_conv > 0)
    out_proj: head_dim · num_heads + mlp / 2 -> D (bias: out_proj_bias)

The layer itself is `mamba3lite.model.attention.MHA`; its decode state is a key/value cache that holds
the state's maximum length, or grows by doubling when none is given.
Unlike Mamba-3's, its FLOPs and the activations it keeps per token grow with the sequence length T.
"""

from __future__ import annotations

from torch import nn

from mamba3lite.errors import ConfigError
from mamba3lite.model.attention import MHA
from mamba3lite.model.config import ModelConfig
from mamba3lite.model.context_parallel import ContextParallel


def build_attention(cfg: ModelConfig, layer_idx: int, device=None, dtype=None) -> nn.Module:
    """The attention mixer of layer `layer_idx`, as mamba_ssm's create_block builds it."""
    return MHA(cfg.d_model, layer_idx=layer_idx, causal=True, **cfg.attn_cfg, device=device, dtype=dtype)


def _widths(cfg: ModelConfig) -> tuple[int, int, int]:
    """(qkv, out, mlp) widths of the official layout (module docstring)."""
    heads, hd = cfg.attn_cfg["num_heads"], cfg.attn_head_dim
    return hd * (heads + 2 * cfg.attn_num_heads_kv), hd * heads, cfg.attn_mlp_dim


def attention_parameters(cfg: ModelConfig) -> int:
    """Parameters of one attention mixer (module docstring)."""
    D, a = cfg.d_model, cfg.attn_cfg
    qkv, out, mlp = _widths(cfg)
    n = D * (qkv + mlp) + (qkv + mlp if a.get("qkv_proj_bias", True) else 0)  # in_proj
    if a.get("d_conv", 0) > 0:
        n += qkv * a["d_conv"] + qkv  # conv1d weight (qkv, 1, d_conv) and bias
    n += (out + mlp // 2) * D + (D if a.get("out_proj_bias", True) else 0)  # out_proj
    return n


def attention_hidden_matrix_parameters(cfg: ModelConfig) -> int:
    """Parameters of the mixer's 2-D hidden matrices (Muon's): in_proj and out_proj."""
    qkv, out, mlp = _widths(cfg)
    return cfg.d_model * (qkv + mlp) + (out + mlp // 2) * cfg.d_model


def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> dict[str, float]:
    """Forward FLOPs per token of one attention mixer in sequences of `seq_len` tokens, by part:
    projections (in_proj, the depthwise conv, out_proj) and attention (q·kᵀ and the weights' product
    with v, per query head, over the (T + 1) / 2 keys a causal query sees on average: the T² term)."""
    D, a = cfg.d_model, cfg.attn_cfg
    qkv, out, mlp = _widths(cfg)
    projections = 2 * D * (qkv + mlp) + 2 * a.get("d_conv", 0) * qkv + 2 * (out + mlp // 2) * D
    keys = (max(seq_len, 1) + 1) / 2
    attention = 2 * 2 * a["num_heads"] * cfg.attn_head_dim * keys
    return {"projections": float(projections), "attention": float(attention)}


def attention_set_context_parallel(mixer: nn.Module, cp: ContextParallel | None) -> None:
    """The layer's key/value exchange over the context-parallel group, where the layer has one; a
    ConfigError where it has none and a group is set."""
    hook = getattr(mixer, "set_context_parallel", None)
    if hook is not None:
        hook(cp)
    elif cp is not None:
        raise ConfigError(
            "training.context_parallel > 1 does not cover attention layers in this installation; "
            "train this hybrid with training.context_parallel=1"
        )
