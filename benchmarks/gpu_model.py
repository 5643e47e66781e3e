"""GPU benchmark (issues 4 and 16): Mamba-3 presets, bf16, side by side with the Transformer and the official
Mamba-3 kernels, forward + backward of the LM loss.

One prepared run on one accelerator, everything in one process:

1. The device's bf16 matmul rate (mean of timed 8192³ products after warm-ups, 1024³ on the CPU;
   --matmul-n): the MFU denominator.
2. For each run shape (--runs PRESET:BxT; default mamba3_440m at 16 x 2048 and 4 x 8192, and
   mamba3_180m at 16 x 2048), bf16 autocast over fp32 weights, as the trainer:
   - mamba3 with each scan backend of --scan-impls (`triton`: the fused kernels; `chunked`: the pure
     PyTorch scan), each eager and compiled (--modes). "compiled" wraps every layer in `torch.compile`
     (regional compilation: one graph, reused by all the identical layers); embedding and the fused
     chunked LM loss stay eager;
   - with --baseline, the same-width, same-depth Transformer of baseline_transformer.py (SDPA, flash on the
     GPU), in --baseline-modes (default compiled, its faster mode);
   - with --official, the same LM with every mixer replaced by the official Mamba-3 layer
     (`mamba_ssm.modules.mamba3.Mamba3`, its fused Triton kernels) of the same shape (d_model, d_state,
     expand, headdim, ngroups, rope_fraction, chunk_size, ...), eager. When mamba_ssm does not import
     (not installed; the CUDA extensions of its package __init__ absent, as with
     MAMBA_SKIP_CUDA_BUILD=TRUE: then its Mamba-3 modules are imported without that __init__), the
     row says why and the run goes on. Its FLOPs are counted as ours (the same shapes).
   Reported: tokens/s, ms per step, peak memory (torch.cuda.max_memory_allocated), for chunked rows
   `mamba3lite.model.memory`'s estimate (activations + fp32 weights and gradients; no optimizer state
   here), train FLOPs per token (3 × forward), achieved FLOP/s, MFU and the first (compiling) step's time.
3. Ratios per run shape: triton / Transformer tokens/s (against the Transformer's fastest row),
   triton / official, triton / chunked (same mode), and peak memory triton / Transformer; then the
   issue-16 targets, each met or not.

Every case is guarded: an error (out of memory: the batch is halved and retried; a backend that cannot
run; a compile failure) is recorded in its row and the run goes on; cases that would start after
--budget-s are skipped and marked so. Results are printed as markdown tables and written as JSON (--json).

    python benchmarks/gpu_model.py [--runs mamba3_440m:16x2048 ...] [--scan-impls triton chunked]
                                   [--modes eager compiled] [--baseline] [--official] [--steps 10]
                                   [--budget-s 420] [--json out.json]

On a machine without CUDA it runs on the CPU (for a smoke test use --runs tiny:1x16 --steps 1
--warmup 0 --matmul-n 64); the numbers then say nothing about a GPU, and `triton` rows say why they
cannot run there unless TRITON_INTERPRET=1.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import importlib
import importlib.util
import json
import os
import re
import sys
import time
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from baseline_transformer import BaselineTransformer, transformer_flops_per_token
from mamba3lite.config import load_config
from mamba3lite.errors import Mamba3LiteError
from mamba3lite.model import Mamba3Transformer, ModelConfig, count_parameters, model_flops_per_token
from mamba3lite.model.memory import activation_bytes_per_token

START = time.perf_counter()
DEFAULT_RUNS = ["mamba3_440m:16x2048", "mamba3_440m:4x8192", "mamba3_180m:16x2048"]
# Issue 16's targets, per (preset, B x T): triton / Transformer tokens/s, and for 440M at 16 x 2048 also
# MFU, triton / official and memory triton / Transformer.
TARGETS = {
    ("mamba3_440m", 16, 2048): {"vs_transformer": 1.0, "mfu": 0.30, "vs_official": 1.0, "mem_ratio": 1.25},
    ("mamba3_440m", 4, 8192): {"vs_transformer": 2.0},
    ("mamba3_180m", 16, 2048): {"vs_transformer": 0.9},
}


@dataclass(frozen=True)
class Case:
    """One measured configuration. model: mamba3 | transformer | official; scan: the mamba3 backend
    (chunked | triton), "sdpa" for the Transformer, "mamba_ssm" for the official layer."""

    model: str
    scan: str
    preset: str
    mode: str
    batch: int
    seq_len: int

    def base_row(self) -> dict:
        return {**dataclasses.asdict(self), "requested_batch": self.batch}


def parse_run(text: str) -> tuple[str, int, int]:
    """`PRESET:BxT` (e.g. mamba3_440m:16x2048) -> (preset, batch, seq_len)."""
    m = re.fullmatch(r"([^:]+):(\d+)x(\d+)", text.strip())
    if not m or int(m.group(2)) < 1 or int(m.group(3)) < 1:
        raise argparse.ArgumentTypeError(f"expected PRESET:BxT, e.g. mamba3_440m:16x2048, got {text!r}")
    return m.group(1), int(m.group(2)), int(m.group(3))


def plan(args: argparse.Namespace) -> list[Case]:
    """Every case of the run, in the order run and printed, most informative first so that --budget-s
    cuts the least: per run shape (in --runs order), the first of --scan-impls (triton), the
    Transformer, the official layer, then the other backends (chunked, measured in earlier sessions)."""
    cases = []
    for shape in args.runs:
        cases += [Case("mamba3", args.scan_impls[0], shape[0], mode, *shape[1:]) for mode in args.modes]
        if args.baseline:
            cases += [Case("transformer", "sdpa", shape[0], m, *shape[1:]) for m in args.baseline_modes]
        if args.official:
            cases.append(Case("official", "mamba_ssm", shape[0], "eager", *shape[1:]))
        for scan in args.scan_impls[1:]:
            cases += [Case("mamba3", scan, shape[0], mode, *shape[1:]) for mode in args.modes]
    return cases


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


def matmul_rate(dev: torch.device, n: int | None = None) -> float:
    """FLOP/s of n x n bf16 products (n: 8192 on CUDA, 1024 on the CPU, where bf16 can take seconds a
    product without native support)."""
    n = n or (8192 if dev.type == "cuda" else 1024)
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    return 2 * n**3 / timed(lambda: a @ b, dev, 10)


@functools.cache
def activation_bytes(preset: str, seq_len: int) -> float:
    """memory.py's per-token, per-layer activation bytes of a preset with the chunked scan (a CPU forward
    of one layer: once per preset and T, not per mode or batch retry)."""
    cfg = dataclasses.replace(load_config(preset).model, scan_impl="chunked")
    return activation_bytes_per_token(cfg, seq_len)


def official_mamba3_class() -> type:
    """`mamba_ssm.modules.mamba3.Mamba3`, or ImportError saying why not.

    mamba_ssm's package __init__ imports its compiled CUDA extensions (selective_scan_cuda, ...), which a
    MAMBA_SKIP_CUDA_BUILD=TRUE install does not have; the Mamba-3 modules need only Triton. So when the
    plain import fails, the package is registered without running that __init__ and the import retried.
    """
    try:
        from mamba_ssm.modules.mamba3 import Mamba3
    except ImportError as first:
        spec = importlib.util.find_spec("mamba_ssm")
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("mamba_ssm is not installed (pip install mamba-ssm)") from None
        for name in [n for n in sys.modules if n == "mamba_ssm" or n.startswith("mamba_ssm.")]:
            del sys.modules[name]
        package = types.ModuleType("mamba_ssm")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["mamba_ssm"] = package
        try:
            Mamba3 = importlib.import_module("mamba_ssm.modules.mamba3").Mamba3
        except Exception as e:
            del sys.modules["mamba_ssm"]
            raise ImportError(f"{first}; without its __init__: {type(e).__name__}: {e}") from None
    return Mamba3


class OfficialMixer(nn.Module):
    """The official Mamba-3 layer behind our mixer's call (x, cache, reset_BT): no cache, no resets."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, u_BTD: torch.Tensor, cache=None, reset_BT=None) -> torch.Tensor:
        assert cache is None and reset_BT is None, "the official layer is benchmarked without cache/resets"
        return self.layer(u_BTD)


def official_lm(cfg: ModelConfig, dev: torch.device) -> nn.Module:
    """Our LM with every mixer replaced by the official Mamba-3 layer of the same shape."""
    Official = official_mamba3_class()
    if dev.type != "cuda":
        raise RuntimeError("the official Mamba-3 kernels need a CUDA device")
    with dev:
        model = Mamba3Transformer(cfg)
    for block in model.layers:
        layer = Official(
            d_model=cfg.d_model, d_state=cfg.d_state, expand=cfg.expand, headdim=cfg.headdim,
            ngroups=cfg.ngroups, rope_fraction=cfg.rope_fraction, dt_min=cfg.dt_min, dt_max=cfg.dt_max,
            dt_init_floor=cfg.dt_init_floor, A_floor=cfg.A_floor, is_outproj_norm=cfg.is_outproj_norm,
            is_mimo=cfg.is_mimo, mimo_rank=cfg.mimo_rank, chunk_size=cfg.chunk_size, device=dev,
        )  # fmt: skip
        block.mixer = OfficialMixer(layer)
    return model


def build(case: Case, dev: torch.device) -> tuple[nn.Module, ModelConfig]:
    cfg = load_config(case.preset).model
    torch.manual_seed(0)
    if case.model == "mamba3":
        with dev:
            model = Mamba3Transformer(cfg)
        model.set_scan_impl(case.scan, dev)  # a backend that cannot run here: a ConfigError, now
    elif case.model == "official":
        model = official_lm(cfg, dev)
    else:
        model = BaselineTransformer(cfg).to(dev)
    return model, cfg


def run_case(case: Case, args: argparse.Namespace, dev: torch.device, peak: float) -> dict:
    row = case.base_row()
    model, cfg = build(case, dev)
    T = case.seq_len
    row["params"] = (
        count_parameters(cfg) if case.model == "mamba3" else sum(p.numel() for p in model.parameters())
    )
    if case.model == "transformer":
        flops = 3 * transformer_flops_per_token(cfg, T)
    else:
        flops = model_flops_per_token(cfg, T)["train"]
    row["train_flops_per_token"] = flops
    if case.model == "mamba3" and case.scan == "chunked":  # memory.py measures the chunked scan
        act = activation_bytes(case.preset, T) * case.batch * T * cfg.n_layers
        row["est_mem_gib"] = (act + 8 * row["params"]) / 2**30
    if case.mode == "compiled":
        for block in model.layers:
            block.compile()
    model.train()
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (case.batch, T + 1), generator=g).to(dev)
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
    row["tokens_per_s"] = case.batch * T / sec
    row["flops_per_s"] = row["tokens_per_s"] * flops
    row["mfu"] = row["flops_per_s"] / peak
    if dev.type == "cuda":
        row["peak_mem_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
    return row


def one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}"


def guarded_case(case: Case, args: argparse.Namespace, dev: torch.device, peak: float) -> dict:
    """run_case, halving the batch after an out-of-memory error (down to 1); any other error is
    recorded in the row: one bad case must not lose the others."""
    batch = case.batch
    while True:
        try:
            row = run_case(dataclasses.replace(case, batch=batch), args, dev, peak)
            if batch != case.batch:
                row["note"] = f"batch {case.batch} ran out of memory"
            return row
        except torch.OutOfMemoryError:
            if batch == 1:
                return {**case.base_row(), "error": "out of memory at batch 1"}
            print(f"  {case.model} {case.scan} {case.preset} {case.mode}: out of memory at batch {batch}, "
                  f"retrying at {batch // 2}")  # fmt: skip
            batch //= 2
        except (Mamba3LiteError, ImportError) as e:  # expected: a backend or package that cannot run here
            return {**case.base_row(), "error": one_line(e)}
        except Exception as e:
            traceback.print_exc()
            return {**case.base_row(), "error": one_line(e)}
        finally:
            gc.collect()
            if case.mode == "compiled":  # an eager case has no graphs to drop (and need not import dynamo)
                with contextlib.suppress(Exception):
                    torch.compiler.reset()
            if dev.type == "cuda":
                torch.cuda.empty_cache()


COLUMNS = (
    "| model | scan | preset | mode | B x T | params | tokens/s | ms/step | peak GiB | est GiB "
    "| train FLOP/tok | FLOP/s | MFU | first step s |"
)


def fmt_row(r: dict) -> str:
    head = f"| {r['model']} | {r['scan']} | {r['preset']} | {r['mode']} | {r['batch']} x {r['seq_len']} |"
    if "error" in r or "skipped" in r:
        return head + f" {r.get('error') or r.get('skipped')} |" + " |" * 8
    mem = f"{r['peak_mem_gib']:.1f}" if "peak_mem_gib" in r else "-"
    est = f"{r['est_mem_gib']:.1f}" if "est_mem_gib" in r else "-"
    return head + (
        f" {r['params'] / 1e6:.1f} M | {r['tokens_per_s']:,.0f} | {r['step_ms']:.1f} | {mem} | {est} | "
        f"{r['train_flops_per_token'] / 1e9:.2f} G | {r['flops_per_s'] / 1e12:.1f} T | "
        f"{100 * r['mfu']:.1f}% | {r['first_step_s']:.1f} |"
    )


def shape_of(r: dict) -> tuple[str, int, int]:
    return r["preset"], r["requested_batch"], r["seq_len"]


def ratios(rows: list[dict]) -> list[dict]:
    """Per run shape and triton mode: triton's tokens/s over the Transformer's fastest row, the official
    layer's and chunked's in the same mode (per token, so a batch halved after out-of-memory still
    compares), and peak memory over the Transformer's (only where both ran at the same batch)."""
    ok = [r for r in rows if "tokens_per_s" in r]
    out = []
    for r in ok:
        if (r["model"], r["scan"]) != ("mamba3", "triton"):
            continue
        same = [o for o in ok if shape_of(o) == shape_of(r)]
        tf = max(
            (o for o in same if o["model"] == "transformer"), key=lambda o: o["tokens_per_s"], default=None
        )
        official = next((o for o in same if o["model"] == "official"), None)
        chunked = next((o for o in same if o["scan"] == "chunked" and o["mode"] == r["mode"]), None)
        mem = None
        if tf and "peak_mem_gib" in r and "peak_mem_gib" in tf and tf["batch"] == r["batch"]:
            mem = r["peak_mem_gib"] / tf["peak_mem_gib"]
        out.append({
            "preset": r["preset"], "batch": r["requested_batch"], "seq_len": r["seq_len"], "mode": r["mode"],
            "mfu": r["mfu"],
            "vs_transformer": r["tokens_per_s"] / tf["tokens_per_s"] if tf else None,
            "transformer_mode": tf["mode"] if tf else None,
            "vs_official": r["tokens_per_s"] / official["tokens_per_s"] if official else None,
            "vs_chunked": r["tokens_per_s"] / chunked["tokens_per_s"] if chunked else None,
            "mem_ratio": mem,
        })  # fmt: skip
    return out


def ratio_table(rs: list[dict]) -> str:
    lines = [
        "| preset | B x T | triton mode | triton / Transformer tokens/s | triton / official | "
        "triton / chunked (same mode) | peak memory triton / Transformer |",
        "|---|---|---|---|---|---|---|",
    ]
    for q in rs:
        tf = f"{q['vs_transformer']:.2f}x ({q['transformer_mode']})" if q["vs_transformer"] else "-"
        mem = f"{q['mem_ratio']:.2f}x" if q["mem_ratio"] else "-"
        lines.append(
            f"| {q['preset']} | {q['batch']} x {q['seq_len']} | {q['mode']} | {tf} | "
            f"{_fmt_x(q['vs_official'])} | {_fmt_x(q['vs_chunked'])} | {mem} |"
        )
    return "\n".join(lines)


def _fmt_x(x: float | None) -> str:
    return f"{x:.2f}x" if x else "-"


TARGET_LABELS = {
    "vs_transformer": "triton / Transformer tokens/s",
    "mfu": "triton MFU",
    "vs_official": "triton / official tokens/s",
    "mem_ratio": "peak memory triton / Transformer",
}


def target_lines(rs: list[dict], runs: list[tuple[str, int, int]]) -> list[str]:
    """Issue 16's targets for the run shapes measured, each against the best triton row of its shape:
    met, MISSED, or not measured."""
    lines = []
    for shape in runs:
        mine = [q for q in rs if (q["preset"], q["batch"], q["seq_len"]) == shape]
        for key, bound in TARGETS.get(shape, {}).items():
            lower_is_better = key == "mem_ratio"
            goal = f"{100 * bound:.0f}%" if key == "mfu" else f"{bound:g}x"
            what = f"target {shape[0]} {shape[1]} x {shape[2]}: {TARGET_LABELS[key]} "
            what += f"{'<=' if lower_is_better else '>='} {goal}"
            values = [q[key] for q in mine if q[key] is not None]
            if not values:
                lines.append(f"{what}: not measured")
                continue
            best = min(values) if lower_is_better else max(values)
            met = best <= bound if lower_is_better else best >= bound
            shown = f"{100 * best:.1f}%" if key == "mfu" else f"{best:.2f}x"
            lines.append(f"{what}: {shown}, {'met' if met else 'MISSED'}")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", nargs="+", type=parse_run, default=[parse_run(r) for r in DEFAULT_RUNS],
                    metavar="PRESET:BxT", help=f"run shapes (default: {' '.join(DEFAULT_RUNS)})")  # fmt: skip
    ap.add_argument("--scan-impls", nargs="+", default=["triton", "chunked"], choices=["triton", "chunked"])
    ap.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    ap.add_argument("--baseline", action="store_true", help="also the same-shape SDPA Transformer")
    ap.add_argument("--baseline-modes", nargs="+", default=["compiled"], choices=["eager", "compiled"])
    ap.add_argument("--official", action="store_true", help="also the official Mamba-3 layer (mamba_ssm)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per case")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps after the first (compiling) one")
    ap.add_argument("--budget-s", type=float, default=420, help="start no case after this many seconds")
    ap.add_argument("--matmul-n", type=int, default=None,
                    help="side of the timed square bf16 products, the MFU denominator (default 8192 on "
                    "CUDA, 1024 on the CPU)")  # fmt: skip
    ap.add_argument("--json", default=None, help="write the rows here as JSON")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    if args.matmul_n is not None and args.matmul_n < 1:
        ap.error("--matmul-n must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = "CPU (no CUDA: numbers say nothing of a GPU)"
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
    torch.backends.cuda.matmul.allow_tf32 = True
    peak = matmul_rate(dev, args.matmul_n)
    head = [
        f"device: {name}; torch {torch.__version__}; python {sys.version.split()[0]}",
        f"bf16 matmul rate (mean of 10 square products after 3 warm-ups): {peak / 1e12:.1f} TFLOP/s",
        "forward + backward of the LM loss, bf16 autocast over fp32 weights, B x T per row (B halved on "
        f"OOM); mean of {args.steps} steps after {args.warmup + 1} warm-up steps",
    ]
    print("\n".join(head), flush=True)
    rows = []
    print(COLUMNS + "\n" + "|---" * (COLUMNS.count("|") - 1) + "|", flush=True)
    for case in plan(args):
        if time.perf_counter() - START > args.budget_s:
            row = {**case.base_row(), "skipped": "skipped: over --budget-s"}
        else:
            row = guarded_case(case, args, dev, peak)
        rows.append(row)
        print(fmt_row(row) + (f" ({row['note']})" if "note" in row else ""), flush=True)
    print("(first step s: the first step's time; for compiled rows it is mostly the compile time)")
    rs = ratios(rows)
    if rs:
        print("\n" + ratio_table(rs))
    targets = target_lines(rs, args.runs)
    if targets:
        print("\n" + "\n".join(targets))
    print(f"total {time.perf_counter() - START:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": head, "peak_bf16_flops": peak, "rows": rows, "ratios": rs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
