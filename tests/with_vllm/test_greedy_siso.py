"""vLLM serves a SISO Mamba-3 export: its greedy output equals the model's own, token for token, for
prompts of several lengths batched together, chunked, with prefill and decode in the same steps."""

from __future__ import annotations

import pytest
from vllm_helpers import (
    NEW_TOKENS,
    NO_VLLM,
    check_text_prompts_start_a_document,
    prompts,
    reference_greedy,
    served_engine,
    tiny_model,
    vllm_greedy,
)

pytest.importorskip("vllm", reason=NO_VLLM)

LENGTHS = [1, 5, 23, 70, 150]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(model, engine, step log): one engine for the module, prefix caching asked for (and refused)."""
    yield from served_engine(tiny_model(), tmp_path_factory.mktemp("siso"), enable_prefix_caching=True)


def test_greedy_equals_the_models_own(served):
    model, llm, log = served
    rows = prompts(LENGTHS)
    got = vllm_greedy(llm, rows, NEW_TOKENS)
    for row, tokens in zip(rows, got):
        assert tokens == reference_greedy(model, row, NEW_TOKENS), f"prompt of {len(row)} tokens"
    # The batch was what the test claims: prompts chunked, decode and prefill in one step.
    assert log.continued() and log.mixed(), log.steps


def test_prefix_caching_is_off_and_a_repeat_is_exact(served):
    model, llm, _ = served
    assert llm.llm_engine.vllm_config.cache_config.enable_prefix_caching is False
    rows = prompts([70, 70], seed=3)
    rows[1] = rows[0][:40] + rows[1][40:]  # a shared prefix, which a prefix cache would reuse
    first = vllm_greedy(llm, rows, NEW_TOKENS)
    assert vllm_greedy(llm, rows, NEW_TOKENS) == first
    assert first == [reference_greedy(model, r, NEW_TOKENS) for r in rows]


def test_text_prompts_start_a_document_as_generate_does(served):
    model, llm, _ = served
    check_text_prompts_start_a_document(model, llm, NEW_TOKENS)
