"""Parameter count and forward FLOPs per token, from the config alone (no model is built).

The peak FLOP/s of the accelerator that MFU divides by is `model/hardware.py`'s.

`count_parameters` is tested equal to the real count on the meta device for every preset, and to the
docs/model.md §5 table with the Llama-3.1 vocabulary. FLOPs count 2 per multiply-add of every matmul, as
implemented (the chunked scan computes full L×L blocks, causal half included); elementwise work
(norms, gates, exponentials, rotation) is left out, as is usual for MFU.
"""

from __future__ import annotations

from mamba3lite.model.config import ModelConfig
from mamba3lite.model.layer_kinds import LAYER_KINDS, layers_by_kind


def block_parameters(cfg: ModelConfig, kind: str) -> int:
    """Parameters of one block whose mixer is of `kind`: norm, mixer, and the MLP half (norm2, fc1
    (D -> 2F), fc2 (F -> D)) when there is one."""
    D, F = cfg.d_model, cfg.d_mlp
    mlp = D + 3 * D * F if F > 0 else 0
    return D + LAYER_KINDS[kind].parameters(cfg) + mlp


def count_parameters(cfg: ModelConfig) -> int:
    """Total parameters of `Mamba3Transformer(cfg)`, summed over the layers by kind; a tied
    embedding/head is counted once."""
    D = cfg.d_model
    blocks = sum(n * block_parameters(cfg, kind) for kind, (n, _) in layers_by_kind(cfg).items())
    embed = cfg.vocab_size * D
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * D
    return embed + blocks + D + head  # + norm_f


def model_flops_per_token(cfg: ModelConfig, seq_len: int) -> dict[str, float]:
    """Forward FLOPs per token by part, for sequences of `seq_len` tokens, plus "forward" and "train".

    The mixers' parts are their kinds' (model/layer_kinds.py), summed over the layers by kind: Mamba-3's
    projections (in_proj + out_proj), scan_intra (the chunk's masked quadratic form: scores and their
    product with the values) and scan_state (chunk states, their use by the queries, the carry);
    attention's projections and attention (the T² term). Then mlp, lm_head, forward (their sum) and
    train = 3 × forward (backward ≈ 2 × forward).
    """
    parts: dict[str, float] = {}
    for kind, (n, _) in layers_by_kind(cfg).items():
        for part, flops in LAYER_KINDS[kind].flops_per_token(cfg, seq_len).items():
            parts[part] = parts.get(part, 0.0) + n * flops
    parts["mlp"] = float(cfg.n_layers * 2 * 3 * cfg.d_model * cfg.d_mlp)
    parts["lm_head"] = float(2 * cfg.d_model * cfg.vocab_size)
    forward = sum(parts.values())
    return {**parts, "forward": float(forward), "train": float(3 * forward)}
