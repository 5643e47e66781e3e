"""Training memory of a config, by measurement: what autograd keeps per token and layer, times the batch.

`activation_bytes_per_token` runs one `Block` forward on the CPU under bf16 autocast (as the trainer
runs on accelerators) and adds up the distinct storages saved for the backward pass, at two lengths:
the growth per token leaves out the weights and their bf16 copies. `training_memory_bytes` scales
that by micro batch × window × layers (or, with gradient checkpointing, keeps one fp32 layer input
per layer plus one layer's activations) and adds 16 bytes per parameter: fp32 weights, gradients and
AdamW's two moments. On the H200 (benchmarks/RESULTS.md, GPU section) the measured eager peaks came
out 4-7% below this estimate, for a layer that kept 12.75 KiB per token more than it does now (in_proj's
whole output, SiLU(z), out_proj's input); the presets' micro batches are sized with it to fit an 80 GB
accelerator. The estimate measures the layer with the config's scan (`chunked` on the CPU);
benchmarks/activation_memory.py compares it with the Triton scan's and the Transformer's. Under
torch.compile (`training.compile`) the compiler picks what to save and the peaks were ~1.4x this
estimate.
"""

from __future__ import annotations

import os

import torch

from mamba3lite.errors import ConfigError
from mamba3lite.model.config import ModelConfig
from mamba3lite.model.flops import count_parameters


def saved_bytes(layer: torch.nn.Module, d_model: int, seq_len: int) -> int:
    """Bytes of the distinct storages autograd keeps for the backward of one forward of `layer` on
    (1, seq_len, d_model) under bf16 autocast on the CPU, weights and their bf16 copies included."""
    x = torch.randn(1, seq_len, d_model, requires_grad=True)
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        storages[st.data_ptr()] = st.nbytes()
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    with hooks, torch.autocast("cpu", dtype=torch.bfloat16):
        layer(x)
    return sum(storages.values())


def saved_bytes_per_token(layer: torch.nn.Module, d_model: int, seq_len: int = 2048) -> float:
    """What `layer` keeps for its backward per token: the growth of `saved_bytes` from seq_len / 2 to
    seq_len tokens, so that the weights and their copies (the same at every length) drop out."""
    half = seq_len // 2
    return (saved_bytes(layer, d_model, seq_len) - saved_bytes(layer, d_model, half)) / (seq_len - half)


def activation_bytes_per_token(cfg: ModelConfig, seq_len: int = 2048) -> float:
    """Bytes saved for backward per token by one layer (bf16 autocast, batch 1, `seq_len` tokens)."""
    from mamba3lite.model.transformer import Block

    return saved_bytes_per_token(Block(cfg), cfg.d_model, seq_len)


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


def physical_memory_bytes(device: torch.device) -> int | None:
    """The memory `device` has in all: a CUDA device's total, the host's RAM for the CPU; None where
    unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):  # not a POSIX host
            return None
    return None


def check_model_fits(cfg: ModelConfig, device: torch.device) -> None:
    """ConfigError, before anything is built, for a model whose training state cannot fit `device` at
    all: 16 bytes per parameter (fp32 weights, gradients, AdamW's two moments) beyond its whole memory,
    or fp32 weights beyond the host's RAM, where the model is built first. (Building 10^8 layers one
    small allocation at a time would not fail: it would take hours.)"""
    n = count_parameters(cfg)
    for where, need, have in (
        (
            "this machine's RAM (the model is built on the host)",
            4 * n,
            physical_memory_bytes(torch.device("cpu")),
        ),
        (f"{torch.device(device)}'s memory", 16 * n, physical_memory_bytes(device)),
    ):
        if have is not None and need > have:
            raise ConfigError(
                f"the model has {n / 1e6:,.1f}M parameters (d_model {cfg.d_model}, n_layers {cfg.n_layers}, "
                f"vocab_size {cfg.vocab_size}): ~{need / 2**30:,.1f} GiB, more than {where}, "
                f"{have / 2**30:,.1f} GiB; use a smaller model (e.g. --config tiny)"
            )
