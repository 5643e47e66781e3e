"""Shared by the serve tests: a live server on 127.0.0.1 (port 0) in a thread of this process, shut
down at the end, and small SSE / HTTP helpers with timeouts."""

from __future__ import annotations

import contextlib
import threading
import time
from types import SimpleNamespace

from mamba3lite.generation import generate_text
from mamba3lite.serve.api import create_app
from mamba3lite.serve.chat import ChatRenderer
from mamba3lite.serve.engine import Engine
from mamba3lite.serve.metrics import Metrics
from mamba3lite.serve.prefix_cache import PrefixCache
from mamba3lite.serve.protocol import Limits
from mamba3lite.serve.server import bind_socket, make_server, serve_forever

MODEL = "tiny"


@contextlib.contextmanager
def live_server(
    loaded, tok, *, api_key=None, limits=None, prefix_mb=16, template=None, manage_engine=True, **engine_kw
):
    """Yields SimpleNamespace(url, engine, metrics); the server is stopped (and the engine) on exit."""
    engine = Engine(loaded.model, tok, prefix_cache=PrefixCache(prefix_mb << 20), **engine_kw)
    metrics = Metrics()
    app = create_app(
        engine, tok, model_name=MODEL, limits=limits or Limits(), api_key=api_key,
        chat=ChatRenderer(template, tok.decode([tok.eos_id])), chat_template=template, metrics=metrics,
        manage_engine=manage_engine,
    )  # fmt: skip
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = make_server(app, sock, grace_s=2)
    thread = threading.Thread(target=serve_forever, args=(server,), daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield SimpleNamespace(url=f"http://127.0.0.1:{port}", engine=engine, metrics=metrics, server=server)
    finally:
        server.should_exit = True
        thread.join(20)
        assert not thread.is_alive(), "the server did not shut down"


def metric_values(text: str) -> dict[str, float]:
    """{name{labels}: value} of a Prometheus text body."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def generate_reference(model, tok, prompt: str, **kw):
    """`generation.generate_text`, the reference the server's output must equal: THE one place the serve
    tests call `generate`. The server does no token healing, so the reference is `generate
    --no-token-healing` (healing is on by default there)."""
    return generate_text(model, tok, prompt, token_healing=False, **kw)
