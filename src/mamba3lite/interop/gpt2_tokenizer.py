"""Our GPT-2 vocabulary as a Hugging Face `tokenizer.json`, built offline from the packaged files.

`mamba3lite.tokenizer.GPT2Tokenizer` encodes with tiktoken from `encoder.json` + GPT-2's
pre-tokenisation pattern, and treats `<|endoftext|>` in text as ordinary text (documents are separated
by the id 50,256 that `prepare` inserts, never by text). The file built here encodes exactly alike:
a byte-level BPE over the same vocabulary and merge list (`vocab.bpe`), with the byte-level
pre-tokenizer, whose split pattern is GPT-2's. `<|endoftext|>` is in the vocabulary (id 50,256, so
readers find the EOS) but is not an "added token", so the text "<|endoftext|>" is split and merged
like any text, as ours.
"""

from __future__ import annotations

import json

from mamba3lite import intake
from mamba3lite.tokenizer import GPT2_EOS_ID, gpt2_encoder, gpt2_vocab_dir, without_document_start


def gpt2_tokenizer_json() -> str:
    """The tokenizer.json text for GPT-2 (needs the `tokenizers` package)."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    except ImportError:
        from mamba3lite.errors import ConfigError

        raise ConfigError(
            "writing tokenizer.json needs the `tokenizers` package; fix: pip install 'mamba3lite[hf]'"
        ) from None
    vocab = gpt2_encoder()
    assert vocab.get("<|endoftext|>") == GPT2_EOS_ID
    lines = intake.read_text_capped(gpt2_vocab_dir() / "vocab.bpe", intake.TOKENIZER).splitlines()
    merges = [tuple(line.split(" ")) for line in lines[1:] if line]  # line 0: "#version: 0.2"
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str(pretty=False)


def is_gpt2_tokenizer_json(text: str) -> bool:
    """Whether a tokenizer.json encodes as our GPT-2: the same vocabulary and merges, the byte-level
    pre-tokenizer, no normalizer and no added tokens (which would match text that ours does not); its
    post-processor adds nothing, or the EOS before a text (an export's: `tokenizer.with_document_start`)."""
    try:
        got = json.loads(without_document_start(text.encode("utf-8"), GPT2_EOS_ID))
        want = json.loads(gpt2_tokenizer_json())
    except (ValueError, RecursionError, ImportError):  # not JSON, too deep, or no `tokenizers`: not ours
        return False
    if not isinstance(got, dict) or not isinstance(got.get("model"), dict):
        return False
    keys = ("normalizer", "pre_tokenizer", "added_tokens", "post_processor")
    return all(got.get(k) == want.get(k) for k in keys) and all(
        got["model"].get(k) == want["model"].get(k) for k in ("type", "vocab", "merges", "byte_fallback")
    )
