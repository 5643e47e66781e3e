"""vLLM on a CPU serves an fp32 export in bfloat16 unless told otherwise (`vllm serve` downcasts): the
plugin runs there with the states in the model's own dtypes (the SSM state and the angles in fp32, the
last key and value in bf16), and the first token after each prompt is the bf16 model's own. Later tokens
may part ways: bf16 rounds the chunked scan differently when vLLM cuts a prompt into other chunks.
A pure model and a hybrid (attention at layer 1, its keys and values in vLLM's bf16 cache), one engine
at a time."""

from __future__ import annotations

import pytest
import torch
from vllm_helpers import NO_VLLM, engine, export, prompts, reference_greedy, tiny_model, vllm_greedy

pytest.importorskip("vllm", reason=NO_VLLM)


MODELS = {
    "pure": {},
    "hybrid": dict(
        n_layers=3, attn_layer_idx=[1], attn_cfg=dict(num_heads=2, num_heads_kv=1, rotary_emb_dim=16)
    ),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def served(request, tmp_path_factory):
    model = tiny_model(**MODELS[request.param])
    out = export(model, tmp_path_factory.mktemp("bf16"))
    with pytest.MonkeyPatch.context() as mp:
        llm = engine(out, mp, dtype="bfloat16")
        yield model.to(torch.bfloat16), llm
        del llm


def test_states_keep_the_models_dtypes_and_the_first_token_is_the_models(served):
    model, llm = served
    rows = prompts([1, 5, 23, 70, 150])
    got = vllm_greedy(llm, rows, 1)
    assert got == [reference_greedy(model, r, 1) for r in rows]
    dtypes = llm.apply_model(lambda m: [t.dtype for t in m.model.layers[0].mixer.kv_cache])[0]
    assert dtypes == [torch.float32, torch.float32, torch.bfloat16, torch.bfloat16]
    if model.cfg.attn_layer_idx:
        kv = llm.apply_model(lambda m: m.model.layers[1].mixer.attn.kv_cache.dtype)[0]
        assert kv == torch.bfloat16
