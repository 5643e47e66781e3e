"""Text generation from a loaded model: encode, prefill + recurrent decode, stream decoded text.

`generate_text` is what `mamba3lite generate` and the quickstart call. The model does the work (one
chunked-scan prefill over the prompt, `Mamba3Transformer.prefill`, then one O(1) recurrent step per new
token, `.step`: the loop of `Mamba3Transformer.generate`, here with token healing's mask on the first
draws, `mamba3lite.token_healing`); this module turns tokens into text as they come.

Context: training windows are cut from documents joined by EOS, so a document's first token follows an
EOS. The prompt is therefore fed as [EOS] + encode(prompt): the model sees "a new document starts
with <prompt>", and an empty prompt is allowed (the model writes a document from scratch). A model
imported with a tokenizer that starts a text with its own BOS is fed that instead (`tokenizer.bos_id`).

Streaming: GPT-2 tokens are byte sequences, so a UTF-8 character can be split across two tokens; text
is emitted only up to the last complete character (a trailing U+FFFD from a partial byte sequence is
held back until the next token completes it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from mamba3lite.errors import ConfigError
from mamba3lite.model.sampling import sample_next
from mamba3lite.token_healing import HealingConstraint, heal_prompt, token_table
from mamba3lite.tokenizer import Tokenizer


@dataclass
class GenerationResult:
    """What one `generate_text` call produced.

    text: the generated continuation (prompt not included, EOS not included).
    token_ids: the ids sampled (EOS not included); with token healing the first ones spell `healed`.
    new_tokens: tokens sampled (the EOS that ended generation included); stopped_at_eos: whether EOS
    ended it before max_new_tokens. seconds: wall time of prefill + decode; prompt_tokens: tokens fed.
    healed: the end of the prompt that token healing backed up and had spelled again ("" when none).
    """

    text: str
    token_ids: list[int]
    new_tokens: int
    prompt_tokens: int
    stopped_at_eos: bool
    seconds: float
    healed: str = ""

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of wall time (prefill included)."""
        return self.new_tokens / self.seconds if self.seconds > 0 else float("inf")


# Below this a temperature or top-p is 0 in float32 (the logits' dtype): sampling would divide by zero.
MIN_SAMPLING_VALUE = 1e-30


def check_sampling_args(
    max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None, seed: int = 0
) -> None:
    """ConfigError naming the flag for values `sample_next` (or the generator's seeding) would reject."""
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if not (temperature == 0 or MIN_SAMPLING_VALUE <= temperature < float("inf")):
        raise ConfigError(
            f"--temperature must be 0 (greedy) or in [{MIN_SAMPLING_VALUE:g}, inf), got {temperature}"
        )
    if top_k is not None and top_k < 1:
        raise ConfigError(f"--top-k must be >= 1, got {top_k}")
    if top_p is not None and not MIN_SAMPLING_VALUE <= top_p <= 1:
        raise ConfigError(f"--top-p must be in [{MIN_SAMPLING_VALUE:g}, 1], got {top_p}")
    # torch.Generator.manual_seed takes a 64-bit integer (beyond it: a traceback, "Overflow when unpacking
    # long long"); [0, 2**63) is also the range training.seed accepts.
    if not 0 <= seed < 2**63:
        raise ConfigError(f"--seed must be in [0, 2**63), got {seed}")


def generate_text(
    model: torch.nn.Module,
    tokenizer,
    prompt: str,
    *,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = 50,
    top_p: float | None = None,
    seed: int = 0,
    on_text: Callable[[str], None] | None = None,
    token_healing: bool = True,
) -> GenerationResult:
    """Continue `prompt` with at most `max_new_tokens` tokens; stop early at the tokenizer's EOS.

    Sampling: softmax(logits / temperature) restricted by top-k / top-p (`model.sampling.sample_next`),
    drawn from a `torch.Generator` on the model's device seeded with `seed`: the same model, prompt,
    settings, seed and device give the same text. `on_text(piece)` is called with each newly completed
    piece of text (streaming). `token_healing` (`mamba3lite.token_healing`): the prompt's last token(s)
    are backed up and the first new tokens spell them again; the text (streamed and returned) is still
    only what follows the prompt.
    """
    check_sampling_args(max_new_tokens, temperature, top_k, top_p, seed)
    prompt_ids = [tokenizer.bos_id, *tokenizer.encode(prompt)]
    if max(prompt_ids) >= (vocab := model.cfg.vocab_size):
        raise ConfigError(f"the prompt encodes to token ids >= the model's vocab_size {vocab}")
    table = token_table(tokenizer) if token_healing else None
    fed_ids, removed = heal_prompt(prompt_ids, table)
    constraint = HealingConstraint(table, removed)
    device = next(model.parameters()).device
    sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    sampling["generator"] = torch.Generator(device=device).manual_seed(seed)
    stream = _TextStream(tokenizer, fed_ids, skip=removed.decode("utf-8"))
    new_ids: list[int] = []
    stopped_at_eos = False
    t0 = time.perf_counter()
    for token in _sampled_tokens(model, fed_ids, max_new_tokens, sampling, constraint):
        if token == tokenizer.eos_id:
            stopped_at_eos = True
            break
        new_ids.append(token)
        if (piece := stream.add(token)) and on_text is not None:
            on_text(piece)
    seconds = time.perf_counter() - t0
    if (tail := stream.finish()) and on_text is not None:
        on_text(tail)
    return GenerationResult(
        text=stream.text,
        token_ids=new_ids,
        new_tokens=len(new_ids) + int(stopped_at_eos),
        prompt_tokens=len(fed_ids),
        stopped_at_eos=stopped_at_eos,
        seconds=seconds,
        healed=removed.decode("utf-8"),
    )


@torch.no_grad()
def _sampled_tokens(
    model: torch.nn.Module, ids: list[int], max_new_tokens: int, sampling: dict, constraint: HealingConstraint
) -> Iterator[int]:
    """The new tokens, one at a time: prefill over `ids`, then sample / step (the model's O(1) decode).
    The caller stops at EOS. While `constraint` is active its mask restricts the draw."""
    model.eval()
    device = next(model.parameters()).device
    cache = model.allocate_cache(1, len(ids) + max_new_tokens, device=device)
    logits_BV, _ = model.prefill(torch.tensor([ids], dtype=torch.long, device=device), cache)
    for i in range(max_new_tokens):
        token = int(sample_next(constraint.mask(logits_BV), **sampling)[0])
        constraint.advance(token)
        yield token
        if i + 1 < max_new_tokens:
            logits_BV = model.step(torch.tensor([token], dtype=torch.long, device=device), cache)


class _TextStream:
    """Generated tokens to text, piece by piece, each piece ending on a complete character.

    Only the tokens since the last piece are decoded (linear, not quadratic), behind the tokens of the
    previous piece (first: the prompt's), whose text is cut off again: decoders that drop the space of
    a leading word marker (SentencePiece's ▁) would otherwise glue every piece to the one before it."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip: str = "") -> None:
        self.tokenizer = tokenizer
        self.context = _context_ids(tokenizer, prompt_ids)
        self.context_text = tokenizer.decode(self.context)
        self.pending: list[int] = []
        self.pieces: list[str] = []
        self.skip = skip  # the text healing removed from the prompt: re-spelled first, not shown again

    def add(self, token: int) -> str:
        """The text completed by `token` ("" while a character is still incomplete)."""
        self.pending.append(token)
        piece = _decode_after(self.tokenizer, self.context, self.context_text, self.pending)
        if piece.endswith("\ufffd"):  # pending does not end on a character boundary yet
            return ""
        self.context, self.pending = self.pending, []
        self.context_text = self.tokenizer.decode(self.context)
        if self.skip:
            n = min(len(self.skip), len(piece))
            assert piece[:n] == self.skip[:n], (piece, self.skip)  # the constraint spelled it
            piece, self.skip = piece[n:], self.skip[n:]
        if piece:
            self.pieces.append(piece)
        return piece

    def finish(self) -> str:
        """The text of a final partial character (shown as U+FFFD), "" when there is none."""
        tail = (
            _decode_after(self.tokenizer, self.context, self.context_text, self.pending)
            if self.pending
            else ""
        )
        self.pending = []
        if self.skip:  # stopped (the limit) before the removed text was spelled again
            tail = tail[len(self.skip) :] if tail.startswith(self.skip) else ""
        if tail:
            self.pieces.append(tail)
        return tail

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def _context_ids(tokenizer: Tokenizer, prompt_ids: list[int], n: int = 8) -> list[int]:
    """The last few prompt tokens, starting on a character boundary (their text has no U+FFFD)."""
    ids = prompt_ids[-n:]
    while ids and "\ufffd" in tokenizer.decode(ids):
        ids = ids[1:]
    return ids


def _decode_after(tokenizer: Tokenizer, context: list[int], context_text: str, ids: list[int]) -> str:
    """The text `ids` add after `context` (whose text alone is `context_text`)."""
    if not context:
        return tokenizer.decode(ids)
    full = tokenizer.decode(context + ids)
    return full[len(context_text) :] if full.startswith(context_text) else tokenizer.decode(ids)
