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
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            out.extend(f"{name}{labels} {value:g}" for labels, value in samples)

        with self._lock:
            reqs = sorted(self.requests.items())
            disconnects = self.disconnects
        metric(
            "mamba3lite_requests_total", "counter", "HTTP requests answered, by endpoint and status.",
            [(f'{{endpoint="{e}",status="{s}"}}', n) for (e, s), n in reqs] or [("", 0)],
        )  # fmt: skip
        metric(
            "mamba3lite_client_disconnects_total",
            "counter",
            "Requests whose client went away.",
            [("", disconnects)],
        )
        metric(
            "mamba3lite_prompt_tokens_total",
            "counter",
            "Prompt tokens of admitted requests.",
            [("", engine.prompt_tokens)],
        )
        metric(
            "mamba3lite_prefill_tokens_total",
            "counter",
            "Prompt tokens actually prefilled (cache hits skip some).",
            [("", engine.prefill_tokens)],
        )
        metric(
            "mamba3lite_completion_tokens_total",
            "counter",
            "Tokens generated.",
            [("", engine.completion_tokens)],
        )
        metric("mamba3lite_decode_steps_total", "counter", "Batched decode steps.", [("", engine.steps)])
        metric("mamba3lite_batch_occupancy", "gauge", "Rows in the running batch.", [("", engine.active)])
        metric(
            "mamba3lite_batch_capacity",
            "gauge",
            "The most rows the batch holds (--max-batch-size).",
            [("", engine.max_batch_size)],
        )
        metric(
            "mamba3lite_queue_length",
            "gauge",
            "Requests waiting to join the batch.",
            [("", engine.queue_len)],
        )
        pc = engine.prefix_cache
        metric(
            "mamba3lite_prefix_cache_hits_total",
            "counter",
            "Prompts that started from a cached state.",
            [("", pc.hits)],
        )
        metric(
            "mamba3lite_prefix_cache_misses_total",
            "counter",
            "Prompts with no cached prefix.",
            [("", pc.misses)],
        )
        metric("mamba3lite_prefix_cache_bytes", "gauge", "Bytes held by the prefix cache.", [("", pc.bytes)])
        metric(
            "mamba3lite_prefix_cache_capacity_bytes",
            "gauge",
            "The prefix cache's bound (--prefix-cache-mb).",
            [("", pc.max_bytes)],
        )
        metric(
            "mamba3lite_prefix_cache_entries", "gauge", "States held by the prefix cache.", [("", len(pc))]
        )
        return "\n".join(out) + "\n"
