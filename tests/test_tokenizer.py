"""The offline GPT-2 tokenizer: known ids, round trips, clear errors."""

from __future__ import annotations

import re

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


def test_a_tokenizer_path_that_is_no_regular_file_is_named_for_what_it_is(tmp_path):
    """A directory, a FIFO (never opened: no hang) or a device behind the name: one ConfigError saying
    what the path is, not "not found"."""
    import os

    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    (tmp_path / "dir.json").mkdir()
    (tmp_path / "zero.json").symlink_to("/dev/zero")
    for name, what in (
        ("fifo.json", "a named pipe"),
        ("dir.json", "a directory"),
        ("zero.json", "a character device"),
    ):
        with pytest.raises(ConfigError, match=f"is {what}.*must be a regular file"):
            load_tokenizer(str(tmp_path / name))


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


def test_a_recorded_tokenizer_is_loaded_by_one_rule(tmp_path):
    """What train, generate and eval refuse alike: a tokenizer file gone, a name not known, another
    vocabulary size or hash."""
    from mamba3lite.errors import CheckpointError
    from mamba3lite.tokenizer import load_recorded_tokenizer

    gpt2 = load_tokenizer("gpt2")
    kw = {"subject": "the data was prepared with", "error": CheckpointError}
    assert load_recorded_tokenizer("gpt2", gpt2.vocab_hash, 50257, **kw) is gpt2
    cases = [
        (str(tmp_path / "tokenizer.json"), None, None, "tokenizer.json, which is not there any more"),
        ("bytes", None, None, "tokenizer bytes, which cannot be loaded here: unknown tokenizer"),
        ("gpt2", None, 512, "which has 50257 tokens, and vocab_size is 512"),
        ("gpt2", "ab" * 32, None, f"vocab hash abababababab, the one here has {gpt2.vocab_hash[:12]}"),
    ]
    for name, vocab_hash, vocab_size, message in cases:
        with pytest.raises(CheckpointError, match=re.escape(message)):
            load_recorded_tokenizer(name, vocab_hash, vocab_size, **kw)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot be loaded here: cannot read tokenizer file"):
        load_recorded_tokenizer(str(tmp_path / "tokenizer.json"), None, None, **kw)
