"""Model benchmark: Mamba-3 (chunked scan, sequential reference) against a causal Transformer, one run.

Everything is measured side by side in the same process on this CPU (issue 4, "Benchmarks"):

1. This machine's matmul rate, fp32 and bf16 (best of a few 2048³ products): the MFU denominators.
2. Training throughput, forward + backward of the LM loss, batch 1 (tokens per step = T), for
   T = 512, 2048, 8192 and each dtype (bf16 = CPU autocast with fp32 weights, as the trainer; fp32):
   - Mamba-3 with the chunked scan (the training path),
   - Mamba-3 with the sequential reference scan (a Python loop over time; its autograd graph holds
     every step's P×N state, so it is measured up to --seq-max-len and, above that, ESTIMATED as its
     tokens/s at the longest measured T, marked "est."; optimistic, since its per-token cost was
     measured to grow with T),
   - a same-width, same-depth Llama-style Transformer as the baseline (baseline_transformer.py):
     RMSNorm -> causal multi-head attention through F.scaled_dot_product_attention with RoPE ->
     residual, RMSNorm -> the same SwiGLU MLP -> residual; tied head; the same fused chunked loss.
   Model FLOPs per token come from `model_flops_per_token` (Mamba-3) and from the same convention for the
   Transformer (2 per multiply-add; causal attention counted over the T/2 keys it actually attends to);
   training FLOPs = 3 × forward. Achieved FLOP/s = train FLOPs per token × tokens/s; MFU = that over the
   measured matmul rate of the same dtype.
3. The scan alone: `chunked_scan` forward + backward at the preset's shapes, T = 2048 (--scan-len), with
   its FLOPs (scan_intra + scan_state of one layer, × 3), as MFU against the bf16 and fp32 matmul rate.
   Inputs as the mixer hands them over (q, k, v in bf16 under bf16 autocast); the backward pass is
   driven by fixed random output gradients, so no loss ops are timed with it; best of >= 10 repeats.
4. Decode latency per token (batch 1, fp32) after a prefill of 128 and of 8192 tokens: Mamba-3's O(1)
   recurrent step against the Transformer's KV-cache step (whose work grows with the context).

Targets (issue 4): the scan >= 20% MFU in bf16 at T = 2048; Mamba-3 forward+backward at least on par
with the Transformer at T = 2048 and >= 3x faster at T = 8192; Mamba-3 decode latency flat in context.

The machine is shared and noisy: every time is the best of --reps repeats after a warm-up (a call
longer than 20 s is timed once), and only ratios are worth quoting. On an oversubscribed machine
torch's 2-thread OpenMP regions spin-wait for a descheduled thread (measured: a sequential-scan step
10-50x slower in wall time with 2 threads than with 1); `--threads 1 --clock cpu` then measures each
piece of work by this process's CPU time on one core, which other jobs' time slices do not inflate.
The matmul peak is measured the same way, so MFU stays a like-for-like ratio. --quick shrinks
everything (tiny model, short T) for a smoke run.

    python benchmarks/bench_model.py [--quick] [--threads 1 --clock cpu] [--reps 2] [--dtypes bf16,fp32]
                                     [--preset NAME]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from baseline_transformer import BaselineTransformer, transformer_flops_per_token
from mamba3lite.malloc import keep_freed_memory
from mamba3lite.model import Mamba3Transformer, ModelConfig, model_flops_per_token
from mamba3lite.model.scan import chunked_scan

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

# The benchmark's small model, pinned here so that results stay comparable while presets evolve: the
# paper's layer shape (N 128, P 64, expand 2, SwiGLU 2·D) at d_model 256 and 4 layers, with the project's
# GPT-2 vocabulary and tied head. --preset benchmarks a config preset's model instead.
SMALL = {"d_model": 256, "n_layers": 4, "d_intermediate": 512, "d_state": 128, "headdim": 64}
QUICK = {"vocab_size": 512, "eos_id": 511, "d_model": 64, "n_layers": 2, "d_intermediate": 128,
         "d_state": 32, "headdim": 32, "chunk_size": 32}  # fmt: skip


# ---------------------------------------------------------------- timing helpers
CLOCK: Callable[[], float] = time.perf_counter  # --clock cpu: time.process_time (see the docstring)
LONG_S = 20.0  # a call this long is timed once (its warm-up call is the measurement)


def best_time(fn: Callable[[], object], reps: int) -> float:
    """Best time of `reps` calls after one warm-up call (the machine is shared: min is the signal).
    A call longer than LONG_S is measured once: its one-off costs are then small against it."""
    t0 = CLOCK()
    fn()
    first = CLOCK() - t0
    if first > LONG_S:
        return first
    times = []
    for _ in range(reps):
        t0 = CLOCK()
        fn()
        times.append(CLOCK() - t0)
    return min(times)


def matmul_flops(dtype: torch.dtype, n: int, reps: int) -> float:
    """FLOP/s of an (n × n) @ (n × n) matmul in `dtype` on this CPU."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n**3 / best_time(lambda: a @ b, max(3, reps))


def autocast_for(dtype: str) -> contextlib.AbstractContextManager:
    if dtype == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def train_step_time(
    model: nn.Module, T: int, vocab: int, dtype: str, reps: int, layers_only: bool = False
) -> float:
    """Best seconds of one forward + backward of the LM loss on one random sequence of T tokens.
    layers_only: the loss is the mean square of the final hidden state (no LM head, no cross-entropy);
    both models' `_body(ids, None)` is their embedding -> layers -> final norm."""
    gen = torch.Generator().manual_seed(T)
    ids = torch.randint(0, vocab, (1, T + 1), generator=gen)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        with autocast_for(dtype):
            if layers_only:
                loss = model._body(ids[:, :-1], None).float().square().mean()
            else:
                loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()

    return best_time(step, reps)


def scan_time(cfg: ModelConfig, T: int, dtype: str, reps: int) -> float:
    """Best seconds of chunked_scan forward + backward for one layer at the preset's shapes, batch 1."""
    H, P, N, R = cfg.nheads, cfg.headdim, cfg.d_state, cfg.rank
    g = torch.Generator().manual_seed(0)
    # q, k, v in the dtype the mixer hands them over in: the autocast dtype under bf16 (mamba3._qk).
    qkv_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    q, k = (
        F.normalize(torch.randn(1, H, T, R, N, generator=g), dim=-1).to(qkv_dtype).requires_grad_()
        for _ in range(2)
    )
    v = torch.randn(1, H, T, R, P, generator=g).to(qkv_dtype).requires_grad_()
    dt = (0.01 + 0.1 * torch.rand(1, H, T, generator=g)).requires_grad_()
    adt = (-dt.detach() * torch.rand(1, H, T, generator=g)).requires_grad_()
    lam = torch.rand(1, H, T, generator=g).requires_grad_()

    with autocast_for(dtype):
        y, h = chunked_scan(q, k, v, adt, dt, lam, chunk_size=cfg.chunk_size)
    # Fixed random output gradients: the backward pass is the scan's alone, with no loss ops around it.
    gy, gh = torch.randn(y.shape, generator=g).to(y.dtype), torch.randn(h.shape, generator=g).to(h.dtype)

    def step() -> None:
        with autocast_for(dtype):
            y, h = chunked_scan(q, k, v, adt, dt, lam, chunk_size=cfg.chunk_size)
        torch.autograd.backward((y, h), (gy, gh))

    # A step takes tens of ms: more repeats than the whole-model rows, for a steadier best.
    return best_time(step, max(reps, 10))


def decode_latency(model: nn.Module, ctx: int, vocab: int, n_tokens: int, mamba: bool) -> float:
    """Median seconds per decoded token (batch 1, fp32) after a prefill of `ctx` tokens."""
    gen = torch.Generator().manual_seed(ctx)
    ids = torch.randint(0, vocab, (1, ctx), generator=gen)
    tok = torch.randint(0, vocab, (1,), generator=gen)
    with torch.no_grad():
        if mamba:
            cache = model.allocate_cache(1)
        else:
            cache = model.allocate_cache(1, ctx + n_tokens + 1)
        model.prefill(ids, cache)
        model.step(tok, cache)  # warm-up
        times = []
        for _ in range(n_tokens):
            t0 = CLOCK()
            model.step(tok, cache)
            times.append(CLOCK() - t0)
    return sorted(times)[len(times) // 2]


# ---------------------------------------------------------------- main
def build_config(args: argparse.Namespace) -> tuple[ModelConfig, str]:
    if args.preset:
        from mamba3lite.config import load_config

        return load_config(args.preset).model, f"preset {args.preset}"
    if args.quick:
        return ModelConfig(**QUICK), "quick (smoke-run shape)"
    return ModelConfig(**SMALL), "small (pinned in bench_model.py)"


def fmt_rate(x: float) -> str:
    return f"{x / 1e9:.1f} G" if x >= 1e9 else f"{x / 1e6:.0f} M"


def cpu_name() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model, short sequences, 1 repeat (smoke run)")
    ap.add_argument(
        "--preset", default=None, help="benchmark this config preset's model instead of the pinned small one"
    )
    ap.add_argument("--seq-lens", default=None, help="comma list of T (default 512,2048,8192)")
    ap.add_argument("--seq-max-len", type=int, default=None, help="longest T run with the sequential scan")
    ap.add_argument("--dtypes", default="bf16,fp32", help="comma list of bf16, fp32")
    ap.add_argument("--contexts", default=None, help="decode contexts (default 128,8192)")
    ap.add_argument("--decode-tokens", type=int, default=None, help="decode steps timed per context")
    ap.add_argument("--scan-len", type=int, default=None, help="T of the scan-only measurement (2048)")
    ap.add_argument(
        "--layers-only",
        action="store_true",
        help="training rows without the LM head and loss (the shared head bounds the full-LM ratio)",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall: perf_counter; cpu: this process's CPU time (with --threads 1 on a shared machine, the "
        "time the work would take on an idle core, free of other jobs' time slices)",
    )
    ap.add_argument("--reps", type=int, default=None, help="timed repeats per measurement (best is kept)")
    args = ap.parse_args()
    q = args.quick
    global CLOCK
    kept = keep_freed_memory()  # as the trainer and CLI do on CPU (mamba3lite/malloc.py); both models gain
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu":
        CLOCK = time.process_time
    seq_lens = [int(x) for x in (args.seq_lens or ("64,256" if q else "512,2048,8192")).split(",")]
    seq_max = args.seq_max_len or (256 if q else 2048)
    contexts = [int(x) for x in (args.contexts or ("16,256" if q else "128,8192")).split(",")]
    n_dec = args.decode_tokens or (4 if q else 32)
    scan_len = args.scan_len or (256 if q else 2048)
    reps = args.reps or (1 if q else 2)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if any(d not in DTYPES for d in dtypes):
        ap.error(f"--dtypes must be a comma list of {', '.join(DTYPES)}")

    torch.manual_seed(0)
    cfg, cfg_name = build_config(args)
    mamba = Mamba3Transformer(cfg)
    base = BaselineTransformer(cfg)
    n_mamba = sum(p.numel() for p in mamba.parameters())
    n_base = sum(p.numel() for p in base.parameters())
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"machine: {cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__} with "
        f"{torch.get_num_threads()} threads, {args.clock} clock; load average {load:.1f} at start; "
        f"glibc keeps freed memory: {kept}"
    )
    print(
        f"model: {cfg_name}: d_model {cfg.d_model}, {cfg.n_layers} layers, N {cfg.d_state}, P {cfg.headdim}, "
        f"H {cfg.nheads}, MLP {cfg.d_mlp}, vocab {cfg.vocab_size}, chunk {cfg.chunk_size}; Mamba-3 "
        f"{n_mamba / 1e6:.2f}M params, Transformer baseline {n_base / 1e6:.2f}M params; batch 1, "
        f"best of {reps} after a warm-up (the sequential reference: best of {max(1, reps - 1)})"
    )

    n_peak = 512 if q else 2048
    peak = {d: matmul_flops(DTYPES[d], n_peak, reps) for d in ("fp32", "bf16")}
    print(f"matmul peak (measured, {n_peak}^3 best of {max(3, reps)}): "
          f"fp32 {fmt_rate(peak['fp32'])}FLOP/s, bf16 {fmt_rate(peak['bf16'])}FLOP/s")  # fmt: skip
    parts = model_flops_per_token(cfg, 2048)
    share = ", ".join(f"{k} {100 * parts[k] / parts['forward']:.0f}%" for k in
                      ("projections", "scan_intra", "scan_state", "mlp", "lm_head"))  # fmt: skip
    print(f"Mamba-3 forward FLOPs/token at T=2048: {parts['forward'] / 1e6:.1f} M ({share})")
    head_flops = parts["lm_head"]  # forward, per token; the same tied head in both models, at any T

    # -- training throughput --
    rows = []
    for dtype in dtypes:
        seq_tok_s: float | None = None  # sequential tokens/s at the longest measured T (for estimates)
        for T in seq_lens:
            mamba.set_scan_impl("chunked")
            t_chunk = train_step_time(mamba, T, cfg.vocab_size, dtype, reps, args.layers_only)
            if seq_max >= T:
                mamba.set_scan_impl("sequential")
                seq_tok_s = T / train_step_time(
                    mamba, T, cfg.vocab_size, dtype, max(1, reps - 1), args.layers_only
                )
                seq_est = False
                mamba.set_scan_impl("chunked")
            else:
                seq_est = True
            t_base = train_step_time(base, T, cfg.vocab_size, dtype, reps, args.layers_only)
            head = head_flops if args.layers_only else 0
            m_flops = 3 * (model_flops_per_token(cfg, T)["forward"] - head)
            b_flops = 3 * (transformer_flops_per_token(cfg, T) - head)
            rows.append((T, dtype, T / t_chunk, seq_tok_s, seq_est, T / t_base, m_flops, b_flops))
            seq = f"{seq_tok_s:.0f}{' est.' if seq_est else ''}" if seq_tok_s else "n/a"
            print(f"  measured T={T} {dtype}: tokens/s chunked {T / t_chunk:.0f}, sequential {seq}, "
                  f"Transformer {T / t_base:.0f}", flush=True)  # fmt: skip

    # -- the scan alone --
    scan_rows = []
    sp = model_flops_per_token(cfg, scan_len)
    scan_flops = 3 * (sp["scan_intra"] + sp["scan_state"]) / cfg.n_layers  # per token, one layer
    # The same without the masked half of each chunk's L×L blocks, which the scan computes and discards:
    # the convention of the Transformer's causal attention count (T/2 keys per query).
    L = max(1, min(cfg.chunk_size, scan_len))
    causal_flops = 3 * (sp["scan_intra"] * (L + 1) / (2 * L) + sp["scan_state"]) / cfg.n_layers
    for dtype in dtypes:
        t = scan_time(cfg, scan_len, dtype, reps)
        scan_rows.append((dtype, scan_len / t, scan_flops * scan_len / t, causal_flops * scan_len / t))

    # -- decode --
    dec = []
    mamba.set_scan_impl("chunked")
    for ctx in contexts:
        t_m = decode_latency(mamba, ctx, cfg.vocab_size, n_dec, mamba=True)
        t_b = decode_latency(base, ctx, cfg.vocab_size, n_dec, mamba=False)
        dec.append((ctx, t_m, t_b))
        print(f"  measured decode ctx={ctx}: {1e3 * t_m:.2f} / {1e3 * t_b:.2f} ms", flush=True)

    # -- tables --
    print()
    what = (
        "the layers only (embedding -> layers -> norm; no LM head, no loss)"
        if args.layers_only
        else "the LM loss"
    )
    print(f"Training, forward + backward of {what}, tokens/s (batch 1; MFU against the measured matmul "
          "rate of the row's dtype)")  # fmt: skip
    print(
        "| T | dtype | Mamba-3 chunked | Mamba-3 sequential | chunked / sequential | Transformer (SDPA) "
        "| Mamba-3 / Transformer | FLOP ratio Transformer / Mamba-3 | Mamba-3 train FLOP/tok "
        "| Mamba-3 FLOP/s | Mamba-3 MFU | Transformer MFU |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for T, dtype, m_tok, s_tok, s_est, b_tok, m_flops, b_flops in rows:
        seq = f"{s_tok:.0f}" + (" est." if s_est else "") if s_tok else "n/a"
        ratio_seq = f"{m_tok / s_tok:.1f}x" + (" est." if s_est else "") if s_tok else "n/a"
        print(
            f"| {T} | {dtype} | {m_tok:.0f} | {seq} | {ratio_seq} | {b_tok:.0f} | {m_tok / b_tok:.2f}x "
            f"| {b_flops / m_flops:.2f}x | {m_flops / 1e6:.0f} M | {fmt_rate(m_flops * m_tok)} "
            f"| {100 * m_flops * m_tok / peak[dtype]:.1f}% | {100 * b_flops * b_tok / peak[dtype]:.1f}% |"
        )
    bound = "" if args.layers_only else "; the tied LM head is the same in both models and bounds it"
    print(f"(FLOP ratio: the speed-up Mamba-3 would have at equal FLOP/s{bound})")
    print()
    print(f"The chunked scan alone (one layer: H {cfg.nheads}, P {cfg.headdim}, N {cfg.d_state}, "
          f"chunk {cfg.chunk_size}), forward + backward, T = {scan_len}")  # fmt: skip
    print("| dtype | tokens/s | scan FLOP/s | MFU vs bf16 matmul | MFU vs fp32 matmul "
          "| causal-half MFU vs bf16 matmul |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for dtype, tok, fl, fl_causal in scan_rows:
        print(f"| {dtype} | {tok:.0f} | {fmt_rate(fl)} | {100 * fl / peak['bf16']:.1f}% "
              f"| {100 * fl / peak['fp32']:.1f}% | {100 * fl_causal / peak['bf16']:.1f}% |")  # fmt: skip
    print(
        "(scan FLOPs as computed: full L×L chunk blocks; causal-half: without their masked half, as the "
        "Transformer's attention is counted)"
    )
    print()
    print("Decode, ms per token (batch 1, fp32, median of the timed steps after a prefill of the context)")
    print("| context | Mamba-3 (recurrent step) | Transformer (KV cache) | Transformer / Mamba-3 |")
    print("|---|---|---|---|")
    for ctx, t_m, t_b in dec:
        print(f"| {ctx} | {1e3 * t_m:.2f} | {1e3 * t_b:.2f} | {t_b / t_m:.2f}x |")
    (c0, m0, b0), (c1, m1, b1) = dec[0], dec[-1]
    print(f"latency growth {c0} -> {c1}: Mamba-3 {m1 / m0:.2f}x (flat = 1), Transformer {b1 / b0:.2f}x")

    # -- targets --
    print()
    by = {(r[0], r[1]): r for r in rows}
    for dtype, _, fl, fl_causal in scan_rows:
        if dtype == "bf16":
            mfu, causal = fl / peak["bf16"], fl_causal / peak["bf16"]
            print(f"target scan >= 20% MFU in bf16 at T={scan_len}: {100 * mfu:.1f}% as computed -> "
                  f"{'met' if mfu >= 0.2 else 'NOT met'}; counting only the causal half of the chunk "
                  f"blocks {100 * causal:.1f}% -> {'met' if causal >= 0.2 else 'NOT met'}")  # fmt: skip
    for T, need in ((2048, 1.0), (8192, 3.0)):
        for d in dtypes:
            if (T, d) in by:
                ratio = by[(T, d)][2] / by[(T, d)][5]
                # With the LM head, even Mamba-3 layers that cost nothing leave the shared head's time: at
                # equal FLOP/s the speed-up cannot exceed Transformer FLOPs / head FLOPs.
                ceiling = "" if args.layers_only else (
                    f" (ceiling if Mamba-3's layers were free, at equal FLOP/s: "
                    f"{by[(T, d)][7] / (3 * head_flops):.2f}x)"
                )  # fmt: skip
                print(f"target Mamba-3 / Transformer >= {need:g}x at T={T} ({d}): {ratio:.2f}x -> "
                      f"{'met' if ratio >= need else 'NOT met'}{ceiling}")  # fmt: skip
    print(
        f"target flat decode: Mamba-3 latency x{m1 / m0:.2f} from context {c0} to {c1} -> "
        f"{'met' if m1 / m0 < 1.5 else 'NOT met'} (flat = within 1.5x on this noisy machine)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
