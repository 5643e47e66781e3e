"""An independent official-layout Mamba-3 language model, for the import/export tests (issue 17).

Written from docs/model.md §1.2 (parameter shapes) and §5 (the LM: embedding, pre-norm blocks of
RMSNorm -> Mamba-3 -> residual and RMSNorm -> GatedMLP -> residual, final RMSNorm, LM head), on the
official names of `MambaLMHeadModel` (`backbone.embedding.weight`, `backbone.layers.{i}.norm.weight`,
`...mixer.*`, `...norm2.weight`, `...mlp.fc1/fc2.weight`, `backbone.norm_f.weight`, `lm_head.weight`),
sharing no code with `mamba3lite`: the mixer is `spec_forward` of tests/test_mamba3_spec.py, itself
written from the text. Hybrids (`attn_layer_idx`): those layers' mixer is mamba_ssm's MHA
(mamba_ssm/modules/mha.py), built as `create_block` builds it, `MHA(d_model, layer_idx=i, **attn_cfg)`,
and run by `official_mha` from that file's forward (rotary as complex numbers, `rotate_as_complex` of
tests/test_attention.py). `official_state_dict` builds random weights of the official shapes from a
config.json alone, as `MambaLMHeadModel(MambaConfig(**config))` would hold them; `official_logits`
runs them. This is the CPU stand-in for `MambaLMHeadModel.from_pretrained` (no mamba_ssm here).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from test_attention import rotate_as_complex
from test_mamba3_spec import spec_forward

F64 = torch.float64
MAMBA_CONFIG_DEFAULTS = dict(
    d_model=2560, d_intermediate=0, n_layer=64, vocab_size=50277, ssm_cfg={}, attn_layer_idx=[], attn_cfg={},
    rms_norm=True, residual_in_fp32=True, fused_add_norm=True, pad_vocab_size_multiple=8, tie_embeddings=True,
)  # fmt: skip
MAMBA3_DEFAULTS = dict(d_state=128, expand=2, headdim=64, ngroups=1, rope_fraction=0.5, is_outproj_norm=False,
                       is_mimo=False, mimo_rank=4, A_floor=1e-4)  # fmt: skip


def resolved(config: dict) -> tuple[dict, dict]:
    c = {**MAMBA_CONFIG_DEFAULTS, **config}
    s = {**MAMBA3_DEFAULTS, **{k: v for k, v in c["ssm_cfg"].items() if k != "layer"}}
    return c, s


def attention(config: dict) -> dict:
    """The MHA keywords of the attention layers with the official defaults filled in (num_heads has none)."""
    c, _ = resolved(config)
    a = {"num_heads_kv": None, "head_dim": None, "mlp_dim": 0, "qkv_proj_bias": True, "out_proj_bias": True,
         "softmax_scale": None, "causal": False, "d_conv": 0, "rotary_emb_dim": 0, "rotary_emb_base": 10000.0,
         "rotary_emb_interleaved": False, **c["attn_cfg"]}  # fmt: skip
    H = a["num_heads"]
    a["num_heads_kv"] = a["num_heads_kv"] or H
    a["head_dim"] = a["head_dim"] or c["d_model"] // H
    a["mlp_dim"] = math.ceil(a["mlp_dim"] / 256) * 256
    return a


def mha_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """name (below `mixer.`) -> shape of an attention layer's tensors, from mha.py's __init__."""
    D, a = resolved(config)[0]["d_model"], attention(config)
    Q = a["head_dim"] * (a["num_heads"] + 2 * a["num_heads_kv"])
    out = {"in_proj.weight": (Q + a["mlp_dim"], D)}
    if a["qkv_proj_bias"]:
        out["in_proj.bias"] = (Q + a["mlp_dim"],)
    if a["d_conv"]:
        out |= {"conv1d.weight": (Q, 1, a["d_conv"]), "conv1d.bias": (Q,)}
    out["out_proj.weight"] = (D, a["head_dim"] * a["num_heads"] + a["mlp_dim"] // 2)
    if a["out_proj_bias"]:
        out["out_proj.bias"] = (D,)
    return out


def official_mha(w: dict, config: dict, u: torch.Tensor) -> torch.Tensor:
    """mha.py's forward without a cache: in_proj -> [qkv | mlp]; the causal depthwise conv over qkv; q and
    the (2, G, P) kv split; rotary on the first r dims of q and k; flash attention (K/V head h // (H/G),
    causal when attn_cfg says so); out_proj over [context | up * silu(gate)]."""
    a = attention(config)
    H, G, P, m = a["num_heads"], a["num_heads_kv"], a["head_dim"], a["mlp_dim"]
    qkv = u @ w["in_proj.weight"].T + w.get("in_proj.bias", 0)
    qkv, x_mlp = qkv.split([qkv.shape[-1] - m, m], dim=-1)
    up, gate = x_mlp.chunk(2, dim=-1)
    if a["d_conv"]:
        W = a["d_conv"]
        conv = F.conv1d(
            qkv.transpose(1, 2), w["conv1d.weight"], w["conv1d.bias"], padding=W - 1, groups=qkv.shape[-1]
        )
        qkv = conv[..., : -(W - 1)].transpose(1, 2)
    q, kv = qkv.split([H * P, 2 * G * P], dim=-1)
    q, kv = q.unflatten(-1, (H, P)), kv.unflatten(-1, (2, G, P))
    k, v = kv.unbind(-3)
    if a["rotary_emb_dim"]:
        r, base, inter = a["rotary_emb_dim"], a["rotary_emb_base"], a["rotary_emb_interleaved"]
        q, k = rotate_as_complex(q, r, base, inter), rotate_as_complex(k, r, base, inter)
    k, v = (x.repeat_interleave(H // G, dim=2) for x in (k, v))
    scale = a["softmax_scale"] or P**-0.5
    scores = torch.einsum("bthp,bshp->bhts", q, k) * scale
    if a["causal"]:
        T = u.shape[1]
        scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    ctx = torch.einsum("bhts,bshp->bthp", scores.softmax(-1), v).flatten(2)
    if m:
        ctx = torch.cat((ctx, up * F.silu(gate)), -1)
    return ctx @ w["out_proj.weight"].T + w.get("out_proj.bias", 0)


def padded_vocab(config: dict) -> int:
    c, _ = resolved(config)
    m = c["pad_vocab_size_multiple"]
    return (c["vocab_size"] + m - 1) // m * m


def mlp_width(config: dict) -> int:
    f = resolved(config)[0]["d_intermediate"]
    return (f + 127) // 128 * 128  # GatedMLP's multiple_of


def official_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor in `MambaLMHeadModel(config).state_dict()` (docs/model.md §1.2, §5)."""
    c, _ = resolved(config)
    D, V = c["d_model"], padded_vocab(config)
    out = {"backbone.embedding.weight": (V, D)}
    for i in range(c["n_layer"]):
        b = f"backbone.layers.{i}."
        out[b + "norm.weight"] = (D,)
        m = b + "mixer."
        if i in c["attn_layer_idx"]:
            out |= {m + k: shape for k, shape in mha_shapes(config).items()}
        else:
            _mamba3_shapes(out, m, config)
        if c["d_intermediate"]:
            F = mlp_width(config)
            out[b + "norm2.weight"] = (D,)
            out[b + "mlp.fc1.weight"] = (2 * F, D)
            out[b + "mlp.fc2.weight"] = (D, F)
    out["backbone.norm_f.weight"] = (D,)
    out["lm_head.weight"] = (V, D)
    return out


def _mamba3_shapes(out: dict, m: str, config: dict) -> None:
    """The Mamba-3 mixer's tensors (names below `m`) into `out`."""
    c, s = resolved(config)
    D, N, P, G = c["d_model"], s["d_state"], s["headdim"], s["ngroups"]
    E = s["expand"] * D
    H = E // P
    R = s["mimo_rank"] if s["is_mimo"] else 1
    split = int(N * s["rope_fraction"])
    split -= split % 2
    S = split // 2
    out[m + "in_proj.weight"] = (2 * E + 2 * N * G * R + 3 * H + S, D)
    out[m + "dt_bias"] = (H,)
    out[m + "B_bias"] = out[m + "C_bias"] = (H, R, N)
    out[m + "B_norm.weight"] = out[m + "C_norm.weight"] = (N,)
    if s["is_mimo"]:
        out[m + "mimo_x"] = out[m + "mimo_z"] = out[m + "mimo_o"] = (H, R, P)
    out[m + "D"] = (H,)
    if s["is_outproj_norm"]:
        out[m + "norm.weight"] = (E,)
    out[m + "out_proj.weight"] = (D, E)


def official_state_dict(config: dict, seed: int = 0, dtype=F64) -> dict[str, torch.Tensor]:
    """Random weights of the official shapes; tied heads are the embedding tensor itself (as the
    official state_dict holds them). Scales keep activations O(1) so every path matters."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, shape in official_shapes(config).items():
        if name == "lm_head.weight" and resolved(config)[0]["tie_embeddings"]:
            sd[name] = sd["backbone.embedding.weight"]
            continue
        t = torch.randn(shape, generator=g, dtype=F64)
        if name.endswith(("norm.weight", "norm2.weight", "norm_f.weight", "B_bias", "C_bias", ".D")):
            t = 1 + 0.3 * t
        elif len(shape) == 2:
            t = t / shape[1] ** 0.5
        else:
            t = 0.5 * t
        sd[name] = t.to(dtype)
    return sd


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def official_logits(
    sd: dict, config: dict, ids: torch.Tensor, activation: str = "heavy_tail"
) -> torch.Tensor:
    """(B, T, padded V) logits of the official LM with weights `sd` on token ids (B, T), in float64."""
    c, s = resolved(config)
    sd = {k: v.to(F64) for k, v in sd.items()}
    x = sd["backbone.embedding.weight"][ids]
    for i in range(c["n_layer"]):
        b = f"backbone.layers.{i}."
        mixer = {k[len(b + "mixer.") :]: v for k, v in sd.items() if k.startswith(b + "mixer.")}
        if i in c["attn_layer_idx"]:
            x = x + official_mha(mixer, config, _rms(x, sd[b + "norm.weight"]))
        else:
            x = x + spec_forward(
            mixer, _rms(x, sd[b + "norm.weight"]), N=s["d_state"], P=s["headdim"], G=s["ngroups"],
            R=s["mimo_rank"] if s["is_mimo"] else 1, mimo=s["is_mimo"], outnorm=s["is_outproj_norm"],
            rope_fraction=s["rope_fraction"], activation=activation, A_floor=s["A_floor"],
        )  # fmt: skip
        if c["d_intermediate"]:
            v, gate = (_rms(x, sd[b + "norm2.weight"]) @ sd[b + "mlp.fc1.weight"].T).chunk(2, dim=-1)
            x = x + (v * gate * torch.sigmoid(gate)) @ sd[b + "mlp.fc2.weight"].T
    return _rms(x, sd["backbone.norm_f.weight"]) @ sd["lm_head.weight"].T
