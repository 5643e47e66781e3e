"""The FastAPI app: OpenAI's completions, chat and models endpoints over the engine, plus /health,
/metrics, and vLLM's /tokenizer_info, /tokenize and /detokenize (lm-eval's `local-completions` detects
those and tokenizes through the server, so it needs no tokenizer files and no network).

    app = create_app(engine, tokenizer, model_name="run", limits=Limits(), api_key=None, chat=renderer)

Each request's choices are jobs of the engine; their events come back to the event loop through one
asyncio queue per request. A client that disconnects (mid-stream or while waiting) cancels its jobs,
which leave the batch at the next step. Every error is OpenAI's error JSON with the right status.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from mamba3lite.serve.auth import authorized
from mamba3lite.serve.engine import Finished, Job, QueueFull, StateTooLarge
from mamba3lite.serve.metrics import Metrics
from mamba3lite.serve.protocol import APIError, Limits, Request, parse_chat, parse_completion, parse_json_body
from mamba3lite.serve.responses import Responder

ENDPOINTS = (
    "/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions",
    "/tokenizer_info", "/tokenize", "/detokenize",
)  # fmt: skip


class _Guard:
    """Pure ASGI middleware (it does not buffer streams): counts every response by endpoint and status,
    and answers 401 for a missing or wrong key on every path but /health."""

    def __init__(self, app, metrics: Metrics, api_key: str | None) -> None:
        self.app, self.metrics, self.api_key = app, metrics, api_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"].rstrip("/") or "/"
        label = path if path in ENDPOINTS else ("/v1/models" if path.startswith("/v1/models/") else "other")

        async def counted(message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.count(label, message["status"])
            await send(message)

        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if path != "/health" and not authorized(headers.get("authorization"), self.api_key):
            err = APIError(
                401, "missing or wrong API key; send Authorization: Bearer KEY", code="invalid_api_key"
            )
            err.type = "authentication_error"
            return await _json(err.body(), 401)(scope, receive, counted)
        return await self.app(scope, receive, counted)


def _json(body: dict, status: int = 200, headers: dict | None = None):
    return JSONResponse(body, status_code=status, headers=headers)


async def read_body(request, limits: Limits) -> dict:
    """The JSON object of the request body, at most `limits.max_body_bytes` (413 beyond)."""
    cap = limits.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > cap:
        raise APIError(413, f"the request body is over {cap} bytes", code="body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > cap:
            raise APIError(413, f"the request body is over {cap} bytes", code="body_too_large")
        chunks.append(chunk)
    return parse_json_body(b"".join(chunks))


def _mb(n_bytes: int) -> str:
    return f"{n_bytes / (1 << 20):.1f}"


class _Submission:
    """The jobs of one request (prompt i, choice k -> index i * n + k) and the queue of their events."""

    def __init__(self, engine, req: Request) -> None:
        loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.jobs: list[Job] = []
        for i, prompt in enumerate(req.prompts):
            for k in range(req.n):
                index = i * req.n + k

                def sink(ev, index=index) -> None:
                    loop.call_soon_threadsafe(self.queue.put_nowait, (index, ev))

                self.jobs.append(Job(prompt.ids, prompt.report_from, req.sampling_for(k), sink))
        try:
            engine.submit(self.jobs)
        except StateTooLarge as e:
            raise APIError(
                400,
                f"this request's decode state ({e.tokens} tokens: the prompt and max_tokens) needs "
                f"{_mb(e.need_bytes)} MB, over the server's limit of {_mb(e.budget_bytes)} MB for all "
                "running requests together; send a shorter prompt or a smaller max_tokens, or restart "
                "the server with a larger --max-state-mb (0 = no limit)",
                param="max_tokens",
                code="state_too_large",
            ) from None
        except QueueFull as e:
            raise APIError(
                429,
                f"{e}; retry shortly",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": "1"},
            ) from None
        self.open = len(self.jobs)

    def cancel(self) -> None:
        for job in self.jobs:
            job.cancel()

    async def events(self, request):
        """(index, event) until every job has Finished; ConnectionError (after cancelling the jobs) if
        the client goes away. One watcher task per request reads the ASGI disconnect message, so the
        per-token path is a plain queue get."""
        watcher = asyncio.ensure_future(self._watch(request))
        try:
            while self.open:
                index, ev = await self.queue.get()
                if index is None:
                    self.cancel()
                    raise ConnectionError("client disconnected")
                if isinstance(ev, Finished):
                    self.open -= 1
                yield index, ev
        finally:
            watcher.cancel()

    async def _watch(self, request) -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                self.queue.put_nowait((None, None))
                return


def create_app(
    engine,
    tokenizer,
    *,
    model_name: str,
    limits: Limits,
    api_key: str | None,
    chat,
    chat_template: str | None = None,
    metrics: Metrics | None = None,
    manage_engine: bool = True,
):
    """The ASGI app. `chat(messages) -> (text, stops)` renders chats; with `manage_engine` the app's
    lifespan starts the engine and stops it at shutdown (cancelling what is left)."""
    metrics = metrics or Metrics()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if manage_engine:
            engine.start()
        try:
            yield
        finally:
            if manage_engine:
                await asyncio.to_thread(engine.stop)

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_Guard, metrics=metrics, api_key=api_key)
    app.state.engine, app.state.metrics = engine, metrics
    _error_handlers(app)
    _openai_routes(app, engine, tokenizer, model_name, limits, chat, metrics)
    _tokenizer_routes(app, tokenizer, limits, chat_template)
    return app


def _error_handlers(app) -> None:
    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return _json(e.body(), e.status, e.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        code = "not_found" if e.status_code == 404 else None
        err = APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", code=code)
        return _json(err.body(), e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request, e: Exception):
        err = APIError(
            500, f"internal error: {type(e).__name__}: {e}", type="server_error", code="internal_error"
        )
        return _json(err.body(), 500)


def _openai_routes(app, engine, tokenizer, model_name: str, limits: Limits, chat, metrics: Metrics) -> None:
    responder = Responder(model_name, tokenizer, metrics)
    vocab = engine.vocab_size
    model_card = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "mamba3lite"}

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(
                404,
                f"model {name!r} is not served here; this server serves {model_name!r}",
                param="model",
                code="model_not_found",
            )

    async def run(request, req: Request, chat_mode: bool):
        check_model(req.model)
        sub = _Submission(engine, req)
        if req.stream:
            return StreamingResponse(
                responder.stream(request, sub, req, chat_mode), media_type="text/event-stream"
            )
        try:
            body = await (responder.chat if chat_mode else responder.completion)(request, sub, req)
        except ConnectionError:
            return Response(status_code=499)
        return _json(body)

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        req = parse_completion(await read_body(request, limits), limits, tokenizer, vocab)
        return await run(request, req, False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        req = parse_chat(await read_body(request, limits), limits, tokenizer, vocab, chat)
        return await run(request, req, True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        check_model(name)
        return model_card

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "active": engine.active, "queued": engine.queue_len}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(engine), media_type="text/plain; version=0.0.4")


def _tokenizer_routes(app, tokenizer, limits: Limits, chat_template: str | None) -> None:
    """vLLM's tokenizer endpoints, as lm-eval's RemoteTokenizer calls them. The EOS token's own text
    tokenizes to the EOS id (lm-eval finds the EOS id that way). /tokenize starts a document unless
    `add_special_tokens` is false, as vLLM's does for an export (whose tokenizer adds the start)."""
    eos_text = tokenizer.decode([tokenizer.eos_id]) or "<|endoftext|>"
    bos_text = eos_text if tokenizer.bos_id == tokenizer.eos_id else tokenizer.decode([tokenizer.bos_id])

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return {
            "eos_token": eos_text, "bos_token": bos_text, "pad_token": None, "chat_template": chat_template,
            "tokenizer_class": type(tokenizer).__name__, "model_max_length": limits.max_prompt_tokens,
        }  # fmt: skip

    @app.post("/tokenize")
    async def tokenize(request: HTTPRequest):
        body = await read_body(request, limits)
        text = body.get("prompt")
        if not isinstance(text, str):
            raise APIError(400, "prompt must be a string", param="prompt", code="invalid_type")
        ids = [tokenizer.eos_id] if text == eos_text else tokenizer.encode(text)
        if body.get("add_special_tokens", True) is not False:
            ids = [tokenizer.bos_id, *ids]
        return {"tokens": ids, "count": len(ids), "max_model_len": limits.max_prompt_tokens}

    @app.post("/detokenize")
    async def detokenize(request: HTTPRequest):
        body = await read_body(request, limits)
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids
        ):
            raise APIError(400, "tokens must be a list of token ids", param="tokens", code="invalid_type")
        return {"prompt": tokenizer.decode(ids)}
