"""vLLM serves a MIMO Mamba-3 export (rank 2, untied head) that resets its state after each EOS: greedy
output equals the model's own, token for token, with EOS inside prompts (the scan's resets, and the
state a chunk ending in EOS leaves) and EOS generated while decoding (the step's reset)."""

from __future__ import annotations

import pytest
import torch
from vllm_helpers import (
    EOS,
    MAX_BATCHED_TOKENS,
    NEW_TOKENS,
    NO_VLLM,
    prompts,
    reference_greedy,
    served_engine,
    tiny_model,
    vllm_greedy,
)

pytest.importorskip("vllm", reason=NO_VLLM)

LENGTHS = [2, 9, 31, 64, 130]


def eos_prone_model():
    """The MIMO model with an EOS logit that wins at about a third of positions, so greedy decoding
    emits EOS now and then (and the next token must start from a fresh state)."""
    model = tiny_model(is_mimo=True, mimo_rank=2, reset_at_eos=True, tie_embeddings=False, n_layers=3)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        w = model.lm_head.weight
        w[EOS] = torch.randn(w.shape[1], generator=g) * w.norm(dim=1).mean() * 3
    return model


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    yield from served_engine(eos_prone_model(), tmp_path_factory.mktemp("mimo"))


def with_eos_inside(rows: list[list[int]]) -> list[list[int]]:
    """The prompts with EOS at a few places inside: the middle, and the last position of the first
    32-token chunk (where a piece ends on an EOS)."""
    out = []
    for r in rows:
        r = list(r)
        for at in (len(r) // 2, 31):
            if 0 < at < len(r):
                r[at] = EOS
        out.append(r)
    return out


def test_greedy_equals_the_models_own(served):
    model, llm, log = served
    rows = with_eos_inside(prompts(LENGTHS, seed=1))
    got = vllm_greedy(llm, rows, 2 * NEW_TOKENS)
    for row, tokens in zip(rows, got):
        assert tokens == reference_greedy(model, row, 2 * NEW_TOKENS), f"prompt of {len(row)} tokens"
    assert any(EOS in tokens[:-1] for tokens in got), "no EOS was decoded: the step's reset went untested"
    assert log.continued() and log.mixed(), log.steps


def test_a_chunk_ending_on_eos_leaves_a_fresh_state(served):
    """One prompt alone is prefilled in chunks of exactly MAX_BATCHED_TOKENS: EOS as the last token of
    the first two chunks, so the next chunk's first token must start afresh."""
    model, llm, log = served
    row = prompts([100], seed=2)[0]
    row[MAX_BATCHED_TOKENS - 1] = row[2 * MAX_BATCHED_TOKENS - 1] = EOS
    del log.steps[:]
    assert vllm_greedy(llm, [row], NEW_TOKENS)[0] == reference_greedy(model, row, NEW_TOKENS)
    assert [p for _, p, _ in log.steps[:3]] == [1, 1, 1], log.steps  # three pieces of the prompt
