"""Response bodies and server-sent-event streams of /v1/completions and /v1/chat/completions, built
from the engine's events (`PromptScores`, `Delta`, `Finished`) of a request's jobs.

A completion's choice is assembled as OpenAI returns it: text (the prompt first with echo), logprobs
(`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`, offsets into the returned text), and a
finish reason; `usage` counts each prompt once and every choice's tokens. A stream sends a chunk per
piece of text, a finish chunk per choice, a usage chunk when `stream_options.include_usage` asks for
it (then every chunk has `"usage": null`), and `data: [DONE]`.
"""

from __future__ import annotations

import json
import time
import uuid

from mamba3lite.serve.engine import Delta, Finished, PromptScores
from mamba3lite.serve.metrics import Metrics
from mamba3lite.serve.protocol import APIError, Request


class Choice:
    """One choice being assembled: text, the tokens' logprobs, the finish reason."""

    def __init__(self, index: int, prompt, echo: bool, tokenizer) -> None:
        self.index, self.tokenizer = index, tokenizer
        self.text = prompt.text if echo else ""
        self.tokens: list[str] = []
        self.token_logprobs: list = []
        self.top_logprobs: list = []
        self.text_offset: list[int] = []
        self.finish: Finished | None = None
        self._offset = 0

    def add_tokens(self, ids, lps, tops) -> dict:
        """Record tokens with their logprobs; returns the logprobs object of just these tokens."""
        part = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, lp, top in zip(ids, lps, tops):
            s = self.tokenizer.decode([tid])
            part["tokens"].append(s)
            part["token_logprobs"].append(lp)
            part["top_logprobs"].append(
                None if top is None else {self.tokenizer.decode([t]): v for t, v in top}
            )
            part["text_offset"].append(self._offset)
            self._offset += len(s)
        for k, v in part.items():
            getattr(self, k).extend(v)
        return part

    def logprobs(self) -> dict:
        return {k: getattr(self, k) for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def _usage(req: Request, choices: dict) -> dict:
    prompt = sum(len(p.ids) - p.report_from for p in req.prompts)
    completion = sum(c.finish.completion_tokens for c in choices.values() if c.finish)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _apply(choice: Choice, ev, want_logprobs: bool) -> dict | None:
    """Fold an event into `choice`; returns the logprobs part it added (None without logprobs)."""
    if isinstance(ev, PromptScores):
        return choice.add_tokens(ev.ids, ev.logprobs, ev.top)
    if isinstance(ev, Delta):
        choice.text += ev.text
        if want_logprobs and ev.token_id is not None:
            return choice.add_tokens([ev.token_id], [ev.logprob], [ev.top])
        return None
    assert isinstance(ev, Finished)
    choice.finish = ev
    if ev.reason == "error":
        raise APIError(500, ev.message or "the engine failed", type="server_error", code="engine_error")
    return None


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class Responder:
    """Response bodies and streams of one app (its model name and tokenizer)."""

    def __init__(self, model_name: str, tokenizer, metrics: Metrics) -> None:
        self.model_name, self.tokenizer, self.metrics = model_name, tokenizer, metrics

    def head(self, prefix: str, obj: str) -> dict:
        return {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "object": obj,
            "created": int(time.time()),
            "model": self.model_name,
        }

    def choices(self, req: Request, n_jobs: int) -> dict[int, Choice]:
        echo = req.sampling.echo
        return {j: Choice(j, req.prompts[j // req.n], echo, self.tokenizer) for j in range(n_jobs)}

    async def collect(self, request, sub, req: Request) -> dict[int, Choice]:
        choices = self.choices(req, len(sub.jobs))
        want_lp = req.sampling.logprobs is not None
        try:
            async for index, ev in sub.events(request):
                _apply(choices[index], ev, want_lp)
        except BaseException:
            if sub.open:
                sub.cancel()
                self.metrics.count_disconnect()
            raise
        return choices

    async def completion(self, request, sub, req: Request) -> dict:
        choices = await self.collect(request, sub, req)
        want_lp = req.sampling.logprobs is not None
        out = [
            {
                "index": j,
                "text": c.text,
                "logprobs": c.logprobs() if want_lp else None,
                "finish_reason": c.finish.reason,
            }
            for j, c in sorted(choices.items())
        ]
        return {**self.head("cmpl", "text_completion"), "choices": out, "usage": _usage(req, choices)}

    async def chat(self, request, sub, req: Request) -> dict:
        choices = await self.collect(request, sub, req)
        out = [
            {
                "index": j,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": None,
                "finish_reason": c.finish.reason,
            }
            for j, c in sorted(choices.items())
        ]
        return {**self.head("chatcmpl", "chat.completion"), "choices": out, "usage": _usage(req, choices)}

    async def stream(self, request, sub, req: Request, chat: bool):
        """Server-sent events: chunks as text arrives, a finish chunk per choice, usage if asked, [DONE]."""
        head = (
            self.head("chatcmpl", "chat.completion.chunk") if chat else self.head("cmpl", "text_completion")
        )
        extra = {"usage": None} if req.include_usage else {}
        choices = self.choices(req, len(sub.jobs))
        want_lp = not chat and req.sampling.logprobs is not None

        def chunk(index: int, text: str | None, part=None, finish=None) -> str:
            if chat:
                delta = (
                    {}
                    if text is None
                    else ({"role": "assistant", "content": ""} if text == "" else {"content": text})
                )
                c = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                c = {"index": index, "text": text or "", "logprobs": part, "finish_reason": finish}
            return _sse({**head, "choices": [c], **extra})

        try:
            for j, c in choices.items():
                if chat:
                    yield chunk(j, "")
                elif req.sampling.echo and not want_lp:
                    yield chunk(j, c.text)
            async for index, ev in sub.events(request):
                c = choices[index]
                try:
                    part = _apply(c, ev, want_lp)
                except APIError as e:
                    yield _sse(e.body())
                    continue
                if isinstance(ev, Finished):
                    yield chunk(index, None if chat else "", None, ev.reason)
                elif isinstance(ev, PromptScores):
                    yield chunk(index, c.text, part)
                elif ev.text or part:
                    yield chunk(index, ev.text, part)
            if req.include_usage:
                yield _sse({**head, "choices": [], "usage": _usage(req, choices)})
            yield "data: [DONE]\n\n"
        finally:
            if sub.open:
                sub.cancel()
                self.metrics.count_disconnect()
