"""import / export / train --init-from (issue 17), checked against an independent official-layout LM.

`official_lm.py` builds official weights from a config.json alone and runs them from docs/model.md (no
mamba3lite code): the stand-in for mamba_ssm's `MambaLMHeadModel`, which cannot run here. Round trips
are in float64: official dir -> import -> our logits equal the independent LM's on every real token
id; import -> export gives back the official tensors bit for bit; our run -> export -> import gives
back our weights bit for bit, and the exported files run in the independent LM with our logits. Hybrids
(attention layers at `attn_layer_idx`, mamba_ssm's MHA built from `attn_cfg`) go both ways alike.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from mamba3lite.checkpoint import CheckpointManager, RunState
from mamba3lite.cli import main
from mamba3lite.config import Config
from mamba3lite.errors import CheckpointError, ConfigError
from mamba3lite.interop.export import export_run
from mamba3lite.interop.import_ import import_official
from mamba3lite.model import Mamba3Transformer
from official_lm import F64, official_logits, official_shapes, official_state_dict, padded_vocab, resolved
from userside_helpers import save_tiny_checkpoint, tiny_config

WORDS = ["<|endoftext|>", *[f"w{i}" for i in range(20)]]  # 21 ids: padded to 24 by a multiple of 8
SISO = {"layer": "Mamba3", "d_state": 8, "headdim": 8, "chunk_size": 4}
BASE = dict(d_model=16, n_layer=2, d_intermediate=32, vocab_size=len(WORDS), ssm_cfg=SISO,
            pad_vocab_size_multiple=8)  # fmt: skip
CASES = {
    "siso-tied-padded": (BASE, "heavy_tail", "bin"),
    "untied-no-mlp-rope1-softplus-kernel-keys": (
        {**BASE, "d_intermediate": 0, "tie_embeddings": False,
         "ssm_cfg": {**SISO, "rope_fraction": 1.0, "fuse_pregate_headwise_norm": True, "dropout": 0.0}},
        "softplus", "safetensors",
    ),
    "mimo-ngroups-outnorm-sharded": (
        {**BASE, "ssm_cfg": {**SISO, "is_mimo": True, "mimo_rank": 2, "ngroups": 2, "is_outproj_norm": True}},
        "heavy_tail", "sharded",
    ),
    # Hybrids: mamba_ssm's MHA at attn_layer_idx, its options set to values that change the math.
    "hybrid-gqa-rotary-conv-mlp": (
        {**BASE, "n_layer": 3, "attn_layer_idx": [1],
         "attn_cfg": {"causal": True, "num_heads": 4, "num_heads_kv": 2, "rotary_emb_dim": 2, "d_conv": 3,
                      "mlp_dim": 20}},
        "heavy_tail", "bin",
    ),
    "hybrid-interleaved-headdim-nobias-scale-untied": (
        {**BASE, "n_layer": 3, "attn_layer_idx": [0, 2], "tie_embeddings": False,
         "attn_cfg": {"causal": True, "num_heads": 2, "num_heads_kv": 1, "head_dim": 8, "rotary_emb_dim": 8,
                      "rotary_emb_interleaved": True, "rotary_emb_base": 500, "qkv_proj_bias": False,
                      "out_proj_bias": False, "softmax_scale": 0.3}},
        "heavy_tail", "sharded",
    ),
}  # fmt: skip


def word_tokenizer(path: Path, words: list[str] = WORDS) -> Path:
    """A non-GPT-2 tokenizer.json: one id per word, split on whitespace."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))
    return path


def write_official(root: Path, config: dict, sd: dict, fmt: str = "bin", tokenizer: bool = True) -> Path:
    """An official model directory as save_pretrained / the hub hold it."""
    from safetensors.torch import save_file

    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(config))
    if fmt == "bin":
        torch.save(sd, root / "pytorch_model.bin")
    else:
        plain = {
            k: v.clone()
            for k, v in sd.items()
            if not (k == "lm_head.weight" and v is sd["backbone.embedding.weight"])
        }
        if fmt == "safetensors":
            save_file(plain, root / "model.safetensors")
        else:  # two shards and an index
            names = sorted(plain)
            shards = {
                "model-00001-of-00002.safetensors": names[::2],
                "model-00002-of-00002.safetensors": names[1::2],
            }
            for file, keys in shards.items():
                save_file({k: plain[k] for k in keys}, root / file)
            index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
            (root / "model.safetensors.index.json").write_text(json.dumps(index))
    if tokenizer:
        word_tokenizer(root / "tokenizer.json")
    return root


def load_f64(run_dir: Path, step: int = 0) -> Mamba3Transformer:
    """The run's checkpoint in a float64 model (loaded and verified by CheckpointManager)."""
    ckpt = CheckpointManager(run_dir)
    cfg = Config.from_dict(ckpt.read_meta(step)["config"]).model
    model = Mamba3Transformer(cfg).to(F64)
    ckpt.load(step, model)
    return model.eval()


def tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in root.rglob("*")
        if p.is_file()
    }


@pytest.mark.parametrize("case", CASES)
def test_official_dir_imports_to_the_independent_lm_and_exports_back_unchanged(tmp_path, case):
    config, activation, fmt = CASES[case]
    sd = official_state_dict(config, seed=1)
    src = write_official(tmp_path / "official", config, sd, fmt)
    before = tree_digest(src)
    result = import_official(str(src), tmp_path / "run", a_activation=activation)
    assert tree_digest(src) == before  # the source is only read

    model = load_f64(tmp_path / "run")
    V = len(WORDS)
    assert model.cfg.vocab_size == V and model.cfg.a_activation == activation
    ids = torch.cat(
        [torch.randperm(V, generator=torch.Generator().manual_seed(0)), torch.tensor([3, 3, 0, 7])]
    )[None]
    with torch.no_grad():
        ours = model(ids)
    want = official_logits(sd, config, ids, activation)
    assert want.shape[-1] == padded_vocab(config) > V
    torch.testing.assert_close(ours, want[..., :V], rtol=1e-10, atol=1e-10)
    assert any("A activation" in n for n in result.notes) and any("tokens_seen" in n for n in result.notes)
    meta = CheckpointManager(tmp_path / "run").read_meta(0)
    assert meta["tokens_seen"] == 0 and meta["imported_from"]["a_activation"] == activation

    export_run(tmp_path / "run", tmp_path / "exported")
    back = torch.load(tmp_path / "exported" / "pytorch_model.bin", weights_only=True)
    assert set(back) == set(official_shapes(config))  # what MambaLMHeadModel.load_state_dict(strict) needs
    for name, t in sd.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    if resolved(config)[0]["tie_embeddings"]:  # the .bin ties the head as the official state_dict does
        assert back["lm_head.weight"].data_ptr() == back["backbone.embedding.weight"].data_ptr()
    from safetensors.torch import load_file

    st = load_file(tmp_path / "exported" / "model.safetensors")
    for name, t in st.items():
        assert torch.equal(t, sd[name]), name
    got_cfg = json.loads((tmp_path / "exported" / "config.json").read_text())
    c_want, s_want = resolved(config)
    c_got, s_got = resolved(got_cfg)
    assert {k: v for k, v in c_got.items() if k != "ssm_cfg"} == {
        k: v for k, v in c_want.items() if k != "ssm_cfg"
    }
    kernel_only = ("fuse_pregate_headwise_norm", "dropout")  # accepted on import, not written back
    assert all(s_got[k] == v for k, v in s_want.items() if k not in kernel_only), (s_got, s_want)
    assert got_cfg["ssm_cfg"]["layer"] == "Mamba3"


def test_our_hybrid_run_exports_for_the_official_lm_and_imports_back_bit_identical(tmp_path):
    cfg = tiny_config("x").model.__class__(**{
        **tiny_config("x").model.__dict__, "n_layers": 3, "attn_layer_idx": (1,),
        "attn_cfg": {"num_heads": 4, "num_heads_kv": 2, "rotary_emb_dim": 4, "d_conv": 2, "mlp_dim": 8},
    })  # fmt: skip
    torch.manual_seed(0)
    model = Mamba3Transformer(cfg).to(F64)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    data = {"tokenizer": "gpt2", "vocab_size": 50257, "eos_id": 50256}
    state = RunState(step=1, config=Config(model=cfg).to_dict(), data=data)
    CheckpointManager(tmp_path / "run").save(1, model, None, state)
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 0  # the CLI, both ways
    out = tmp_path / "out"
    official_cfg = json.loads((out / "config.json").read_text())
    assert official_cfg["attn_layer_idx"] == [1]
    # exactly the MHA keywords mamba_ssm's create_block passes on, causal said (MHA's default is False)
    assert official_cfg["attn_cfg"] == {**cfg.attn_cfg, "causal": True}
    sd = torch.load(out / "pytorch_model.bin", weights_only=True)
    assert set(sd) == set(official_shapes(official_cfg))
    assert {k for k in sd if k.startswith("backbone.layers.1.mixer.")} == {
        f"backbone.layers.1.mixer.{n}" for n in ("in_proj.weight", "in_proj.bias", "conv1d.weight",
                                                 "conv1d.bias", "out_proj.weight", "out_proj.bias")
    }  # fmt: skip
    ids = torch.tensor([[464, 3290, 318, 257, 50256, 11, 995, 0, 50000, 7, 7, 7]])
    with torch.no_grad():
        ours = model.eval()(ids)
    torch.testing.assert_close(official_logits(sd, official_cfg, ids), ours, rtol=1e-10, atol=1e-10)
    assert (
        "attention (mamba_ssm MHA, 4 heads, 2 key/value heads) at layers 1" in (out / "README.md").read_text()
    )

    assert main(["import", str(out), "--out", str(tmp_path / "back")]) == 0
    back = load_f64(tmp_path / "back")
    assert back.cfg.attn_layer_idx == (1,) and back.cfg.attn_cfg == cfg.attn_cfg
    for (k, a), (k2, b) in zip(model.state_dict().items(), back.state_dict().items()):
        assert k == k2 and a.dtype == b.dtype and torch.equal(a, b), k
    with torch.no_grad():
        assert torch.equal(back(ids), ours)


def test_our_run_exports_for_the_official_lm_and_imports_back_bit_identical(tmp_path):
    torch.manual_seed(0)
    cfg = tiny_config(tmp_path / "run").model.__class__(**{**tiny_config("x").model.__dict__, "n_layers": 2})
    model = Mamba3Transformer(cfg).to(F64)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    save_tiny_checkpoint(tmp_path / "run", step=5, model=model)
    meta_path = tmp_path / "run" / "meta_step_5.json"
    meta = json.loads(meta_path.read_text())
    assert meta["config"]["model"]["n_layers"] == 1  # the helper records the tiny config: fix it up
    kept = {k: meta[k] for k in ("tokens_seen", "data", "metrics", "last_eval")}
    state = RunState(step=5, **kept, config=Config(model=cfg).to_dict())
    CheckpointManager(tmp_path / "run").save(5, model, None, state)
    res = export_run(tmp_path / "run", tmp_path / "out")
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md", "config.json", "model.safetensors", "pytorch_model.bin", "tokenizer.json"
    ]  # fmt: skip
    official_cfg = json.loads((out / "config.json").read_text())
    # exactly MambaConfig's fields: from_pretrained does MambaConfig(**config)
    assert set(official_cfg) == set(resolved({})[0])
    sd = torch.load(out / "pytorch_model.bin", weights_only=True)
    assert set(sd) == set(official_shapes(official_cfg))
    assert all(tuple(sd[k].shape) == s for k, s in official_shapes(official_cfg).items())
    ids = torch.tensor([[464, 3290, 318, 257, 50256, 11, 995, 0, 50000]])
    with torch.no_grad():
        ours = model.eval()(ids)
    torch.testing.assert_close(official_logits(sd, official_cfg, ids), ours, rtol=1e-10, atol=1e-10)
    card = (out / "README.md").read_text()
    assert "heavy-tail" in card and "7.7500" in card and f"{res.n_params:,}" in card and "160" in card

    import_official(str(out), tmp_path / "back")
    back = load_f64(tmp_path / "back")
    for (k, a), (k2, b) in zip(model.state_dict().items(), back.state_dict().items()):
        assert k == k2 and a.dtype == b.dtype and torch.equal(a, b), k
    with torch.no_grad():
        assert torch.equal(back(ids), ours)
    assert CheckpointManager(tmp_path / "back").read_meta(0)["data"]["tokenizer"] == "gpt2"


TEXTS = [
    "Hello world",
    "def main():\n    return  42\n\n\n",
    "  leading spaces,\ttabs\t\tand\r\nwindows lines   \n  ",
    "unicode: héllo wörld — naïve café, 日本語のテキスト, emoji 🎉🧪, ß ẞ ﬁ",
    "special tokens as text: <|endoftext|> and x<|endoftext|>y <|endoftext|>",
    "it's we'll they're I'd 1234567 3.14159 $100 #tag @user",
    "",
    " " * 9 + "\n" * 3 + "end",
]


def test_gpt2_tokenizer_json_encodes_exactly_as_ours(tmp_path):
    from tokenizers import Tokenizer

    from mamba3lite.interop.gpt2_tokenizer import gpt2_tokenizer_json, is_gpt2_tokenizer_json
    from mamba3lite.tokenizer import load_tokenizer

    text = gpt2_tokenizer_json()
    hf, ours = Tokenizer.from_str(text), load_tokenizer("gpt2")
    for t in TEXTS:
        ids = hf.encode(t, add_special_tokens=False).ids
        assert ids == ours.encode(t), t
        assert hf.decode(ids, skip_special_tokens=False) == t
    assert hf.token_to_id("<|endoftext|>") == 50256 and hf.get_vocab_size() == 50257
    assert is_gpt2_tokenizer_json(text)
    assert not is_gpt2_tokenizer_json(word_tokenizer(tmp_path / "w.json").read_text())


def test_hf_name_downloads_through_huggingface_hub(tmp_path, monkeypatch):
    import huggingface_hub

    src = write_official(tmp_path / "snapshot", BASE, official_state_dict(BASE), "safetensors")
    asked = []

    def fake_snapshot_download(repo_id, allow_patterns=None, **kw):
        asked.append((repo_id, allow_patterns))
        return str(src)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    import_official("hf:state-spaces/mamba3-tiny", tmp_path / "run")
    assert asked[0][0] == "state-spaces/mamba3-tiny" and "config.json" in asked[0][1]
    assert (
        CheckpointManager(tmp_path / "run").read_meta(0)["imported_from"]["source"]
        == "hf:state-spaces/mamba3-tiny"
    )


# ------------------------------------------------------------------------------------- bad input
def _truncate(name: str):
    def damage(root: Path) -> None:
        p = root / name
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])

    return damage


def _edit_config(**changes):
    def damage(root: Path) -> None:
        cfg = json.loads((root / "config.json").read_text())
        for k, v in changes.items():
            if k.startswith("ssm."):
                cfg["ssm_cfg"][k[4:]] = v
            else:
                cfg[k] = v
        (root / "config.json").write_text(json.dumps(cfg))

    return damage


def _drop_layer_key(root: Path) -> None:
    cfg = json.loads((root / "config.json").read_text())
    del cfg["ssm_cfg"]["layer"]
    (root / "config.json").write_text(json.dumps(cfg))


INDEX = "model.safetensors.index.json"


def _write(name: str, text: str):
    return lambda r: (r / name).write_text(text)


def _prefix_config(field: str):
    """config.json with `field` first: the same key later in the file would win, so a new key."""

    def damage(root: Path) -> None:
        text = (root / "config.json").read_text()
        (root / "config.json").write_text("{" + field + "," + text[1:])

    return damage


def _nan_weights(root: Path) -> None:
    sd = torch.load(root / "pytorch_model.bin")
    sd["backbone.embedding.weight"][0, 0] = float("nan")
    torch.save(sd, root / "pytorch_model.bin")


def _edit_weights(edit):
    """The .bin's state dict changed by `edit(sd)` (the official tied head is a view of the embedding:
    the edit decides whether it stays one)."""

    def damage(root: Path) -> None:
        sd = dict(torch.load(root / "pytorch_model.bin"))
        edit(sd)
        torch.save(sd, root / "pytorch_model.bin")

    return damage


def _untie_head(sd: dict) -> None:
    sd["lm_head.weight"] = sd["backbone.embedding.weight"].clone()
    sd["lm_head.weight"][0, 0] += 1


def _pickle_with_code(root: Path) -> None:
    """A pytorch_model.bin whose pickle would call a function when loaded without weights_only."""
    torch.save({"backbone.embedding.weight": torch.zeros(2), "x": _Exploit()}, root / "pytorch_model.bin")


class _Exploit:
    def __reduce__(self):
        return (print, ("this ran",))


def _index_names(target: str):
    def damage(root: Path) -> None:
        index = json.loads((root / "model.safetensors.index.json").read_text())
        index["weight_map"][next(iter(index["weight_map"]))] = target
        (root / "model.safetensors.index.json").write_text(json.dumps(index))

    return damage


BAD = {
    "no-config": ("bin", lambda r: (r / "config.json").unlink(), "no config.json"),
    "no-weights": ("bin", lambda r: (r / "pytorch_model.bin").unlink(), "no weights"),
    "truncated-bin": ("bin", _truncate("pytorch_model.bin"), "damaged or incomplete"),
    "bin-not-a-pickle": ("bin", _write("pytorch_model.bin", "not weights at all\n"), "is not a PyTorch file"),
    "bin-runs-code": ("bin", _pickle_with_code, "without running pickled code"),
    "truncated-safetensors": ("safetensors", _truncate("model.safetensors"), "damaged or incomplete"),
    "missing-shard": ("sharded", lambda r: (r / "model-00002-of-00002.safetensors").unlink(), "is missing"),
    "shape-disagrees": ("bin", _edit_config(d_intermediate=300), "has shape"),
    "tokenizer-too-large": (
        "bin", lambda r: word_tokenizer(r / "tokenizer.json", [*WORDS, *"abcdefgh"]), "29 token ids"
    ),
    # attention layers: mamba_ssm builds MHA(d_model, layer_idx=i, **attn_cfg), causal=False by default
    "attention-causal-absent": (
        "bin", _edit_config(attn_layer_idx=[1], attn_cfg={"num_heads": 4}), "attn_cfg.causal is absent"
    ),
    "attention-not-causal": (
        "bin", _edit_config(attn_layer_idx=[1], attn_cfg={"num_heads": 4, "causal": False}),
        "attn_cfg.causal is False",
    ),
    "attention-unknown-key": (
        "bin", _edit_config(attn_layer_idx=[1], attn_cfg={"num_heads": 4, "causal": True, "window_size": 8}),
        "attn_cfg has key 'window_size'",
    ),
    "attention-key-typo": (
        "bin", _edit_config(attn_layer_idx=[1], attn_cfg={"num_head": 4, "causal": True}),
        "did you mean `num_heads`?",
    ),
    "attention-width-does-not-add-up": (
        "bin", _edit_config(attn_layer_idx=[1], attn_cfg={"num_heads": 3, "causal": True}),
        "model.attn_cfg.num_heads: the width does not add up",
    ),
    "attention-layer-out-of-range": (
        "bin", _edit_config(attn_layer_idx=[2], attn_cfg={"num_heads": 4, "causal": True}),
        "model.attn_layer_idx: layer 2 is out of range",
    ),
    "hybrid-of-mamba2-layers": (
        "bin", _edit_config(attn_layer_idx=[1], attn_cfg={"num_heads": 4, "causal": True},
                            **{"ssm.layer": "Mamba2"}), "'Mamba2'",
    ),
    "attention-cfg-a-list": ("bin", _edit_config(attn_layer_idx=[1], attn_cfg=[4]), "attn_cfg must be"),
    # the weights of a pure model under a hybrid's config: layer 1 holds a Mamba-3 mixer, not attention
    "attention-weights-of-a-mamba-layer": (
        "bin", _edit_config(attn_layer_idx=[1], attn_cfg={"num_heads": 4, "causal": True}),
        "'backbone.layers.1.mixer.in_proj.weight' has shape (94, 16)",
    ),
    "mamba2": ("bin", _edit_config(**{"ssm.layer": "Mamba2"}), "'Mamba2'"),
    "mamba1-by-default": ("bin", _drop_layer_key, "'Mamba1' (the default when absent)"),
    "unknown-key": ("bin", _edit_config(new_thing=1), "unknown key 'new_thing'"),
    "unknown-ssm-key": ("bin", _edit_config(**{"ssm.d_conv": 4}), "unknown key 'd_conv'"),
    "layernorm": ("bin", _edit_config(rms_norm=False), "rms_norm"),
    "bad-value": ("bin", _edit_config(**{"ssm.headdim": 7}), "model.headdim"),
    "no-tokenizer": ("bin", lambda r: (r / "tokenizer.json").unlink(), "--tokenizer"),
    # The JSON files enter through the border reader (intake): each problem one error naming the file.
    "config-not-json": ("bin", lambda r: (r / "config.json").write_text("{"), "is not valid JSON"),
    "config-a-list": ("bin", lambda r: (r / "config.json").write_text("[]"), "not a valid model config"),
    "config-nan": ("bin", _edit_config(d_model=float("nan")), "config.json is not valid JSON"),
    "index-a-list": (
        "sharded", lambda r: (r / "model.safetensors.index.json").write_text("[1]"), "safetensors index"
    ),
    # the one reader (mamba3lite/intake.py) for every JSON file of the directory
    "config-huge-int": ("bin", _prefix_config('"x": ' + "9" * 5000), "5,000 digits"),
    "config-deeply-nested": ("bin", _prefix_config('"x": ' + "[" * 100_000), "nested too deeply"),
    "index-deeply-nested": ("sharded", _write(INDEX, "[" * 100_000), "nested too deeply"),
    "index-huge-int": ("sharded", _write(INDEX, '{"a": ' + "9" * 5000 + "}"), "5,000"),
    "index-names-an-absolute-path": ("sharded", _index_names("/dev/zero"), "is not a file directly in"),
    "tokenizer-deeply-nested": ("bin", _write("tokenizer.json", "[" * 100_000), "tokenizer.json"),
    # refused before the model is built (10**9 layers took hours) or written (generate would refuse it)
    "n-layer-huge": ("bin", _edit_config(n_layer=10**9), "the weights hold 2 layers"),
    "nan-weights": ("bin", _nan_weights, "holds NaN or infinite values"),
    # translate's checks, one each: a tensor outside the layout, missing, extra, a tied head that differs
    "foreign-tensor": (
        "bin", _edit_weights(lambda sd: sd.update(extra=torch.zeros(1))), "not part of a MambaLMHeadModel"
    ),
    "tensor-missing": (
        "bin", _edit_weights(lambda sd: sd.pop("backbone.norm_f.weight")), "norm_f.weight' is missing"
    ),
    "extra-tensor": (
        "bin", _edit_weights(lambda sd: sd.update({"backbone.norm_g.weight": torch.zeros(1)})), "has no place"
    ),
    "tied-head-differs": ("bin", _edit_weights(_untie_head), "lm_head.weight differs from the embedding"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD)
def test_bad_official_input_is_one_error_and_nothing_is_written(tmp_path, capsys, case):
    fmt, damage, words = BAD[case]
    src = write_official(tmp_path / "official", BASE, official_state_dict(BASE), fmt)
    damage(src)
    before = tree_digest(src)
    code = main(["import", str(src), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1 and err[0].startswith("error: ") and words in err[0], err
    assert "Traceback" not in err[0]
    assert not (tmp_path / "run").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["official"]  # no partial directory left
    assert tree_digest(src) == before


@pytest.mark.parametrize("command", ["import", "export"])
def test_existing_non_empty_out_is_refused_untouched(tmp_path, capsys, command):
    src = write_official(tmp_path / "official", BASE, official_state_dict(BASE), "bin")
    import_official(str(src), tmp_path / "run")
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("my own file")
    what = str(src) if command == "import" else str(tmp_path / "run")
    assert main([command, what, "--out", str(out)]) != 0
    err = capsys.readouterr().err
    assert "error: --out" in err and "not empty" in err
    assert [p.name for p in out.iterdir()] == ["mine.txt"] and (out / "mine.txt").read_text() == "my own file"


@pytest.mark.parametrize("command", ["import", "export"])
def test_out_that_is_a_file_or_a_broken_link_is_refused_by_the_one_rule(tmp_path, capsys, command):
    src = write_official(tmp_path / "official", BASE, official_state_dict(BASE), "bin")
    import_official(str(src), tmp_path / "run")
    what = str(src) if command == "import" else str(tmp_path / "run")
    afile = tmp_path / "afile"
    afile.write_text("mine")
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "nowhere")
    for out, said in ((afile, "is a file, not a directory"), (link, "is a broken symbolic link")):
        assert main([command, what, "--out", str(out)]) != 0
        assert f"error: --out {out} {said}" in capsys.readouterr().err
    assert afile.read_text() == "mine" and link.is_symlink() and not link.exists()


def test_export_refuses_what_the_official_model_cannot_do(tmp_path):
    model_cfg = tiny_config("x").model.__class__(**{**tiny_config("x").model.__dict__, "trapezoid": False})
    save_tiny_checkpoint(tmp_path / "run", model=Mamba3Transformer(model_cfg))
    meta = json.loads((tmp_path / "run" / "meta_step_5.json").read_text())
    CheckpointManager(tmp_path / "run").save(
        6,
        Mamba3Transformer(model_cfg),
        None,
        RunState(step=6, data=meta["data"], config=Config(model=model_cfg).to_dict()),
    )
    with pytest.raises(ConfigError, match=r"model\.trapezoid=false"):
        export_run(tmp_path / "run", tmp_path / "out", step=6)
    assert not (tmp_path / "out").exists()
    with pytest.raises(CheckpointError, match="no checkpoint of step 7"):
        export_run(tmp_path / "run", tmp_path / "out", step=7)


# --------------------------------------------------------------------------- the run dir in use
@pytest.mark.slow
def test_imported_run_works_with_generate_eval_inspect_and_export_cli(tmp_path, capsys):
    src = write_official(tmp_path / "official", BASE, official_state_dict(BASE), "bin")
    assert main(["import", str(src), "--out", str(tmp_path / "run"), "--a-activation", "softplus"]) == 0
    out = capsys.readouterr().out
    assert "A activation: softplus" in out and "tokens_seen is 0" in out
    assert main(["generate", "--checkpoint-dir", str(tmp_path / "run"), "--prompt", "w1 w2",
                 "--max-new-tokens", "5", "--device", "cpu"]) == 0  # fmt: skip
    assert capsys.readouterr().out.startswith("w1 w2")
    # an imported run's max_seq_len is 2048 (the released models' context): eval windows that long
    data = _word_dataset(tmp_path / "data", tmp_path / "run" / "tokenizer.json", n_train=2100, n_val=2100)
    assert main(["eval", "--checkpoint-dir", str(tmp_path / "run"), "--data-path", str(data), "--json",
                 "--device", "cpu"]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)["loss"] > 0
    assert main(["inspect", str(tmp_path / "run")]) == 0
    shown = capsys.readouterr().out
    assert "A softplus" in shown and "imported from" in shown
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "exported")]) == 0
    assert "softplus" in capsys.readouterr().out  # the official code's A differs: said on export
    assert "softplus" in (tmp_path / "exported" / "README.md").read_text()


def test_an_imported_run_still_generates_after_it_is_moved(tmp_path, capsys):
    # The meta records the tokenizer copy relative to the run directory, so neither the old place of the
    # run nor the source directory is needed any more.
    src = write_official(tmp_path / "official", BASE, official_state_dict(BASE), "bin")
    import_official(str(src), tmp_path / "run")
    meta = json.loads((tmp_path / "run" / "meta_step_0.json").read_text())
    assert meta["data"]["tokenizer"] == "tokenizer.json"
    shutil.move(tmp_path / "run", tmp_path / "moved")
    shutil.rmtree(src)
    assert main(["generate", "--checkpoint-dir", str(tmp_path / "moved"), "--prompt", "w1 w2",
                 "--max-new-tokens", "3", "--device", "cpu"]) == 0  # fmt: skip
    assert capsys.readouterr().out.startswith("w1 w2")
    assert main(["inspect", str(tmp_path / "moved")]) == 0
    assert f"tokenizer      {tmp_path / 'moved' / 'tokenizer.json'}" in capsys.readouterr().out
    assert main(["export", str(tmp_path / "moved"), "--out", str(tmp_path / "exported")]) == 0
    assert (tmp_path / "exported" / "tokenizer.json").read_bytes() == (
        tmp_path / "moved" / "tokenizer.json"
    ).read_bytes()


def test_a_recorded_tokenizer_path_resolves_against_the_run_directory(tmp_path):
    from mamba3lite.pretrained import recorded_tokenizer

    assert recorded_tokenizer("tokenizer.json", tmp_path) == str(tmp_path / "tokenizer.json")
    trained = "/data/tok/tokenizer.json"  # a trained run records the prepared data's tokenizer, absolute
    assert recorded_tokenizer(trained, tmp_path) == trained
    assert recorded_tokenizer("gpt2", tmp_path) == recorded_tokenizer(None, tmp_path) == "gpt2"


def _word_dataset(root: Path, tokenizer: Path, n_train: int = 600, n_val: int = 80) -> Path:
    from mamba3lite.data.shards import write_dataset
    from mamba3lite.tokenizer import load_tokenizer

    tok = load_tokenizer(str(tokenizer))
    rng = np.random.default_rng(0)
    parts = []
    for split, n in (("train", n_train), ("val", n_val)):
        ids = rng.integers(1, len(WORDS), n)
        ids[::17] = tok.eos_id
        parts.append((split, ids, int((ids == tok.eos_id).sum()), 3 * n))
    write_dataset(root, parts, vocab_size=tok.vocab_size, eos_id=tok.eos_id,
                  tokenizer={"name": tok.name, "vocab_hash": tok.vocab_hash})  # fmt: skip
    return root


def _train_args(data: Path, run: Path, source: Path) -> list[str]:
    return [
        "train", "--config", "tiny", "--data-path", str(data), "--checkpoint-dir", str(run),
        "--init-from", str(source), "--set", "training.max_seq_len=16",
        "--set", "training.micro_batch_size=2", "--set", "training.global_batch_size=2",
        "--set", "training.warmup_steps=1",
        "--set", "training.progress=false", "--set", "training.eval_every=0", "--set", "training.device=cpu",
    ]  # fmt: skip


def test_train_init_from_starts_a_fresh_run_from_the_weights(tmp_path, capsys):
    from mamba3lite.cli import build_parser
    from mamba3lite.commands import train as train_cmd
    from mamba3lite.train.entry import init_from_source

    src = write_official(tmp_path / "official", BASE, official_state_dict(BASE, dtype=torch.float32), "bin")
    import_official(str(src), tmp_path / "imported")
    data = _word_dataset(tmp_path / "data", tmp_path / "imported" / "tokenizer.json")
    args = _train_args(data, tmp_path / "new", tmp_path / "imported")
    ns = build_parser().parse_args(args)
    cfg, model = init_from_source(train_cmd.build_config(ns), train_cmd.train_options(ns))
    source = load_f64(tmp_path / "imported")
    for (k, a), b in zip(model.state_dict().items(), source.state_dict().values()):
        assert torch.equal(a.to(F64), b), k
    assert cfg.model == source.cfg
    capsys.readouterr()

    assert main([*args, "--max-steps", "2"]) == 0
    meta = CheckpointManager(tmp_path / "new").read_meta(2)
    assert meta["tokens_seen"] == 2 * 2 * 16 and meta["scheduler"]["step"] == 2
    assert meta["config"]["model"] == Config(model=source.cfg).to_dict()["model"]
    assert "init-from" in capsys.readouterr().out
    # The run explains itself: its resolved config names the source (training.init_from).
    from mamba3lite.config import load_config

    assert load_config(str(tmp_path / "new" / "config.yaml")).training.init_from == str(tmp_path / "imported")
    assert meta["config"]["training"]["init_from"] == str(tmp_path / "imported")

    # --set training.init_from=X is the flag under another name: the same config, the same weights
    flag_free = [a for a in args if a not in ("--init-from", str(tmp_path / "imported"))]
    ns_set = build_parser().parse_args([*flag_free, "--set", f"training.init_from={tmp_path / 'imported'}"])
    assert ns_set.init_from is None
    cfg_set, model_set = init_from_source(train_cmd.build_config(ns_set), train_cmd.train_options(ns_set))
    assert cfg_set == cfg and cfg_set.training.init_from == str(tmp_path / "imported")
    for (k, a), b in zip(model_set.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), k

    # --set model.* applies on top of the source's config (here the A activation)
    ns = build_parser().parse_args([*args, "--set", "model.a_activation=softplus"])
    cfg, _ = init_from_source(train_cmd.build_config(ns), train_cmd.train_options(ns))
    assert cfg.model.a_activation == "softplus" and cfg.model.d_model == source.cfg.d_model

    # a dataset tokenized with GPT-2 is refused, naming the tokenizer, before anything is written
    from userside_helpers import make_dataset

    gpt2_data = make_dataset(tmp_path / "gpt2data")
    code = main([*_train_args(gpt2_data, tmp_path / "other", tmp_path / "imported"), "--max-steps", "2"])
    err = capsys.readouterr().err
    assert code != 0 and "error:" in err and "prepare --tokenizer" in err, err
    assert not (tmp_path / "other").exists()


def test_a_run_started_from_init_from_resumes_without_its_source(tmp_path, capsys):
    """The same command re-run after the source moved (a cleared hub cache, a deleted directory): the run
    resumes from its own checkpoint, which holds the weights, with the model config recorded there."""
    src = write_official(tmp_path / "official", BASE, official_state_dict(BASE, dtype=torch.float32), "bin")
    import_official(str(src), tmp_path / "imported")
    # The data's tokenizer file stays where the data names it (outside the source that moves): a tokenizer
    # cached by path used to hide, in this one process, that the data's was gone.
    shutil.copy(tmp_path / "imported" / "tokenizer.json", tmp_path / "tokenizer.json")
    data = _word_dataset(tmp_path / "data", tmp_path / "tokenizer.json")
    args = _train_args(data, tmp_path / "new", tmp_path / "imported")
    assert main([*args, "--max-steps", "2"]) == 0
    capsys.readouterr()
    (tmp_path / "imported").rename(tmp_path / "moved")
    assert main([*args, "--max-steps", "4"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "not loaded" in out and "checkpoint step 2" in out, out
    ckpt = CheckpointManager(tmp_path / "new")
    assert ckpt.list_steps()[-1] == 4
    assert ckpt.read_meta(4)["config"]["model"] == ckpt.read_meta(2)["config"]["model"]
    assert ckpt.read_meta(4)["tokens_seen"] == 4 * 2 * 16  # continued, not restarted
    # a fresh run (another directory) still needs the source, and says so
    code = main([*_train_args(data, tmp_path / "fresh", tmp_path / "imported"), "--max-steps", "2"])
    err = capsys.readouterr().err
    assert code != 0 and str(tmp_path / "imported") in err and not (tmp_path / "fresh").exists(), err


def test_init_from_an_official_directory_translates_it_as_import_does(tmp_path):
    from mamba3lite.interop.init_from import load_init_source

    src = write_official(tmp_path / "official", BASE, official_state_dict(BASE), "sharded")
    import_official(str(src), tmp_path / "run")
    imported = load_f64(tmp_path / "run")
    source = load_init_source(str(src))
    assert source.config == imported.cfg
    assert source.vocab_hash == hashlib.sha256((src / "tokenizer.json").read_bytes()).hexdigest()
    model = source.build_model(source.config)
    for (k, a), b in zip(model.state_dict().items(), imported.state_dict().values()):
        assert torch.equal(a.to(F64), b.to(torch.float32).to(F64)), k
    with pytest.raises(CheckpointError, match="neither a run directory"):
        load_init_source(str(tmp_path))


def test_import_and_init_from_read_the_document_start_from_the_checkpoints_tokenizer(tmp_path, capsys):
    """An official directory whose tokenizer.json starts a text with a BOS ("<s>", id 1) other than its EOS:
    the imported run, and a run started with --init-from it on data tokenized by that tokenizer, feed
    [BOS] + ids to generate and serve (the tokenizer's `bos_id`), and inspect says which start it is."""
    from mamba3lite.pretrained import load_pretrained
    from mamba3lite.tokenizer import start_template

    src = write_official(
        tmp_path / "official", BASE, official_state_dict(BASE, dtype=torch.float32), tokenizer=False
    )
    path = word_tokenizer(src / "tokenizer.json", ["<|endoftext|>", "<s>", *WORDS[2:]])
    spec = json.loads(path.read_text())
    spec["post_processor"] = start_template("<s>", 1)
    path.write_text(json.dumps(spec))
    import_official(str(src), tmp_path / "imported")
    assert load_pretrained(tmp_path / "imported").load_tokenizer().bos_id == 1
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "imported")]) == 0
    assert "doc start      id 1, a BOS '<s>' (id 1)" in capsys.readouterr().out

    data = _word_dataset(tmp_path / "data", path)
    assert main([*_train_args(data, tmp_path / "new", src), "--max-steps", "1"]) == 0
    assert load_pretrained(tmp_path / "new").load_tokenizer().bos_id == 1


def test_bf16_weights_keep_their_dtype_and_load_widened(tmp_path):
    from mamba3lite.pretrained import load_pretrained

    sd = official_state_dict(BASE, dtype=torch.bfloat16)
    sd["backbone.layers.0.mixer.dt_bias"] = sd[
        "backbone.layers.0.mixer.dt_bias"
    ].float()  # mixed, as official
    src = write_official(tmp_path / "official", BASE, sd, "safetensors")
    import_official(str(src), tmp_path / "run")
    loaded = load_pretrained(tmp_path / "run")
    assert loaded.model.embed.weight.dtype == torch.float32
    assert torch.equal(loaded.model.embed.weight, sd["backbone.embedding.weight"][: len(WORDS)].float())
    export_run(tmp_path / "run", tmp_path / "out")
    back = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    for name, t in sd.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name


def test_import_command_choices_are_the_model_s():
    from mamba3lite.commands import import_ as cmd
    from mamba3lite.interop import import_
    from mamba3lite.model.config import A_ACTIVATIONS

    assert cmd.A_ACTIVATIONS == A_ACTIVATIONS and cmd.DEFAULT_A_ACTIVATION == import_.DEFAULT_A_ACTIVATION


def test_export_of_an_import_refuses_changed_padding_rows(tmp_path):
    src = write_official(tmp_path / "official", BASE, official_state_dict(BASE), "bin")
    import_official(str(src), tmp_path / "run")
    pad = tmp_path / "run" / "official_padding.safetensors"
    data = bytearray(pad.read_bytes())
    data[-1] ^= 0xFF
    pad.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="padded embedding rows"):
        export_run(tmp_path / "run", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_export_refuses_a_run_without_a_usable_tokenizer(tmp_path):
    src = write_official(tmp_path / "official", BASE, official_state_dict(BASE), "bin")
    import_official(str(src), tmp_path / "run")
    (tmp_path / "run" / "tokenizer.json").write_text("{}")  # edited after the import
    with pytest.raises(CheckpointError, match="changed since the model was trained"):
        export_run(tmp_path / "run", tmp_path / "out")
    (tmp_path / "run" / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="not there any more"):
        export_run(tmp_path / "run", tmp_path / "out")
    # a --dummy run of another vocabulary records no tokenizer: nothing to ship with it
    cfg = tiny_config(tmp_path / "dummy").model.__class__(
        **{**tiny_config("x").model.__dict__, "vocab_size": 300, "eos_id": 0}
    )
    CheckpointManager(tmp_path / "dummy").save(
        1, Mamba3Transformer(cfg), None, RunState(step=1, config=Config(model=cfg).to_dict())
    )
    with pytest.raises(CheckpointError, match="records no tokenizer"):
        export_run(tmp_path / "dummy", tmp_path / "out")
    assert not (tmp_path / "out").exists()
