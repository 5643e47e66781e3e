"""The counters behind GET /metrics, rendered as Prometheus text (exposition format 0.0.4).

Request counts by endpoint and status are kept here (the API counts each response once); token counts,
batch occupancy, queue length and the prefix cache's hits and bytes are read from the engine when
scraped, so they cannot drift from what the engine did.
"""

from __future__ import annotations

import threading
from collections import Counter


class Metrics:
    """requests[(endpoint, status)] and disconnects; `render(engine)` is the /metrics body."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[tuple[str, int]] = Counter()
        self.disconnects = 0

    def count(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, int(status))] += 1

    def count_disconnect(self) -> None:
        with self._lock:
            self.disconnects += 1

    def render(self, engine) -> str:
        with self._lock:
            reqs = sorted(self.requests.items())
            disconnects = self.disconnects
        out = _family(
            "mamba3lite_requests_total", "counter", "HTTP requests answered, by endpoint and status.",
            [(f'{{endpoint="{e}",status="{s}"}}', n) for (e, s), n in reqs] or [("", 0)],
        )  # fmt: skip
        out += _family(
            "mamba3lite_client_disconnects_total",
            "counter",
            "Requests whose client went away.",
            [("", disconnects)],
        )
        for name, kind, help_, read in ENGINE_METRICS:
            out += _family(name, kind, help_, [("", read(engine))])
        return "\n".join(out) + "\n"


def _family(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> list[str]:
    return [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *(f"{name}{lab} {v:g}" for lab, v in samples)]


# (name, type, help, how to read it from the engine) of everything /metrics reads from the engine.
ENGINE_METRICS = (
    (
        "mamba3lite_prompt_tokens_total",
        "counter",
        "Prompt tokens of admitted requests.",
        lambda e: e.prompt_tokens,
    ),
    (
        "mamba3lite_prefill_tokens_total",
        "counter",
        "Prompt tokens actually prefilled (cache hits skip some).",
        lambda e: e.prefill_tokens,
    ),
    ("mamba3lite_completion_tokens_total", "counter", "Tokens generated.", lambda e: e.completion_tokens),
    ("mamba3lite_decode_steps_total", "counter", "Batched decode steps.", lambda e: e.steps),
    ("mamba3lite_batch_occupancy", "gauge", "Rows in the running batch.", lambda e: e.active),
    (
        "mamba3lite_batch_capacity",
        "gauge",
        "The most rows the batch holds (--max-batch-size).",
        lambda e: e.max_batch_size,
    ),
    ("mamba3lite_queue_length", "gauge", "Requests waiting to join the batch.", lambda e: e.queue_len),
    (
        "mamba3lite_decode_state_bytes",
        "gauge",
        "Bytes held by the running batch's decode state.",
        lambda e: e.state_bytes,
    ),
    (
        "mamba3lite_decode_state_capacity_bytes",
        "gauge",
        "The decode state's bound (--max-state-mb; 0: none).",
        lambda e: e.max_state_bytes or 0,
    ),
    (
        "mamba3lite_prefix_cache_hits_total",
        "counter",
        "Prompts that started from a cached state.",
        lambda e: e.prefix_cache.hits,
    ),
    (
        "mamba3lite_prefix_cache_misses_total",
        "counter",
        "Prompts with no cached prefix.",
        lambda e: e.prefix_cache.misses,
    ),
    (
        "mamba3lite_prefix_cache_tokens_saved_total",
        "counter",
        "Prompt tokens not prefilled thanks to a hit.",
        lambda e: e.prefix_cache.tokens_saved,
    ),
    (
        "mamba3lite_prefix_cache_bytes",
        "gauge",
        "Bytes held by the prefix cache.",
        lambda e: e.prefix_cache.bytes,
    ),
    (
        "mamba3lite_prefix_cache_capacity_bytes",
        "gauge",
        "The prefix cache's bound (--prefix-cache-mb).",
        lambda e: e.prefix_cache.max_bytes,
    ),
    (
        "mamba3lite_prefix_cache_entries",
        "gauge",
        "States held by the prefix cache.",
        lambda e: len(e.prefix_cache),
    ),
)
