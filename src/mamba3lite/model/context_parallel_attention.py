"""Context parallelism for the attention layers of a hybrid (model/attention.py `MHA`): the C ranks of a
group share each training window, rank c holding the contiguous piece c of T_c = T/C tokens
(context_parallel.cut_window), as for the Mamba-3 layers (model/context_parallel.py), which pass their
state instead.

Per attention layer and step, each rank (queries stay local):
1. Documents. Rank c knows only its own resets; a document may have started on an earlier piece. One
   all-gather of the resets (B, T_c booleans per rank; none without `reset_at_eos`) gives every rank the
   window's, from which it names each of the window's T tokens by the buffer position where its
   document starts: doc_t = max{s ≤ t : reset_s} (0 without one). A query at window position t of
   piece c sees the keys s ≤ t with doc_s = doc_t; its rotary position, and the conv's reach, is t − doc_t.
   A reset at a piece's first token is the LM's (ContextParallel.previous_token), so it is in the resets.
2. The conv's halo (only when d_conv > 0): the causal depthwise conv of token t reads the qkv inputs of
   the W − 1 tokens before it, which for the first tokens of a piece are the previous piece's last ones.
   Each rank contributes its last min(W − 1, T_c) inputs (one differentiable all-gather); rank c takes
   the W − 1 inputs before its piece from the ranks before it (zeros before the window).
3. Keys and values. Each rank rotates its own keys (rotation depends on the key's own position only)
   and all-gathers [k | v] (one differentiable all-gather, `ContextParallel.gather`, whose backward
   all-reduces the gathered gradient and keeps this rank's slice: every rank's gradient with respect to
   its keys and values reaches it). A causal query of piece c sees no later piece: rank c attends over
   the first (c + 1)·T_c keys only, with the document mask of step 1.

What a rank keeps for the backward: its queries (T_c), the keys and values it attended over (up to T,
on the last rank) and the mask (T_c × (c + 1)·T_c booleans): the keys and values do not shrink with C,
everything else does. Ring attention would keep only T_c keys at a time; with one attention layer in
several, an all-gather was enough for the activation target (benchmarks/bench_context_parallel.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mamba3lite.model.context_parallel import ContextParallel


def window_documents(
    cp: ContextParallel, reset_BT: Tensor | None, batch: int, piece: int, device: torch.device
) -> tuple[Tensor, Tensor, Tensor]:
    """(pos_BT, doc_start_BT, key_doc_BC) of this rank's piece (module docstring, step 1): the window
    positions of its tokens, where their documents start (window positions), and the document start of
    every key of the window (C = T: all pieces')."""
    T = piece * cp.size
    t_C = torch.arange(T, device=device)
    if reset_BT is None:
        key_doc_BC = torch.zeros(batch, T, dtype=torch.long, device=device)
    else:
        window_BC = cp.gather(reset_BT).permute(1, 0, 2).reshape(batch, T)  # the pieces side by side
        key_doc_BC = torch.cummax(torch.where(window_BC, t_C, 0), dim=1).values
    mine = slice(cp.rank * piece, (cp.rank + 1) * piece)
    return t_C[mine].expand(batch, piece), key_doc_BC[:, mine], key_doc_BC


def conv_halo(cp: ContextParallel, x_BTQ: Tensor, width: int) -> Tensor:
    """The `width` conv inputs before this rank's piece (B, width, Q), zeros before the window (module
    docstring, step 2); differentiable."""
    Bsz, T, Q = x_BTQ.shape
    if width == 0:  # d_conv 1: no tap before the token (every rank skips the exchange alike)
        return x_BTQ.new_zeros(Bsz, 0, Q)
    m = min(width, T)
    tails_CBMQ = cp.gather(x_BTQ[:, T - m :])
    before_BXQ = tails_CBMQ[: cp.rank].permute(1, 0, 2, 3).reshape(Bsz, cp.rank * m, Q)
    before_BXQ = before_BXQ[:, max(0, before_BXQ.shape[1] - width) :]
    pad_BXQ = x_BTQ.new_zeros(Bsz, width - before_BXQ.shape[1], Q)
    return torch.cat((pad_BXQ, before_BXQ), dim=1)


def gather_keys_values(
    cp: ContextParallel, k_BGTP: Tensor, v_BGTP: Tensor, pieces: int
) -> tuple[Tensor, Tensor]:
    """The keys and values of the first `pieces` pieces of the window, (B, G, pieces·T_c, P) each
    (module docstring, step 3); differentiable: the backward returns every rank's gradient of this rank's
    keys and values to it."""
    Bsz, G, T, P = k_BGTP.shape
    kv_CBGTX = cp.gather(torch.cat((k_BGTP, v_BGTP), dim=-1))[:pieces]
    kv_BGCX = kv_CBGTX.permute(1, 2, 0, 3, 4).reshape(Bsz, G, pieces * T, 2 * P)
    k_BGCP, v_BGCP = kv_BGCX.split([P, P], dim=-1)
    return k_BGCP, v_BGCP
