"""vLLM serves hybrid exports (Mamba-3 layers and attention layers, as mamba_ssm's MHA): greedy output
equals the model's own, token for token, for prompts of several lengths batched together, chunked, with
prefill and decode in the same steps. Three hybrids, one engine at a time:

    gqa   attention at layer 1; 4 query heads over 2 key/value heads; rotary on half the head in GPT-NeoX
          halves; the gated MLP on part of in_proj; a conv over qkv (4 taps: its window in vLLM's state
          cache); biases
    mha   attention at layer 3 (the last); 2 query heads over 2; no rotary; a one-tap conv (no window)
    mqa   attention at layers 0 and 2; 2 query heads over 1; interleaved (GPT-J) rotary on the whole head
          at another base; a softmax scale of its own; no conv; no biases
"""

from __future__ import annotations

import pytest
from vllm_helpers import (
    NEW_TOKENS,
    NO_VLLM,
    StepLog,
    check_text_prompts_start_a_document,
    prompts,
    reference_greedy,
    served_engine,
    tiny_model,
    vllm_greedy,
)

pytest.importorskip("vllm", reason=NO_VLLM)

from vllm.model_executor.layers.attention import Attention

from mamba3lite.vllm_plugin import HYBRID_ARCHITECTURE

LENGTHS = [1, 6, 27, 70, 140]
# Head size 32 (vLLM's CPU attention refuses 16); d_model 64.
HYBRIDS = {
    "gqa": dict(
        attn_layer_idx=[1],
        attn_cfg=dict(num_heads=4, num_heads_kv=2, head_dim=32, rotary_emb_dim=16, mlp_dim=64, d_conv=4),
    ),
    "mha": dict(attn_layer_idx=[3], attn_cfg=dict(num_heads=2, d_conv=1)),
    "mqa": dict(
        attn_layer_idx=[0, 2],
        attn_cfg=dict(
            num_heads=2, num_heads_kv=1, rotary_emb_dim=32, rotary_emb_interleaved=True,
            rotary_emb_base=500.0, softmax_scale=0.3, qkv_proj_bias=False, out_proj_bias=False,
        ),
    ),
}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(HYBRIDS))
def served(request, tmp_path_factory):
    """(model, engine, step log) of one hybrid, 4 layers."""
    model = tiny_model(n_layers=4, **HYBRIDS[request.param])
    log = StepLog(layer_idx=next(i for i in range(4) if i not in model.cfg.attn_layer_idx))
    yield from served_engine(model, tmp_path_factory.mktemp(request.param), log)


def test_the_export_is_served_as_a_hybrid(served):
    model, llm, _ = served
    model_config = llm.llm_engine.vllm_config.model_config
    assert model_config.architecture == HYBRID_ARCHITECTURE
    assert model_config.is_hybrid and not model_config.is_attention_free
    attn = model.cfg.attn_cfg
    assert model_config.get_head_size() == 32
    assert model_config.get_total_num_kv_heads() == model.cfg.attn_num_heads_kv
    # The attention layers run through vLLM's paged attention, their keys and values in its cache.
    context = llm.llm_engine.vllm_config.compilation_config.static_forward_context
    attention = {name: layer for name, layer in context.items() if isinstance(layer, Attention)}
    assert sorted(attention) == [f"model.layers.{i}.mixer.attn" for i in model.cfg.attn_layer_idx]
    assert all(layer.kv_cache.numel() > 0 for layer in attention.values())
    # A conv of more than one tap keeps its window as a state layer of its own.
    convs = sorted(name for name in context if name.endswith(".conv"))
    windowed = attn.get("d_conv", 0) > 1
    assert convs == [f"model.layers.{i}.mixer.conv" for i in model.cfg.attn_layer_idx if windowed]


def test_greedy_equals_the_models_own(served):
    model, llm, log = served
    rows = prompts(LENGTHS, seed=4)
    got = vllm_greedy(llm, rows, NEW_TOKENS)
    for row, tokens in zip(rows, got):
        assert tokens == reference_greedy(model, row, NEW_TOKENS), f"prompt of {len(row)} tokens"
    assert log.continued() and log.mixed(), log.steps


def test_text_prompts_start_a_document_as_generate_does(served):
    model, llm, _ = served
    check_text_prompts_start_a_document(model, llm, NEW_TOKENS)
