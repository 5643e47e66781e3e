"""Context parallelism for Mamba-3: the C ranks of a group share each training window, rank c holding
the contiguous piece c of T/C tokens, and pass the recurrent state along instead of attention's keys.
(A hybrid's attention layers all-gather their keys and values instead: context_parallel_attention.py.)

The exchange, per Mamba-3 layer (h_t ∈ R^{P×N}, the recurrence of model/scan.py):

    h_t = α_t h_{t−1} + β_t v_{t−1} k_{t−1}ᵀ + γ_t v_t k_tᵀ,    y_t = h_t q_t,    α_t = e^{ΔA_t}

1. Angles first (they are needed before q and k are rotated). θ_t is a running sum of dθ that restarts
   at resets, so a piece that starts from 0 ends at θ̃_c (the sum since its start or its last reset);
   the global angle entering piece c is Θ_0 = 0, Θ_{c+1} = (Θ_c·[no reset in piece c] + θ̃_c) mod 2π,
   and token t of piece c has θ_t = θ̃_t + Θ_c·[no reset in [start, t]].
2. Each rank scans its piece from a zero state (any backend: the scan's contract is unchanged), giving
   the local outputs ỹ_t and the local final state h̃_c.
3. The state entering piece c, in the chunked scan's carried form (scan.start_state), is
   S_c = h_end(c−1) + b_c · Σ_r v_{last,r} k_{last,r}ᵀ of piece c−1, where b_c = (1 − λ)Δ of the piece's
   first token (0 when it is a reset: the trapezoid's previous-token term is cut with the chain).
   The recurrence is linear in the state, so h_t = h̃_t + w_t S_c with w_t = e^{Σ_{s=start..t} ΔA_s}
   · [no reset in [start, t]], and the pieces combine in prefix order:
       S_0 = 0,   h_end(c) = D_c S_c + h̃_c  with D_c = w_{last} (the piece's total decay, 0 after a reset).
   One all-gather of (h̃_c, D_c, b_c, k_last, v_last) per layer; every rank then runs the C-step prefix
   locally (C is small; the C·P·N products are negligible next to the scan).
4. The correction y_t += w_t · S_c q_t (per MIMO rank), an O(T·R·P·N) product like the scan's own state
   read, instead of re-running the scan from S_c. It keeps q for its backward (the scan's own q), or on
   the Triton path q̂ and θ, from which it recomputes q (the fused scan keeps those, not q).

The collectives are differentiable (`_AllGather`: all-gather forward, all-reduce of the gathered
gradient and this rank's slice backward), so the backward sends the gradients of S_c and Θ_c back to
the ranks that produced them. Every rank's result is selected from the prefix over all C pieces, so every
rank takes part in each backward collective, in the same order (the same graph on every rank; under
activation checkpointing the recomputed forward repeats the same collectives on every rank).

Resets at a piece boundary: the first token of piece c is a reset when the last input token of piece
c−1 is EOS; `ContextParallel.previous_token` exchanges it (one int per row) and the LM's reset rule
uses it as a decode cache's last token.

Public API for the training seam (train/parallel/ builds the group from the device mesh's "cp" dimension):
    model.set_context_parallel(group)        Mamba3Transformer: every mixer exchanges over `group` (a
                                             ProcessGroup; None: C = 1, no exchange, the default)
    cut_window(x_BT, y_BT, rank, size)       this rank's piece of a batch of windows (rank and size
                                             within the group; a ConfigError when size does not divide T)
    model.context_parallel.reduce_loss(l)    the window's mean loss from the pieces' (detached, for logs)
Each rank computes the mean loss of its piece and backpropagates it; averaging the gradients over the
flattened (data parallel × context parallel) ranks, as DDP/FSDP do over their group, then gives the
whole window's gradient (exact when every piece scores the same number of targets, as without ignored
targets). The exchange's own collectives run on `group` inside forward and backward, in the same order
on every rank of it. Decode (a cache) stays on one process: clear the group (None) first.
Every scan backend works unchanged (sequential, chunked, triton: each piece is scanned from a zero
state by the backend's own function). A piece need not be a multiple of the chunk size (the last chunk
is zero-padded, as in any scan); a multiple wastes nothing.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from mamba3lite.errors import ConfigError
from mamba3lite.model.rotation import bias_rotate_grads, per_head, rotate_, rotation_factors


def cut_window(x_BT: Tensor, y_BT: Tensor, rank: int, size: int) -> tuple[Tensor, Tensor]:
    """Piece `rank` of `size` contiguous pieces of the inputs and targets (B, T) -> (B, T/size)."""
    T = x_BT.shape[1]
    if T % size:
        raise ConfigError(
            f"training.context_parallel={size} does not divide the window of {T} tokens "
            f"(training.max_seq_len); choose a context_parallel that divides it"
        )
    assert 0 <= rank < size and y_BT.shape == x_BT.shape
    piece = T // size
    return x_BT[:, rank * piece : (rank + 1) * piece], y_BT[:, rank * piece : (rank + 1) * piece]


def live_mask(reset_BT: Tensor | None, like_BHT: Tensor) -> Tensor | None:
    """(B, 1, T) in like's dtype: 1 while no reset has happened in [start, t], else 0; None without
    resets."""
    if reset_BT is None:
        return None
    return (torch.cumsum(reset_BT.to(torch.int32), dim=1) == 0).to(like_BHT.dtype)[:, None]


def combine_angles(theta_end_CBHS: Tensor, reset_any_CB: Tensor) -> Tensor:
    """Θ_c (C, B, H, S), the global angle entering each piece, from each piece's local end angle θ̃_c and
    whether it holds a reset (the module docstring, step 1)."""
    theta_in = [torch.zeros_like(theta_end_CBHS[0])]
    for c in range(theta_end_CBHS.shape[0] - 1):
        keep = (~reset_any_CB[c]).to(theta_end_CBHS.dtype)[:, None, None]
        theta_in.append(torch.remainder(theta_in[c] * keep + theta_end_CBHS[c], 2 * math.pi))
    return torch.stack(theta_in)


def combine_states(
    h_end_CBHPN: Tensor, decay_CBH: Tensor, boa_start_CBH: Tensor, k_last_CBHRN: Tensor, v_last_CBHRP: Tensor
) -> Tensor:
    """S_c (C, B, H, P, N), the carried state entering each piece, from each piece's local final state,
    total decay, first token's (1 − λ)Δ and last token's k, v (the module docstring, step 3)."""
    S_in = [torch.zeros_like(h_end_CBHPN[0])]
    for c in range(h_end_CBHPN.shape[0] - 1):
        h_end = decay_CBH[c, :, :, None, None] * S_in[c] + h_end_CBHPN[c]
        kv_BHPN = torch.einsum("bhrp,bhrn->bhpn", v_last_CBHRP[c], k_last_CBHRN[c])
        S_in.append(h_end + boa_start_CBH[c + 1, :, :, None, None] * kv_BHPN)
    return torch.stack(S_in)


def state_weights(adt_BHT: Tensor, reset_BT: Tensor | None) -> Tensor:
    """w_t = e^{Σ_{s ≤ t} ΔA_s}·[no reset in [0, t]] (B, H, T) in ≥ fp32: how much of the state entering
    the piece is left in h_t."""
    sd = torch.promote_types(adt_BHT.dtype, torch.float32)
    w = torch.exp(torch.cumsum(adt_BHT.to(sd), dim=2))
    live = live_mask(reset_BT, w)
    return w if live is None else w * live


def first_token_boa(dt_BHT: Tensor, lam_BHT: Tensor, reset_BT: Tensor | None) -> Tensor:
    """b = (1 − λ)Δ of the piece's first token (B, H), 0 when it is a reset."""
    sd = torch.promote_types(dt_BHT.dtype, torch.float32)
    b = (1 - lam_BHT[:, :, 0].to(sd)) * dt_BHT[:, :, 0].to(sd)
    return b if reset_BT is None else b * (~reset_BT[:, :1]).to(sd)


class _StateCorrection(torch.autograd.Function):
    """y + w ⊙ (S q) per token and rank, saving q (which the scan keeps anyway: the same storage), S and
    w; autograd would also keep the (B, H, T, R, P) product S q for w's gradient. Computed in the state
    dtype (w's), returned in y's."""

    @staticmethod
    def forward(ctx, y_BHTRP, q_BHTRN, S_BHPN, w_BHT):
        sd = w_BHT.dtype
        with torch.autocast(y_BHTRP.device.type, enabled=False):
            Sq = torch.einsum("bhpn,bhtrn->bhtrp", S_BHPN.to(sd), q_BHTRN.to(sd))
            out = y_BHTRP + (Sq * w_BHT[..., None, None]).to(y_BHTRP.dtype)
        ctx.save_for_backward(q_BHTRN, S_BHPN, w_BHT)
        return out

    @staticmethod
    def backward(ctx, g_BHTRP):
        q, S, w = ctx.saved_tensors
        sd = w.dtype
        with torch.autocast(g_BHTRP.device.type, enabled=False):
            g, qf, Sf = g_BHTRP.to(sd), q.to(sd), S.to(sd)
            d_w = (g * torch.einsum("bhpn,bhtrn->bhtrp", Sf, qf)).sum((-2, -1))
            gw = g * w[..., None, None]
            d_q = torch.einsum("bhtrp,bhpn->bhtrn", gw, Sf).to(q.dtype)
            d_S = torch.einsum("bhtrp,bhtrn->bhpn", gw, qf).to(S.dtype)
        return g_BHTRP, d_q, d_S, d_w


def state_correction(y_BHTRP: Tensor, q_BHTRN: Tensor, S_BHPN: Tensor, w_BHT: Tensor) -> Tensor:
    """y_t + w_t · S q_t (per rank r), in y's dtype (the module docstring, step 4)."""
    return _StateCorrection.apply(y_BHTRP, q_BHTRN, S_BHPN, w_BHT)


def _rotated_queries(q_hat_BGTRN: Tensor, q_bias_HRN: Tensor, theta_BHTS: Tensor | None, halves: bool):
    """q = R(θ)(q̂ + C_bias) per head (B, H, T, R, N), in q̂'s dtype (rotation.bias_rotate's queries)."""
    q = per_head(q_hat_BGTRN, q_bias_HRN)
    if theta_BHTS is None:
        return q
    return rotate_(q, rotation_factors(theta_BHTS.to(q.dtype)[:, :, :, None], halves), halves)


class _RotatedStateCorrection(torch.autograd.Function):
    """`_StateCorrection` given the per-group normed queries q̂ (B, G, T, R, N), their per-head bias and
    the angles instead of q: the Triton scan's fused op keeps exactly those (not the per-head q, H/G
    times larger), and this recomputes q from them in its backward too (rotation.py's closed forms)."""

    @staticmethod
    def forward(ctx, y_BHTRP, q_hat_BGTRN, q_bias_HRN, theta_BHTS, halves, S_BHPN, w_BHT):
        sd = w_BHT.dtype
        with torch.autocast(y_BHTRP.device.type, enabled=False):
            q = _rotated_queries(q_hat_BGTRN, q_bias_HRN, theta_BHTS, halves).to(sd)
            Sq = torch.einsum("bhpn,bhtrn->bhtrp", S_BHPN.to(sd), q)
            out = y_BHTRP + (Sq * w_BHT[..., None, None]).to(y_BHTRP.dtype)
        ctx.save_for_backward(q_hat_BGTRN, q_bias_HRN, theta_BHTS, S_BHPN, w_BHT)
        ctx.halves = halves
        return out

    @staticmethod
    def backward(ctx, g_BHTRP):
        q_hat, q_bias, theta, S, w = ctx.saved_tensors
        sd = w.dtype
        with torch.autocast(g_BHTRP.device.type, enabled=False):
            q = _rotated_queries(q_hat, q_bias, theta, ctx.halves)
            g, qf, Sf = g_BHTRP.to(sd), q.to(sd), S.to(sd)
            d_w = (g * torch.einsum("bhpn,bhtrn->bhtrp", Sf, qf)).sum((-2, -1))
            gw = g * w[..., None, None]
            d_q = torch.einsum("bhtrp,bhpn->bhtrn", gw, Sf)
            d_S = torch.einsum("bhtrp,bhtrn->bhpn", gw, qf).to(S.dtype)
            _, d_q_hat, _, d_bias, d_theta = bias_rotate_grads(
                theta, q, q, None, d_q, ctx.halves, q_hat.shape[1], q_hat.dtype
            )
        return g_BHTRP, d_q_hat, d_bias.to(q_bias.dtype), d_theta, None, d_S, d_w


def rotated_state_correction(
    y_BHTRP: Tensor,
    q_hat_BGTRN: Tensor,
    q_bias_HRN: Tensor,
    theta_BHTS: Tensor | None,
    halves: bool,
    S_BHPN: Tensor,
    w_BHT: Tensor,
) -> Tensor:
    """`state_correction` with q = R(θ)(q̂ + C_bias) recomputed, never kept (the Triton path's form)."""
    return _RotatedStateCorrection.apply(y_BHTRP, q_hat_BGTRN, q_bias_HRN, theta_BHTS, halves, S_BHPN, w_BHT)


def _pack(tensors: list[Tensor], dtype: torch.dtype) -> Tensor:
    """(B, ...) tensors -> one (B, F) tensor of `dtype` (one collective for all of them)."""
    return torch.cat([t.to(dtype).flatten(1) for t in tensors], dim=1)


def _unpack(flat_CBF: Tensor, like: list[Tensor]) -> list[Tensor]:
    """The inverse of `_pack` over a leading rank axis: (C, B, F) -> [(C, *t.shape) for t in like]."""
    sizes = [t[0].numel() for t in like]
    parts = torch.split(flat_CBF, sizes, dim=2)
    return [p.reshape(p.shape[0], *t.shape) for p, t in zip(parts, like)]


class _AllGather(torch.autograd.Function):
    """(…) on each rank -> (C, …) on every rank; the backward sums the gathered gradients over the
    ranks (all-reduce) and returns this rank's slice: the gradient of everything every rank did with it.
    (gloo has no reduce-scatter, so the all-reduce of the C slices is the portable form.)"""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        x = x.contiguous()
        out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, x, group=group)
        return torch.stack(out)

    @staticmethod
    def backward(ctx, g: Tensor):
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        return g[dist.get_rank(ctx.group)], None


class ContextParallel:
    """The exchange of one context-parallel group (module docstring); `group` a ProcessGroup (the
    default group when it is `dist.group.WORLD`). Holds no tensors: one object serves every layer."""

    def __init__(self, group) -> None:
        assert dist.is_initialized(), "context parallelism needs an initialised process group"
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def gather(self, x_BF: Tensor) -> Tensor:
        """Differentiable all-gather: (B, F) -> (C, B, F)."""
        return _AllGather.apply(x_BF, self.group)

    def angles(self, dtheta_BHTS: Tensor, reset_BT: Tensor | None, cumulative) -> Tensor:
        """θ (B, H, T, S) of this piece from its increments, continuing the previous pieces' angles.
        `cumulative` is the mixer's running-sum rule (mamba3.cumulative_angles)."""
        theta_loc = cumulative(dtheta_BHTS, None, reset_BT)
        B = dtheta_BHTS.shape[0]
        reset_any_B = torch.zeros(B, dtype=torch.bool, device=dtheta_BHTS.device)
        if reset_BT is not None:
            reset_any_B = reset_BT.any(dim=1)
        end_BHS = theta_loc[:, :, -1]
        flags = reset_any_B.to(end_BHS.dtype)[:, None]
        gathered = _unpack(self.gather(_pack([end_BHS, flags], end_BHS.dtype)), [end_BHS, flags])
        theta_in_BHS = combine_angles(gathered[0], gathered[1][..., 0] > 0.5)[self.rank]
        # The sum in float64, as cumulative_angles keeps its running sum.
        wide = torch.float32 if dtheta_BHTS.device.type == "mps" else torch.float64
        live = live_mask(reset_BT, theta_loc)
        shift = theta_in_BHS[:, :, None].to(wide) * (1 if live is None else live[..., None].to(wide))
        return torch.remainder(theta_loc.to(wide) + shift, 2 * math.pi).to(theta_loc.dtype)

    def incoming_state(
        self,
        h_end_BHPN: Tensor,
        k_last_BHRN: Tensor,
        v_last_BHRP: Tensor,
        adt_BHT: Tensor,
        dt_BHT: Tensor,
        lam_BHT: Tensor,
        reset_BT: Tensor | None,
    ) -> tuple[Tensor, Tensor]:
        """(S_BHPN, w_BHT): the state the previous pieces leave, and how much of it each token of this
        piece keeps (module docstring, step 3), from this piece's local final state h_end, its last
        token's k and v, and its per-token ΔA, Δ, λ and resets. The caller adds w_t·S q_t to y_t
        (`state_correction`, step 4)."""
        w_BHT = state_weights(adt_BHT, reset_BT)
        parts = [
            h_end_BHPN,
            w_BHT[:, :, -1],
            first_token_boa(dt_BHT, lam_BHT, reset_BT),
            k_last_BHRN,
            v_last_BHRP,
        ]
        gathered = _unpack(self.gather(_pack(parts, w_BHT.dtype)), parts)
        return combine_states(*gathered)[self.rank], w_BHT

    def previous_token(self, input_ids_BT: Tensor) -> Tensor:
        """The last input token of the previous piece per row (B,), −1 on the first piece."""
        last_B = input_ids_BT[:, -1].contiguous()
        out = [torch.empty_like(last_B) for _ in range(self.size)]
        dist.all_gather(out, last_B, group=self.group)
        return out[self.rank - 1] if self.rank > 0 else torch.full_like(last_B, -1)

    def reduce_loss(self, loss: Tensor) -> Tensor:
        """The mean of the pieces' mean losses over the group (a detached copy, for logging)."""
        total = loss.detach().clone()
        dist.all_reduce(total, group=self.group)
        return total / self.size


class MeasuredRank(ContextParallel):
    """Rank `rank` of a context-parallel group of `size`, alone in this process, for measuring what a rank
    keeps (model/memory.py): `gather` stacks `size` copies of this rank's piece where the group's would
    hold every rank's. The shapes, dtypes and ops are the real exchange's, so are the storages autograd
    saves; the values (and the gradients) are not, and no process group is needed."""

    def __init__(self, rank: int, size: int) -> None:
        assert 0 <= rank < size, (rank, size)
        self.group, self.rank, self.size = None, rank, size

    def gather(self, x_BF: Tensor) -> Tensor:
        return torch.stack([x_BF.contiguous()] * self.size)
