"""The Mamba-3 layer kind (model/layer_kinds.py): its mixer, parameter and FLOP counts, and its part in
context parallelism. The mixer is `Mamba3` (model/mamba3.py); its decode state is `Mamba3Cache`, a fixed
size whatever the length.

Counts follow docs/model.md §1.2 (parameters) and count 2 FLOPs per multiply-add of every matmul, as
implemented: the chunked scan computes full L×L blocks, causal half included; elementwise work (norms,
gates, exponentials, rotation) is left out, as is usual for MFU.
"""

from __future__ import annotations

import math

from torch import nn

from mamba3lite.model.config import ModelConfig
from mamba3lite.model.context_parallel import ContextParallel
from mamba3lite.model.mamba3 import Mamba3


def build_mamba3(cfg: ModelConfig, layer_idx: int, device=None, dtype=None) -> Mamba3:
    """The Mamba-3 mixer of layer `layer_idx` (every Mamba-3 layer has the same shape)."""
    return Mamba3.from_config(cfg, device=device, dtype=dtype)


def mamba3_parameters(cfg: ModelConfig) -> int:
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


def mamba3_hidden_matrix_parameters(cfg: ModelConfig) -> int:
    """Parameters of the mixer's 2-D hidden matrices (Muon's): in_proj and out_proj."""
    return cfg.d_model * cfg.d_in_proj + cfg.d_inner * cfg.d_model


def mamba3_flops_per_token(cfg: ModelConfig, seq_len: int) -> dict[str, float]:
    """Forward FLOPs per token of one Mamba-3 mixer in sequences of `seq_len` tokens, by part:
    projections (in_proj + out_proj), scan_intra (the chunk's masked quadratic form: scores and their
    product with the values), scan_state (chunk states, their use by the queries, the carry)."""
    D, E, H, N, P, R = cfg.d_model, cfg.d_inner, cfg.nheads, cfg.d_state, cfg.headdim, cfg.rank
    L = max(1, min(cfg.chunk_size, seq_len))
    # The scan pads the last chunk to L tokens: its work per real token is that of ceil(T/L)·L tokens.
    padded = math.ceil(max(seq_len, 1) / L) * L / max(seq_len, 1)
    projections = 2 * D * (cfg.d_in_proj + E)
    # Per chunk and head: scores (LR × N) @ (N × LR) and (LR × LR) @ (LR × P): 2·L²R²(N + P); per token ÷ L.
    scan_intra = padded * H * 2 * L * R * R * (N + P)
    # Per token and head: chunk state Vᵀ K̃ (2·R·P·N), queries on the carried state (2·R·N·P), and the
    # carry S ← e^{…} S + dS once per chunk (2·P·N / L).
    scan_state = padded * H * (4 * R * P * N + 2 * P * N / L)
    return {
        "projections": float(projections),
        "scan_intra": float(scan_intra),
        "scan_state": float(scan_state),
    }


def mamba3_set_context_parallel(mixer: nn.Module, cp: ContextParallel | None) -> None:
    """Pass the recurrent state between the ranks' pieces (model/context_parallel.py); None: no exchange."""
    mixer.set_context_parallel(cp)
