"""The quickstart's CPU training step: Mamba-3 against a same-shape Transformer, side by side (issue 33).

One training step = forward of the LM loss, backward, optimizer step (Muon for the hidden matrices, AdamW
for the rest, as the quickstart's recipe), on random token ids, at the quickstart's shape: the `tiny`
preset with the recipe's optimizer and batch (8 x 128 tokens), vocabulary 4096, `--shape` DxL of the
recipe's family (d_state 32, head dim 64, d_inner 2D, SwiGLU 2D). The baseline is bench_model.py's
Llama-style `BaselineTransformer` of the same width, depth, MLP, norms, tied head and loss.

The two models' steps alternate (A, B, A, B, ...) in one process, so a neighbour's load hits both alike;
the medians and their ratio are printed (`--clock cpu --threads 1`: this process's CPU time, which other
jobs on a shared machine do not inflate) (tokens/s of Mamba-3 over the Transformer's: issue 33's target is
>= 0.9). The machine is shared: quote ratios, not seconds.

`--dtype` is training.dtype (default auto: bf16 only where this CPU computes it natively,
model/precision.py); Muon's Newton-Schulz follows it, for both models alike, as in the trainer.

`--profile` adds, for the Mamba-3 step: torch.profiler's top-op table (forward + backward + optimizer,
self CPU time), the per-phase split (forward, backward, optimizer) and the mixer's parts (projections,
angles, norms, rotation, scan, gate/out) in the forward, and its hand-written backward Functions.
`--chunk-sizes 32,64,128` times the Mamba-3 step for each model.chunk_size, alternating.
`--compile` times torch.compile as the trainer compiles on one process (inductor): compile seconds and
the compiled step, beside the eager one (quickstart/compile_choice.py decides from these whether a run
should compile).

    python benchmarks/bench_cpu_step.py [--shape 192x3] [--dtype auto|fp32|bf16] [--threads 1] [--steps 10]
                                        [--profile] [--chunk-sizes 32,64,128] [--compile]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import Tensor, nn

from baseline_transformer import BaselineTransformer
from mamba3lite.config import load_config
from mamba3lite.model import Mamba3Transformer
from mamba3lite.model import mamba3 as mamba3_module
from mamba3lite.model.precision import resolve_precision
from mamba3lite.quickstart import recipe
from mamba3lite.quickstart.compile_choice import choose_compile
from mamba3lite.train.optim import build_optimizer
from mamba3lite.train.parallel.strategies import Local


def quickstart_config(shape: recipe.Shape, dtype: str, extra: list[str] = ()):
    """The quickstart's config at `shape` (the recipe's optimizer and batch, vocabulary 4096)."""
    overrides = [*recipe.recipe_overrides(), "model.vocab_size=4096", "model.eos_id=0"]
    return load_config("tiny").with_overrides(
        overrides + shape.overrides() + [f"training.dtype={dtype}"] + list(extra)
    )


class Trainee:
    """A model, its optimizer and one fixed batch; `step()` runs one training step."""

    def __init__(self, name: str, model: nn.Module, cfg, seed: int = 0, wrap=None) -> None:
        """`wrap`: what the step calls instead of `model` (e.g. the trainer's compiled form)."""
        self.name, self.cfg = name, cfg
        self.optimizer = build_optimizer(model, cfg.training)
        self.model = wrap(model) if wrap else model
        g = torch.Generator().manual_seed(seed)
        tc = cfg.training
        self.ids = torch.randint(
            0, cfg.model.vocab_size, (tc.micro_batch_size, tc.max_seq_len + 1), generator=g
        )
        self.tokens = tc.micro_batch_size * tc.max_seq_len
        self.autocast = resolve_precision(tc.dtype, "cpu").dtype

    def forward(self) -> Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast is not None):
            return self.model(self.ids[:, :-1], self.ids[:, 1:])

    def step(self) -> None:
        self.forward().backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


CLOCK = time.perf_counter  # --clock cpu: time.process_time


def alternate(trainees: list[Trainee], steps: int, warmup: int = 2) -> dict[str, list[float]]:
    """Seconds per step of each trainee, their steps interleaved (warm-up steps untimed)."""
    for _ in range(warmup):
        for t in trainees:
            t.step()
    times = {t.name: [] for t in trainees}
    for _ in range(steps):
        for t in trainees:
            t0 = CLOCK()
            t.step()
            times[t.name].append(CLOCK() - t0)
    return times


def print_times(times: dict[str, list[float]], tokens: int, reference: str) -> None:
    ref = statistics.median(times[reference])
    print(f"{'model':<28} {'median s/step':>14} {'min':>8} {'tokens/s':>10} {'tok/s vs ' + reference:>22}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<28} {med:>14.4f} {min(ts):>8.4f} {tokens / med:>10,.0f} {ref / med:>22.3f}")


# The mixer's forward parts, as the profiler labels them (method of Mamba3 -> label).
_PARTS = {
    "_project": "mixer.projections",
    "_normed": "mixer.bc_norm",
    "_qk": "mixer.bias_rotation",
    "_raw_values": "mixer.values",
    "_output": "mixer.gate_out",
}
_BACKWARD_PARTS = {
    "_ChunkCoreBackward": "scan",
    "_DecayWeightsBackward": "scan",
    "_BiasRotateBackward": "bias_rotation",
    "_GatedOutProjBackward": "gate_out",
}


def _labelled(fn: Callable, label: str) -> Callable:
    def wrapper(*args, **kwargs):
        with torch.profiler.record_function(label):
            return fn(*args, **kwargs)

    return wrapper


def profile(trainee: Trainee, steps: int, row_limit: int) -> None:
    """The top-op table of `steps` training steps and the per-phase / per-part split."""
    originals = {name: getattr(mamba3_module.Mamba3, name) for name in _PARTS}
    orig_angles, orig_scan = mamba3_module.cumulative_angles, None
    for name, label in _PARTS.items():
        setattr(mamba3_module.Mamba3, name, _labelled(originals[name], label))
    mamba3_module.cumulative_angles = _labelled(orig_angles, "mixer.angles")
    mixers = [m for m in trainee.model.modules() if isinstance(m, mamba3_module.Mamba3)]
    for m in mixers:
        m._bound_scan(trainee.ids.device)
        orig_scan = m._scan
        m._scan = _labelled(orig_scan, "mixer.scan")
    try:
        trainee.step()
        phases = {"forward": [], "backward": [], "optimizer": []}
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                t0 = time.perf_counter()
                with torch.profiler.record_function("phase.forward"):
                    loss = trainee.forward()
                t1 = time.perf_counter()
                with torch.profiler.record_function("phase.backward"):
                    loss.backward()
                t2 = time.perf_counter()
                with torch.profiler.record_function("phase.optimizer"):
                    trainee.optimizer.step()
                    trainee.optimizer.zero_grad(set_to_none=True)
                t3 = time.perf_counter()
                for k, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2)):
                    phases[k].append(dt)
    finally:
        for name in _PARTS:
            setattr(mamba3_module.Mamba3, name, originals[name])
        mamba3_module.cumulative_angles = orig_angles
        for m in mixers:
            m._scan = orig_scan
    events = prof.key_averages()
    print(f"\ntorch.profiler, {trainee.name}, {steps} steps (fwd + bwd + optimizer), by self CPU time:")
    print(events.table(sort_by="self_cpu_time_total", row_limit=row_limit))
    total = sum(sum(v) for v in phases.values())
    print(f"phases (wall, {steps} steps, the profiler's overhead included):")
    for k, v in phases.items():
        print(f"  {k:<10} {sum(v) / steps * 1e3:8.1f} ms/step  {sum(v) / total:6.1%}")
    by_key = {e.key: e for e in events}
    fwd = by_key["phase.forward"].cpu_time_total
    print("mixer forward parts (CPU time incl. children, all layers, share of the model forward):")
    for label in ["mixer.projections", "mixer.angles", "mixer.bc_norm", "mixer.bias_rotation", "mixer.values",
                  "mixer.scan", "mixer.gate_out"]:  # fmt: skip
        if label in by_key:
            e = by_key[label]
            print(
                f"  {label:<22} {e.cpu_time_total / steps / 1e3:8.2f} ms/step  {e.cpu_time_total / fwd:6.1%}"
            )
    bwd = by_key["phase.backward"].cpu_time_total
    print("mixer backward Functions (CPU time incl. children, share of the backward):")
    for e in events:
        for fname, part in _BACKWARD_PARTS.items():
            if e.key == f"autograd::engine::evaluate_function: {fname}":
                print(f"  {part:<14} {fname:<26} {e.cpu_time_total / steps / 1e3:8.2f} ms/step  "
                      f"{e.cpu_time_total / bwd:6.1%}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="192x3", help="d_model x n_layers of the recipe's family")
    ap.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"], help="training.dtype")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    ap.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                    help="cpu: this process's CPU time (with --threads 1, what a shared machine's other "
                    "jobs do not inflate)")  # fmt: skip
    ap.add_argument("--steps", type=int, default=10, help="timed steps per model (after 2 warm-up)")
    ap.add_argument("--profile", action="store_true", help="profile the Mamba-3 step (top ops, phases)")
    ap.add_argument("--profile-steps", type=int, default=5)
    ap.add_argument("--rows", type=int, default=18, help="rows of the profiler's table")
    ap.add_argument("--chunk-sizes", default="", help="e.g. 32,64,128: time Mamba-3 per model.chunk_size")
    ap.add_argument("--compile", action="store_true", help="time torch.compile (inductor)")
    ap.add_argument("--no-transformer", action="store_true", help="skip the Transformer baseline")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    d, n = (int(v) for v in args.shape.lower().split("x"))
    shape = recipe.Shape(d, n)
    cfg = quickstart_config(shape, args.dtype)
    mc, tc = cfg.model, cfg.training
    print(f"shape {shape} (d_state {mc.d_state}, headdim {mc.headdim}, d_inner {mc.d_inner}, SwiGLU "
          f"{mc.d_mlp}), vocab {mc.vocab_size}, batch {tc.micro_batch_size}x{tc.max_seq_len}, "
          f"chunk_size {mc.chunk_size}, dtype {resolve_precision(args.dtype, 'cpu').reason}, "
          f"threads {torch.get_num_threads()}, clock {args.clock}, torch {torch.__version__}")  # fmt: skip

    torch.manual_seed(0)
    mamba = Trainee("mamba3", Mamba3Transformer(mc), cfg)
    trainees = [mamba]
    if not args.no_transformer:
        torch.manual_seed(0)
        trainees.append(Trainee("transformer", BaselineTransformer(mc), cfg))
    if args.chunk_sizes:
        for L in (int(v) for v in args.chunk_sizes.split(",")):
            if mc.chunk_size == L:
                continue
            c = quickstart_config(shape, args.dtype, [f"model.chunk_size={L}"])
            torch.manual_seed(0)
            trainees.append(Trainee(f"mamba3 chunk_size={L}", Mamba3Transformer(c.model), c))
    times = alternate(trainees, args.steps)
    print_times(times, mamba.tokens, "transformer" if not args.no_transformer else "mamba3")

    if args.compile:
        torch.manual_seed(0)
        compiled = Trainee(
            "mamba3 compiled", Mamba3Transformer(mc), cfg, wrap=lambda m: Local().wrap(m, compile=True)
        )
        t0 = time.perf_counter()
        compiled.step()
        first_s = time.perf_counter() - t0
        times = alternate([mamba, compiled], args.steps, warmup=1)
        print(f"\ntorch.compile as the trainer compiles (inductor): first step (compiling) {first_s:.1f} s")
        print_times(times, mamba.tokens, "mamba3")
        eager_s, compiled_s = (statistics.median(times[t.name]) for t in (mamba, compiled))
        for minutes in (1, 5, 30):
            print(
                f"  {minutes:>2} min left: "
                + choose_compile(eager_s, compiled_s, first_s - compiled_s, 60 * minutes).reason
            )

    if args.profile:
        profile(mamba, args.profile_steps, args.rows)


if __name__ == "__main__":
    main()
