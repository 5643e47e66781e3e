"""Log-likelihood of continuations given contexts, two ways: the plain path (the spec) and state reuse.

Both take pairs (context_ids, continuation_ids), context non-empty, and return per pair

    logprob  = Σ_j log p(cont_j | context, cont_<j)      (nats, summed over the continuation's tokens)
    is_greedy = every cont_j is the argmax of its next-token distribution

exactly what lm-eval's `loglikelihood` requests ask for.

`score_plain` is what lm-eval's standard causal-LM path does: each pair is one row
(context + continuation)[:-1], right-padded into a batch, one forward pass, the continuation's positions
read from the logits. A multiple-choice item of k choices reads its shared context k times.

`score_with_state_reuse` uses the recurrence: a Mamba model's state after the context summarises it
whole, so the context runs once (`prefill`: its last logits score every choice's first token) and each
choice continues from a copy of that state (`extend_hidden`, then the head on the scored positions
only). Contexts of several items are prefilled in one batch, left-padded, each row starting from a
fresh state at its first real token (`fresh_BT`: the pads before it are forgotten exactly, as packed
documents are at EOS); the choices of those items are then scored in batches of their own. A HellaSwag
item (a context about twice a choice, 4 choices) then costs about 1 + 4/2 context-lengths of tokens
instead of 4 x 1.5. Same numbers as the plain path (float64 test): the chunked scan started from a state
is the same recurrence as the one run over the whole sequence.

Both score a token as log p = logit − logsumexp(logits) (`_token_scores`), the same arithmetic. The
plain path, as lm-eval's, runs the head on every position of its rows; the reuse path on the scored
positions only, which is part of its gain (benchmarks/RESULTS.md says how much).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import Tensor

from mamba3lite.model.decode_state import DecodeState
from mamba3lite.model.mamba3 import linear_in_own_dtype

Pair = tuple[Sequence[int], Sequence[int]]
# Positions whose logits are computed and scored at once by the state-reuse path: 128 x 50,257 fp32
# logits are 26 MB, as the loss's chunks (model/transformer.py LOSS_CHUNK_ROWS).
HEAD_ROWS = 128


def _autocast(device: torch.device, bf16: bool):
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def _token_scores(logits_NV: Tensor, targets_N: Tensor) -> tuple[Tensor, Tensor]:
    """(log p(target) (N,), target is the argmax (N,) bool) per row, in at least fp32.

    log p = logit[target] − logsumexp(logits): two reductions, no (N, V) log-softmax written out (on the
    CPU that write and the argmax over V cost as much as a small model's forward). Greedy is the argmax
    test lm-eval makes: logit[target] ≥ max, confirmed by an argmax on those rows only (first index wins a
    tie, as in lm-eval)."""
    x = logits_NV.to(torch.promote_types(logits_NV.dtype, torch.float32))
    tgt_logit_N = x.gather(1, targets_N[:, None])[:, 0]
    lp_N = tgt_logit_N - torch.logsumexp(x, dim=-1)
    greedy_N = tgt_logit_N >= x.amax(dim=-1)
    if bool(greedy_N.any()):
        rows = greedy_N.nonzero()[:, 0]
        greedy_N[rows] = x[rows].argmax(-1) == targets_N[rows]
    return lp_N, greedy_N


def _score_rows(logits_TV: Tensor, targets: Sequence[int]) -> tuple[float, bool]:
    """(Σ log p at `targets`, all targets greedy) of logits (len(targets), V)."""
    tgt_T = torch.tensor(list(targets), dtype=torch.long, device=logits_TV.device)
    lp_T, greedy_T = _token_scores(logits_TV, tgt_T)
    return float(lp_T.sum()), bool(greedy_T.all())


def _pad(rows: list[Sequence[int]], device: torch.device) -> Tensor:
    """Right-padded (B, T) batch: the model is causal, so padding after a row's end changes nothing in
    it (the pad id 0 is never scored)."""
    width = max(len(r) for r in rows)
    out = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(list(r), dtype=torch.long)
    return out.to(device)


@torch.no_grad()
def score_plain(
    model, pairs: Sequence[Pair], batch_size: int, bf16: bool = False
) -> list[tuple[float, bool]]:
    """lm-eval's standard path (see the module docstring); longest rows first, `batch_size` per pass."""
    assert batch_size >= 1 and all(len(c) > 0 and len(t) > 0 for c, t in pairs)
    device = next(model.parameters()).device
    order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
    out: list[tuple[float, bool] | None] = [None] * len(pairs)
    for b in range(0, len(order), batch_size):
        idx = order[b : b + batch_size]
        rows = [(list(pairs[i][0]) + list(pairs[i][1]))[:-1] for i in idx]
        with _autocast(device, bf16):
            logits_BTV = model(_pad(rows, device))
        for r, i in enumerate(idx):
            ctx, cont = pairs[i]
            start = len(ctx) - 1  # the position whose output predicts cont[0]
            out[i] = _score_rows(logits_BTV[r, start : start + len(cont)], cont)
    return out  # type: ignore[return-value]


def _prefill_left_padded(
    model, contexts: list[tuple[int, ...]], device: torch.device, max_len: int
) -> tuple[Tensor, DecodeState]:
    """(last-position logits (G, V), the state after each context (G rows), each able to hold `max_len`
    tokens) of `contexts`, in one batch: left-padded so that all end at the last column, each row's first
    real token starting from a fresh state (the pads before it are forgotten, exactly: the reset of
    packed documents)."""
    width = max(len(c) for c in contexts)
    ids_GT = torch.zeros(len(contexts), width, dtype=torch.long)
    fresh_GT = torch.zeros(len(contexts), width, dtype=torch.bool)
    for g, c in enumerate(contexts):
        ids_GT[g, width - len(c) :] = torch.tensor(c, dtype=torch.long)
        fresh_GT[g, width - len(c)] = True
    cache = model.allocate_cache(len(contexts), max_len, device=device)
    last_GV, cache = model.prefill(ids_GT.to(device), cache, fresh_BT=fresh_GT.to(device))
    return last_GV, cache


def _score_positions(model, h_ND: Tensor, targets_N: Tensor) -> tuple[Tensor, Tensor]:
    """`_token_scores` of hidden states h (N, D) through the head, in blocks of HEAD_ROWS rows: each
    block reads the (V, D) head once and its (rows, V) logits stay in cache for the scoring."""
    scores = [
        _token_scores(
            linear_in_own_dtype(model.lm_head, h_ND[a : a + HEAD_ROWS]), targets_N[a : a + HEAD_ROWS]
        )
        for a in range(0, h_ND.shape[0], HEAD_ROWS)
    ]
    return torch.cat([lp for lp, _ in scores]), torch.cat([g for _, g in scores])


@torch.no_grad()
def score_with_state_reuse(
    model, pairs: Sequence[Pair], batch_size: int, bf16: bool = False
) -> list[tuple[float, bool]]:
    """The same numbers as `score_plain`, each distinct context run once (see the module docstring).

    Pairs with the same context ids form a group. Up to `batch_size` distinct contexts (similar lengths
    together) are prefilled in one batch, left-padded; their last logits score every first continuation
    token. The continuations longer than one token then continue, `batch_size` rows at a time (similar
    lengths together), each from its own copy of its context's state; the head runs on the positions
    scored only. No order changes a number.
    """
    assert batch_size >= 1 and all(len(c) > 0 and len(t) > 0 for c, t in pairs)
    device = next(model.parameters()).device
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (ctx, _) in enumerate(pairs):
        groups.setdefault(tuple(ctx), []).append(i)
    contexts = sorted(groups, key=len, reverse=True)
    lp_P = torch.zeros(len(pairs), dtype=torch.float64)
    greedy_P = torch.ones(len(pairs), dtype=torch.bool)
    for c0 in range(0, len(contexts), batch_size):
        block = contexts[c0 : c0 + batch_size]
        # The most tokens a row will hold: the padded contexts, then its longest continuation.
        longest = max(len(pairs[i][1]) for ctx in block for i in groups[ctx])
        with _autocast(device, bf16):
            last_GV, cache = _prefill_left_padded(model, block, device, len(block[0]) + longest)
        members = [(i, g) for g, ctx in enumerate(block) for i in groups[ctx]]  # (pair, its context's row)
        g_M = torch.tensor([g for _, g in members], dtype=torch.long, device=device)
        first_M = torch.tensor([pairs[i][1][0] for i, _ in members], dtype=torch.long, device=device)
        with _autocast(device, bf16):
            lp_M, greedy_M = _token_scores(last_GV.index_select(0, g_M), first_M)
        idx_M = torch.tensor([i for i, _ in members], dtype=torch.long)
        lp_P[idx_M] += lp_M.double().cpu()
        greedy_P[idx_M] &= greedy_M.cpu()
        longer = sorted((m for m in members if len(pairs[m[0]][1]) > 1), key=lambda m: -len(pairs[m[0]][1]))
        for r0 in range(0, len(longer), batch_size):
            rows = longer[r0 : r0 + batch_size]
            rows_R = torch.tensor([g for _, g in rows], dtype=torch.long, device=device)
            mask_RT = _pad([[1] * (len(pairs[i][1]) - 1) for i, _ in rows], device).bool()
            targets_N = torch.tensor([t for i, _ in rows for t in pairs[i][1][1:]], device=device)
            with _autocast(device, bf16):
                h_RTD = model.extend_hidden(
                    _pad([pairs[i][1][:-1] for i, _ in rows], device), cache.select(rows_R)
                )
                lp_N, greedy_N = _score_positions(model, h_RTD[mask_RT], targets_N)
            row_N = torch.arange(len(rows), device=device)[:, None].expand_as(mask_RT)[mask_RT]
            lp_R = torch.zeros(len(rows), dtype=lp_N.dtype, device=device).index_add_(0, row_N, lp_N)
            miss_R = torch.zeros(len(rows), dtype=torch.long, device=device).index_add_(
                0, row_N, (~greedy_N).long()
            )
            idx_R = torch.tensor([i for i, _ in rows], dtype=torch.long)
            lp_P[idx_R] += lp_R.double().cpu()
            greedy_P[idx_R] &= (miss_R == 0).cpu()
    return [(float(lp), bool(g)) for lp, g in zip(lp_P, greedy_P)]
