"""`mamba3lite serve`: an OpenAI-compatible HTTP server over a run, with batched recurrent decoding.

    mamba3lite serve --checkpoint-dir mamba3lite-quickstart/run --port 8000
    curl http://127.0.0.1:8000/v1/completions -d '{"model": "run", "prompt": "def ", "max_tokens": 32}'

Prints one line, `serving RUN step N on http://HOST:PORT` (`--port 0` picks a free port and prints it),
and serves until SIGTERM or Ctrl-C: then it stops accepting, gives in-flight requests
--shutdown-timeout seconds, cancels the rest and exits 0. Needs the `serve` extra (FastAPI, uvicorn).
"""

from __future__ import annotations

import argparse
import errno
import sys
from pathlib import Path

from mamba3lite.commands.options import add_checkpoint_options

HELP = "serve a checkpoint over an OpenAI-compatible HTTP API (batched recurrent decoding)"
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_checkpoint_options(parser)
    a = parser.add_argument
    a("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, this machine only)")
    a("--port", type=int, default=8000, help="TCP port (default 8000; 0 = a free port, printed)")
    a("--dtype", default="fp32", choices=sorted(DTYPES), help="weights' dtype (default fp32)")
    a(
        "--model-name",
        default=None,
        metavar="NAME",
        help="the model id clients send (default: the run dir's name)",
    )
    _add_request_limits(parser)
    _add_memory(parser)
    _add_access(parser)


def _add_request_limits(parser: argparse.ArgumentParser) -> None:
    """What one request may ask, and how many run and wait together."""
    a = parser.add_argument
    a("--max-batch-size", type=int, default=32, metavar="N", help="rows decoded together (default 32)")
    a(
        "--max-queue",
        type=int,
        default=256,
        metavar="N",
        help="requests waiting beyond the batch; more get 429 (default 256)",
    )
    a(
        "--max-tokens-limit",
        type=int,
        default=4096,
        metavar="N",
        help="the largest max_tokens a request may ask (default 4096)",
    )
    a(
        "--max-prompt-tokens",
        type=int,
        default=32768,
        metavar="N",
        help="the longest prompt, in tokens (default 32768)",
    )


def _add_memory(parser: argparse.ArgumentParser) -> None:
    """What the server holds in memory: cached prefix states and the running requests' decode state."""
    a = parser.add_argument
    a(
        "--prefix-cache-mb",
        type=float,
        default=256,
        metavar="MB",
        help="prefix-state cache size; 0 = off (default 256)",
    )
    a(
        "--max-state-mb",
        type=float,
        default=8192,
        metavar="MB",
        help="the most decode state the running requests hold together (a hybrid's key/value cache grows "
        "with each request's prompt + max_tokens, reserved when it joins; those that do not fit wait, one "
        "that cannot fit alone gets 400); 0 = no limit (default 8192)",
    )
    a(
        "--prefix-boundary",
        type=int,
        default=256,
        metavar="T",
        help="cache the state every T prompt tokens (default 256)",
    )


def _add_access(parser: argparse.ArgumentParser) -> None:
    """Who may call the server, and how it stops."""
    a = parser.add_argument
    a(
        "--api-key-file",
        default=None,
        metavar="F",
        help="require Authorization: Bearer <the key in F> (or set MAMBA3LITE_API_KEY)",
    )
    a("--insecure-no-auth", action="store_true", help="allow a non-loopback --host without an API key")
    a(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds in-flight requests get at shutdown (default 10)",
    )


def _check_args(args: argparse.Namespace) -> None:
    from mamba3lite.errors import ConfigError

    for flag, value, lo in (
        ("--max-batch-size", args.max_batch_size, 1), ("--max-queue", args.max_queue, 1),
        ("--max-tokens-limit", args.max_tokens_limit, 1), ("--max-prompt-tokens", args.max_prompt_tokens, 1),
        ("--prefix-boundary", args.prefix_boundary, 1), ("--port", args.port, 0),
    ):  # fmt: skip
        if value < lo:
            raise ConfigError(f"{flag} must be >= {lo}, got {value}")
    if args.port > 65535:
        raise ConfigError(f"--port must be in [0, 65535], got {args.port}")
    if not 0 <= args.prefix_cache_mb < float("inf"):
        raise ConfigError(f"--prefix-cache-mb must be >= 0, got {args.prefix_cache_mb}")
    if not 0 <= args.max_state_mb < float("inf"):
        raise ConfigError(f"--max-state-mb must be >= 0 (0 = no limit), got {args.max_state_mb}")
    if 0 < args.max_state_mb * (1 << 20) < 1:
        raise ConfigError(f"--max-state-mb {args.max_state_mb} is under one byte; give 0 for no limit")
    if not 0 < args.shutdown_timeout < float("inf"):
        raise ConfigError(f"--shutdown-timeout must be > 0, got {args.shutdown_timeout}")


def _require_extra() -> None:
    from mamba3lite.errors import ConfigError

    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ConfigError(
            f"`mamba3lite serve` needs FastAPI and uvicorn ({e.name} is missing); "
            "fix: pip install 'mamba3lite[serve]'"
        ) from None


def build_app(args: argparse.Namespace, loaded, api_key: str | None):
    """(app, engine) for the loaded run and the command's flags."""
    import torch

    from mamba3lite.serve.api import create_app
    from mamba3lite.serve.chat import ChatRenderer, find_chat_template
    from mamba3lite.serve.engine import Engine
    from mamba3lite.serve.prefix_cache import PrefixCache
    from mamba3lite.serve.protocol import Limits

    tok = loaded.load_tokenizer()
    loaded.model.to(getattr(torch, DTYPES[args.dtype]))
    engine = Engine(
        loaded.model,
        tok,
        max_batch_size=args.max_batch_size,
        max_queue=args.max_queue,
        prefix_cache=PrefixCache(int(args.prefix_cache_mb * (1 << 20))),
        boundary=args.prefix_boundary,
        max_state_bytes=int(args.max_state_mb * (1 << 20)) or None,
    )  # fmt: skip  (no max_len: a key/value cache grows with its longest row instead of holding the limit)
    template = find_chat_template(loaded.run_dir, loaded.tokenizer_name)
    app = create_app(
        engine, tok, model_name=args.model_name or Path(loaded.run_dir).name,
        limits=Limits(max_tokens=args.max_tokens_limit, max_prompt_tokens=args.max_prompt_tokens),
        api_key=api_key, chat=ChatRenderer(template, tok.decode([tok.eos_id])), chat_template=template,
    )  # fmt: skip
    return app, engine


def state_limit_note(args: argparse.Namespace, model, max_state_bytes: int | None) -> str | None:
    """A note when the largest request the limits allow (the longest prompt and the largest max_tokens)
    needs more decode state than --max-state-mb: such requests will get 400."""
    tokens = args.max_prompt_tokens + args.max_tokens_limit
    if max_state_bytes is None or (need := model.state_bytes(1, tokens)) <= max_state_bytes:
        return None
    return (
        f"a request of {tokens} tokens (--max-prompt-tokens + --max-tokens-limit) needs "
        f"{need / (1 << 20):.1f} MB of decode state, over --max-state-mb {args.max_state_mb:g}: "
        "requests that long get 400"
    )


def run(args: argparse.Namespace) -> int:
    from mamba3lite.errors import ConfigError
    from mamba3lite.pretrained import load_pretrained, resolve_device
    from mamba3lite.serve.auth import check_exposure, load_api_key
    from mamba3lite.serve.server import bind_socket, make_server, serve_forever

    _check_args(args)
    _require_extra()
    api_key = load_api_key(args.api_key_file)
    check_exposure(args.host, api_key, args.insecure_no_auth)
    loaded = load_pretrained(args.checkpoint_dir, args.step, device=resolve_device(args.device))
    for note in loaded.notes:
        print(f"note: {note}", file=sys.stderr)
    app, engine = build_app(args, loaded, api_key)
    note = state_limit_note(args, loaded.model, engine.max_state_bytes)
    if note:
        print(f"note: {note}", file=sys.stderr)
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        why = (
            "is in use; choose another --port (0 = any free one)"
            if e.errno == errno.EADDRINUSE
            else f"cannot be bound: {e.strerror or e}"
        )
        raise ConfigError(f"--host {args.host} --port {args.port} {why}") from None
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"serving {loaded.run_dir} step {loaded.step} on http://{shown}:{port}", flush=True)
    serve_forever(make_server(app, sock, grace_s=args.shutdown_timeout))
    print("server stopped", file=sys.stderr)
    return 0
