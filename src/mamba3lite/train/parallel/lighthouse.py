"""The torchft lighthouse (the Rust server in torchft's wheel): started in this process, its address
printed, served until SIGINT/SIGTERM. Tests start one in-process with `start_lighthouse`."""

from __future__ import annotations

import os
import signal
import threading

from mamba3lite.errors import ConfigError
from mamba3lite.train.parallel.replicas import INSTALL_HINT


def start_lighthouse(bind: str = "[::]", port: int = 0, min_replicas: int = 1, join_timeout_ms: int = 5000,
                     heartbeat_timeout_ms: int = 5000):  # fmt: skip
    """A running `LighthouseServer` (`.address()`, `.shutdown()`); ConfigError for bad settings or a port
    in use."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum at INFO
    try:
        from torchft._torchft import LighthouseServer
    except ImportError as e:
        raise ConfigError(f"the lighthouse needs torchft ({e}); {INSTALL_HINT}") from None
    if min_replicas < 1:
        raise ConfigError(f"--min-replicas must be >= 1, got {min_replicas}")
    try:
        return LighthouseServer(
            bind=f"{bind}:{port}",
            min_replicas=min_replicas,
            join_timeout_ms=join_timeout_ms,
            heartbeat_timeout_ms=heartbeat_timeout_ms,
        )
    except Exception as e:  # the Rust server's bind error
        raise ConfigError(
            f"cannot start the lighthouse on {bind}:{port}: {e}; choose another --port"
        ) from None


def serve_lighthouse(
    bind: str, port: int, min_replicas: int, join_timeout_ms: int, heartbeat_timeout_ms: int
) -> int:
    """Run a lighthouse until SIGINT/SIGTERM; prints its address (what training.fault_tolerance.lighthouse
    takes)."""
    server = start_lighthouse(bind, port, min_replicas, join_timeout_ms, heartbeat_timeout_ms)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    print(f"lighthouse at {server.address()} (min_replicas {min_replicas}); pass it as "
          f"--set training.fault_tolerance.lighthouse={server.address()}", flush=True)  # fmt: skip
    done.wait()
    server.shutdown()
    print("lighthouse stopped", flush=True)
    return 0
