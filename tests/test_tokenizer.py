"""The offline GPT-2 tokenizer: known ids, round trips, clear errors."""

from __future__ import annotations

import pytest

from mamba3lite.errors import ConfigError
from mamba3lite.tokenizer import GPT2_EOS_ID, GPT2_VOCAB_SIZE, load_tokenizer


def test_gpt2_known_ids():
    tok = load_tokenizer("gpt2")
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.vocab_size == GPT2_VOCAB_SIZE == 50_257
    assert tok.eos_id == GPT2_EOS_ID == 50_256
    assert len(tok.vocab_hash) == 64


def test_gpt2_round_trip_and_no_special_tokens():
    tok = load_tokenizer("gpt2")
    text = "def f(x):\n\treturn x ** 2  # ünïcödé ✓\n<|endoftext|>"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert GPT2_EOS_ID not in ids  # the literal string is text, never the EOS id
    assert tok.encode_batch([text, "a"]) == [ids, tok.encode("a")]


def test_unknown_tokenizer_names_the_choices():
    with pytest.raises(ConfigError, match=r"unknown tokenizer 'gpt5'.*gpt2"):
        load_tokenizer("gpt5")


def test_missing_tokenizer_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_tokenizer(str(tmp_path / "tokenizer.json"))


def test_hf_tokenizer_json(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    t = tokenizers.Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.add_special_tokens(["</s>"])
    path = tmp_path / "tokenizer.json"
    t.save(str(path))
    tok = load_tokenizer(str(path))
    assert tok.encode("a b a") == [0, 1, 0]
    assert tok.eos_id == 3
    assert tok.vocab_size == 4
