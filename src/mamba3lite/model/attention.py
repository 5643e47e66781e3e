"""The attention layer of hybrid models: the official MHA of mamba_ssm (`mamba_ssm/modules/mha.py`) with
its constructor and parameter names, so that an official hybrid's attention layers load with strict=True.

    [q | k, v | m] = in_proj(u)                  q (.., H, P); k, v (.., G, P); m (.., 2M)
    qkv ← causal depthwise conv1d(qkv) + bias    only when d_conv > 0 (kernel W = d_conv)
    q, k ← R(pos·ω) on their first r dims        RoPE, r = rotary_emb_dim (0: none), ω_j = base^(−2j/r)
    ctx = softmax(q kᵀ·scale + mask) v           scale = softmax_scale or 1/√P; query head h reads
                                                 K/V head h // (H/G) (GQA; G = 1 is MQA)
    out = out_proj([ctx | up ⊙ SiLU(gate)])      [up | gate] = m.chunk(2): the gated MLP (mlp_dim > 0)

The rotary pairs are flash_attn's RotaryEmbedding's: the two halves of the r dims (GPT-NeoX), or the
interleaved pairs (2j, 2j+1) with `rotary_emb_interleaved` (GPT-J). `mlp_dim` is rounded up to a
multiple of 256, as the official layer does.

Packed documents: `reset_BT[b, t]` true means token t starts a new document. A token attends only to
keys of its own document (and, when causal, not to later ones); its rotary position and the conv's window
count from its document's start. A window's outputs therefore equal its documents run one by one.

Context parallelism (`set_context_parallel`): each rank runs its piece of the window's queries over the
keys and values of its own and the earlier pieces, all-gathered, with documents, rotary positions and
the conv's reach counted over the whole window (model/context_parallel_attention.py).

Shapes (letters as docs/architecture.md §6 rule 3, plus): G key/value heads; C key positions (a decode
state's capacity, or the keys the queries see); Q the qkv width P·(H + 2G), which the conv runs over;
W the conv kernel (d_conv); J the rotary frequencies (r/2); M the gated MLP's width (mlp_dim/2).

Two implementations of attention with one contract: `attention_reference` (the softmax written out: the
specification, which the tests hold the other to in float64) and `attention_sdpa` (PyTorch's
scaled_dot_product_attention: flash / memory-efficient kernels on GPU, a fused kernel on CPU).
Where documents are packed, SDPA takes a boolean block-diagonal causal mask. flex_attention was measured
against it on this project's CPU at T = 512 (B 2, H 12, P 64): its compiled forward took 16-18 ms to
SDPA's 24 ms (~1.4x faster), but torch 2.13 has no CPU backward for it and it compiles for ~28 s, so
training on a CPU stays on SDPA. The mask costs B·T² bytes: long windows on GPU would want
flex_attention or a varlen kernel instead (not built).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mamba3lite.errors import ConfigError, did_you_mean_hint
from mamba3lite.model.config import check_attention_shape
from mamba3lite.model.context_parallel import ContextParallel
from mamba3lite.model.context_parallel_attention import conv_halo, gather_keys_values, window_documents
from mamba3lite.model.mamba3 import linear_in_own_dtype
from mamba3lite.model.rotation import pair_views

# The smallest capacity a growing decode state takes: a few doublings fewer for short prompts.
MIN_GROWN_CAPACITY = 16


# ---- attention: the specification and the fast path, one contract ----
def attention_reference(
    q_BHTP: Tensor, k_BGCP: Tensor, v_BGCP: Tensor, mask_BTC: Tensor | None, scale: float, causal: bool
) -> Tensor:
    """ctx (B, H, T, P) = softmax(q kᵀ·scale + mask) v, written out: the specification of attention.

    mask_BTC (bool, True: the query may see the key) or None: then C == T and a query sees every key
    (causal=False) or the keys up to itself (causal=True). Query head h reads K/V head h // (H/G)."""
    H, G = q_BHTP.shape[1], k_BGCP.shape[1]
    k_BHCP = k_BGCP.repeat_interleave(H // G, dim=1)
    v_BHCP = v_BGCP.repeat_interleave(H // G, dim=1)
    scores_BHTC = torch.einsum("bhtp,bhcp->bhtc", q_BHTP, k_BHCP) * scale
    if mask_BTC is None and causal:
        T, C = scores_BHTC.shape[-2:]
        mask_BTC = torch.ones(T, C, dtype=torch.bool, device=q_BHTP.device).tril()[None]
    if mask_BTC is not None:
        scores_BHTC = scores_BHTC.masked_fill(~mask_BTC[:, None], float("-inf"))
    return torch.einsum("bhtc,bhcp->bhtp", torch.softmax(scores_BHTC, dim=-1), v_BHCP)


def attention_sdpa(
    q_BHTP: Tensor, k_BGCP: Tensor, v_BGCP: Tensor, mask_BTC: Tensor | None, scale: float, causal: bool
) -> Tensor:
    """`attention_reference` on F.scaled_dot_product_attention. Without a mask it runs `is_causal`, which
    the GPU's flash kernel takes, with GQA through `enable_gqa` (no repeated copy of K/V).

    With a mask and several queries (packed training windows, prefill), K/V are repeated per query head:
    the CUDA kernel that takes masks (memory-efficient) has no GQA and SDPA would fall back to its math
    kernel; on this project's CPU the two ways measured the same (T = 512, H 12, G 4). A single query
    (a decode step) keeps `enable_gqa`: repeating would copy the whole cache for every token."""
    H, G = q_BHTP.shape[1], k_BGCP.shape[1]
    if mask_BTC is None:
        return F.scaled_dot_product_attention(
            q_BHTP, k_BGCP, v_BGCP, is_causal=causal, scale=scale, enable_gqa=H != G
        )
    if H != G and q_BHTP.shape[2] > 1:
        k_BGCP, v_BGCP = (x.repeat_interleave(H // G, dim=1) for x in (k_BGCP, v_BGCP))
    return F.scaled_dot_product_attention(
        q_BHTP, k_BGCP, v_BGCP, attn_mask=mask_BTC[:, None], scale=scale, enable_gqa=k_BGCP.shape[1] != H
    )


ATTENTION_IMPLS: dict[str, Callable[..., Tensor]] = {"sdpa": attention_sdpa, "reference": attention_reference}


def document_mask(key_doc_BC: Tensor, doc_start_BT: Tensor, pos_BT: Tensor, causal: bool) -> Tensor:
    """mask_BTC: query t may see key c. Both are named by the buffer position where their document starts
    (key_doc −1: no document, never seen); a query sees the keys of its own document, and when causal
    only those at positions ≤ its own `pos_BT`."""
    mask_BTC = key_doc_BC[:, None, :] == doc_start_BT[:, :, None]
    if causal:
        c_C = torch.arange(key_doc_BC.shape[1], device=key_doc_BC.device)
        mask_BTC &= c_C <= pos_BT[:, :, None]
    return mask_BTC


def rotary(x_BTHP: Tensor, pos_BT: Tensor, dim: int, base: float, interleaved: bool) -> Tensor:
    """RoPE on the first `dim` channels of x as flash_attn's RotaryEmbedding: pair j turns by pos·ω_j,
    ω_j = base^(−2j/dim); the pairs are the halves of those channels, or (2j, 2j+1) when interleaved.
    Computed in ≥ fp32 (the angles of long positions need it), returned in x's dtype."""
    wide = torch.promote_types(x_BTHP.dtype, torch.float32)
    omega_J = 1.0 / (base ** (torch.arange(0, dim, 2, device=x_BTHP.device, dtype=wide) / dim))
    angle_BT1J = (pos_BT.to(wide)[..., None] * omega_J)[:, :, None]
    cos, sin = torch.cos(angle_BT1J), torch.sin(angle_BT1J)
    xr = x_BTHP[..., :dim].to(wide)
    a, b = pair_views(xr, dim // 2, halves=not interleaved)
    ra, rb = a * cos - b * sin, a * sin + b * cos
    turned = torch.cat((ra, rb), -1) if not interleaved else torch.stack((ra, rb), -1).flatten(-2)
    return torch.cat((turned.to(x_BTHP.dtype), x_BTHP[..., dim:]), dim=-1)


# ---- the decode state ----
@dataclass(eq=False)
class KVBuffer:
    """The keys and values of a batch, (B, G, C, P) each, shared by a state and its row views (`rows`),
    so that growing it keeps them sharing. Rotated keys are stored, as the official cache does: a key's
    rotation depends only on its own position. Positions never written hold zeros (not garbage: a masked
    key's value still meets a zero weight, and 0·NaN would be NaN)."""

    k_BGCP: Tensor
    v_BGCP: Tensor
    growable: bool

    @property
    def capacity(self) -> int:
        return self.k_BGCP.shape[2]

    def reserve(self, needed: int) -> None:
        """Make room for `needed` positions per row: double (at least) when growable, else refuse."""
        if needed <= self.capacity:
            return
        if not self.growable:
            raise ConfigError(
                f"the attention decode state holds {self.capacity} positions per row and {needed} are "
                "needed: allocate it with a larger max_len (or max_len=None to let it grow)"
            )
        new = max(needed, 2 * self.capacity, MIN_GROWN_CAPACITY)
        for name in ("k_BGCP", "v_BGCP"):
            old = getattr(self, name)
            grown = old.new_zeros(*old.shape[:2], new, old.shape[3])
            grown[:, :, : old.shape[2]] = old
            setattr(self, name, grown)


@dataclass(eq=False)
class AttentionState:
    """Decode state of one attention layer for a batch of rows, written in place by `MHA.forward(..., state)`
    and `MHA.step`. Rows may be at different lengths.

    kv: the keys and values (`KVBuffer`), rows [row_start, row_stop) of it are this state's;
    length_B: positions filled per row (int64, on the CPU: each call slices the keys to the longest row,
    which a device tensor would make a synchronisation per layer per token);
    doc_start_B: per row, the position where its current document starts (int64, on the state's device):
    keys before it are masked, rotary positions count from it;
    conv_BWQ: the last W − 1 qkv inputs per row (None when d_conv = 0); those before the document's start
    are masked where used.
    """

    kv: KVBuffer
    row_start: int
    row_stop: int
    length_B: Tensor
    doc_start_B: Tensor
    conv_BWQ: Tensor | None

    @property
    def k_BGCP(self) -> Tensor:
        return self.kv.k_BGCP[self.row_start : self.row_stop]

    @property
    def v_BGCP(self) -> Tensor:
        return self.kv.v_BGCP[self.row_start : self.row_stop]

    @property
    def batch_size(self) -> int:
        return self.row_stop - self.row_start

    @property
    def capacity(self) -> int:
        return self.kv.capacity

    def filled(self) -> int:
        """The longest row's filled length (0 for no rows)."""
        return int(self.length_B.max()) if self.batch_size else 0

    def rows(self, start: int, stop: int) -> AttentionState:
        """Rows [start, stop) as a state sharing this one's storage: what is written through it is written
        here (growing included: the buffer is shared)."""
        assert 0 <= start <= stop <= self.batch_size, (start, stop, self.batch_size)
        conv = None if self.conv_BWQ is None else self.conv_BWQ[start:stop]
        return AttentionState(
            self.kv, self.row_start + start, self.row_start + stop,
            self.length_B[start:stop], self.doc_start_B[start:stop], conv,
        )  # fmt: skip

    def select(self, index_B: Tensor | list[int]) -> AttentionState:
        """A new state whose row i is a copy of row index_B[i] (any order, repeats allowed), at the same
        capacity and growth."""
        index = torch.as_tensor(index_B, dtype=torch.long)
        on_device = index.to(self.doc_start_B.device)
        kv = KVBuffer(self.k_BGCP[on_device], self.v_BGCP[on_device], self.kv.growable)
        conv = None if self.conv_BWQ is None else self.conv_BWQ[on_device]
        return AttentionState(
            kv, 0, len(index), self.length_B[index.cpu()], self.doc_start_B[on_device], conv
        )

    def load_(self, src: AttentionState) -> None:
        """Copy `src` (the same number of rows) into this state in place: its filled positions only, growing
        this state if it must (or refusing, at a fixed capacity)."""
        assert src.batch_size == self.batch_size, (src.batch_size, self.batch_size)
        n = src.filled()
        self.kv.reserve(n)
        self.k_BGCP[:, :, :n].copy_(src.k_BGCP[:, :, :n])
        self.v_BGCP[:, :, :n].copy_(src.v_BGCP[:, :, :n])
        self.length_B.copy_(src.length_B)
        self.doc_start_B.copy_(src.doc_start_B)
        if self.conv_BWQ is not None:
            self.conv_BWQ.copy_(src.conv_BWQ)

    def snapshot(self) -> AttentionState:
        """An independent copy holding only the filled positions (a prefix cache keeps many); it grows if
        decoding continues from it."""
        n = self.filled()
        kv = KVBuffer(self.k_BGCP[:, :, :n].clone(), self.v_BGCP[:, :, :n].clone(), growable=True)
        conv = None if self.conv_BWQ is None else self.conv_BWQ.clone()
        return AttentionState(kv, 0, self.batch_size, self.length_B.clone(), self.doc_start_B.clone(), conv)

    def nbytes(self) -> int:
        """Bytes held by this state's rows: keys and values at full capacity, lengths, document starts,
        conv window."""
        tensors = (self.k_BGCP, self.v_BGCP, self.length_B, self.doc_start_B, self.conv_BWQ)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


# ---- the layer ----
class MHA(nn.Module):
    """Multi-head attention with the official layer's constructor and parameter names (`in_proj`,
    optional `conv1d`, `out_proj`; the rotary embedding holds no parameters).

    forward(u_BTD, state=None, reset_BT=None) -> out_BTD. With a state, the tokens continue its rows
    (prefill or extend): their keys and values are written into it and the queries see its cached keys;
    the state path serves inference (no gradient reaches what is written into the state).
    step(u_BD, state, reset_B=None) -> out_BD: one token, attending over the cached keys in O(T).
    With a context-parallel group set (`set_context_parallel`), forward runs this rank's piece of each
    training window (module docstring).
    `reset_BT[b, t]` true: token t starts a new document (packed documents; the LM computes it).
    `layer_idx` is kept for the official signature; the decode state is the caller's, not a dict's.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        num_heads_kv: int | None = None,
        head_dim: int | None = None,
        mlp_dim: int = 0,
        qkv_proj_bias: bool = True,
        out_proj_bias: bool = True,
        softmax_scale: float | None = None,
        causal: bool = False,
        layer_idx: int | None = None,
        d_conv: int = 0,
        rotary_emb_dim: int = 0,
        rotary_emb_base: float = 10000.0,
        rotary_emb_interleaved: bool = False,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        num_heads_kv = num_heads if num_heads_kv is None else num_heads_kv
        if not (isinstance(embed_dim, int) and embed_dim >= 1):
            raise ConfigError(f"MHA embed_dim must be an integer >= 1 (got {embed_dim!r})")
        shape = dict(num_heads=num_heads, num_heads_kv=num_heads_kv, head_dim=head_dim, mlp_dim=mlp_dim)
        shape |= dict(d_conv=d_conv, rotary_emb_dim=rotary_emb_dim, softmax_scale=softmax_scale)
        check_attention_shape(shape | {"rotary_emb_base": rotary_emb_base}, embed_dim, "MHA ")
        fk = {"device": device, "dtype": dtype}
        self.embed_dim, self.layer_idx, self.causal = embed_dim, layer_idx, causal
        self.num_heads, self.num_heads_kv = num_heads, num_heads_kv
        self.head_dim = embed_dim // num_heads if head_dim is None else head_dim
        self.mlp_dim = math.ceil(mlp_dim / 256) * 256
        self.d_conv, self.softmax_scale = d_conv, softmax_scale
        self.rotary_emb_dim, self.rotary_emb_base = rotary_emb_dim, float(rotary_emb_base)
        self.rotary_emb_interleaved = rotary_emb_interleaved
        self.scale = self.head_dim**-0.5 if softmax_scale is None else softmax_scale
        H, G, P = num_heads, num_heads_kv, self.head_dim
        self.qkv_dim = P * (H + 2 * G)
        self.in_proj = nn.Linear(embed_dim, self.qkv_dim + self.mlp_dim, bias=qkv_proj_bias, **fk)
        if d_conv > 0:
            self.conv1d = nn.Conv1d(
                self.qkv_dim, self.qkv_dim, d_conv, padding=d_conv - 1, groups=self.qkv_dim, **fk
            )
        self.out_proj = nn.Linear(P * H + self.mlp_dim // 2, embed_dim, bias=out_proj_bias, **fk)
        self.set_attention_impl("sdpa")
        self.context_parallel: ContextParallel | None = None

    def set_attention_impl(self, name: str) -> None:
        """Run attention with "sdpa" (the fast path, the default) or "reference" (the written-out softmax)."""
        if name not in ATTENTION_IMPLS:
            hint = did_you_mean_hint(name, ATTENTION_IMPLS, f"; choose one of {sorted(ATTENTION_IMPLS)}")
            raise ConfigError(f"unknown attention implementation {name!r}{hint}")
        self.attn_impl, self._attend = name, ATTENTION_IMPLS[name]

    def set_context_parallel(self, cp: ContextParallel | None) -> None:
        """Attend from this rank's piece of each window over the keys and values of the pieces before it,
        exchanged over the group (model/context_parallel_attention.py); None: the whole window is here."""
        self.context_parallel = cp

    # ---- public ----
    def forward(
        self, u_BTD: Tensor, state: AttentionState | None = None, reset_BT: Tensor | None = None
    ) -> Tensor:
        if self.context_parallel is not None:
            assert state is None, "decode runs on one process: clear the context-parallel group first"
            return self._forward_piece(u_BTD, reset_BT, self.context_parallel)
        Bsz, T, _ = u_BTD.shape
        qkv_BTQ, up_BTM, gate_BTM = self._project(u_BTD)

        # Buffer positions of the tokens, where their documents start, and their positions in them.
        t_T = torch.arange(T, device=u_BTD.device)
        if state is not None:
            state.kv.reserve(state.filled() + T)  # refused before anything is written
        if state is None:
            pos_BT = t_T.expand(Bsz, T)
            start_B = torch.zeros(Bsz, dtype=torch.long, device=u_BTD.device)
        else:
            pos_BT = state.length_B.to(u_BTD.device)[:, None] + t_T
            start_B = state.doc_start_B
        doc_start_BT = start_B[:, None].expand(Bsz, T)
        if reset_BT is not None:
            doc_start_BT = torch.cummax(torch.where(reset_BT, pos_BT, doc_start_BT), dim=1).values
        in_doc_BT = pos_BT - doc_start_BT

        if self.d_conv > 0:
            if state is None:
                window_BWQ = qkv_BTQ.new_zeros(Bsz, self.d_conv - 1, qkv_BTQ.shape[-1])
            else:
                window_BWQ = state.conv_BWQ.to(qkv_BTQ.dtype)
            qkv_BTQ = self._conv(qkv_BTQ, in_doc_BT, window_BWQ, state)
        q_BHTP, k_BGTP, v_BGTP = self._heads(qkv_BTQ, in_doc_BT)

        if state is None:
            mask_BTC = None
            if reset_BT is not None:  # packed documents: block-diagonal
                mask_BTC = document_mask(doc_start_BT, doc_start_BT, pos_BT, self.causal)
            k_BGCP, v_BGCP = k_BGTP, v_BGTP
        else:
            k_BGCP, v_BGCP, mask_BTC = self._extend(state, k_BGTP, v_BGTP, pos_BT, doc_start_BT)
            k_BGCP, v_BGCP = k_BGCP.to(q_BHTP.dtype), v_BGCP.to(q_BHTP.dtype)
        ctx_BHTP = self._attend(q_BHTP, k_BGCP, v_BGCP, mask_BTC, self.scale, self.causal)
        return self._output(ctx_BHTP, up_BTM, gate_BTM)

    def step(self, u_BD: Tensor, state: AttentionState, reset_B: Tensor | None = None) -> Tensor:
        """One token per row: forward of a length-1 sequence continuing the state."""
        reset_BT = None if reset_B is None else reset_B[:, None]
        return self.forward(u_BD[:, None], state, reset_BT)[:, 0]

    def allocate_state(
        self, batch_size: int, max_len: int | None = None, device=None, dtype=None
    ) -> AttentionState:
        """An empty decode state for `batch_size` rows: room for `max_len` positions per row, or, with
        max_len None, room that doubles as needed. dtype: the model's (in_proj's) by default."""
        if not isinstance(batch_size, int) or batch_size < 0:
            raise ConfigError(f"batch_size must be a non-negative integer, got {batch_size!r}")
        if max_len is not None and (not isinstance(max_len, int) or max_len < 1):
            raise ConfigError(f"max_len must be a positive integer (or None to grow), got {max_len!r}")
        dtype = dtype or self.in_proj.weight.dtype
        device = torch.device(device or self.in_proj.weight.device)
        G, P = self.num_heads_kv, self.head_dim
        kv = KVBuffer(
            torch.zeros(batch_size, G, max_len or 0, P, device=device, dtype=dtype),
            torch.zeros(batch_size, G, max_len or 0, P, device=device, dtype=dtype),
            growable=max_len is None,
        )
        conv = None
        if self.d_conv > 0:
            conv = torch.zeros(batch_size, self.d_conv - 1, self.qkv_dim, device=device, dtype=dtype)
        return AttentionState(
            kv, 0, batch_size, torch.zeros(batch_size, dtype=torch.long),
            torch.zeros(batch_size, dtype=torch.long, device=device), conv,
        )  # fmt: skip

    # ---- pieces ----
    def _project(self, u_BTD: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """in_proj: (qkv_BTQ, up_BTM, gate_BTM)."""
        qkv_BTQ, m_BT2M = linear_in_own_dtype(self.in_proj, u_BTD).split([self.qkv_dim, self.mlp_dim], -1)
        up_BTM, gate_BTM = m_BT2M.unflatten(-1, (2, self.mlp_dim // 2)).unbind(-2)
        return qkv_BTQ, up_BTM, gate_BTM

    def _heads(self, qkv_BTQ: Tensor, in_doc_BT: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """qkv -> (q_BHTP, k_BGTP, v_BGTP), q and k rotated by their positions in their documents."""
        H, G, P = self.num_heads, self.num_heads_kv, self.head_dim
        q_BTHP, k_BTGP, v_BTGP = qkv_BTQ.split([H * P, G * P, G * P], -1)
        q_BTHP, k_BTGP = q_BTHP.unflatten(-1, (H, P)), k_BTGP.unflatten(-1, (G, P))
        v_BTGP = v_BTGP.unflatten(-1, (G, P))
        if self.rotary_emb_dim > 0:
            r, base, inter = self.rotary_emb_dim, self.rotary_emb_base, self.rotary_emb_interleaved
            q_BTHP, k_BTGP = (rotary(x, in_doc_BT, r, base, inter) for x in (q_BTHP, k_BTGP))
        return tuple(x.transpose(1, 2) for x in (q_BTHP, k_BTGP, v_BTGP))

    def _output(self, ctx_BHTP: Tensor, up_BTM: Tensor, gate_BTM: Tensor) -> Tensor:
        """out_proj over [context | up ⊙ SiLU(gate)]."""
        ctx_BTX = torch.cat((ctx_BHTP.transpose(1, 2).flatten(2), up_BTM * F.silu(gate_BTM)), dim=-1)
        return self.out_proj(ctx_BTX)

    def _forward_piece(self, u_BTD: Tensor, reset_BT: Tensor | None, cp: ContextParallel) -> Tensor:
        """forward of this rank's piece of a window: documents, the conv's halo, keys and values
        exchanged over the group (model/context_parallel_attention.py); queries stay here."""
        Bsz, T, _ = u_BTD.shape
        qkv_BTQ, up_BTM, gate_BTM = self._project(u_BTD)
        pos_BT, doc_start_BT, key_doc_BC = window_documents(cp, reset_BT, Bsz, T, u_BTD.device)
        in_doc_BT = pos_BT - doc_start_BT
        if self.d_conv > 0:
            window_BWQ = conv_halo(cp, qkv_BTQ, self.d_conv - 1)
            qkv_BTQ = self._conv(qkv_BTQ, in_doc_BT, window_BWQ, None)
        q_BHTP, k_BGTP, v_BGTP = self._heads(qkv_BTQ, in_doc_BT)
        # A causal query sees no later piece.
        pieces = cp.rank + 1 if self.causal else cp.size
        k_BGCP, v_BGCP = gather_keys_values(cp, k_BGTP, v_BGTP, pieces)
        mask_BTC = document_mask(key_doc_BC[:, : pieces * T], doc_start_BT, pos_BT, self.causal)
        ctx_BHTP = self._attend(q_BHTP, k_BGCP, v_BGCP, mask_BTC, self.scale, self.causal)
        return self._output(ctx_BHTP, up_BTM, gate_BTM)

    def _conv(
        self, x_BTQ: Tensor, in_doc_BT: Tensor, window_BWQ: Tensor, state: AttentionState | None
    ) -> Tensor:
        """The causal depthwise conv over qkv, not reaching before a token's document: out_t = bias +
        Σ_w weight_w · x_{t−(W−1)+w} over the taps whose input lies in t's document (lag W−1−w ≤ the
        token's position in it). `window_BWQ`: the W − 1 inputs before the first token (a decode
        state's, the previous piece's, or zeros); a state, when given, keeps the last W − 1."""
        T, W = x_BTQ.shape[1], self.d_conv
        padded = torch.cat((window_BWQ, x_BTQ), dim=1)
        taps_BTQW = torch.stack([padded[:, w : w + T] for w in range(W)], dim=-1)
        lag_W = torch.arange(W - 1, -1, -1, device=x_BTQ.device)
        seen_BT1W = (lag_W <= in_doc_BT[..., None])[:, :, None]
        weight_QW = self.conv1d.weight[:, 0].to(x_BTQ.dtype)
        out_BTQ = torch.einsum("btqw,qw->btq", taps_BTQW * seen_BT1W, weight_QW)
        if state is not None and W > 1:
            with torch.no_grad():
                state.conv_BWQ.copy_(padded[:, padded.shape[1] - (W - 1) :])
        return out_BTQ + self.conv1d.bias.to(x_BTQ.dtype)

    def _extend(
        self, state: AttentionState, k_BGTP: Tensor, v_BGTP: Tensor, pos_BT: Tensor, doc_start_BT: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Write the new keys and values at their positions in the state's rows, move its lengths and
        document starts on, and return the keys and values the queries see, (B, G, C, P), C the longest
        row, with their mask."""
        Bsz, G, T, P = k_BGTP.shape
        old_len_B = state.length_B.to(pos_BT.device)
        C = state.filled() + T  # forward reserved it
        with torch.no_grad():
            k_buf, v_buf = state.k_BGCP, state.v_BGCP
            at_BGTP = pos_BT[:, None, :, None].expand(Bsz, G, T, P)
            k_buf.scatter_(2, at_BGTP, k_BGTP.to(k_buf.dtype))
            v_buf.scatter_(2, at_BGTP, v_BGTP.to(v_buf.dtype))
            # Each key's document, named by its start: the cached keys of the row's current document,
            # −1 for older documents and unfilled positions, then the new tokens' own.
            c_C = torch.arange(C, device=pos_BT.device)
            start_B1 = state.doc_start_B[:, None]
            cached_BC = (c_C >= start_B1) & (c_C < old_len_B[:, None])
            key_doc_BC = torch.where(cached_BC, start_B1, -1).scatter(1, pos_BT, doc_start_BT)
            mask_BTC = document_mask(key_doc_BC, doc_start_BT, pos_BT, self.causal)
            state.length_B += T
            if T > 0:
                state.doc_start_B.copy_(doc_start_BT[:, -1])
        return k_buf[:, :, :C], v_buf[:, :, :C], mask_BTC
