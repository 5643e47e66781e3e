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
choice continues from a copy of that state (`extend`, the choices of several items batched together).
A HellaSwag item (context ~2x a choice, 4 choices) then costs about 1 + 4/2 context-lengths of tokens
instead of 4 x 1.5. Same numbers as the plain path (float64 test): the chunked scan started from a state
is the same recurrence as the one run over the whole sequence.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import Tensor

from mamba3lite.model.transformer import ModelCache

Pair = tuple[Sequence[int], Sequence[int]]


def _autocast(device: torch.device, bf16: bool):
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def _score_rows(logits_TV: Tensor, targets: Sequence[int]) -> tuple[float, bool]:
    """(Σ log-softmax at `targets`, all targets greedy) of logits (len(targets), V)."""
    logp_TV = torch.log_softmax(logits_TV.to(torch.promote_types(logits_TV.dtype, torch.float32)), dim=-1)
    tgt_T = torch.tensor(list(targets), dtype=torch.long, device=logp_TV.device)
    lp = float(logp_TV.gather(1, tgt_T[:, None]).sum())
    return lp, bool((logp_TV.argmax(-1) == tgt_T).all())


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


def _repeat_cache(cache: ModelCache, n: int) -> list[ModelCache]:
    """n independent copies of a one-row cache (each `extend` writes its own rows in place)."""
    return [ModelCache(
        layers=[type(lc)(**{k: v.clone() for k, v in vars(lc).items()}) for lc in cache.layers],
        last_token_B=cache.last_token_B.clone(),
    ) for _ in range(n)]  # fmt: skip


def _cat_caches(caches: list[ModelCache]) -> ModelCache:
    """One cache whose row b is `caches[b]`'s (one row each)."""
    first = caches[0]
    layers = []
    for li, lc in enumerate(first.layers):
        fields = {k: torch.cat([vars(c.layers[li])[k] for c in caches]) for k in vars(lc)}
        layers.append(type(lc)(**fields))
    return ModelCache(layers=layers, last_token_B=torch.cat([c.last_token_B for c in caches]))


@torch.no_grad()
def score_with_state_reuse(
    model, pairs: Sequence[Pair], batch_size: int, bf16: bool = False
) -> list[tuple[float, bool]]:
    """The same numbers as `score_plain`, each distinct context run once (see the module docstring).

    Pairs with the same context ids form a group; groups are taken in order until their continuations
    fill `batch_size` rows; each group's context is prefilled (one row), then every continuation that
    has more than one token continues from its own copy of that state, all rows in one `extend`.
    """
    assert batch_size >= 1 and all(len(c) > 0 and len(t) > 0 for c, t in pairs)
    device = next(model.parameters()).device
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (ctx, _) in enumerate(pairs):
        groups.setdefault(tuple(ctx), []).append(i)
    out: list[tuple[float, bool] | None] = [None] * len(pairs)
    pending: list[tuple[tuple[int, ...], list[int]]] = []

    def flush() -> None:
        caches: list[ModelCache] = []
        rows: list[list[int]] = []
        members: list[tuple[int, float, bool]] = []
        for ctx, idx in pending:
            cache = model.allocate_cache(1, device=device)
            with _autocast(device, bf16):
                last_1V, _ = model.prefill(torch.tensor([ctx], dtype=torch.long, device=device), cache)
            longer = [i for i in idx if len(pairs[i][1]) > 1]
            caches += _repeat_cache(cache, len(longer))
            for i in idx:
                cont = list(pairs[i][1])
                lp0, greedy0 = _score_rows(last_1V, cont[:1])
                if len(cont) == 1:
                    out[i] = (lp0, greedy0)
                else:
                    rows.append(cont[:-1])
                    members.append((i, lp0, greedy0))
        if rows:
            with _autocast(device, bf16):
                logits_BTV = model.extend(_pad(rows, device), _cat_caches(caches))
            for r, (i, lp0, greedy0) in enumerate(members):
                cont = list(pairs[i][1])
                lp, greedy = _score_rows(logits_BTV[r, : len(cont) - 1], cont[1:])
                out[i] = (lp0 + lp, greedy0 and greedy)
        pending.clear()

    n_rows = 0
    for ctx, idx in groups.items():
        if pending and n_rows + len(idx) > batch_size:
            flush()
            n_rows = 0
        pending.append((ctx, idx))
        n_rows += len(idx)
    if pending:
        flush()
    return out  # type: ignore[return-value]
