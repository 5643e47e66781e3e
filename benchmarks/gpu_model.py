"""GPU benchmark (issue 4, "If your session has a GPU"): Mamba-3 presets, bf16, T = 2048, eager and compiled.

One prepared run on one accelerator, everything side by side in one process:

1. The device's bf16 matmul rate (mean of timed 8192³ products after warm-ups): the MFU denominator.
2. For each preset (default mamba3_180m and mamba3_440m) and each mode, forward + backward of the LM
   loss at --batch × 2048 tokens (default 16, the seed's micro batch; the 440M and larger presets have
   since been split to 8 × 4 accumulation to fit 80 GB), bf16 autocast over fp32 weights, as the trainer:
   - eager: the model as is (pure PyTorch chunked scan);
   - compiled: every layer wrapped by `torch.compile` (regional compilation: one graph, reused by all
     the identical layers, so compile time does not grow with depth); embedding and the fused chunked
     LM loss stay eager.
   Reported: tokens/s, ms per step, peak memory (torch.cuda.max_memory_allocated) beside the estimate
   of `mamba3lite.model.memory` (activations + fp32 weights and gradients; no optimizer state here),
   model train FLOPs per token (`model_flops_per_token`, 3 × forward), achieved FLOP/s and MFU, and the
   compile warm-up time.
3. With --baseline, the same-width, same-depth Transformer of bench_model.py (SDPA, flash on the GPU)
   in the same two modes, and a second table: Mamba-3 tokens/s ÷ the Transformer's, per preset and mode.

Every case is guarded: an error (out of memory, a compile failure) is recorded in its row and the run
goes on; cases that would start after --budget-s are skipped and marked so. Results are printed as a
markdown table and written as JSON (--json).

    python benchmarks/gpu_model.py [--presets mamba3_180m mamba3_440m] [--seq-len 2048] [--batch 16]
                                   [--steps 10] [--baseline] [--budget-s 420] [--json out.json]

On a machine without CUDA it runs on the CPU (for a smoke test use --presets tiny --seq-len 128
--batch 2 --steps 2); the numbers then say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import sys
import time
import traceback
from collections.abc import Callable

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_model import BaselineTransformer, transformer_flops_per_token
from mamba3lite.config import load_config
from mamba3lite.model import Mamba3Transformer, count_parameters, model_flops_per_token
from mamba3lite.model.memory import activation_bytes_per_token

START = time.perf_counter()


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn: Callable[[], object], dev: torch.device, n: int) -> float:
    """Mean seconds per call of `fn` over n calls (the caller has warmed it up)."""
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    sync(dev)
    return (time.perf_counter() - t0) / n


def matmul_rate(dev: torch.device) -> float:
    n = 8192 if dev.type == "cuda" else 1024
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    return 2 * n**3 / timed(lambda: a @ b, dev, 10)


@functools.cache
def activation_bytes(preset: str, seq_len: int) -> float:
    """memory.py's per-token, per-layer activation bytes of a preset (a CPU forward of one layer: once per
    preset, not per mode or batch retry)."""
    return activation_bytes_per_token(load_config(preset).model, seq_len)


def build(kind: str, preset: str, dev: torch.device) -> tuple[nn.Module, object]:
    cfg = load_config(preset).model
    torch.manual_seed(0)
    if kind == "mamba3":
        with dev:
            model = Mamba3Transformer(cfg)
    else:
        model = BaselineTransformer(cfg).to(dev)
    return model, cfg


def run_case(
    kind: str, preset: str, mode: str, args: argparse.Namespace, dev: torch.device, peak: float
) -> dict:
    row: dict = {"model": kind, "preset": preset, "mode": mode, "batch": args.batch, "seq_len": args.seq_len}
    model, cfg = build(kind, preset, dev)
    T = args.seq_len
    row["params"] = count_parameters(cfg) if kind == "mamba3" else sum(p.numel() for p in model.parameters())
    if kind == "mamba3":
        flops = model_flops_per_token(cfg, T)["train"]
    else:
        flops = 3 * transformer_flops_per_token(cfg, T)
    row["train_flops_per_token"] = flops
    if kind == "mamba3":  # what memory.py predicts for this run: activations + fp32 weights and grads
        act = activation_bytes(preset, T) * args.batch * T * cfg.n_layers
        row["est_mem_gib"] = (act + 8 * row["params"]) / 2**30
    if mode == "compiled":
        for block in model.layers:
            block.compile()
    model.train()
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, T + 1), generator=g).to(dev)
    amp = torch.autocast(dev.type, dtype=torch.bfloat16)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        with amp:
            loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()

    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    sync(dev)
    t0 = time.perf_counter()
    step()  # compiles in compiled mode
    sync(dev)
    row["first_step_s"] = time.perf_counter() - t0
    for _ in range(args.warmup):
        step()
    sec = timed(step, dev, args.steps)
    row["step_ms"] = sec * 1e3
    row["tokens_per_s"] = args.batch * T / sec
    row["flops_per_s"] = row["tokens_per_s"] * flops
    row["mfu"] = row["flops_per_s"] / peak
    if dev.type == "cuda":
        row["peak_mem_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
    return row


def guarded_case(
    kind: str, preset: str, mode: str, args: argparse.Namespace, dev: torch.device, peak: float, base: dict
) -> dict:
    """run_case, halving the batch after an out-of-memory error (down to 1); any other error is
    recorded in the row: one bad case must not lose the others."""
    batch = args.batch
    while True:
        try:
            case_args = argparse.Namespace(**{**vars(args), "batch": batch})
            row = run_case(kind, preset, mode, case_args, dev, peak)
            if batch != args.batch:
                row["note"] = f"batch {args.batch} ran out of memory"
            return row
        except torch.OutOfMemoryError:
            if batch == 1:
                return {**base, "error": "out of memory at batch 1"}
            print(f"  {kind} {preset} {mode}: out of memory at batch {batch}, retrying at {batch // 2}")
            batch //= 2
        except Exception as e:
            traceback.print_exc()
            return {**base, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}
        finally:
            gc.collect()
            with contextlib.suppress(Exception):
                torch.compiler.reset()
            if dev.type == "cuda":
                torch.cuda.empty_cache()


def fmt_row(r: dict) -> str:
    if "error" in r or "skipped" in r:
        why = r.get("error") or r.get("skipped")
        return f"| {r['model']} | {r['preset']} | {r['mode']} | {why} | | | | | | | | |"
    mem = f"{r['peak_mem_gib']:.1f}" if "peak_mem_gib" in r else "-"
    est = f"{r['est_mem_gib']:.1f}" if "est_mem_gib" in r else "-"
    return (
        f"| {r['model']} | {r['preset']} | {r['mode']} | {r['params'] / 1e6:.1f} M | {r['batch']} | "
        f"{r['tokens_per_s']:,.0f} | "
        f"{r['step_ms']:.1f} | {mem} | {est} | {r['train_flops_per_token'] / 1e9:.2f} G | "
        f"{r['flops_per_s'] / 1e12:.1f} T | {100 * r['mfu']:.1f}% | {r['first_step_s']:.1f} |"
    )


def ratio_table(rows: list[dict]) -> str:
    """Mamba-3 tokens/s ÷ the Transformer's, per preset and mode (per token, so unequal batches after an
    out-of-memory retry still compare)."""
    rate = {(r["model"], r["preset"], r["mode"]): r.get("tokens_per_s") for r in rows}
    lines = ["| preset | mode | Mamba-3 / Transformer tokens/s |", "|---|---|---|"]
    for (kind, preset, mode), m in rate.items():
        t = rate.get(("transformer", preset, mode))
        if kind == "mamba3":
            lines.append(f"| {preset} | {mode} | {f'{m / t:.2f}x' if m and t else '-'} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=["mamba3_180m", "mamba3_440m"])
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per case")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps after the first (compiling) one")
    ap.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    ap.add_argument("--baseline", action="store_true", help="also the same-shape SDPA Transformer")
    ap.add_argument("--budget-s", type=float, default=420, help="start no case after this many seconds")
    ap.add_argument("--json", default=None, help="write the rows here as JSON")
    args = ap.parse_args()

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = "CPU (no CUDA: numbers say nothing of a GPU)"
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
    torch.backends.cuda.matmul.allow_tf32 = True
    peak = matmul_rate(dev)
    head = [
        f"device: {name}; torch {torch.__version__}; python {sys.version.split()[0]}",
        f"bf16 matmul rate (mean of 10 square products after 3 warm-ups): {peak / 1e12:.1f} TFLOP/s",
        f"forward + backward of the LM loss, bf16 autocast, batch {args.batch} (halved on OOM) "
        f"x T {args.seq_len}; "
        f"mean of {args.steps} steps after {args.warmup + 1} warm-up steps",
    ]
    print("\n".join(head), flush=True)
    kinds = ["mamba3"] + (["transformer"] if args.baseline else [])
    rows = []
    cols = "| model | preset | mode | params | batch | tokens/s | ms/step | peak GiB | est GiB "
    cols += "| train FLOP/tok | FLOP/s | MFU | first step s |"
    print(cols + "\n" + "|---" * 13 + "|", flush=True)
    for kind in kinds:
        for preset in args.presets:
            for mode in args.modes:
                base = {"model": kind, "preset": preset, "mode": mode}
                if time.perf_counter() - START > args.budget_s:
                    row = {**base, "skipped": "skipped: over --budget-s"}
                else:
                    row = guarded_case(kind, preset, mode, args, dev, peak, base)
                rows.append(row)
                print(fmt_row(row) + (f" ({row['note']})" if "note" in row else ""), flush=True)
    print("(first step s: the first step's time; for compiled rows it is mostly the compile time)")
    if args.baseline:
        print(ratio_table(rows))
    print(f"total {time.perf_counter() - START:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": head, "peak_bf16_flops": peak, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
