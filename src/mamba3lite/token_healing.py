"""Token healing: a prompt that ends inside what would be one token is continued as if it had not.

A BPE encodes "def " as "def" + " ": the model has rarely seen a lone " " token followed by a word
(" main" is one token), so after it it predicts what follows a lone space in training, a run of
whitespace. Healing (as in the guidance library and transformers' `token_healing`) backs up the prompt's
last token(s) and makes the first sampled token(s) spell the removed text again, so the model chooses
how the prompt's end is tokenized: "def" then " main(".

    kept_ids, removed = heal_prompt(prompt_ids, token_table(tokenizer))
    constraint = HealingConstraint(token_table(tokenizer), removed)   # removed: bytes
    while constraint.active: logits = constraint.mask(logits); ...; constraint.advance(token)

`heal_prompt` backs up the last token, then more while the text removed so far, with the token before it
prepended, is still the start of some vocabulary token (at most MAX_BACKED_UP tokens), never a special
token (the EOS that starts a document) and never so that the removed text starts inside a UTF-8
character. The constraint allows, while `remaining` bytes of the removed text are still to be spelled,
the tokens whose bytes start with `remaining` (they finish it, and go on) and the tokens that are a
proper prefix of it (they spell part of it). Everything works on bytes: a byte-level BPE's tokens are
byte strings (a character may be split across two).

The token → bytes table is built once per tokenizer (`token_table` is cached) and answers both
questions by binary search in the sorted byte strings.
"""

from __future__ import annotations

import bisect
import functools

import torch

MAX_BACKED_UP = 4  # tokens; guidance backs up the ones that could merge, a handful at most


class TokenTable:
    """A tokenizer's ids as byte strings, sorted for prefix queries. `bytes_of[i]` is None for ids that
    never match text (special tokens, unused ids)."""

    def __init__(self, bytes_of: list[bytes | None]) -> None:
        self.bytes_of = bytes_of
        pairs = sorted((b, i) for i, b in enumerate(bytes_of) if b)
        self._sorted = [b for b, _ in pairs]
        self._ids = [i for _, i in pairs]
        self._id_of: dict[bytes, int] = {}
        for b, i in pairs:
            self._id_of.setdefault(b, i)

    def starting_with(self, prefix: bytes) -> list[int]:
        """Ids of the tokens whose bytes start with `prefix` (`prefix` itself included)."""
        lo = bisect.bisect_left(self._sorted, prefix)
        hi = lo
        # The tokens starting with prefix are contiguous in sorted order; find the end by galloping.
        step = 1
        while hi + step <= len(self._sorted) and self._sorted[hi + step - 1].startswith(prefix):
            hi += step
            step *= 2
        while step > 1:
            step //= 2
            if hi + step <= len(self._sorted) and self._sorted[hi + step - 1].startswith(prefix):
                hi += step
        return self._ids[lo:hi]

    def proper_prefixes_of(self, text: bytes) -> list[int]:
        """Ids of the tokens that are a non-empty proper prefix of `text`."""
        return [self._id_of[text[:k]] for k in range(1, len(text)) if text[:k] in self._id_of]

    def allowed(self, remaining: bytes) -> list[int]:
        """The tokens that may come next while `remaining` is still to be spelled."""
        return self.starting_with(remaining) + self.proper_prefixes_of(remaining)


@functools.lru_cache(maxsize=8)
def token_table(tokenizer) -> TokenTable | None:
    """The tokenizer's TokenTable, built once (cached per tokenizer object; `load_tokenizer` returns one
    object per tokenizer); None when its tokens are not byte strings (`Tokenizer.token_bytes`), and then
    there is no healing."""
    get = getattr(tokenizer, "token_bytes", None)
    bytes_of = get() if get is not None else None
    return TokenTable(bytes_of) if bytes_of is not None else None


def _starts_a_character(data: bytes) -> bool:
    return not data or (data[0] & 0xC0) != 0x80  # not a UTF-8 continuation byte


def heal_prompt(prompt_ids: list[int], table: TokenTable | None) -> tuple[list[int], bytes]:
    """(the prompt ids to feed, the bytes of the text removed from its end) for token healing; the
    prompt unchanged and b"" when there is nothing to heal (no table, an empty prompt, a prompt ending
    in a special token). See the module docstring for the rule."""
    if table is None:
        return list(prompt_ids), b""
    cut, removed = len(prompt_ids), b""
    while cut > 0 and len(prompt_ids) - cut < MAX_BACKED_UP:
        piece = table.bytes_of[prompt_ids[cut - 1]] if prompt_ids[cut - 1] < len(table.bytes_of) else None
        if piece is None:
            break
        candidate = piece + removed
        if removed and _starts_a_character(removed) and not table.starting_with(candidate):
            break  # the token before would not merge with the removed text
        cut, removed = cut - 1, candidate
    if not _starts_a_character(removed) or not removed or not table.allowed(removed):
        return list(prompt_ids), b""  # cannot cut on a character boundary here: no healing
    return list(prompt_ids[:cut]), removed


class HealingConstraint:
    """Which tokens may be sampled while the removed text is being spelled again (`remaining`)."""

    def __init__(self, table: TokenTable | None, removed: bytes) -> None:
        assert table is not None or not removed
        self.table = table
        self.remaining = removed

    @property
    def active(self) -> bool:
        return bool(self.remaining)

    def mask(self, logits_BV: torch.Tensor) -> torch.Tensor:
        """`logits_BV` with every token that cannot come next at -inf (unchanged once inactive)."""
        if not self.remaining:
            return logits_BV
        assert self.table is not None
        allowed = torch.tensor(self.table.allowed(self.remaining), dtype=torch.long, device=logits_BV.device)
        masked_BV = torch.full_like(logits_BV, float("-inf"))
        masked_BV[:, allowed] = logits_BV[:, allowed]
        return masked_BV

    def advance(self, token: int) -> None:
        """Account for the sampled `token` (one the mask allowed)."""
        if not self.remaining:
            return
        assert self.table is not None
        piece = self.table.bytes_of[token]
        assert piece is not None, token
        if piece.startswith(self.remaining):
            self.remaining = b""
        else:
            assert self.remaining.startswith(piece), (piece, self.remaining)
            self.remaining = self.remaining[len(piece) :]
