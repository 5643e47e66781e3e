"""`mamba3lite serve` side by side: batched decoding, the prefix-state cache, and the HTTP overhead.

    python benchmarks/bench_serve.py [--preset tiny] [--tokens 64] [--prompt-tokens 2048]
                                     [--streams 1,8,32] [--threads 2] [--repeat 2]

The preset's model (random weights: speed does not depend on them) behind the real server (FastAPI +
uvicorn on 127.0.0.1, in a thread of this process); the httpx clients run in a second process (as real
clients would: their parsing does not take the server's interpreter lock). Each pair is measured in the
same run:
  decode     aggregate completion tokens/s of N concurrent greedy streams of --tokens tokens each
             (wall time from the first request to the last [DONE]), against 1 stream
  TTFT       time to the first streamed token of a --prompt-tokens prompt (token ids), first seen
             (prefilled in full) against the same prompt again (a prefix-cache hit), and a prompt that
             shares those tokens plus 16 new ones (a boundary hit: only the tail is prefilled)
  overhead   tokens/s of one server stream against `generation.generate_text` in process, same prompt
  hybrid     (--hybrid, on by default) decode tokens/s at the largest stream count of a pure model and of
             a hybrid of the same size, each behind its own server: the preset's width and at least 4
             layers, the hybrid's mixers attention at one layer in four (layers 2, 6, ...: the
             mamba3_180m_hybrid preset's placement; heads of 64, rotary on half of each head, no biases),
             its key/value cache growing with the streams' lengths; and `model.step` alone at that
             many rows, the ceiling of each
Targets (issue 26): decode at 32 streams >= 8x 1 stream (tiny); TTFT >= 10x faster on a hit at 2,048
tokens; one server stream >= 0.9x generate. Issue 39: the hybrid at 32 streams >= 0.8x the pure model.
Best of --repeat, the repeats interleaved. The clients share the machine's cores, and the machine may be
shared with other jobs: quote the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import multiprocessing
import os
import platform
import threading
import time

import httpx
import torch

from mamba3lite.config import load_config
from mamba3lite.generation import generate_text
from mamba3lite.model import Mamba3Transformer
from mamba3lite.serve.api import create_app
from mamba3lite.serve.chat import ChatRenderer
from mamba3lite.serve.engine import Engine
from mamba3lite.serve.prefix_cache import PrefixCache
from mamba3lite.serve.protocol import Limits
from mamba3lite.serve.server import bind_socket, make_server, serve_forever
from mamba3lite.tokenizer import load_tokenizer


def start_server(model, tok, max_batch: int):
    engine = Engine(model, tok, max_batch_size=max_batch, max_queue=1024, prefix_cache=PrefixCache(256 << 20))
    app = create_app(
        engine, tok, model_name="bench", limits=Limits(max_tokens=4096, max_prompt_tokens=65536),
        api_key=None, chat=ChatRenderer(None, tok.decode([tok.eos_id])),
    )  # fmt: skip
    sock = bind_socket("127.0.0.1", 0)
    server = make_server(app, sock, grace_s=2)
    thread = threading.Thread(target=serve_forever, args=(server,), daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}", engine


async def stream(client, url: str, body: dict) -> tuple[float, float, int]:
    """(seconds to the first token, seconds to [DONE], completion tokens) of one streamed request."""
    t0 = time.perf_counter()
    first, tokens = None, 0
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk["choices"]:
                first = time.perf_counter() - t0
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return first, time.perf_counter() - t0, tokens


async def decode_rate(url: str, n_streams: int, tokens: int, salt: int) -> float:
    async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_connections=256)) as c:
        bodies = [
            {"prompt": f"row_{salt}_{i} = ", "max_tokens": tokens, "temperature": 0} for i in range(n_streams)
        ]
        t0 = time.perf_counter()
        out = await asyncio.gather(*(stream(c, url, b) for b in bodies))
        return sum(o[2] for o in out) / (time.perf_counter() - t0)


async def ttft(url: str, ids: list[int]) -> float:
    async with httpx.AsyncClient(timeout=3600) as c:
        return (await stream(c, url, {"prompt": ids, "max_tokens": 1, "temperature": 0}))[0]


def client_process(conn, url: str) -> None:
    """The load generator (a child process): answers (kind, args) requests until None."""
    calls = {"decode": decode_rate, "ttft": ttft, "one": one_stream_rate}
    while (msg := conn.recv()) is not None:
        kind, args = msg
        conn.send(asyncio.run(calls[kind](url, *args)))


class Clients:
    """The client process; `ask(kind, *args)` runs one measurement there and returns its number."""

    def __init__(self, url: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=client_process, args=(child, url), daemon=True)
        self.proc.start()

    def ask(self, kind: str, *args):
        self.conn.send((kind, args))
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(30)


def step_rate(model, batch: int, min_s: float = 2.0) -> float:
    """tokens/s of `model.step` alone at `batch` rows (at least 3 steps and `min_s` seconds): the ceiling
    the server's decode can reach."""
    cache = model.allocate_cache(batch)
    token_B = torch.zeros(batch, dtype=torch.long)
    steps = 0
    with torch.inference_mode():
        model.step(token_B, cache)
        t0 = time.perf_counter()
        while steps < 3 or time.perf_counter() - t0 < min_s:
            model.step(token_B, cache)
            steps += 1
    return batch * steps / (time.perf_counter() - t0)


def hybrid_pair(model_cfg):
    """(pure, hybrid) model configs of the same size (module docstring, "hybrid")."""
    pure = dataclasses.replace(model_cfg, n_layers=max(4, model_cfg.n_layers), attn_layer_idx=(), attn_cfg={})
    heads = max(1, pure.d_model // 64)
    attn_cfg = {"num_heads": heads, "rotary_emb_dim": pure.d_model // heads // 2, "qkv_proj_bias": False,
                "out_proj_bias": False}  # fmt: skip
    hybrid = dataclasses.replace(pure, attn_layer_idx=tuple(range(2, pure.n_layers, 4)), attn_cfg=attn_cfg)
    return pure, hybrid


def hybrid_rows(cfgs: tuple, tok, n_streams: int, tokens: int, repeat: int) -> list[str]:
    """The "hybrid" rows: decode tokens/s at `n_streams` streams of the pure and the hybrid model (best of
    `repeat`, interleaved), and their `model.step` ceilings."""
    rates, ceilings, sizes, servers = [], [], [], []
    for cfg in cfgs:
        torch.manual_seed(0)
        model = Mamba3Transformer(cfg).eval()
        sizes.append(sum(p.numel() for p in model.parameters()) / 1e6)
        server, thread, url, _ = start_server(model, tok, n_streams)
        servers.append((server, thread, Clients(url)))
        servers[-1][2].ask("decode", n_streams, 8, -1)  # warm-up
        ceilings.append(step_rate(model, n_streams))
        rates.append(0.0)
    for r in range(repeat):
        for i, (_, _, clients) in enumerate(servers):
            rates[i] = max(rates[i], clients.ask("decode", n_streams, tokens, 2000 + r * 1000 + n_streams))
    for server, thread, clients in servers:
        clients.close()
        server.should_exit = True
        thread.join(30)
    attn = ",".join(map(str, cfgs[1].attn_layer_idx))
    what = f"{cfgs[0].n_layers} layers, {sizes[0]:.2f}M vs {sizes[1]:.2f}M, attention at {attn}"
    return [
        row(f"decode tokens/s at {n_streams} streams, pure vs hybrid ({what})", f"{rates[0]:.1f}",
            f"{rates[1]:.1f}", rates[1] / rates[0], 0.8),
        row(f"model.step alone at {n_streams} rows, pure vs hybrid (ceiling)", f"{ceilings[0]:.1f}",
            f"{ceilings[1]:.1f}", ceilings[1] / ceilings[0], None),
    ]  # fmt: skip


def row(name: str, a: str, b: str, ratio: float, target: float | None) -> str:
    mark = "" if target is None else f">= {target:g}x" + ("" if ratio >= target else " MISS")
    return f"| {name} | {a} | {b} | {ratio:.2f}x | {mark} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per stream")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--streams", default="1,8,32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--hybrid", action=argparse.BooleanOptionalAction, default=True,
                    help="also compare a hybrid with the pure model of the same size")  # fmt: skip
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = load_config(args.preset)
    model = Mamba3Transformer(cfg.model).eval()
    tok = load_tokenizer("gpt2")
    streams = [int(s) for s in args.streams.split(",")]
    server, thread, url, engine = start_server(model, tok, max(streams))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"machine: {platform.machine()}, {torch.get_num_threads()} thread(s), {platform.platform()}")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"torch {torch.__version__}, cpu, preset {args.preset} ({n_params / 1e6:.2f}M parameters), fp32")
    print(
        f"{args.tokens} new tokens per stream, {args.prompt_tokens}-token TTFT prompt, best of {args.repeat}"
    )
    print()
    clients = Clients(url)
    clients.ask("decode", max(streams), 8, -1)  # warm-up: every batch size up to the largest
    rates = dict.fromkeys(streams, 0.0)
    for r in range(args.repeat):  # interleaved, so that a change in the machine's load hits every count
        for n in streams:
            rates[n] = max(rates[n], clients.ask("decode", n, args.tokens, r * 1000 + n))
    ceiling = {s: step_rate(model, s) for s in (streams[0], streams[-1])}
    g = torch.Generator().manual_seed(1)
    miss, hit, tail = [], [], []
    for _ in range(args.repeat):
        ids = torch.randint(0, tok.eos_id, (args.prompt_tokens,), generator=g).tolist()
        miss.append(clients.ask("ttft", ids))
        hit.append(clients.ask("ttft", ids))
        tail.append(clients.ask("ttft", ids + torch.randint(0, tok.eos_id, (16,), generator=g).tolist()))
    prompt = "def main():"
    gen, srv = [], []
    for _ in range(args.repeat):
        res = generate_text(model, tok, prompt, max_new_tokens=args.tokens, temperature=0.0)
        gen.append(res.new_tokens / res.seconds)
        srv.append(clients.ask("one", prompt, args.tokens))
    clients.close()
    server.should_exit = True
    thread.join(30)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    print("| measurement | A | B | B/A | target |")
    print("|---|---|---|---|---|")
    one = rates[streams[0]]
    for s in streams[1:]:
        target = 8.0 if (s == 32 and args.preset == "tiny") else None
        print(
            row(
                f"decode tokens/s, {streams[0]} vs {s} streams",
                f"{one:.1f}",
                f"{rates[s]:.1f}",
                rates[s] / one,
                target,
            )
        )
    c0, c1 = ceiling[streams[0]], ceiling[streams[-1]]
    print(
        row(
            f"model.step alone, {streams[0]} vs {streams[-1]} rows (ceiling)",
            f"{c0:.1f}",
            f"{c1:.1f}",
            c1 / c0,
            None,
        )
    )
    m, h, t = min(miss), min(hit), min(tail)
    print(
        row(
            f"TTFT s, {args.prompt_tokens}-token prompt: miss vs full hit",
            f"{m:.3f}",
            f"{h:.3f}",
            m / h,
            10.0,
        )
    )
    print(row(f"TTFT s, miss vs shared {args.prompt_tokens} + 16 new", f"{m:.3f}", f"{t:.3f}", m / t, None))
    gb, sb = max(gen), max(srv)
    print(row("tokens/s, generate vs 1 server stream", f"{gb:.1f}", f"{sb:.1f}", sb / gb, 0.9))
    if args.hybrid:
        for line in hybrid_rows(hybrid_pair(cfg.model), tok, streams[-1], args.tokens, args.repeat):
            print(line)
    print(
        f"\nprefix cache: {engine.prefix_cache.hits} hits, {engine.prefix_cache.bytes / 2**20:.1f} MiB held"
    )


async def one_stream_rate(url: str, prompt: str, tokens: int) -> float:
    async with httpx.AsyncClient(timeout=3600) as c:
        t0 = time.perf_counter()
        _, _, n = await stream(c, url, {"prompt": prompt, "max_tokens": tokens, "temperature": 0})
        return n / (time.perf_counter() - t0)


if __name__ == "__main__":
    main()
