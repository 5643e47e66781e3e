"""Token sampling: a pure function of the logits, the sampling settings and the generator."""

from __future__ import annotations

import torch
from torch import Tensor


def sample_next(
    logits_BV: Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Draw one token per row from softmax(logits / temperature), restricted by top-k and top-p.

    temperature 0 is greedy (argmax; top_k/top_p then do not matter). top_k keeps the k largest logits
    (ties at the k-th value are kept); top_p keeps the smallest set of most likely tokens whose
    probability reaches p (always at least one). The draw uses `generator`, so a seeded generator gives
    the same tokens for the same logits. Returns token ids (B,) int64 on the logits' device.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    logits_BV = logits_BV.float()
    if temperature == 0:
        return logits_BV.argmax(dim=-1)
    # Shifted so that each row's largest logit is 0: a temperature so small that the division
    # overflows then sends the others to -inf, i.e. the greedy limit, instead of inf/inf = NaN.
    logits_BV = (logits_BV - logits_BV.amax(dim=-1, keepdim=True)) / temperature
    if top_k is not None and top_k < logits_BV.shape[-1]:
        kth_B1 = torch.topk(logits_BV, top_k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth_B1, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_BV, order_BV = torch.sort(logits_BV, dim=-1, descending=True)
        probs_BV = torch.softmax(sorted_BV, dim=-1)
        # Drop a token when the tokens strictly more likely than it already reach top_p.
        before_BV = torch.cumsum(probs_BV, dim=-1) - probs_BV
        drop_sorted_BV = before_BV >= top_p
        drop_BV = torch.zeros_like(drop_sorted_BV).scatter(-1, order_BV, drop_sorted_BV)
        logits_BV = logits_BV.masked_fill(drop_BV, float("-inf"))
    probs_BV = torch.softmax(logits_BV, dim=-1)
    return torch.multinomial(probs_BV, 1, generator=generator).squeeze(-1)
