"""Compute precision on this CPU: a quickstart training step under training.dtype bf16 and auto, and a
Muon step alone with its Newton-Schulz in bf16 and in fp32, side by side.

    python benchmarks/bench_precision.py [--threads 1,2] [--rounds 3] [--steps 2] [--shape 192x3]
                                         [--vocab 4096]

The model is the quickstart's: the `tiny` preset with the recipe's optimizer, lr and batch, its 4,096-id
vocabulary (unless `--vocab` says otherwise), and `--shape` D x layers of its family (quickstart/recipe.py).
A training step is the quickstart's timing step (`recipe.time_shape`'s: forward under the resolved
dtype's autocast, backward, Muon + AdamW step) on random token ids; the Muon step alone is
`FullMatrixMuon.step` over the model's hidden matrices with fixed random gradients. The cases alternate
within each round (A, B, A, B, ...), in one process, after one untimed step each; printed: the median ms
per step and the ratio to the faster case, per thread count. What `auto` resolves to on this machine is
printed above the table (on a CPU with native bf16 the two training rows are the same computation).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from mamba3lite.config import Config, load_config
from mamba3lite.model import Mamba3Transformer
from mamba3lite.model.precision import resolve_precision
from mamba3lite.optimizers import is_hidden_matrix
from mamba3lite.quickstart import recipe
from mamba3lite.train.optim import FullMatrixMuon


def quickstart_config(shape: recipe.Shape, dtype: str, vocab: int = recipe.VOCAB) -> Config:
    """The quickstart's config at `shape`, with training.dtype `dtype` (and `vocab` ids)."""
    overrides = [*recipe.recipe_overrides(), f"model.vocab_size={vocab}", "model.eos_id=0"]
    return load_config("tiny").with_overrides([*overrides, *shape.overrides(), f"training.dtype={dtype}"])


def muon_step(cfg: Config, ns_dtype: torch.dtype) -> Callable[[], None]:
    """One Muon step over the hidden matrices of a fresh model of `cfg`, Newton-Schulz in `ns_dtype`."""
    torch.manual_seed(0)
    model = Mamba3Transformer(cfg.model)
    hidden = [p for n, p in model.named_parameters() if is_hidden_matrix(n, p)]
    for p in hidden:
        p.grad = torch.randn_like(p)
    opt = FullMatrixMuon(hidden, ns_dtype=ns_dtype, lr=1e-3, adjust_lr_fn="match_rms_adamw")
    return opt.step


def alternate(cases: dict[str, Callable[[], None]], rounds: int, steps: int) -> dict[str, float]:
    """Median seconds per call of each case, the cases alternating within each round."""
    for run in cases.values():
        run()  # untimed: first-call allocations
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, run in cases.items():
            for _ in range(steps):
                t0 = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per thread count")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per case per round")
    ap.add_argument("--shape", default="192x3", help="the quickstart shape D x layers")
    ap.add_argument("--vocab", type=int, default=recipe.VOCAB, help="vocabulary size (the quickstart's)")
    args = ap.parse_args(argv)
    d_model, n_layers = (int(x) for x in args.shape.split("x"))
    shape = recipe.Shape(d_model, n_layers)
    configs = {dtype: quickstart_config(shape, dtype, args.vocab) for dtype in ("bf16", "auto")}
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}; dtype auto here: "
          f"{resolve_precision('auto', 'cpu').reason}")  # fmt: skip
    print(f"quickstart shape {shape}, vocab {args.vocab:,}, batch {recipe.MICRO_BATCH} x {recipe.SEQ_LEN}, "
          f"Muon + AdamW; median of {args.rounds} alternating rounds x {args.steps} steps")  # fmt: skip
    print("\n| threads | case | ms/step | x fastest |\n|---|---|---|---|")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        train = alternate({f"train step, dtype={d}": recipe.training_step(c) for d, c in configs.items()},
                          args.rounds, args.steps)  # fmt: skip
        ns = {"Muon step alone, bf16 Newton-Schulz": torch.bfloat16, "Muon step alone, fp32 Newton-Schulz":
              torch.float32}  # fmt: skip
        muon = alternate({k: muon_step(configs["auto"], v) for k, v in ns.items()}, args.rounds, args.steps)
        for table in (train, muon):
            fastest = min(table.values())
            for name, s in table.items():
                print(f"| {threads} | {name} | {s * 1e3:,.0f} | {s / fastest:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
