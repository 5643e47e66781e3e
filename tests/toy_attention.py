"""A stand-in for the attention layer kind, for testing the seam around it (model/layer_kinds.py,
model/decode_state.py): the official MHA's constructor and parameter layout (in_proj over q, k, v and
the MLP part, an optional depthwise conv1d, out_proj) with plain causal softmax attention. No rotary,
no packed-document resets: it exists so that a hybrid model can be built, decoded and served in the
tests; it is not the attention layer (model/attention.py is).

Its decode state grows with the length, as a key/value cache does: `ToyKV` holds (B, max_len, ...) keys
and values and each row's length, and follows the protocol through `RowTensors`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mamba3lite.model.decode_state import RowTensors

SPEC = "toy_attention:ToyMHA"  # what kind_attention.ATTENTION_CLASS is set to in the tests


@dataclass
class ToyKV(RowTensors):
    k_BLKP: Tensor
    v_BLKP: Tensor
    len_B: Tensor


class ToyMHA(nn.Module):
    def __init__(self, embed_dim, num_heads, num_heads_kv=None, head_dim=None, mlp_dim=0, qkv_proj_bias=True,
                 out_proj_bias=True, softmax_scale=None, causal=False, layer_idx=None, d_conv=0,
                 rotary_emb_dim=0, rotary_emb_base=10000.0, rotary_emb_interleaved=False, device=None,
                 dtype=None) -> None:  # fmt: skip
        super().__init__()
        fk = {"device": device, "dtype": dtype}
        assert causal and rotary_emb_dim == 0
        self.num_heads, self.num_heads_kv = num_heads, num_heads_kv or num_heads
        self.head_dim = head_dim or embed_dim // num_heads
        self.mlp_dim = math.ceil(mlp_dim / 256) * 256
        self.d_conv, self.softmax_scale = d_conv, softmax_scale
        qkv = self.head_dim * (self.num_heads + 2 * self.num_heads_kv)
        self.in_proj = nn.Linear(embed_dim, qkv + self.mlp_dim, bias=qkv_proj_bias, **fk)
        if d_conv > 0:
            self.conv1d = nn.Conv1d(qkv, qkv, d_conv, padding=d_conv - 1, groups=qkv, **fk)
        out = self.head_dim * self.num_heads
        self.out_proj = nn.Linear(out + self.mlp_dim // 2, embed_dim, bias=out_proj_bias, **fk)

    def allocate_state(self, batch_size, max_len=None, device=None, dtype=None) -> ToyKV:
        assert self.d_conv == 0 and max_len is not None, "the toy decodes without conv, to a known length"
        w = self.out_proj.weight
        shape = (batch_size, max_len, self.num_heads_kv, self.head_dim)
        kw = {"device": device or w.device, "dtype": dtype or w.dtype}
        return ToyKV(torch.zeros(shape, **kw), torch.zeros(shape, **kw),
                     torch.zeros(batch_size, dtype=torch.long, device=kw["device"]))  # fmt: skip

    def _qkv(self, u_BTD: Tensor):
        qkv = self.in_proj(u_BTD)
        qkv, mlp = qkv.split([qkv.shape[-1] - self.mlp_dim, self.mlp_dim], dim=-1)
        if self.d_conv > 0:
            qkv = self.conv1d(qkv.transpose(1, 2))[..., : u_BTD.shape[1]].transpose(1, 2)
        hd, H, K = self.head_dim, self.num_heads, self.num_heads_kv
        q, k, v = qkv.split([H * hd, K * hd, K * hd], dim=-1)
        B, T = u_BTD.shape[:2]
        return q.view(B, T, H, hd), k.view(B, T, K, hd), v.view(B, T, K, hd), mlp

    def _out(self, ctx_BTHP: Tensor, mlp: Tensor) -> Tensor:
        ctx = ctx_BTHP.flatten(2)
        if self.mlp_dim > 0:
            up, gate = mlp.chunk(2, dim=-1)
            ctx = torch.cat([ctx, up * F.silu(gate)], dim=-1)
        return self.out_proj(ctx)

    def _attend(self, q_BTHP, k_BSKP, v_BSKP, mask_BTS) -> Tensor:
        rep = self.num_heads // self.num_heads_kv
        k = k_BSKP.repeat_interleave(rep, dim=2).transpose(1, 2)
        v = v_BSKP.repeat_interleave(rep, dim=2).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q_BTHP.transpose(1, 2), k, v, attn_mask=mask_BTS[:, None], scale=self.softmax_scale
        )
        return out.transpose(1, 2)

    def forward(self, u_BTD: Tensor, state: ToyKV | None = None, reset_BT: Tensor | None = None) -> Tensor:
        assert reset_BT is None, "the toy has no packed documents"
        q, k, v, mlp = self._qkv(u_BTD)
        T = u_BTD.shape[1]
        if state is None:
            causal = torch.ones(T, T, dtype=torch.bool, device=u_BTD.device).tril()
            return self._out(self._attend(q, k, v, causal.expand(u_BTD.shape[0], T, T)), mlp)
        start = int(state.len_B[0])
        assert bool((state.len_B == start).all()), "the toy prefills rows of one length"
        with torch.no_grad():
            state.k_BLKP[:, start : start + T] = k
            state.v_BLKP[:, start : start + T] = v
            state.len_B += T
        S = start + T
        mask = torch.ones(T, S, dtype=torch.bool, device=u_BTD.device).tril(start)
        ctx = self._attend(q, state.k_BLKP[:, :S], state.v_BLKP[:, :S], mask.expand(u_BTD.shape[0], T, S))
        return self._out(ctx, mlp)

    def step(self, u_BD: Tensor, state: ToyKV, reset_B: Tensor | None = None) -> Tensor:
        assert reset_B is None
        q, k, v, mlp = self._qkv(u_BD[:, None])
        rows = torch.arange(u_BD.shape[0], device=u_BD.device)
        with torch.no_grad():
            state.k_BLKP[rows, state.len_B] = k[:, 0]
            state.v_BLKP[rows, state.len_B] = v[:, 0]
            state.len_B += 1
        keys = torch.arange(state.k_BLKP.shape[1], device=u_BD.device)
        mask = (keys[None, :] < state.len_B[:, None])[:, None]  # each row's own length
        return self._out(self._attend(q, state.k_BLKP, state.v_BLKP, mask), mlp)[:, 0]
