"""Fitting a byte-level BPE to a corpus (`mamba3lite prepare --train-tokenizer N`).

`train_bpe(texts, n_ids)` returns the bytes of a Hugging Face `tokenizer.json` with exactly `n_ids` ids:
the special token `<|endoftext|>` (EOS, id 0), the 256 byte symbols, then `n_ids - 257` merges learned
from `texts` with the `tokenizers` library's BPE trainer. Byte-level, so every string round-trips
(decode(encode(x)) == x) and no text is ever unknown.

Pre-tokenization (the pieces a merge never crosses), written for code as much as prose:

    "        "            a run of two or more spaces (indentation, alignment), all of them: so
                          "        return" is "        " + "return", and every line indented 8 deep
                          starts with the same token
    'll 's ...            English contractions, as GPT-2
    " foo_bar2"           an identifier or word, with its one leading space (as GPT-2), `_` and digits
    " 123"                a run of digits, with its leading space
    " ()."                a run of punctuation, with its leading space
    "\\n\\n"                a run of newlines
    " " "\\t\\t"            a lone space (before a newline, a tab, the end), other whitespace runs (tabs)

Deterministic: the trainer's merges are ranked by count, ties broken by the pair's ids, and the word
counts do not depend on the order texts arrive in or on the number of threads (checked by the tests,
with and without `TOKENIZERS_PARALLELISM`). The same texts and `n_ids` give byte-identical JSON.
"""

from __future__ import annotations

from collections.abc import Iterable

from mamba3lite.errors import ConfigError, DataError

EOS_TOKEN = "<|endoftext|>"
N_BYTE_SYMBOLS = 256
# 256 byte symbols + EOS + at least one merge: with no merge the "BPE" is a byte tokenizer.
MIN_TRAINED_IDS = N_BYTE_SYMBOLS + 2
# A pair seen once is a memorised accident of the sample, not a unit of the language.
MIN_PAIR_FREQUENCY = 2

PRETOKENIZE_PATTERN = (
    r" {2,}"
    r"|'(?:[sdmt]|ll|ve|re)"
    r"| ?[\p{L}_][\p{L}\p{N}_]*"
    r"| ?\p{N}+"
    r"| ?[^\s\p{L}\p{N}_]+"
    r"|\n+"
    r"| "
    r"|[^\S\n ]+"
)


def trained_eos_id() -> int:
    """EOS's id in a tokenizer `train_bpe` made: the trainer puts special tokens first."""
    return 0


def check_n_ids(n_ids: int) -> None:
    """ConfigError for a --train-tokenizer value that cannot be a byte-level BPE."""
    if n_ids < MIN_TRAINED_IDS:
        raise ConfigError(
            f"--train-tokenizer {n_ids} is too small: a byte-level BPE needs {N_BYTE_SYMBOLS} byte "
            f"symbols + EOS + at least one merge, so at least {MIN_TRAINED_IDS} ids (e.g. 8192)"
        )


def require_tokenizers():
    """The `tokenizers` package, or a ConfigError with the install hint."""
    try:
        import tokenizers
    except ImportError as e:
        raise ConfigError(
            "--train-tokenizer needs the `tokenizers` package; fix: pip install 'mamba3lite[hf]'"
        ) from e
    return tokenizers


def empty_bpe():
    """An untrained byte-level BPE with this module's pre-tokenizer and decoder (a `tokenizers.Tokenizer`)."""
    tk = require_tokenizers()
    from tokenizers import decoders, models, pre_tokenizers

    tok = tk.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(tk.Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def train_bpe(texts: Iterable[str], n_ids: int) -> bytes:
    """The tokenizer.json (UTF-8 bytes) of a byte-level BPE of exactly `n_ids` ids fit to `texts`.

    ConfigError for `n_ids` below MIN_TRAINED_IDS; DataError when the texts cannot form that many
    (the trainer stops when no pair occurs MIN_PAIR_FREQUENCY times): the message says how many they
    can form."""
    check_n_ids(n_ids)
    require_tokenizers()
    from tokenizers import pre_tokenizers, trainers

    tok = empty_bpe()
    trainer = trainers.BpeTrainer(
        vocab_size=n_ids,
        min_frequency=MIN_PAIR_FREQUENCY,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    got = tok.get_vocab_size(with_added_tokens=True)
    if got < n_ids:
        raise DataError(
            f"--train-tokenizer {n_ids}: the train split's text can form only {got} ids (no pair of "
            f"tokens occurs {MIN_PAIR_FREQUENCY} times beyond that); pass --train-tokenizer {got} or "
            "less, or add text"
        )
    assert got == n_ids and tok.token_to_id(EOS_TOKEN) == trained_eos_id(), (got, tok.token_to_id(EOS_TOKEN))
    return tok.to_str().encode("utf-8")
