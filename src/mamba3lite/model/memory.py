"""Training memory of a config, by measurement: what autograd keeps per token and layer, times the batch.

`activation_bytes_per_token` runs one `Block` forward on the CPU under bf16 autocast (as the trainer
runs on accelerators) and adds up the distinct storages saved for the backward pass, less the
per-layer bf16 copies of the weights. `training_memory_bytes` scales that by micro batch × window ×
layers (or, with gradient checkpointing, keeps one fp32 layer input per layer plus one layer's
activations) and adds 16 bytes per parameter: fp32 weights, gradients and AdamW's two moments.
On the H200 (benchmarks/RESULTS.md, GPU section) the measured eager peaks came out 4-7% below this
estimate, for a layer that kept 8.75 KiB per token more than it does now (in_proj's whole output and
SiLU(z)); the presets' micro batches are sized with it to fit an 80 GB accelerator. The estimate
measures the layer with the config's scan (`chunked` on the CPU); benchmarks/activation_memory.py
compares it with the Triton scan's and the Transformer's. Under torch.compile
(`training.compile`) the compiler picks what to save and the peaks were ~1.4x this estimate.
"""

from __future__ import annotations

import torch

from mamba3lite.model.config import ModelConfig
from mamba3lite.model.flops import count_parameters


def activation_bytes_per_token(cfg: ModelConfig, seq_len: int = 2048) -> float:
    """Bytes saved for backward per token by one layer (bf16 autocast, batch 1, `seq_len` tokens)."""
    from mamba3lite.model.transformer import Block

    block = Block(cfg)
    x = torch.randn(1, seq_len, cfg.d_model, requires_grad=True)
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        storages[st.data_ptr()] = st.nbytes()
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    with hooks, torch.autocast("cpu", dtype=torch.bfloat16):
        block(x)
    weight_copies = sum(2 * p.numel() for p in block.parameters() if p.dim() >= 2)
    return (sum(storages.values()) - weight_copies) / seq_len


def training_memory_bytes(
    cfg: ModelConfig, micro_batch: int, seq_len: int, grad_checkpointing: bool = False
) -> float:
    """Estimated peak bytes of one training process: activations of a micro step + model state."""
    tokens = micro_batch * seq_len
    per_layer = activation_bytes_per_token(cfg, seq_len) * tokens
    if grad_checkpointing:  # each layer keeps its fp32 input; one layer's activations are live at a time
        activations = cfg.n_layers * 4 * cfg.d_model * tokens + per_layer
    else:
        activations = cfg.n_layers * per_layer
    return activations + 16 * count_parameters(cfg)
