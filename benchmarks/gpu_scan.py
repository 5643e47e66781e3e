"""The scan alone on a GPU: the Triton kernels (model/scan_triton.py) beside the PyTorch chunked scan, at
the layer shapes of the presets, checked for equality and timed, in one run.

For each case (the scan inputs of one layer: batch B, heads H, length T, state N, head dim P, MIMO
rank R, chunk L; packed documents, i.e. resets, unless the case says otherwise):

1. Equality. fp32: triton vs chunked, y, the final state and the gradients of all six inputs, as the
   largest difference over the largest value (both compute in fp32: expect ~1e-6). bf16 autocast:
   triton and chunked each against the fp32 chunked result (bf16 matmuls: expect ~1e-2, triton no worse
   than chunked).
2. Speed and memory. Forward + backward (a weighted sum of y and h as the loss) under bf16 autocast,
   median ms over --steps timed runs after warm-ups, and the peak memory above the inputs
   (torch.cuda.max_memory_allocated): chunked eager, chunked compiled (torch.compile of the function),
   triton; ratios against chunked eager.

3. Decode: one token of the recurrence, `scan.scan_step` (PyTorch) beside the fused Triton step kernel
   (`triton_scan_step`), at each case's widths for 1 and 16 rows (bf16 q, k, v, an fp32 state, as in
   decode under bf16): largest relative difference and median µs per step, with the speed-up.

4. With --profile CASE: one forward + backward of the Triton scan at CASE under torch.profiler, the
   kernels (the state and chunk kernels each way, and the wrapper's PyTorch ops) by GPU time: where the
   time goes, should the ratios miss their targets.

    python benchmarks/gpu_scan.py [--cases siso_440m mimo_440m ...] [--steps 10] [--budget-s 240]
                                  [--profile siso_440m]

Without CUDA it runs under the Triton interpreter (TRITON_INTERPRET=1, set here) at --quick shapes, for
a smoke test only; its numbers say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
import traceback

import torch

from mamba3lite.model.scan import chunked_scan, scan_step
from mamba3lite.model.scan_triton import triton_chunked_scan, triton_scan_step, triton_unavailable_reason

START = time.perf_counter()
if not torch.cuda.is_available():  # the interpreter is chosen when the kernels are first built
    os.environ.setdefault("TRITON_INTERPRET", "1")
# name: (B, H, T, N, P, R, L, resets)
CASES = {
    "siso_180m": (16, 24, 2048, 128, 64, 1, 64, True),
    "siso_440m": (16, 32, 2048, 128, 64, 1, 64, True),
    "siso_440m_8k": (4, 32, 8192, 128, 64, 1, 64, True),
    "mimo_440m": (16, 32, 2048, 128, 64, 4, 16, True),
    "siso_440m_nodocs": (16, 32, 2048, 128, 64, 1, 64, False),
    "quick_siso": (2, 2, 37, 16, 16, 1, 16, True),  # CPU smoke shapes: three chunks, the last ragged
    "quick_mimo": (2, 2, 21, 16, 16, 2, 8, True),
}


def make_inputs(
    case: tuple, dev: torch.device, seed: int = 0
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    B, H, T, N, P, R, _, resets = case
    g = torch.Generator(device=dev).manual_seed(seed)

    def rand(*shape):
        return torch.rand(*shape, generator=g, device=dev)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=dev)

    q, k = randn(B, H, T, R, N) / N**0.5, randn(B, H, T, R, N)  # roughly the mixer's normed scale
    v = randn(B, H, T, R, P)
    dt = rand(B, H, T) * 0.1 + 0.001
    adt = -(rand(B, H, T) * 2 + 0.01) * dt
    lam = rand(B, H, T)
    reset = (rand(B, T) < 1 / 512) if resets else None  # documents of ~512 tokens
    return [x.requires_grad_() for x in (q, k, v, adt, dt, lam)], reset


def run(fn, inputs, reset, weights):
    y, h = fn(*inputs, reset_BT=reset)
    loss = (y.float() * weights[0]).sum() + (h * weights[1]).sum()
    return y, h, torch.autograd.grad(loss, inputs)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def check(case: tuple, dev: torch.device) -> dict:
    inputs, reset = make_inputs(case, dev)
    L = case[6]
    g = torch.Generator(device=dev).manual_seed(1)
    B, H, T, N, P, R = case[:6]
    weights = (
        torch.randn(B, H, T, R, P, generator=g, device=dev),
        torch.randn(B, H, P, N, generator=g, device=dev),
    )
    chunked = functools.partial(chunked_scan, chunk_size=L)
    triton = functools.partial(triton_chunked_scan, chunk_size=L)
    ref = run(chunked, inputs, reset, weights)
    got = run(triton, inputs, reset, weights)
    out = {"fp32": max(rel_err(a, b) for a, b in zip((got[0], got[1], *got[2]), (ref[0], ref[1], *ref[2])))}
    if dev.type == "cuda":  # the interpreter computes in fp32 whatever the autocast dtype
        for name, fn in (("bf16 chunked", chunked), ("bf16 triton", triton)):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                res = run(fn, inputs, reset, weights)
            out[name] = max(
                rel_err(a, b) for a, b in zip((res[0], res[1], *res[2]), (ref[0], ref[1], *ref[2]))
            )
    return out


def median_s(fn, dev: torch.device, steps: int, warmup: int) -> float:
    """Median seconds of `fn()` over `steps` timed calls after `warmup` untimed ones (synchronized on a
    GPU around each call)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_impl(fn, case: tuple, dev: torch.device, steps: int) -> tuple[float, float]:
    """(median ms of forward + backward under bf16 autocast on a GPU, peak MiB above the inputs)."""
    inputs, reset = make_inputs(case, dev)
    B, H, T, N, P, R = case[:6]
    weights = (torch.ones(B, H, T, R, P, device=dev), torch.ones(B, H, P, N, device=dev))
    amp = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if dev.type == "cuda"
        else torch.autocast("cpu", enabled=False)
    )

    def step():
        with amp:
            run(fn, inputs, reset, weights)

    for _ in range(2 if dev.type == "cuda" else 0):
        step()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    ms = 1e3 * median_s(step, dev, steps, warmup=0)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if dev.type == "cuda" else float("nan")
    return ms, peak


def time_decode(case: tuple, rows: int, dev: torch.device, steps: int, warmup: int) -> dict:
    """{impl: median µs of one decode step} and the kernel's largest relative difference, at `rows`."""
    _, H, _, N, P, R, _, _ = case
    g = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32):
        return torch.randn(*shape, generator=g, device=dev).to(dtype)

    dt = torch.rand(rows, H, generator=g, device=dev) * 0.1 + 0.001
    adt = -(torch.rand(rows, H, generator=g, device=dev) * 2 + 0.01) * dt
    lam = torch.rand(rows, H, generator=g, device=dev)
    inputs = (
        randn(rows, H, R, N), randn(rows, H, R, N), randn(rows, H, R, P), adt, dt, lam,
        randn(rows, H, P, N, dtype=torch.float32), randn(rows, R, H, N), randn(rows, R, H, P),
    )  # fmt: skip
    out = {}
    with torch.no_grad():
        want, got = scan_step(*inputs), triton_scan_step(*inputs)
        out["err"] = max(rel_err(a, b) for a, b in zip(got, want))
        for impl, fn in (("scan_step", scan_step), ("triton", triton_scan_step)):
            out[impl] = 1e6 * median_s(lambda f=fn: f(*inputs), dev, steps, warmup=warmup)
    return out


def profile(case: tuple, dev: torch.device) -> None:
    """Print the profiler's table of one bf16 forward + backward of the Triton scan at `case` (after a
    warm-up, so that autotuning is not in it), by GPU time (CPU time under the interpreter)."""
    inputs, reset = make_inputs(case, dev)
    B, H, T, N, P, R, L, _ = case
    weights = (torch.ones(B, H, T, R, P, device=dev), torch.ones(B, H, P, N, device=dev))
    fn = functools.partial(triton_chunked_scan, chunk_size=L)
    cuda = dev.type == "cuda"
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)
    with amp:
        run(fn, inputs, reset, weights)
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if cuda else []
    )
    with torch.profiler.profile(activities=activities) as prof, amp:
        run(fn, inputs, reset, weights)
        if cuda:
            torch.cuda.synchronize()
    sort = "cuda_time_total" if cuda else "cpu_time_total"
    print(f"\nprofile: triton scan fwd+bwd, B={B} T={T} H={H} N={N} P={P} R={R} L={L}, by {sort}")
    print(prof.key_averages().table(sort_by=sort, row_limit=15, max_name_column_width=48))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="+", choices=sorted(CASES), default=None)
    ap.add_argument("--quick", action="store_true", help="the CPU smoke shapes")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--budget-s", type=float, default=240, help="skip cases that would start after this")
    ap.add_argument("--profile", choices=sorted(CASES), help="profile the Triton scan at this case")
    args = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    reason = triton_unavailable_reason(dev)
    if reason is not None:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    quick = args.quick or dev.type != "cuda"
    names = args.cases or (
        ["quick_siso", "quick_mimo"] if quick else [n for n in CASES if not n.startswith("quick")]
    )
    print(f"device {torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu (Triton interpreter)'}")
    print("\n| case | B×T | H | N | P | R | L | fp32 err | bf16 err chunked | bf16 err triton |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    speed_rows, failed = [], False
    for name in names:
        case = CASES[name]
        B, H, T, N, P, R, L, _ = case
        if time.perf_counter() - START > args.budget_s:
            print(f"| {name} | skipped: over --budget-s |")
            continue
        try:
            errs = check(case, dev)
            cols = [f"{errs['fp32']:.1e}"] + [
                f"{errs[k]:.1e}" if k in errs else "-" for k in ("bf16 chunked", "bf16 triton")
            ]
            print(f"| {name} | {B}×{T} | {H} | {N} | {P} | {R} | {L} | " + " | ".join(cols) + " |")
            failed |= errs["fp32"] > 1e-3
            timings = {}
            for impl, fn in (
                ("chunked eager", functools.partial(chunked_scan, chunk_size=L)),
                ("chunked compiled", torch.compile(functools.partial(chunked_scan, chunk_size=L))),
                ("triton", functools.partial(triton_chunked_scan, chunk_size=L)),
            ):
                if quick and impl == "chunked compiled":
                    continue  # compile time would dominate a smoke run
                timings[impl] = time_impl(fn, case, dev, 1 if quick else args.steps)
            speed_rows.append((name, timings))
        except Exception:  # an out-of-memory or compile failure is recorded, and the run goes on
            failed = True
            print(f"| {name} | failed: {traceback.format_exc().strip().splitlines()[-1]} |")
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    print("\n| case | impl | fwd+bwd ms | speed-up vs chunked eager | peak MiB | memory vs chunked eager |")
    print("|---|---|---|---|---|---|")
    for name, timings in speed_rows:
        ms0, mem0 = timings["chunked eager"]
        for impl, (ms, mem) in timings.items():
            memory = f"{mem:.0f} | {mem / mem0:.2f}x" if dev.type == "cuda" else "- | -"
            print(f"| {name} | {impl} | {ms:.2f} | {ms0 / ms:.2f}x | {memory} |")
    print("\n| case | rows | decode step err | scan_step µs | triton µs | speed-up |")
    print("|---|---|---|---|---|---|")
    for name, _ in speed_rows:
        for rows in (1, 16):
            try:
                t = time_decode(CASES[name], rows, dev, *((1, 0) if quick else (100, 3)))
                print(
                    f"| {name} | {rows} | {t['err']:.1e} | {t['scan_step']:.0f} | {t['triton']:.0f} "
                    f"| {t['scan_step'] / t['triton']:.2f}x |"
                )
                failed |= t["err"] > 1e-4
            except Exception:
                failed = True
                print(f"| {name} | {rows} | failed: {traceback.format_exc().strip().splitlines()[-1]} |")
    if args.profile:
        try:
            profile(CASES[args.profile], dev)
        except Exception:  # a profiler failure does not fail the check
            print(f"profile failed: {traceback.format_exc().strip().splitlines()[-1]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
