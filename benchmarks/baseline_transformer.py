"""The benchmarks' Transformer baseline: a small pre-norm GPT of the Mamba-3 LM's width, depth, MLP, norms,
tied head and loss, so that the two differ only in the sequence mixer.

    embed ─► n_layers × [x += Attention(RMSNorm(x)); x += SwiGLU(RMSNorm(x))] ─► RMSNorm ─► tied head

Attention: causal multi-head self-attention through F.scaled_dot_product_attention with RoPE (base
10,000, split halves: the Llama/NeoX convention), head dim `cfg.headdim`, no biases. The MLP
(`GatedMLP`), the norms (`RMSNorm`) and the fused chunked loss (`linear_cross_entropy`) are the Mamba-3
LM's own modules. Initialisation as the Mamba-3 LM's (`Mamba3Transformer._init_weights`): embedding
~ N(0, init_std), linear layers torch's default, the residual branches' outputs (attn.out, mlp.fc2)
divided by sqrt(n_layers). Attention runs across the EOS tokens inside a window (a plain GPT); the
Mamba-3 LM resets its state there (`reset_at_eos`).

Parameter names follow the Mamba-3 LM's where they play the same part (`embed`, `layers.i.norm`,
`layers.i.mlp.fc1`, `norm_f`), so the optimizer's name rule (train/optim.py) splits both alike: the
attention's qkv and out matrices and the MLP's are hidden matrices (Muon under `optimizer: muon`), the
embedding (= head) and the norms AdamW's.

Used by bench_model.py (training throughput, decode latency), gpu_model.py, activation_memory.py and
ttq_transformer.py (the time-to-quality baseline row).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mamba3lite.model import ModelConfig
from mamba3lite.model.mamba3 import RMSNorm
from mamba3lite.model.transformer import GatedMLP, linear_cross_entropy


def rope_tables(positions_T: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """cos, sin (T, dim/2) of the standard RoPE (base 10,000) at the given positions."""
    inv = 1.0 / (10_000 ** (torch.arange(0, dim, 2, dtype=torch.float32, device=positions_T.device) / dim))
    ang_TK = positions_T.float()[:, None] * inv[None]
    return ang_TK.cos(), ang_TK.sin()


def apply_rope(x_BhTd: Tensor, cos_TK: Tensor, sin_TK: Tensor) -> Tensor:
    """Rotate split halves of the head dim (Llama/NeoX convention)."""
    a, b = x_BhTd.chunk(2, dim=-1)
    cos, sin = cos_TK.to(x_BhTd.dtype), sin_TK.to(x_BhTd.dtype)
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


@dataclass
class KVCache:
    """Per-layer K/V buffers (B, heads, max_len, head_dim), filled up to `length`."""

    k: list[Tensor]
    v: list[Tensor]
    length: int = 0


class Attention(nn.Module):
    """Causal multi-head self-attention (head dim = the Mamba head dim), RoPE, SDPA; no biases."""

    def __init__(self, d_model: int, headdim: int) -> None:
        super().__init__()
        self.nh, self.hd = d_model // headdim, headdim
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x_BTD: Tensor, pos0: int = 0, cache: tuple[Tensor, Tensor] | None = None) -> Tensor:
        B, T, D = x_BTD.shape
        q, k, v = self.qkv(x_BTD).view(B, T, 3, self.nh, self.hd).permute(2, 0, 3, 1, 4)
        cos, sin = rope_tables(torch.arange(pos0, pos0 + T, device=x_BTD.device), self.hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # write this step's keys/values, attend over everything so far
            kc, vc = cache
            kc[:, :, pos0 : pos0 + T] = k
            vc[:, :, pos0 : pos0 + T] = v
            end = pos0 + T
            y = F.scaled_dot_product_attention(
                q, kc[:, :, :end], vc[:, :, :end], is_causal=pos0 == 0 and T > 1
            )
        return self.out(y.transpose(1, 2).reshape(B, T, D))


class TransformerBlock(nn.Module):
    """One layer: x += attn(norm(x)); x += mlp(norm2(x)), as the Mamba-3 LM's `Block` with attention."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg.d_model, cfg.headdim)
        self.norm2 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = GatedMLP(cfg.d_model, cfg.d_mlp)

    def forward(self, x_BTD: Tensor, pos0: int = 0, cache: tuple[Tensor, Tensor] | None = None) -> Tensor:
        x_BTD = x_BTD + self.attn(self.norm(x_BTD), pos0, cache)
        return x_BTD + self.mlp(self.norm2(x_BTD))


class BaselineTransformer(nn.Module):
    """Llama-style causal LM with the Mamba-3 LM's width, depth, MLP, norms, tied head and loss."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm_f = RMSNorm(cfg.d_model, cfg.norm_eps)
        with torch.no_grad():  # the Mamba-3 LM's initialisation (module docstring)
            nn.init.normal_(self.embed.weight, std=cfg.init_std)
            for block in self.layers:
                block.attn.out.weight.div_(math.sqrt(cfg.n_layers))
                block.mlp.fc2.weight.div_(math.sqrt(cfg.n_layers))

    def _body(self, ids_BT: Tensor, cache: KVCache | None = None) -> Tensor:
        x = self.embed(ids_BT)
        pos0 = 0 if cache is None else cache.length
        for i, block in enumerate(self.layers):
            x = block(x, pos0, None if cache is None else (cache.k[i], cache.v[i]))
        if cache is not None:
            cache.length += ids_BT.shape[1]
        return self.norm_f(x)

    def forward(self, ids_BT: Tensor, targets_BT: Tensor) -> Tensor:
        h = self._body(ids_BT)
        return linear_cross_entropy(h.flatten(0, 1), self.embed.weight, targets_BT.flatten())

    def allocate_cache(self, batch: int, max_len: int) -> KVCache:
        shape = (batch, self.cfg.d_model // self.cfg.headdim, max_len, self.cfg.headdim)
        n = self.cfg.n_layers
        return KVCache([torch.zeros(shape) for _ in range(n)], [torch.zeros(shape) for _ in range(n)])

    @torch.no_grad()
    def prefill(self, ids_BT: Tensor, cache: KVCache) -> Tensor:
        return self._body(ids_BT, cache)[:, -1] @ self.embed.weight.T

    @torch.no_grad()
    def step(self, token_B: Tensor, cache: KVCache) -> Tensor:
        return self._body(token_B[:, None], cache)[:, 0] @ self.embed.weight.T


def transformer_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs per token (2 per multiply-add): qkv + out projections, causal attention (scores and
    values over T/2 keys on average), SwiGLU, head. As `model_flops_per_token` for the matmuls; its scan
    counts full chunk blocks, masked half included (the scan table prints both conventions)."""
    D, nl = cfg.d_model, cfg.n_layers
    proj = nl * 2 * D * 4 * D
    attn = nl * 2 * 2 * D * (seq_len / 2)
    mlp = nl * 2 * 3 * D * cfg.d_mlp
    return float(proj + attn + mlp + 2 * D * cfg.vocab_size)
