"""The attention layer of a hybrid as a vLLM attention layer: `VllmMHA` is the package's `MHA` (same
parameters, same projections and output) whose keys and values live in vLLM's paged cache.

    [q | k, v | up, gate] = in_proj(u)           MHA._project
    qkv ← causal conv over qkv                   only when d_conv > 0: MHA._conv, its window of the last
                                                 d_conv − 1 inputs in vLLM's Mamba state cache
                                                 (qkv_conv.py)
    q, k ← RoPE at the tokens' positions         vLLM's get_rope: rotary_dim = rotary_emb_dim, the halves
                                                 (neox style) or, interleaved, the pairs (2j, 2j+1)
    ctx = vLLM Attention(q, k, v)                scale = softmax_scale or 1/√P, GQA with num_heads_kv
    out = out_proj([ctx | up ⊙ SiLU(gate)])      MHA._output

vLLM's positions count from a request's first token, as `MHA` counts from its document's start when a
prompt holds one document: the model refuses resets at EOS (`reset_at_eos`) for hybrids, since vLLM's
attention has no documents inside a request.
"""

from __future__ import annotations

from torch import Tensor
from vllm.config import CacheConfig, ModelConfig
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.rotary_embedding import get_rope

from mamba3lite.model.attention import MHA
from mamba3lite.model.config import ModelConfig as Mamba3Config
from mamba3lite.vllm_plugin.qkv_conv import VllmQkvConv


class VllmMHA(MHA):
    """`MHA` attending through vLLM's `Attention` (see the module docstring).

    forward(u_1TD, eos_T, positions_T) -> out_1TD over the step's flat batch of T tokens (the signature
    of the vLLM mixers; `eos_T` is unused: a hybrid does not reset at EOS).
    """

    @classmethod
    def build(
        cls,
        cfg: Mamba3Config,
        layer_idx: int,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        prefix: str,
    ) -> VllmMHA:
        """The attention mixer of layer `layer_idx` of the model `cfg` (as kind_attention builds it),
        its vLLM attention registered as `prefix`.attn (and its conv window, if any, as `prefix`.conv);
        rotary tables for positions below the model's max_model_len."""
        layer = cls(cfg.d_model, layer_idx=layer_idx, causal=True, **cfg.attn_cfg)
        layer.qkv_conv = None
        if layer.d_conv > 1:
            layer.qkv_conv = VllmQkvConv(
                layer.d_conv, layer.qkv_dim, model_config, cache_config, f"{prefix}.conv"
            )
        layer.rotary_emb = None
        if layer.rotary_emb_dim > 0:
            layer.rotary_emb = get_rope(
                layer.head_dim,
                max_position=model_config.max_model_len,
                is_neox_style=not layer.rotary_emb_interleaved,
                rope_parameters={"rope_theta": layer.rotary_emb_base, "rope_dim": layer.rotary_emb_dim},
            )
        layer.attn = Attention(
            layer.num_heads, layer.head_dim, layer.scale, num_kv_heads=layer.num_heads_kv,
            cache_config=cache_config, prefix=f"{prefix}.attn",
        )  # fmt: skip
        return layer

    def forward(self, u_1TD: Tensor, eos_T: Tensor | None, positions_T: Tensor) -> Tensor:
        H, G, P = self.num_heads, self.num_heads_kv, self.head_dim
        qkv_1TQ, up_1TM, gate_1TM = self._project(u_1TD)
        qkv_TQ = qkv_1TQ[0]
        if self.qkv_conv is not None:
            qkv_TQ = self.qkv_conv(qkv_TQ, positions_T, self._conv)
        elif self.d_conv == 1:  # one tap: no window to keep
            qkv_TQ = self._conv(qkv_1TQ, positions_T[None], qkv_1TQ[:, :0], None)[0]
        q_TX, k_TY, v_TY = qkv_TQ.split([H * P, G * P, G * P], -1)
        if self.rotary_emb is not None:
            q_TX, k_TY = self.rotary_emb(positions_T, q_TX, k_TY)
        ctx_TX = self.attn(q_TX.contiguous(), k_TY.contiguous(), v_TY.contiguous())
        ctx_1HTP = ctx_TX.unflatten(-1, (H, P)).transpose(0, 1)[None]
        return self._output(ctx_1HTP, up_1TM, gate_1TM)
