"""Whether the quickstart compiles its model (torch.compile as `training.compile` does): only when it pays.

Compiling costs its seconds before the first step, once; it pays only when the seconds it saves over the
training time left exceed them. `choose_compile` is that rule, a pure function of four measurements;
`measure_compile` takes them on this machine for a config (eager and compiled steps of the same model
and optimizer, and the compile time: the compiled model's first step less an eager step).

Steps saved: with e and c the eager and compiled seconds per step, compile time K and training time
left W, the eager run takes W / e steps and the compiled one (W − K) / c; compiling wins when
(W − K) / c > W / e, i.e. when the gain W·(1 − c / e) exceeds K. A margin (COMPILE_MARGIN) keeps a
measurement's noise from choosing compile for a gain inside it.

Measuring costs a compile itself (minutes on a 2-core CPU), so `plan_compile` measures only when the
training time left could repay the cheapest compile at the speed-up compiling gave here
(EXPECTED_SPEEDUP, COMPILE_S_FLOOR) after paying for the measurement's own compile; a five- or
ten-minute quickstart never can, and says so without measuring.
The compiled path is the trainer's own (`training.compile`: the strategy's `wrap`), so what is measured
is what runs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from mamba3lite.quickstart.recipe import training_step

# Compile only if the time saved exceeds the compile time by this factor: the step times are medians of
# a few steps on a machine that may be shared, and a compiled run also recompiles for a new batch shape.
COMPILE_MARGIN = 1.5
PROBE_STEPS = 3  # timed steps of each form (after the compile, or one untimed eager step)
# Measured on the 2-core development VM (benchmarks/bench_cpu_step.py --compile, the quickstart's 192x3
# shape, fp32): compiling made a step 1.18x faster and its first step took minutes on the shared machine.
# The floor is a compile time below any seen there; with these two, compiling cannot pay in less than
# COMPILE_MARGIN * COMPILE_S_FLOOR / (1 - 1 / EXPECTED_SPEEDUP) seconds of training (plus the measuring
# compile's own), and a shorter run is not measured.
EXPECTED_SPEEDUP = 1.2
COMPILE_S_FLOOR = 60.0


@dataclass(frozen=True)
class CompileChoice:
    """The decision and its one-line reason, for the quickstart's plan."""

    compile: bool
    reason: str


def choose_compile(
    eager_step_s: float, compiled_step_s: float, compile_s: float, train_s: float
) -> CompileChoice:
    """Compile when the training seconds saved over `train_s` (the training time left, compile
    included) exceed `compile_s` by COMPILE_MARGIN; eager otherwise (also when compiling is slower
    per step, or when compile time is not finite: the compile failed)."""
    assert eager_step_s > 0 and compiled_step_s > 0 and train_s >= 0
    speedup = eager_step_s / compiled_step_s
    head = f"torch.compile: {eager_step_s * 1e3:.0f} -> {compiled_step_s * 1e3:.0f} ms/step ({speedup:.2f}x)"
    if not compile_s < float("inf"):
        return CompileChoice(False, "torch.compile failed here: eager")
    if compiled_step_s >= eager_step_s:
        return CompileChoice(False, f"{head}, no faster: eager")
    saved_s = train_s * (1 - compiled_step_s / eager_step_s)
    pays = saved_s > COMPILE_MARGIN * compile_s
    verdict = "compiled" if pays else "eager"
    relation = ">" if pays else "<="
    return CompileChoice(
        pays,
        f"{head} saves {saved_s:.0f} s of {train_s:.0f} s {relation} {COMPILE_MARGIN:g}x its "
        f"{compile_s:.0f} s compile: {verdict}",
    )


@dataclass(frozen=True)
class CompileTiming:
    """What `measure_compile` measured: seconds per step eager and compiled, and the compile seconds
    (inf when compiling failed)."""

    eager_step_s: float
    compiled_step_s: float
    compile_s: float


def time_steps(step: Callable[[], None], steps: int) -> list[float]:
    """Seconds of each of `steps` calls of `step`."""
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        out.append(time.perf_counter() - t0)
    return out


def measure_compile(cfg, steps: int = PROBE_STEPS) -> CompileTiming:
    """Eager and compiled (the trainer's `training.compile` path) seconds per step of `cfg`'s model and
    optimizer on this machine, the medians of `steps` steps each, and the compile time: the compiled
    model's first step less the eager median. A compile that raises gives compile_s = inf
    (choose_compile then says eager)."""
    eager = training_step(cfg)
    eager()  # untimed: first-call allocations
    eager_s = statistics.median(time_steps(eager, steps))
    compiled = training_step(cfg, compile=True)
    try:
        first_s = time_steps(compiled, 1)[0]
    except Exception:  # any compiler failure means: run eager
        return CompileTiming(eager_s, eager_s, float("inf"))
    compiled_s = statistics.median(time_steps(compiled, steps))
    return CompileTiming(eager_s, compiled_s, max(first_s - compiled_s, 0.0))


def plan_compile(
    cfg, train_s: float, measure: Callable[..., CompileTiming] = measure_compile
) -> CompileChoice:
    """The step path for `train_s` seconds of training of `cfg`: `choose_compile` on `measure(cfg)`
    when compiling could pay at all (module docstring), else eager without measuring. `measure` is the
    measurement (a parameter, so the rule is tested without compiling)."""
    if cfg.training.compile:
        return CompileChoice(True, "torch.compile (the config's training.compile)")
    # the measurement costs a compile of its own before the run's: it is worth it only when what is left
    # after it could still repay one
    least_s = COMPILE_S_FLOOR + COMPILE_MARGIN * COMPILE_S_FLOOR / (1 - 1 / EXPECTED_SPEEDUP)
    if train_s <= least_s:
        return CompileChoice(
            False,
            f"eager: torch.compile (~{EXPECTED_SPEEDUP:g}x a step here) cannot repay a compile of "
            f"{COMPILE_S_FLOOR:.0f} s or more in {train_s:.0f} s of training (it needs > {least_s:.0f} s)",
        )
    t = measure(cfg)
    return choose_compile(t.eager_step_s, t.compiled_step_s, t.compile_s, train_s)
