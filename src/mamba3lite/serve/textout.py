"""Generated tokens to text, piece by piece, with stop strings matched across token boundaries.

`TokenText` decodes only the tokens since the last complete piece, behind a few context tokens whose
text is cut off again (so decoders that drop a word marker's space at the start do not glue pieces
together, and the cost stays linear). A piece ends on a complete character: a trailing U+FFFD from a
byte sequence split between tokens is held back until the next token completes it.

`StopMatcher` sees the text as it grows and holds back the longest tail that could still become the
start of a stop string, so a stop string split over two or more tokens is found, and is never emitted:
the output is the text before the first occurrence of any stop string.
"""

from __future__ import annotations

from mamba3lite.tokenizer import Tokenizer

CONTEXT_TOKENS = 8


class TokenText:
    """Tokens to text pieces; `add(token)` returns the text that token completed ("" if none yet)."""

    def __init__(self, tokenizer: Tokenizer, context_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        ids = list(context_ids[-CONTEXT_TOKENS:])
        while ids and "\ufffd" in tokenizer.decode(ids):
            ids = ids[1:]
        self.context = ids
        self.context_text = tokenizer.decode(ids) if ids else ""
        self.pending: list[int] = []

    def _decode_pending(self) -> str:
        if not self.context:
            return self.tokenizer.decode(self.pending)
        full = self.tokenizer.decode(self.context + self.pending)
        if full.startswith(self.context_text):
            return full[len(self.context_text) :]
        return self.tokenizer.decode(self.pending)

    def add(self, token: int) -> str:
        self.pending.append(token)
        piece = self._decode_pending()
        if piece.endswith("\ufffd"):
            return ""
        self.context, self.pending = self.pending, []
        self.context_text = self.tokenizer.decode(self.context)
        return piece

    def finish(self) -> str:
        """The text of a final partial character (as U+FFFD), "" when there is none."""
        tail = self._decode_pending() if self.pending else ""
        self.pending = []
        return tail


class StopMatcher:
    """Text in, text out, cut before the first stop string.

    `feed(piece)` returns (text safe to emit now, stopped); once stopped, nothing more is emitted.
    `flush()` returns the held-back tail at the end of generation (no stop string was completed).
    """

    def __init__(self, stops: tuple[str, ...] | list[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.held = ""
        self.stopped = False

    def feed(self, piece: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stops:
            return piece, False
        text = self.held + piece
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.held, self.stopped = "", True
            return text[:cut], True
        keep = self._open_tail(text)
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def _open_tail(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best

    def flush(self) -> str:
        out, self.held = ("" if self.stopped else self.held), ""
        return out
