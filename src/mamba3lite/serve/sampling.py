"""One request's sampling settings, and the per-row token choice of the batched decode loop.

The draw itself is `model.sampling.sample_next` on the row's logits with the row's own seeded
`torch.Generator`, exactly as `generation.generate_text` draws: the same prompt, settings and seed give
the same tokens alone, in any batch, and through `mamba3lite generate`. The penalties are OpenAI's:
logit[j] -= frequency_penalty * count[j] + presence_penalty * [count[j] > 0], counted over the tokens
generated so far (not the prompt).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mamba3lite.model.sampling import sample_next


@dataclass(frozen=True)
class Sampling:
    """max_tokens: new tokens at most (0 only to score the prompt); temperature 0 = greedy; top_k/top_p:
    None = off; seed: the row generator's seed; stop: strings that end the text (excluded from it);
    logprobs: top alternatives reported per token (None: no logprobs); echo: the prompt is part of the
    returned text (and, with logprobs, scored)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    echo: bool = False

    @property
    def penalised(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0


class RowSampler:
    """Chooses the next token of one row from its logits (V,), keeping the row's generator and counts."""

    def __init__(self, sampling: Sampling, vocab_size: int, device: torch.device) -> None:
        self.s = sampling
        self.generator = torch.Generator(device=device).manual_seed(sampling.seed)
        self.counts_V = torch.zeros(vocab_size, device=device) if sampling.penalised else None
        # argmax of the raw logits: the batch can take it for this row in one call
        self.plain_greedy = sampling.temperature == 0 and not sampling.penalised

    def choose(self, logits_V: Tensor) -> int:
        logits_1V = logits_V[None]
        if self.counts_V is not None:
            pen_V = self.s.frequency_penalty * self.counts_V + self.s.presence_penalty * (self.counts_V > 0)
            logits_1V = logits_1V.float() - pen_V
        token = int(sample_next(logits_1V, self.s.temperature, self.s.top_k, self.s.top_p, self.generator)[0])
        if self.counts_V is not None:
            self.counts_V[token] += 1
        return token


def top_logprobs(
    logits_TV: Tensor, ids_T: Tensor, n: int
) -> tuple[list[float], list[list[int]], list[list[float]]]:
    """Per row: log p(ids[t]) under softmax(logits[t]), and the n most likely ids with their log p."""
    logp_TV = torch.log_softmax(logits_TV.float(), dim=-1)
    chosen = logp_TV.gather(1, ids_T[:, None])[:, 0].tolist()
    if n <= 0:
        return chosen, [[] for _ in chosen], [[] for _ in chosen]
    top = torch.topk(logp_TV, n, dim=-1)
    return chosen, top.indices.tolist(), top.values.tolist()
