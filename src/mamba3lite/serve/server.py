"""Running the app under uvicorn on a socket bound first (so `--port 0` can print the port it got), with
SIGTERM and Ctrl-C meaning "shut down gracefully, then return" rather than uvicorn's re-raise of the
signal after shutdown (which would end the process with -15 instead of exit 0).

Shutdown: the listening socket closes (no new requests), in-flight requests get `grace_s` seconds to
finish, the rest are cancelled (the app's lifespan stops the engine), and `serve_forever` returns.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port) (port 0: a free one), IPv4 or IPv6 as `host` is."""
    info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, addr = info[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def make_server(app, sock: socket.socket, grace_s: float = 10.0):
    """A uvicorn Server for `app` on `sock` whose signal handling only asks it to exit."""
    import uvicorn

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return

            def ask_exit(sig, frame) -> None:
                if self.should_exit and sig == signal.SIGINT:
                    self.force_exit = True  # a second Ctrl-C: stop waiting for in-flight requests
                self.should_exit = True

            old = {s: signal.signal(s, ask_exit) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, h in old.items():
                    signal.signal(s, h)

    config = uvicorn.Config(
        app, log_level="warning", timeout_graceful_shutdown=max(1, round(grace_s)), access_log=False,
        lifespan="on", timeout_keep_alive=5,
    )  # fmt: skip
    server = _Server(config)
    server.bound_socket = sock
    return server


def serve_forever(server) -> None:
    """Run until a signal (or `server.should_exit`); returns after the graceful shutdown."""
    server.run(sockets=[server.bound_socket])
