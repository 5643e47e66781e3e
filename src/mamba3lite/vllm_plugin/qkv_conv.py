"""The conv over qkv of a hybrid's attention layer (`attn_cfg.d_conv` = W > 1) as a vLLM state layer:
its state is the last W − 1 qkv inputs of a request, one slot per request in vLLM's Mamba state cache
(beside the layer's keys and values in the paged attention cache), read and written as `VllmMamba3`'s
states are (layer.py: decode rows, then prefill pieces, vLLM's Mamba-1 metadata).

    decode tokens   -> MHA._conv of one token over its slot's window, the window moved on by one
    prefill pieces  -> MHA._conv of the piece over its slot's window (zeros for a request's first piece),
                       the piece's last W − 1 inputs written back

The conv's math is MHA's own (`MHA._conv`), with vLLM's positions as the tokens' places in their one
document (a tap before the request's first token reads nothing).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from vllm.config import CacheConfig, ModelConfig
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from mamba3lite.vllm_plugin.layer import prefill_pieces, register_state_layer, step_metadata

# MHA._conv: (x_BTQ, in_doc_BT, window_BWQ, state) -> out_BTQ
ConvFn = Callable[[Tensor, Tensor, Tensor, None], Tensor]


def conv_state_spec(W: int, Q: int, dtype: torch.dtype) -> tuple[tuple[tuple[int, ...], ...], tuple]:
    """(shapes, dtypes) of one request's conv state: the last W − 1 inputs of width Q."""
    return ((W - 1, Q),), (dtype,)


class VllmQkvConv(nn.Module, MambaBase):
    """The conv window of one attention layer in vLLM's cache (module docstring); no parameters (the
    conv's weights stay MHA's `conv1d`)."""

    def __init__(self, W: int, Q: int, model_config: ModelConfig, cache_config: CacheConfig, prefix: str):
        super().__init__()
        self.W = W
        self.state_shapes, self.state_dtypes = conv_state_spec(W, Q, model_config.dtype)
        self.model_config, self.cache_config, self.prefix = model_config, cache_config, prefix
        self.kv_cache = (torch.tensor([]),)
        register_state_layer(prefix, self)

    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        return self.state_shapes

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        return self.state_dtypes

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.MAMBA3LITE

    def forward(self, qkv_TQ: Tensor, positions_T: Tensor, conv: ConvFn) -> Tensor:
        md = step_metadata(self.prefix)
        if md is None:  # vLLM's profiling run: one stateless sequence
            window_1WQ = qkv_TQ.new_zeros(1, self.W - 1, qkv_TQ.shape[-1])
            return conv(qkv_TQ[None], positions_T[None], window_1WQ, None)[0]
        (state,) = self.kv_cache
        out_TQ = torch.empty_like(qkv_TQ)
        n_dec = md.num_decode_tokens
        if md.num_decodes > 0:
            rows = md.state_indices_tensor_d[:, 0]
            window_BWQ = state[rows].to(qkv_TQ.dtype)
            x_B1Q = qkv_TQ[:n_dec, None]
            out_TQ[:n_dec] = conv(x_B1Q, positions_T[:n_dec, None], window_BWQ, None)[:, 0]
            state[rows] = torch.cat((window_BWQ, x_B1Q), dim=1)[:, 1:].to(state.dtype)
        if md.num_prefills > 0:
            for slot, start, end, continues in prefill_pieces(md):
                window_1WQ = state[slot : slot + 1].to(qkv_TQ.dtype)
                if not continues:
                    window_1WQ = torch.zeros_like(window_1WQ)
                x_1TQ = qkv_TQ[None, start:end]
                out_TQ[start:end] = conv(x_1TQ, positions_T[None, start:end], window_1WQ, None)[0]
                padded = torch.cat((window_1WQ, x_1TQ), dim=1)
                state[slot] = padded[0, padded.shape[1] - (self.W - 1) :].to(state.dtype)
        return out_TQ
