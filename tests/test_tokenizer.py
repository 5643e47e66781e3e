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


def _word_tokenizer_json(post_processor=None) -> bytes:
    """A word-level tokenizer.json as `tokenizers` writes it (EOS id 0), with `post_processor`."""
    tokenizers = pytest.importorskip("tokenizers")
    words = ["<|endoftext|>", "<s>", "<unk>", "def", "add"]
    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>")
    )
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|endoftext|>", "<s>"])
    if post_processor is not None:
        tok.post_processor = post_processor
    return tok.to_str().encode("utf-8")


def test_the_document_start_is_put_in_and_taken_out_byte_for_byte():
    """An export's tokenizer.json starts a text with the EOS; import gets the run's bytes back (so the
    vocabulary hash); a file that adds a start of its own is read as it is and left alone."""
    import json

    from tokenizers import Tokenizer, processors

    from mamba3lite.tokenizer import document_start, with_document_start, without_document_start

    raw = _word_tokenizer_json()
    assert document_start(json.loads(raw)) is None
    started = with_document_start(raw, "<|endoftext|>", 0)
    assert Tokenizer.from_str(started.decode()).encode("def add").ids == [0, 3, 4]
    assert Tokenizer.from_str(started.decode()).encode("def add", add_special_tokens=False).ids == [3, 4]
    assert document_start(json.loads(started)) == ("<|endoftext|>", 0)
    assert without_document_start(started, 0) == raw
    assert without_document_start(raw, 0) == raw
    # a post-processor that adds nothing before the text (byte-level offsets) keeps its work, then the start
    byte_level = _word_tokenizer_json(processors.ByteLevel(trim_offsets=False))
    sequenced = with_document_start(byte_level, "<|endoftext|>", 0)
    assert Tokenizer.from_str(sequenced.decode()).encode("def").ids == [0, 3]
    assert document_start(json.loads(sequenced)) == ("<|endoftext|>", 0)
    # a BOS of the tokenizer's own ("<s> $A"): that is the start, and no file of that kind is rewritten
    bos = _word_tokenizer_json(processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)]))
    assert document_start(json.loads(bos)) == ("<s>", 1)
    assert without_document_start(bos, 0) == bos
    roberta = _word_tokenizer_json(processors.RobertaProcessing(("</s>", 0), ("<s>", 1)))
    assert document_start(json.loads(roberta)) == ("<s>", 1)
