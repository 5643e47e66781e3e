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


def tiktoken_twin(spec: dict, byte_of: dict[str, int]):
    """A `tiktoken.Encoding` that encodes ordinary text exactly as the tokenizer.json `spec` does, when
    `spec` is one `train_bpe` makes (this pre-tokenizer, a byte-level BPE without dropout or other
    options, merges in the order of the ids they create), else None. `byte_of`: GPT-2's printable
    character -> byte map. tiktoken encodes ~14x faster than `tokenizers` (10.7 vs 0.74 MB/s on the stdlib
    corpus, one thread) and gives the same ids: a BPE whose merge k creates id `first + k` is applied
    either by merge rank (HF) or by the rank of the merged token (tiktoken), which is the same order.
    The tests check the two agree (the stdlib corpus, arbitrary Unicode)."""
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    ours = [
        {"type": "Split", "pattern": {"Regex": PRETOKENIZE_PATTERN}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False},
    ]
    plain = {"type": "BPE", "dropout": None, "unk_token": None, "fuse_unk": False, "byte_fallback": False}
    if (
        spec.get("normalizer") is not None
        or not isinstance(steps, list)
        or len(steps) != 2
        or any({k: s.get(k) for k in want} != want for s, want in zip(steps, ours))
        or {k: model.get(k) for k in plain} != plain
        or model.get("ignore_merges")
        or model.get("continuing_subword_prefix")
        or model.get("end_of_word_suffix")
    ):
        return None
    return _twin_from_ranks(model, spec.get("added_tokens") or [], byte_of)


def _twin_from_ranks(model: dict, added: list, byte_of: dict[str, int]):
    """The tiktoken twin of a plain byte-level BPE `model`, or None when its ids are not its merge order."""
    vocab, merges = model.get("vocab") or {}, model.get("merges") or []
    specials = {t["content"]: t["id"] for t in added if t.get("special")}
    if len(specials) != len(added) or any(vocab.get(t, i) != i for t, i in specials.items()):
        return None
    ranks = {}
    for text, i in vocab.items():
        if text not in specials:
            if not all(c in byte_of for c in text):
                return None
            ranks[bytes(byte_of[c] for c in text)] = i
    pairs = [m.split(" ", 1) if isinstance(m, str) else m for m in merges]
    first = len(vocab) - len(pairs)
    singles = [i for b, i in ranks.items() if len(b) == 1]
    if len(singles) != N_BYTE_SYMBOLS or max(singles) >= first or len(ranks) != len(vocab) - len(specials):
        return None
    if any(vocab.get(a + b) != first + k for k, (a, b) in enumerate(pairs)):
        return None
    import tiktoken

    return tiktoken.Encoding("mamba3lite-bpe", pat_str=PRETOKENIZE_PATTERN, mergeable_ranks=ranks,
                             special_tokens=specials)  # fmt: skip
