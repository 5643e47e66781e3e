"""Parameter count and forward FLOPs per token, from the config alone (no model is built).

The peak FLOP/s of the accelerator that MFU divides by is `model/hardware.py`'s.

`count_parameters` is tested equal to the real count on the meta device for every preset, and to the
docs/model.md §5 table with the Llama-3.1 vocabulary. FLOPs count 2 per multiply-add of every matmul, as
implemented (the chunked scan computes full L×L blocks, causal half included); elementwise work
(norms, gates, exponentials, rotation) is left out, as is usual for MFU.
"""

from __future__ import annotations

import math

from mamba3lite.model.config import ModelConfig


def mixer_parameters(cfg: ModelConfig) -> int:
    """Parameters of one Mamba-3 mixer (docs/model.md §1.2)."""
    D, E, H, N, P, R = cfg.d_model, cfg.d_inner, cfg.nheads, cfg.d_state, cfg.headdim, cfg.rank
    n = D * cfg.d_in_proj  # in_proj
    n += H  # dt_bias
    n += 2 * H * R * N  # B_bias, C_bias
    n += 2 * N  # B_norm, C_norm
    n += H  # D
    if cfg.is_mimo:
        n += 3 * H * R * P  # mimo_x, mimo_z, mimo_o
    if cfg.is_outproj_norm:
        n += E
    n += E * D  # out_proj
    return n


def count_parameters(cfg: ModelConfig) -> int:
    """Total parameters of `Mamba3Transformer(cfg)`; a tied embedding/head is counted once."""
    D, F = cfg.d_model, cfg.d_mlp
    per_layer = D + mixer_parameters(cfg)  # norm + mixer
    if F > 0:
        per_layer += D + 3 * D * F  # norm2 + fc1 (D -> 2F) + fc2 (F -> D)
    embed = cfg.vocab_size * D
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * D
    return embed + cfg.n_layers * per_layer + D + head  # + norm_f


def model_flops_per_token(cfg: ModelConfig, seq_len: int) -> dict[str, float]:
    """Forward FLOPs per token by part, for sequences of `seq_len` tokens, plus "forward" and "train".

    Keys: projections (in_proj + out_proj), scan_intra (the chunk's masked quadratic form: scores and
    their product with the values), scan_state (chunk states, their use by the queries, the carry),
    mlp, lm_head, forward (their sum) and train = 3 × forward (backward ≈ 2 × forward).
    """
    D, E, H, N, P, R = cfg.d_model, cfg.d_inner, cfg.nheads, cfg.d_state, cfg.headdim, cfg.rank
    L = max(1, min(cfg.chunk_size, seq_len))
    nl = cfg.n_layers
    # The scan pads the last chunk to L tokens: its work per real token is that of ceil(T/L)·L tokens.
    padded = math.ceil(max(seq_len, 1) / L) * L / max(seq_len, 1)
    projections = nl * 2 * D * (cfg.d_in_proj + E)
    # Per chunk and head: scores (LR × N) @ (N × LR) and (LR × LR) @ (LR × P): 2·L²R²(N + P); per token ÷ L.
    scan_intra = padded * nl * H * 2 * L * R * R * (N + P)
    # Per token and head: chunk state Vᵀ K̃ (2·R·P·N), queries on the carried state (2·R·N·P), and the
    # carry S ← e^{…} S + dS once per chunk (2·P·N / L).
    scan_state = padded * nl * H * (4 * R * P * N + 2 * P * N / L)
    mlp = nl * 2 * 3 * D * cfg.d_mlp
    lm_head = 2 * D * cfg.vocab_size
    forward = projections + scan_intra + scan_state + mlp + lm_head
    return {
        "projections": float(projections),
        "scan_intra": float(scan_intra),
        "scan_state": float(scan_state),
        "mlp": float(mlp),
        "lm_head": float(lm_head),
        "forward": float(forward),
        "train": float(3 * forward),
    }
