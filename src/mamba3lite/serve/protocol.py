"""Request bodies to validated settings, and OpenAI-style errors.

Every bad request becomes an `APIError` with the HTTP status and the error JSON OpenAI's API returns:
{"error": {"message", "type", "param", "code"}}. Fields this server knows but does not implement, whose
value would change the result (`suffix`, `logit_bias`, `best_of` > n, chat `tools`, ...), are refused
with 400 rather than silently ignored; other unknown fields (`user`, `metadata`, ...) are ignored.

A text prompt is read as [EOS] + encode(text), as `mamba3lite generate` reads it (the model sees "a new
document starts with the prompt"); a prompt of token ids is read exactly as given (a client that
tokenized it, lm-eval's `local-completions`, decides every token). Echo and prompt logprobs report the
prompt's own tokens, not the added EOS.
"""

from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass, replace
from typing import Any

from mamba3lite.serve.sampling import Sampling

MAX_N = 16
MAX_LOGPROBS = 5
MAX_STOPS = 4  # OpenAI's API takes at most 4 stop sequences
# A stop sequence's length in characters. The decoder holds back up to this many characters of a stream
# while it may be the start of a stop (serve/textout.py), so the bound is also that of the hold-back.
MAX_STOP_CHARS = 256
# The chat roles a message may take: OpenAI's, less those of tool and function calls (refused, UNSUPPORTED).
ROLES = ("system", "developer", "user", "assistant")
MAX_SEED = 2**63
MIN_SAMPLING_VALUE = 1e-30
# Fields that change what a request means and that this server does not implement.
UNSUPPORTED = {
    "suffix": "suffix (insertion) is not supported",
    "logit_bias": "logit_bias is not supported",
    "tools": "tools are not supported",
    "tool_choice": "tool_choice is not supported",
    "functions": "functions are not supported",
    "function_call": "function_call is not supported",
    "response_format": "response_format is not supported",
    "guided_json": "guided decoding is not supported",
    "guided_regex": "guided decoding is not supported",
}


class APIError(Exception):
    """An error response: HTTP `status`, and the OpenAI error object's fields."""

    def __init__(
        self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
        code: str | None = None, headers: dict | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str | None, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass(frozen=True)
class Limits:
    """What a request may ask for: max_tokens, prompt tokens, body bytes."""

    max_tokens: int = 4096
    max_prompt_tokens: int = 32768
    max_body_bytes: int = 4 << 20


@dataclass
class Prompt:
    """One prompt: the ids the model reads, the index of the first reported one, its text (for echo)."""

    ids: list[int]
    report_from: int
    text: str


@dataclass
class Request:
    """A validated completion or chat request: prompts, n choices each, and the shared settings (each
    choice's seed is `seed + choice index`)."""

    model: str | None
    prompts: list[Prompt]
    sampling: Sampling
    n: int
    stream: bool
    include_usage: bool

    def sampling_for(self, choice: int) -> Sampling:
        return replace(self.sampling, seed=(self.sampling.seed + choice) % MAX_SEED)


def parse_json_body(raw: bytes) -> dict:
    """The body as a JSON object; APIError 400 for non-UTF-8, malformed JSON, NaN, or a non-object."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad(
            None, f"the request body is not UTF-8 ({e.reason} at byte {e.start})", "invalid_json"
        ) from None

    def no_constants(name: str):
        raise ValueError(f"{name} is not JSON")

    try:
        body = json.loads(text, parse_constant=no_constants)
    except (ValueError, RecursionError) as e:
        raise bad(None, f"the request body is not valid JSON: {e}", "invalid_json") from None
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object", "invalid_json")
    return body


def _num(body: dict, name: str, default, lo: float, hi: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad(name, f"{name} must be a number, got {json.dumps(v)[:40]}", "invalid_type")
    if not lo <= v <= hi:
        raise bad(name, f"{name} must be in [{lo:g}, {hi:g}], got {v}")
    return float(v)


def _int(body: dict, name: str, default, lo: int, hi: int, code: str = "invalid_value") -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise bad(name, f"{name} must be an integer, got {json.dumps(v)[:40]}", "invalid_type")
    if not lo <= v <= hi:
        raise bad(name, f"{name} must be in [{lo}, {hi}], got {v}", code)
    return v


def _bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"{name} must be true or false, got {json.dumps(v)[:40]}", "invalid_type")
    return v


def _stops(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("stop", "stop must be a string or a list of strings", "invalid_type")
    if len(stops) > MAX_STOPS:
        raise bad("stop", f"at most {MAX_STOPS} stop sequences, got {len(stops)}")
    for i, stop in enumerate(stops):
        if len(stop) > MAX_STOP_CHARS:
            raise bad(
                "stop", f"a stop sequence has at most {MAX_STOP_CHARS} characters; stop[{i}] has {len(stop)}"
            )
    return tuple(s for s in stops if s)


def _refuse_unsupported(body: dict) -> None:
    for name, why in UNSUPPORTED.items():
        if body.get(name) not in (None, {}, [], ""):
            raise bad(name, f"{why} by this server; remove {name!r}", "unsupported_parameter")


def parse_sampling(
    body: dict, limits: Limits, *, max_tokens_names=("max_tokens",), logprobs=None
) -> Sampling:
    """The sampling fields shared by completions and chat (see `Sampling`)."""
    _refuse_unsupported(body)
    max_tokens = None
    for name in max_tokens_names:
        max_tokens = _int(body, name, max_tokens, 0, limits.max_tokens, "max_tokens_over_limit")
    temperature = _num(body, "temperature", 1.0, 0.0, 1e6)
    if 0 < temperature < MIN_SAMPLING_VALUE:
        raise bad("temperature", f"temperature must be 0 (greedy) or >= {MIN_SAMPLING_VALUE:g}")
    top_p = _num(body, "top_p", 1.0, MIN_SAMPLING_VALUE, 1.0)
    top_k = _int(body, "top_k", 0, -1, 1 << 30)
    seed = _int(body, "seed", None, 0, MAX_SEED - 1)
    return Sampling(
        max_tokens=16 if max_tokens is None else max_tokens,
        temperature=temperature,
        top_p=None if top_p >= 1 else top_p,
        top_k=None if top_k <= 0 else top_k,  # 0 and -1 (vLLM's "off") mean no top-k
        seed=secrets.randbelow(MAX_SEED) if seed is None else seed,
        presence_penalty=_num(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_num(body, "frequency_penalty", 0.0, -2.0, 2.0),
        stop=_stops(body),
        logprobs=logprobs,
    )


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not isinstance(opts, dict):
        raise bad("stream_options", "stream_options must be an object", "invalid_type")
    if not stream:
        raise bad("stream_options", "stream_options is only allowed with stream: true")
    return stream, _bool(opts, "include_usage")


def _n(body: dict) -> int:
    n = _int(body, "n", 1, 1, MAX_N, "n_over_limit")
    best_of = _int(body, "best_of", n, 1, MAX_N)
    if best_of != n:
        raise bad("best_of", "best_of other than n is not supported", "unsupported_parameter")
    return n


def _model(body: dict) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", "model must be a string", "invalid_type")
    return model


def parse_completion(body: dict, limits: Limits, tokenizer, vocab_size: int) -> Request:
    """A /v1/completions body; APIError 400 for anything invalid (the message names the field)."""
    n_lp = _int(body, "logprobs", None, 0, MAX_LOGPROBS, "logprobs_over_limit")
    sampling = parse_sampling(body, limits, logprobs=n_lp)
    echo = _bool(body, "echo")
    if sampling.max_tokens == 0 and not echo:
        raise bad("max_tokens", "max_tokens 0 is only meaningful with echo: true (to score the prompt)")
    stream, include_usage = _stream_flags(body)
    prompts = [_prompt(p, tokenizer, vocab_size, limits) for p in _prompt_list(body.get("prompt"))]
    return Request(_model(body), prompts, replace(sampling, echo=echo), _n(body), stream, include_usage)


def _prompt_list(v: Any) -> list:
    """`prompt` as a list of single prompts (a string or a list of ids each)."""
    if v is None:
        raise bad("prompt", "prompt is required", "missing_required_parameter")
    if isinstance(v, str):
        return [v]
    if not isinstance(v, list) or not v:
        raise bad(
            "prompt",
            "prompt must be a string, a list of strings, a list of token ids or a list of lists of ids",
        )
    if all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return [v]
    if all(isinstance(x, str) for x in v) or all(isinstance(x, list) for x in v):
        return v
    raise bad(
        "prompt", "prompt must be a string, a list of strings, a list of token ids or a list of lists of ids"
    )


def _prompt(p: Any, tokenizer, vocab_size: int, limits: Limits) -> Prompt:
    if isinstance(p, str):  # "" is the document start alone: the model writes a document from scratch
        prompt = Prompt([tokenizer.bos_id, *tokenizer.encode(p)], 1, p)
    else:
        if not p:
            raise bad("prompt", "a prompt of token ids is empty; send at least one id")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in p):
            raise bad("prompt", f"token ids must be integers in [0, {vocab_size})")
        prompt = Prompt(list(p), 0, tokenizer.decode(list(p)))
    n_tokens = len(prompt.ids) - prompt.report_from
    if n_tokens > limits.max_prompt_tokens:
        raise bad(
            "prompt",
            f"the prompt has {n_tokens} tokens, over this server's limit of {limits.max_prompt_tokens}",
            "prompt_too_long",
        )
    return prompt


def parse_chat(body: dict, limits: Limits, tokenizer, vocab_size: int, render) -> Request:
    """A /v1/chat/completions body (`render(messages) -> (prompt text, extra stop strings)`)."""
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
        raise bad(
            "logprobs",
            "logprobs are not supported on chat completions; use /v1/completions",
            "unsupported_parameter",
        )
    sampling = parse_sampling(body, limits, max_tokens_names=("max_tokens", "max_completion_tokens"))
    messages = _messages(body.get("messages"))
    text, extra_stops = render(messages)
    sampling = replace(sampling, stop=(*sampling.stop, *extra_stops))
    stream, include_usage = _stream_flags(body)
    prompt = _prompt(text, tokenizer, vocab_size, limits)
    return Request(_model(body), [prompt], sampling, _n(body), stream, include_usage)


def _messages(v: Any) -> list[dict]:
    if not isinstance(v, list) or not v:
        raise bad("messages", "messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}]", f"messages[{i}] must be an object with a string role", "invalid_type")
        if m["role"] not in ROLES:
            raise bad(
                f"messages[{i}].role",
                f"messages[{i}].role is {json.dumps(m['role'])[:40]}; allowed: {', '.join(ROLES)}",
            )
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(
                isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str)
                for c in content
            ):
                raise bad(
                    f"messages[{i}].content", "only text content parts are supported", "unsupported_parameter"
                )
            content = "".join(c["text"] for c in content)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise bad(
                f"messages[{i}].content", "content must be a string or a list of text parts", "invalid_type"
            )
        out.append({"role": m["role"], "content": content})
    return out
