"""The layer-kind seam (model/layer_kinds.py): ModelConfig's attn_layer_idx / attn_cfg and their bad
inputs, Block picking the kind by index, counts summed by kind (equal to one block × n_layers for a pure
model, to the real parameter count for a hybrid), memory and FLOPs that grow with the length for
attention, and a hybrid that decodes through the model's decode state.

The attention layer is model/attention.py's MHA (its own math is tested in tests/test_attention.py)."""

from __future__ import annotations

import dataclasses
import queue

import pytest
import torch

from mamba3lite.config import Config
from mamba3lite.errors import ConfigError
from mamba3lite.interop.hf_export import hf_config
from mamba3lite.interop.official_config import OfficialVocab, official_config_from_model
from mamba3lite.model import (
    Mamba3Transformer,
    ModelConfig,
    count_parameters,
    memory,
    model_flops_per_token,
)
from mamba3lite.model.kind_mamba3 import mamba3_flops_per_token, mamba3_parameters
from mamba3lite.model.layer_kinds import LAYER_KINDS, kind_of_layer, layers_by_kind
from mamba3lite.model.memory import (
    activation_bytes,
    activation_bytes_per_token,
    largest_unit_parameters,
    layer_activation_bytes_per_token,
    optimizer_state_bytes,
    saved_bytes,
    saved_bytes_per_token_growing,
)
from mamba3lite.optimizers import is_hidden_matrix
from mamba3lite.serve.batch_state import BatchState
from mamba3lite.serve.engine import Delta, Engine, Finished, Job
from mamba3lite.serve.prefix_cache import PrefixCache
from mamba3lite.serve.sampling import Sampling
from mamba3lite.tokenizer import load_tokenizer

F64 = torch.float64
BASE = dict(vocab_size=61, d_model=32, n_layers=4, d_intermediate=40, mlp_multiple_of=8, d_state=16,
            headdim=8, chunk_size=8, eos_id=3)  # fmt: skip
HEADS = {"num_heads": 4}


def cfg_of(**kw) -> ModelConfig:
    return ModelConfig(**{**BASE, **kw})


def hybrid(**attn) -> ModelConfig:
    return cfg_of(attn_layer_idx=(1, 3), attn_cfg={**HEADS, **attn})


# ---- config ----
def test_defaults_are_a_pure_mamba3_model():
    cfg = ModelConfig()
    assert cfg.attn_layer_idx == () and cfg.attn_cfg == {}
    assert {cfg.layer_kind(i) for i in range(cfg.n_layers)} == {"mamba3"}


def test_layer_kind_by_index_and_lists_become_tuples():
    cfg = cfg_of(attn_layer_idx=[3, 1], attn_cfg={**HEADS, "rotary_emb_base": "1e4"})
    assert cfg.attn_layer_idx == (3, 1)  # JSON and YAML give lists
    assert [cfg.layer_kind(i) for i in range(4)] == ["mamba3", "attention", "mamba3", "attention"]
    assert cfg.attn_cfg["rotary_emb_base"] == 10000.0  # YAML 1.1 reads 1e4 as a string
    assert (cfg.attn_num_heads_kv, cfg.attn_head_dim, cfg.attn_mlp_dim) == (4, 8, 0)
    gqa = cfg_of(
        attn_layer_idx=(0,), attn_cfg={"num_heads": 6, "num_heads_kv": 2, "head_dim": 16, "mlp_dim": 300}
    )
    assert (gqa.attn_num_heads_kv, gqa.attn_head_dim, gqa.attn_mlp_dim) == (2, 16, 512)


def one(**attn):
    return {"attn_layer_idx": (1,), "attn_cfg": attn}


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"attn_layer_idx": (4,), "attn_cfg": HEADS}, r"layer 4 is out of range for n_layers = 4"),
        ({"attn_layer_idx": (-1,), "attn_cfg": HEADS}, r"layer -1 is out of range"),
        ({"attn_layer_idx": (1, 2, 1), "attn_cfg": HEADS}, r"names layer 1 more than once"),
        ({"attn_layer_idx": "1", "attn_cfg": HEADS}, r"attn_layer_idx must be a list of layer indices"),
        ({"attn_layer_idx": (1.5,), "attn_cfg": HEADS}, r"attn_layer_idx must be a list"),
        (one(num_heads=6, num_heads_kv=4), r"num_heads = 6 is not divisible by num_heads_kv = 4"),
        (one(**HEADS, rotary_emb_dim=3), r"rotary_emb_dim must be even"),
        (one(**HEADS, rotary_emb_dim=16), r"rotary_emb_dim = 16 is larger than the head dimension 8"),
        (one(num_head=4), r"unknown key `num_head`; did you mean `num_heads`"),
        (one(**HEADS, rotary=4), r"unknown key `rotary`"),
        (one(num_heads=5), r"the width does not add up: d_model \(embed_dim\) = 32 .* num_heads = 5"),
        ({"attn_cfg": HEADS}, r"attn_cfg is set but model.attn_layer_idx is empty"),
        ({"attn_layer_idx": (1,)}, r"attn_cfg.num_heads is required"),
        (one(num_heads="four"), r"attn_cfg.num_heads must be an integer"),
        (one(num_heads=0), r"attn_cfg.num_heads must be an integer >= 1"),
        (one(**HEADS, qkv_proj_bias="no"), r"qkv_proj_bias must be true or false"),
        (one(**HEADS, softmax_scale=-1), r"softmax_scale must be > 0"),
        (one(**HEADS, d_conv=-2), r"attn_cfg.d_conv must be an integer >= 0"),
        (one(**HEADS, rotary_emb_base="inf"), r"rotary_emb_base must be a finite number"),
        ({"attn_layer_idx": (1,), "attn_cfg": [4]}, r"attn_cfg must be a mapping"),
    ],
)
def test_bad_attention_settings_are_one_clear_error(kw, message):
    with pytest.raises(ConfigError, match=message):
        cfg_of(**kw)


def test_a_width_that_adds_up_with_head_dim():
    cfg = cfg_of(attn_layer_idx=(1,), attn_cfg={"num_heads": 5, "head_dim": 8, "rotary_emb_dim": 8})
    assert cfg.attn_head_dim == 8


def test_yaml_and_set_take_the_attention_fields():
    raw = {"model": {**BASE, "attn_layer_idx": [0, 2], "attn_cfg": {"num_heads": 4, "num_heads_kv": 2}}}
    cfg = Config.from_dict(raw)
    assert cfg.model.attn_layer_idx == (0, 2) and cfg.model.attn_cfg == {"num_heads": 4, "num_heads_kv": 2}
    assert cfg.to_dict()["model"]["attn_layer_idx"] == [0, 2]  # YAML/JSON safe, and back
    assert Config.from_dict(cfg.to_dict()).model == cfg.model
    base = Config.from_dict({"model": BASE})
    one = base.with_overrides(["model.attn_layer_idx=1,3", "model.attn_cfg={num_heads: 4, d_conv: 4}"])
    assert one.model.attn_layer_idx == (1, 3) and one.model.attn_cfg == {"num_heads": 4, "d_conv": 4}
    dotted = base.with_overrides(["model.attn_layer_idx=[1]", "model.attn_cfg.num_heads=4",
                                  "model.attn_cfg.rotary_emb_dim=4"])  # fmt: skip
    assert dotted.model.attn_cfg == {"num_heads": 4, "rotary_emb_dim": 4}
    merged = dotted.with_overrides(["model.attn_cfg.num_heads_kv=2"])  # merged into the current mapping
    assert merged.model.attn_cfg == {"num_heads": 4, "rotary_emb_dim": 4, "num_heads_kv": 2}
    with pytest.raises(ConfigError, match="unknown key `num_head`; did you mean `num_heads`"):
        base.with_overrides(["model.attn_layer_idx=[1]", "model.attn_cfg.num_head=4"])
    with pytest.raises(ConfigError, match=r"model\.d_model is not a mapping"):
        base.with_overrides(["model.d_model.x=4"])
    with pytest.raises(ConfigError, match="unknown key in section `model:` `attn_cf`"):
        base.with_overrides(["model.attn_cf.num_heads=4"])


# ---- the registry ----
def test_layers_by_kind_without_a_loop_over_the_layers():
    assert layers_by_kind(cfg_of()) == {"mamba3": (4, 0)}
    assert layers_by_kind(hybrid()) == {"mamba3": (2, 0), "attention": (2, 1)}
    first = cfg_of(attn_layer_idx=(0, 1), attn_cfg=HEADS)
    assert layers_by_kind(first) == {"attention": (2, 0), "mamba3": (2, 2)}
    every = cfg_of(attn_layer_idx=(3, 2, 1, 0), attn_cfg=HEADS)
    assert layers_by_kind(every) == {"attention": (4, 0)}
    huge = cfg_of(n_layers=10**8, attn_layer_idx=(0,), attn_cfg=HEADS)  # a typo: counted, never built
    assert layers_by_kind(huge) == {"attention": (1, 0), "mamba3": (10**8 - 1, 1)}
    assert kind_of_layer(hybrid(), 3) is LAYER_KINDS["attention"]


def test_block_picks_the_kind_by_index():
    model = Mamba3Transformer(hybrid())
    kinds = [type(b.mixer).__name__ for b in model.layers]
    assert kinds == ["Mamba3", "MHA", "Mamba3", "MHA"]
    assert model.layers[1].mixer.in_proj.out_features == 8 * (4 + 2 * 4)
    # The official create_block's keywords: causal, layer_idx, then attn_cfg.
    assert model.layers[3].mixer.num_heads == 4


def test_scan_and_context_parallel_settings_skip_what_a_kind_lacks():
    model = Mamba3Transformer(hybrid())
    model.set_scan_impl("sequential", "cpu")
    assert model.scan_impl == "sequential"
    assert [getattr(b.mixer, "scan_impl", None) for b in model.layers] == ["sequential", None] * 2
    model.set_context_parallel(None)  # no group: nothing to exchange, every kind accepts it
    assert [b.mixer.context_parallel for b in model.layers] == [None] * 4
    only_attention = Mamba3Transformer(cfg_of(attn_layer_idx=(0, 1, 2, 3), attn_cfg=HEADS))
    assert only_attention.scan_impl is None


# ---- counts by kind ----
@pytest.mark.parametrize(
    "attn",
    [
        {}, {"num_heads_kv": 2}, {"num_heads_kv": 1, "head_dim": 16},
        {"qkv_proj_bias": False, "out_proj_bias": False}, {"d_conv": 4}, {"mlp_dim": 40},
        {"mlp_dim": 300, "d_conv": 3, "num_heads_kv": 2},
    ],
)  # fmt: skip
def test_parameter_count_of_a_hybrid_is_the_real_count(attn):
    cfg = hybrid(**attn)
    with torch.device("meta"):
        model = Mamba3Transformer(cfg)
    assert count_parameters(cfg) == sum(p.numel() for p in model.parameters())
    real = sum(p.numel() for name, p in model.named_parameters() if is_hidden_matrix(name, p))
    n = count_parameters(cfg)
    assert 0 < real < n and optimizer_state_bytes(cfg, "muon") == 4 * real + 8 * (n - real)  # by kind
    block = max(sum(p.numel() for p in b.parameters()) for b in model.layers)
    assert largest_unit_parameters(dataclasses.replace(cfg, vocab_size=8)) == block


def test_a_pure_model_counts_one_block_times_n_layers():
    """Summing by kind changes nothing for a pure model: n_layers × one Mamba-3 block, as before."""
    cfg = cfg_of()
    D, F = cfg.d_model, cfg.d_mlp
    block = D + mamba3_parameters(cfg) + D + 3 * D * F
    assert count_parameters(cfg) == cfg.vocab_size * D + cfg.n_layers * block + D
    for T in (8, 40, 2048):
        f = model_flops_per_token(cfg, T)
        assert list(f) == ["projections", "scan_intra", "scan_state", "mlp", "lm_head", "forward", "train"]
        for part, one in mamba3_flops_per_token(cfg, T).items():
            assert f[part] == pytest.approx(cfg.n_layers * one, rel=1e-15)


def test_attention_flops_grow_with_the_length_and_mamba3_layers_keep_theirs():
    cfg, pure = hybrid(), cfg_of()
    for T in (16, 256):
        f, p = model_flops_per_token(cfg, T), model_flops_per_token(pure, T)
        mamba = mamba3_flops_per_token(cfg, T)
        for part in ("scan_intra", "scan_state"):
            assert f[part] == pytest.approx(2 * mamba[part])  # two Mamba-3 layers of four
        assert f["mlp"] == p["mlp"] and f["lm_head"] == p["lm_head"]
        # q·kᵀ and the product with v: 2 FLOPs × 2 matmuls × heads × head_dim × (T + 1) / 2 keys, 2 layers
        assert f["attention"] == pytest.approx(2 * 2 * 2 * 32 * (T + 1) / 2)
        assert f["forward"] == pytest.approx(sum(v for k, v in f.items() if k not in ("forward", "train")))
    short, long = model_flops_per_token(cfg, 64), model_flops_per_token(cfg, 128)
    assert long["attention"] / short["attention"] == pytest.approx(129 / 65)


# ---- memory by kind ----
class _Quadratic(torch.nn.Module):
    """Keeps a T × T matrix for its backward, and nothing of fixed size: saved(T) = a·T² + b·T."""

    def forward(self, x):
        w = torch.softmax(x @ x.transpose(1, 2), dim=-1)
        return w @ x


def test_a_layer_that_keeps_t_squared_is_measured_exactly_at_its_length():
    layer = _Quadratic()
    for T in (32, 100):
        exact = saved_bytes(layer, 8, T, compute=None) / T  # no weights: all of it grows with T
        assert saved_bytes_per_token_growing(layer, 8, T, compute=None) == pytest.approx(exact)
    assert saved_bytes_per_token_growing(layer, 8, 100, compute=None) > saved_bytes_per_token_growing(
        layer, 8, 32, compute=None
    )


def test_activations_sum_over_the_layers_by_kind(monkeypatch):
    cfg = hybrid()
    monkeypatch.setattr(memory, "_PER_TOKEN_CACHE", {})
    mamba = layer_activation_bytes_per_token(cfg, "mamba3", 32, None)
    attention = layer_activation_bytes_per_token(cfg, "attention", 32, None)
    assert mamba == layer_activation_bytes_per_token(cfg_of(), "mamba3", 32, None)  # the same block
    assert activation_bytes_per_token(cfg, 32, None) == pytest.approx((2 * mamba + 2 * attention) / 4)
    assert activation_bytes(cfg, 2, 32, compute=None) == pytest.approx(2 * 32 * (2 * mamba + 2 * attention))
    ckpt = activation_bytes(cfg, 2, 32, grad_checkpointing=True, compute=None)
    assert ckpt == pytest.approx(4 * 4 * 32 * 2 * 32 + 2 * 32 * max(mamba, attention))
    # Unpacked windows take SDPA's fused causal kernel, which keeps no T × T weights: the bytes per token
    # are measured at the run's length and come out the same.
    assert layer_activation_bytes_per_token(cfg, "attention", 128, None) == pytest.approx(attention)
    pure = cfg_of()
    assert activation_bytes(pure, 2, 32, compute=None) == pytest.approx(
        pure.n_layers * 2 * 32 * layer_activation_bytes_per_token(pure, "mamba3", 32, None)
    )


# ---- a hybrid decodes through the model's state ----
def hybrid_model(toy_cfg: ModelConfig) -> Mamba3Transformer:
    torch.manual_seed(0)
    model = Mamba3Transformer(toy_cfg).to(F64)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def test_hybrid_prefill_then_steps_equal_the_forward():
    model = hybrid_model(hybrid(num_heads_kv=2, mlp_dim=40))
    x = torch.randint(4, 61, (2, 20), generator=torch.Generator().manual_seed(1))
    want = model(x)
    cache = model.allocate_cache(2, max_len=20, dtype=F64)
    first, _ = model.prefill(x[:, :7], cache)
    steps = [first] + [model.step(x[:, t], cache) for t in range(7, 19)]
    torch.testing.assert_close(torch.stack(steps, 1), want[:, 6:19])
    assert cache.nbytes() > model.allocate_cache(2, max_len=10, dtype=F64).nbytes()  # grows with max_len


def test_hybrid_rows_of_different_lengths_batch_through_the_protocol():
    """Serve's continuous batching on a state that grows with the length: two sequences prefilled
    alone, joined into one batch (load_ into rows), then stepped together, equal each one alone."""
    model = hybrid_model(hybrid())
    x = torch.randint(4, 61, (2, 16), generator=torch.Generator().manual_seed(2))
    lengths = (5, 9)
    batch = BatchState(model, max_rows=2, initial_rows=1, max_len=16)  # grows on the second join
    for r, n in enumerate(lengths):
        one = model.allocate_cache(1, 16, dtype=F64)
        model.prefill(x[r : r + 1, :n], one)
        batch.add(one)
    assert batch.capacity == 2
    together = [
        model.step(torch.stack([x[0, lengths[0] + i], x[1, lengths[1] + i]]), batch.view()) for i in range(4)
    ]
    for r, n in enumerate(lengths):
        alone = model(x[r : r + 1, : n + 4])[0, n : n + 4]
        torch.testing.assert_close(torch.stack([t[r] for t in together]), alone)


def test_hybrid_state_snapshot_resumes_like_the_prefix():
    """The prefix cache's use: a snapshot after a prefix, loaded into a fresh state, continues as the
    prefix's own state does."""
    model = hybrid_model(hybrid())
    x = torch.randint(4, 61, (1, 12), generator=torch.Generator().manual_seed(3))
    cache = model.allocate_cache(1, 12, dtype=F64)
    model.prefill(x[:, :6], cache)
    snap = cache.snapshot()
    want = model.extend(x[:, 6:], cache)
    fresh = model.allocate_cache(1, 12, dtype=F64)
    fresh.load_(snap)
    torch.testing.assert_close(model.extend(x[:, 6:], fresh), want, rtol=0, atol=0)


# ---- exports name the layer kinds ----
def test_exports_of_a_hybrid_write_its_attention_layers():
    """The official config.json says which layers are attention and with which MHA keywords (causal
    stated: mamba_ssm's MHA defaults to false); the HF config lists each layer's kind in transformers'
    words. The round trips through both formats are in tests/test_interop.py and tests/test_export_hf.py."""
    vocab = OfficialVocab(vocab_size=61, pad_multiple=8)
    exportable = {"mlp_multiple_of": 128}  # the official GatedMLP's rounding
    official = official_config_from_model(
        cfg_of(attn_layer_idx=(1, 3), attn_cfg={**HEADS, "rotary_emb_dim": 2}, **exportable), vocab
    )
    assert official["attn_layer_idx"] == [1, 3]
    assert official["attn_cfg"] == {**HEADS, "rotary_emb_dim": 2, "causal": True}
    pure = official_config_from_model(cfg_of(**exportable), vocab)
    assert pure["attn_layer_idx"] == [] and pure["attn_cfg"] == {}
    assert hf_config(hybrid(), torch.float32)["layer_types"] == [
        "linear_attention", "full_attention", "linear_attention", "full_attention"
    ]  # fmt: skip


def test_greedy_serving_of_a_hybrid_equals_generate_alone_batched_and_from_the_prefix_cache():
    """Serve's engine on a hybrid (a state that grows with the length): each request's greedy tokens,
    alone, in a batch with others, and again from cached prefix states, equal the model's generate."""
    tok = load_tokenizer("gpt2")
    torch.manual_seed(0)
    cfg = cfg_of(vocab_size=tok.vocab_size, eos_id=tok.eos_id, attn_layer_idx=(1, 3), attn_cfg=HEADS)
    model = Mamba3Transformer(cfg)
    model.eval()
    prompts = [[tok.eos_id, *tok.encode(p)] for p in ("def add(a, b):", "import os\n", "class Point:")]
    n_new = 6
    want = []
    for ids in prompts:
        steps = model.generate(torch.tensor([ids]), n_new, temperature=0.0)
        want.append([int(t[0]) for t in steps])

    engine = Engine(model, tok, max_batch_size=4, prefix_cache=PrefixCache(1 << 20), boundary=2, max_len=64)
    engine.start()
    try:

        def run(batch):
            sinks = [queue.Queue() for _ in batch]
            engine.submit([Job(prompts[i], 1, Sampling(max_tokens=n_new, temperature=0.0), q.put)
                           for i, q in zip(batch, sinks)])  # fmt: skip
            out = []
            for q in sinks:
                ids = []
                while not isinstance(ev := q.get(timeout=60), Finished):
                    if isinstance(ev, Delta) and ev.token_id is not None:
                        ids.append(ev.token_id)
                out.append(ids)
            return out

        def expected(i):  # the engine stops at EOS, generate keeps yielding
            ids = want[i]
            return ids[: ids.index(tok.eos_id)] if tok.eos_id in ids else ids

        assert run([0]) == [expected(0)]
        assert run([0, 1, 2]) == [expected(i) for i in range(3)]  # batched, and prompt 0 from the cache
        assert engine.prefix_cache.hits >= 1
        assert engine.state_bytes == model.allocate_cache(4, 64).nbytes()
    finally:
        engine.stop()
