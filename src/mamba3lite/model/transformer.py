"""Mamba3Transformer: the Llama-style Mamba-3 language model (docs/model.md §5) with decode and generate.

    embed ─► n_layers × [x += mixer(RMSNorm(x)); x += SwiGLU(RMSNorm(x))] ─► RMSNorm ─► lm_head (tied)

The mixer of layer i is of kind `cfg.layer_kind(i)` (model/layer_kinds.py): Mamba-3, or attention at the
indices in `cfg.attn_layer_idx`. The decode state is the model's (model/decode_state.py): one state per
layer, of its kind, behind one protocol.
No positional embedding: positions enter only through the data-dependent rotation inside the mixer.
The residual stream stays in fp32 (official `residual_in_fp32`); under autocast the matmuls run in bf16.

Weight decay: parameters that must not be decayed carry `p._no_weight_decay = True` (the mixer's
dt_bias and D, as official); the trainer also exempts every parameter with ndim < 2 (norms, biases) and
the embedding (`embed.weight`, which is also the tied head).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from mamba3lite.model.config import ModelConfig
from mamba3lite.model.context_parallel import ContextParallel
from mamba3lite.model.decode_state import DecodeState, ModelCache, fresh_last_tokens
from mamba3lite.model.layer_kinds import build_mixer, kind_of_layer
from mamba3lite.model.mamba3 import RMSNorm, linear_in_own_dtype
from mamba3lite.model.sampling import sample_next
from mamba3lite.model.scan import autocast_dtype

# Rows of logits materialised at once by the loss. CPU: 128 × 50,257 × 4 B ≈ 26 MB, below glibc's 32 MB
# mmap threshold, so the buffer is reused instead of page-faulted in afresh for every chunk (2x on CPU).
# Accelerators: larger chunks, fewer kernel launches.
LOSS_CHUNK_ROWS = {"cpu": 128}
LOSS_CHUNK_ROWS_DEFAULT = 1024
# Chunks whose gradients are gathered (in the compute dtype) before the two gradient matmuls, so that the
# (D, V) gradient is accumulated (and converted to fp32) once per group rather than once per chunk.
LOSS_GROUP_CHUNKS = {"cpu": 16}
LOSS_GROUP_CHUNKS_DEFAULT = 4


class GatedMLP(nn.Module):
    """SwiGLU as the official GatedMLP: [v, g] = fc1(x).chunk(2); out = fc2(v ⊙ SiLU(g)); no biases."""

    def __init__(self, d_model: int, d_hidden: int, device=None, dtype=None) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, 2 * d_hidden, bias=False, device=device, dtype=dtype)
        self.fc2 = nn.Linear(d_hidden, d_model, bias=False, device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        v, g = linear_in_own_dtype(self.fc1, x).chunk(2, dim=-1)
        return self.fc2(v * F.silu(g))


class Block(nn.Module):
    """Layer `layer_idx`: x += mixer(norm(x)); x += mlp(norm2(x)) (the MLP half is absent when d_mlp = 0).
    The mixer is of the layer's kind (model/layer_kinds.py)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0, device=None, dtype=None) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, device=device, dtype=dtype)
        self.mixer = build_mixer(cfg, layer_idx, device=device, dtype=dtype)
        self.mlp = None
        if cfg.d_mlp > 0:
            self.norm2 = RMSNorm(cfg.d_model, cfg.norm_eps, device=device, dtype=dtype)
            self.mlp = GatedMLP(cfg.d_model, cfg.d_mlp, device=device, dtype=dtype)

    def forward(
        self, x_BTD: Tensor, reset_BT: Tensor | None = None, state: DecodeState | None = None
    ) -> Tensor:
        x_BTD = x_BTD + self.mixer(self.norm(x_BTD), state, reset_BT)
        if self.mlp is not None:
            x_BTD = x_BTD + self.mlp(self.norm2(x_BTD))
        return x_BTD

    def step(self, x_BD: Tensor, state: DecodeState, reset_B: Tensor | None) -> Tensor:
        x_BD = x_BD + self.mixer.step(self.norm(x_BD), state, reset_B)
        if self.mlp is not None:
            x_BD = x_BD + self.mlp(self.norm2(x_BD))
        return x_BD


class _LinearCrossEntropy(torch.autograd.Function):
    """mean CE(h @ Wᵀ, targets) over rows with target ≠ ignore_index, never holding all (N, V) logits.

    The forward pass walks over row chunks and, when gradients are needed, computes them right away
    (softmax − onehot is known as soon as the logits are): the backward pass only scales the stored
    gradients. Same FLOPs as the plain loss, memory O(chunk · V) instead of O(N · V).
    """

    @staticmethod
    def forward(ctx, h_ND, w_VD, targets_N, ignore_index: int, chunk_rows: int, needs_grad: bool):
        N, V = h_ND.shape[0], w_VD.shape[0]
        dev = h_ND.device
        cd = autocast_dtype(dev.type) or h_ND.dtype
        h, w = h_ND.to(cd), w_VD.to(cd)
        acc = torch.promote_types(cd, torch.float32)
        valid_N = targets_N != ignore_index
        n_valid = valid_N.sum()
        row_scale_N = valid_N.to(acc) / n_valid.clamp(min=1).to(acc)  # d mean / d row
        loss = torch.zeros((), dtype=acc, device=dev)
        group = chunk_rows * LOSS_GROUP_CHUNKS.get(dev.type, LOSS_GROUP_CHUNKS_DEFAULT)
        if needs_grad:
            grad_h = torch.empty_like(h_ND)
            # Wᵀ's gradient is accumulated as (D, V) = hᵀ g: a plain row-major matmul (g.T @ h would be
            # a transposed operand, which CPU bf16 kernels copy first).
            grad_wT = torch.zeros(w_VD.shape[1], V, dtype=acc, device=dev)
            g_buf = torch.empty(min(group, N), V, dtype=cd, device=dev)
        for gi in range(0, N, group):
            gj = min(gi + group, N)
            for i in range(gi, gj, chunk_rows):
                j = min(i + chunk_rows, gj)
                tgt = targets_N[i:j].clamp(min=0)[:, None]
                # One fused softmax pass gives both the loss (−log p_target) and the gradient
                # (p − onehot); fewer passes over the (rows, V) block is what makes this fast on CPU.
                # (The softmax runs on fp32 logits: on CPU a bf16 softmax converts in and out itself.)
                logits = (h[i:j] @ w.T).to(acc)
                probs = torch.softmax(logits, dim=-1)
                if dev.type == "cpu":
                    # −log p_target from the softmax itself (no extra pass); rows whose p_target
                    # underflowed take an exact logsumexp instead (rare; a data-dependent branch).
                    p_t = probs.gather(1, tgt)[:, 0]
                    nll = -torch.log(p_t)
                    tiny = p_t < 1e-30
                    if bool(tiny.any()):
                        lg = logits[tiny]
                        nll[tiny] = torch.logsumexp(lg, dim=-1) - lg.gather(1, tgt[tiny])[:, 0]
                else:  # accelerators: passes are cheap, a host sync is not
                    nll = torch.logsumexp(logits, dim=-1) - logits.gather(1, tgt)[:, 0]
                loss = loss + (nll * valid_N[i:j]).sum()
                if needs_grad:
                    probs.scatter_add_(1, tgt, -torch.ones_like(tgt, dtype=probs.dtype))
                    g_buf[i - gi : j - gi].copy_(probs)
            if needs_grad:
                # The row scale (valid / n_valid) goes on the small (rows, D) operands, not on g.
                g = g_buf[: gj - gi]
                scale = row_scale_N[gi:gj, None]
                grad_h[gi:gj] = ((g @ w).to(acc) * scale).to(h_ND.dtype)
                grad_wT += ((h[gi:gj] * scale.to(cd)).T @ g).to(acc)
        if needs_grad:
            ctx.save_for_backward(grad_h, grad_wT.T.contiguous().to(w_VD.dtype))
        return loss / n_valid

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        # loss.backward() (grad 1) on the CPU: skip two full passes. Not while compiling (no data-dependent
        # branch), and not on an accelerator, where reading grad_out would be a host sync per micro-step
        # and the two passes are cheap.
        if grad_out.device.type == "cpu" and not torch.compiler.is_compiling() and float(grad_out) == 1.0:
            return grad_h, grad_w, None, None, None, None
        return grad_h * grad_out.to(grad_h.dtype), grad_w * grad_out.to(grad_w.dtype), None, None, None, None


def linear_cross_entropy(
    h_ND: Tensor, w_VD: Tensor, targets_N: Tensor, ignore_index: int = -100, chunk_rows: int | None = None
) -> Tensor:
    """Mean next-token cross-entropy of logits h @ Wᵀ (fp32 scalar), computed in row chunks."""
    if chunk_rows is None:
        chunk_rows = LOSS_CHUNK_ROWS.get(h_ND.device.type, LOSS_CHUNK_ROWS_DEFAULT)
    needs_grad = torch.is_grad_enabled() and (h_ND.requires_grad or w_VD.requires_grad)
    return _LinearCrossEntropy.apply(h_ND, w_VD, targets_N, ignore_index, chunk_rows, needs_grad)


class Mamba3Transformer(nn.Module):
    """The language model. See the module docstring for the layout; `cfg` fixes everything.

    forward(input_ids_BT, targets_BT=None): logits_BTV (fp32 when not under autocast), or, with
    targets, the mean cross-entropy over positions whose target is not −100 (fp32 scalar).
    `grad_checkpointing` (settable): recompute each layer in the backward pass to save memory.
    Decode: `allocate_cache`, `prefill`, `step` (cache updated in place), `generate` (a generator);
    `hidden_states` is the one road from ids (and a state, fresh starts) to the final-norm hidden states.
    """

    def __init__(self, cfg: ModelConfig, device=None, dtype=None) -> None:
        super().__init__()
        self.cfg = cfg
        self.grad_checkpointing = False
        self.context_parallel: ContextParallel | None = None
        fk = {"device": device, "dtype": dtype}
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model, **fk)
        self.layers = nn.ModuleList(Block(cfg, i, **fk) for i in range(cfg.n_layers))
        self.norm_f = RMSNorm(cfg.d_model, cfg.norm_eps, **fk)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False, **fk)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        # Official wrapper: embedding ~ N(0, 0.02); the residual-branch outputs (out_proj, fc2) keep
        # Linear's kaiming_uniform(a=√5) init divided by √n_layers (the k = 1 that takes effect, §5).
        nn.init.normal_(self.embed.weight, std=self.cfg.init_std)
        if not self.cfg.tie_embeddings:
            nn.init.normal_(self.lm_head.weight, std=self.cfg.init_std)
        for block in self.layers:
            block.mixer.out_proj.weight.div_(math.sqrt(self.cfg.n_layers))
            if block.mlp is not None:
                block.mlp.fc2.weight.div_(math.sqrt(self.cfg.n_layers))

    def _scanning_mixers(self) -> list[nn.Module]:
        """The mixers of the layers whose kind has a scan backend."""
        return [b.mixer for i, b in enumerate(self.layers) if kind_of_layer(self.cfg, i).scans]

    def set_scan_impl(self, name: str, device: torch.device | str | None = None) -> None:
        """Choose the scan backend ("auto", "chunked", "sequential", "triton") of every layer that has
        one, resolved for `device` now when given, else at the first forward (see `Mamba3.set_scan_impl`).
        Layers of a kind without a scan (attention) are not concerned."""
        for mixer in self._scanning_mixers():
            mixer.set_scan_impl(name, device)

    def set_context_parallel(self, group) -> None:
        """Train on pieces of each window: this process holds piece `rank` of the `size` contiguous
        pieces of every window (`context_parallel.cut_window`), and every mixer exchanges what its kind
        needs over `group` (a torch.distributed ProcessGroup; Mamba-3: the recurrent state, attention:
        the keys and values). None: the whole window is here."""
        cp = None if group is None else ContextParallel(group)
        for i, block in enumerate(self.layers):
            kind_of_layer(self.cfg, i).set_context_parallel(block.mixer, cp)
        self.context_parallel = cp

    @property
    def scan_impl(self) -> str | None:
        """The scan backend the scanning layers run (None until resolved for a device, or when no layer
        has a scan)."""
        mixers = self._scanning_mixers()
        return mixers[0].scan_impl if mixers else None

    def _resets(
        self, input_ids_BT: Tensor, last_token_B: Tensor | None, fresh_BT: Tensor | None = None
    ) -> Tensor | None:
        """reset[b, t] = the previous input token is EOS (token 0 looks at the cache's last token), or
        `fresh_BT[b, t]` (a caller's own resets) where given."""
        if not self.cfg.reset_at_eos:
            return fresh_BT
        if fresh_BT is not None:
            return self._resets(input_ids_BT, last_token_B) | fresh_BT
        prev_BT = torch.roll(input_ids_BT, 1, dims=1)
        if prev_BT.shape[1] == 0:  # an empty sequence: nothing to reset
            return prev_BT == self.cfg.eos_id
        if last_token_B is None:
            prev_BT[:, 0] = -1
        else:
            prev_BT[:, 0] = last_token_B
        return prev_BT == self.cfg.eos_id

    def _body(self, input_ids_BT: Tensor, reset_BT: Tensor | None, states: list | None = None) -> Tensor:
        x_BTD = self.embed(input_ids_BT)
        for i, block in enumerate(self.layers):
            state = None if states is None else states[i]
            if self.grad_checkpointing and self.training and torch.is_grad_enabled() and state is None:
                x_BTD = checkpoint(block, x_BTD, reset_BT, use_reentrant=False)
            else:
                x_BTD = block(x_BTD, reset_BT, state)
        return self.norm_f(x_BTD)

    def hidden_states(
        self, input_ids_BT: Tensor, cache: ModelCache | None = None, fresh_BT: Tensor | None = None
    ) -> Tensor:
        """The final-norm hidden states (B, T, D) of every position, with autograd when enabled.

        With `cache`, the sequence continues from it and the cache is updated in place (its state after
        the last token); without, it starts fresh. `fresh_BT` (optional, bool): True where a row starts
        from a fresh state, e.g. its first token after left padding, as an EOS before it would under
        `reset_at_eos`. (The HF export's glue calls this; `forward` adds the loss and context
        parallelism, `prefill` / `extend` the head.)"""
        if cache is None:
            return self._body(input_ids_BT, self._resets(input_ids_BT, None, fresh_BT))
        if input_ids_BT.shape[1] == 0:
            raise ValueError("continuing from a cache needs at least one token per row")
        reset_BT = self._resets(input_ids_BT, cache.last_token_B, fresh_BT)
        h_BTD = self._body(input_ids_BT, reset_BT, cache.layers)
        cache.last_token_B.copy_(input_ids_BT[:, -1])
        return h_BTD

    def forward(self, input_ids_BT: Tensor, targets_BT: Tensor | None = None) -> Tensor:
        last_B = None  # the token before the window: none, unless this is a later context-parallel piece
        if self.context_parallel is not None and self.cfg.reset_at_eos:
            last_B = self.context_parallel.previous_token(input_ids_BT)
        h_BTD = self._body(input_ids_BT, self._resets(input_ids_BT, last_B))
        if targets_BT is None:
            return linear_in_own_dtype(self.lm_head, h_BTD)
        w_VD = self.lm_head.weight
        return linear_cross_entropy(h_BTD.flatten(0, 1).to(w_VD.dtype), w_VD, targets_BT.flatten())

    # ---- decode ----
    def allocate_cache(
        self, batch_size: int, max_len: int | None = None, device=None, dtype=None
    ) -> ModelCache:
        """Zero decode state for `batch_size` rows that will hold at most `max_len` tokens each (a
        recurrent layer ignores it; a key/value cache is sized by it). Dtypes: each mixer's
        `allocate_state` (Mamba-3: the model dtype, states at least fp32)."""
        device = device or self.embed.weight.device
        return ModelCache(
            layers=[
                b.mixer.allocate_state(batch_size, max_len, device=device, dtype=dtype) for b in self.layers
            ],
            last_token_B=fresh_last_tokens(batch_size, device),
        )

    def state_bytes(self, batch_size: int, length: int, dtype=None) -> int:
        """Bytes of the decode state of `batch_size` rows that hold `length` tokens each: what
        `allocate_cache(batch_size, length, dtype=dtype).nbytes()` holds, computed on the meta device
        (nothing is allocated). Each kind answers through its own state: a Mamba-3 layer's does not
        depend on `length`, a key/value cache's grows linearly with it; all of it is linear in the rows."""
        return self.allocate_cache(batch_size, length, device="meta", dtype=dtype).nbytes()

    @torch.no_grad()
    def prefill(
        self, input_ids_BT: Tensor, cache: ModelCache, fresh_BT: Tensor | None = None
    ) -> tuple[Tensor, ModelCache]:
        """Run the prompt through the chunked scan, continuing from `cache` (fresh or used) and writing
        the final state into it in place. Returns (logits of the last position (B, V), the same cache).
        `fresh_BT` (optional, bool): True where a row starts from a fresh state, e.g. its first token
        after left padding, so that rows of different lengths end together and batch exactly."""
        if input_ids_BT.shape[1] == 0:
            raise ValueError("prefill needs at least one token per row")
        h_BTD = self.hidden_states(input_ids_BT, cache, fresh_BT)
        return linear_in_own_dtype(self.lm_head, h_BTD[:, -1]), cache

    @torch.no_grad()
    def extend(self, input_ids_BT: Tensor, cache: ModelCache) -> Tensor:
        """`prefill` returning the logits of every position (B, T, V): continue a sequence from `cache`
        (updated in place) and score all of it, e.g. several continuations of one shared context."""
        return linear_in_own_dtype(self.lm_head, self.extend_hidden(input_ids_BT, cache))

    @torch.no_grad()
    def extend_hidden(self, input_ids_BT: Tensor, cache: ModelCache) -> Tensor:
        """`extend` before the head: the final-norm hidden states (B, T, D), for a caller that needs the
        logits of a few positions only (`lm_head` on those rows)."""
        if input_ids_BT.shape[1] == 0:
            raise ValueError("extend needs at least one token per row")
        return self.hidden_states(input_ids_BT, cache)

    @torch.no_grad()
    def step(self, token_B: Tensor, cache: ModelCache) -> Tensor:
        """Feed one token per row; O(1) in the context length. Updates `cache` in place; returns (B, V)."""
        reset_B = (cache.last_token_B == self.cfg.eos_id) if self.cfg.reset_at_eos else None
        x_BD = self.embed(token_B)
        for block, layer_state in zip(self.layers, cache.layers):
            x_BD = block.step(x_BD, layer_state, reset_B)
        cache.last_token_B.copy_(token_B)
        return linear_in_own_dtype(self.lm_head, self.norm_f(x_BD))

    @torch.no_grad()
    def generate(
        self,
        input_ids_BT: Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
        eos_id: int | None = None,
    ) -> Iterator[Tensor]:
        """Yield the new tokens (B,) one step at a time: prefill, then sample / step.

        Stops after `max_new_tokens` or once every row has produced `eos_id`; a row that has finished
        keeps yielding `eos_id`. temperature 0 is greedy. Sampling is `sampling.sample_next`.
        """
        B, T = input_ids_BT.shape
        cache = self.allocate_cache(B, T + max_new_tokens, device=input_ids_BT.device)
        logits_BV, _ = self.prefill(input_ids_BT, cache)
        done_B = torch.zeros(input_ids_BT.shape[0], dtype=torch.bool, device=input_ids_BT.device)
        for i in range(max_new_tokens):
            token_B = sample_next(logits_BV, temperature, top_k, top_p, generator)
            if eos_id is not None:
                token_B = token_B.masked_fill(done_B, eos_id)
                done_B |= token_B == eos_id
            yield token_B
            if eos_id is not None and bool(done_B.all()):
                return
            if i + 1 < max_new_tokens:
                logits_BV = self.step(token_B, cache)
