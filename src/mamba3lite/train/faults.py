"""Fault injection for tests: make chosen micro-steps' losses NaN (and hold a replica group at a step).

The environment variable MAMBA3LITE_INJECT_NONFINITE, read when the Pretrainer is built, names the
micro-steps. They are counted per process from 0 in execution order (not restored by resume or
rollback, so an injected fault does not recur after a rollback). Syntax: comma-separated items, each
an index `7` or a run `start:count` (`10:5` = 10..14); optionally prefixed by `rR@` to apply to rank R
only (`r1@3` = micro-step 3 on rank 1).
"""

from __future__ import annotations

import os
import time

import torch

from mamba3lite.errors import ConfigError

INJECT_ENV = "MAMBA3LITE_INJECT_NONFINITE"


def parse_injection(spec: str, rank: int = 0) -> set[int]:
    """Micro-step indices (this process's count) whose loss is made NaN; see the module docstring."""
    out: set[int] = set()
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        if "@" in item:
            who, _, item = item.partition("@")
            if not who.startswith("r") or not who[1:].isdigit():
                raise ConfigError(f"{INJECT_ENV}: bad rank prefix {who!r} (expected rN@...)")
            if int(who[1:]) != rank:
                continue
        try:
            if ":" in item:
                start, count = (int(v) for v in item.split(":"))
                out.update(range(start, start + count))
            else:
                out.add(int(item))
        except ValueError:
            raise ConfigError(f"{INJECT_ENV}: bad item {item!r} (expected N or START:COUNT)") from None
    return out


class FaultInjector:
    """The micro-step clock and the losses it spoils: `apply(loss)` once per micro-step."""

    def __init__(self, bad_micro_steps: set[int]) -> None:
        self.bad_micro_steps = bad_micro_steps
        self.micro_count = 0  # per process, never restored: see the module docstring

    @classmethod
    def from_env(cls, rank: int) -> FaultInjector:
        return cls(parse_injection(os.environ.get(INJECT_ENV, ""), rank))

    def apply(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss`, or NaN when this micro-step is one to spoil; advances the clock."""
        spoil = self.micro_count in self.bad_micro_steps
        self.micro_count += 1
        # NaN in value with the gradient of `loss` itself: the non-finite guard masks it with
        # torch.where, and the model's backward then sees an exact zero (loss * nan would send NaN
        # back into it: d(loss * nan)/d loss = nan, and 0 * nan = nan)
        return loss + (float("nan") - loss.detach()) if spoil else loss


# Fault-tolerance tests and benchmarks/bench_fault_tolerance.py: "STEP:PATH" holds this process before it
# starts step STEP + 1 until the file PATH exists, so that a healthy replica group is still training
# when a killed peer comes back (the caller creates PATH once the peer has restarted: an event, not a
# sleep). Unset: nothing is held.
HOLD_ENV = "MAMBA3LITE_FT_HOLD"


class StepHold:
    """The hold of HOLD_ENV (see above); `before(step)` once per step."""

    def __init__(self, spec: str) -> None:
        self.step, self.path = -1, None
        if spec:
            step, sep, path = spec.partition(":")
            if not sep or not step.isdigit() or not path:
                raise ConfigError(f"{HOLD_ENV}: expected STEP:PATH, got {spec!r}")
            self.step, self.path = int(step), path

    @classmethod
    def from_env(cls) -> StepHold:
        return cls(os.environ.get(HOLD_ENV, ""))

    def before(self, step: int) -> None:
        """Wait (polling) for the file when `step` steps are done and it is the held step."""
        if step == self.step and self.path is not None:
            while not os.path.exists(self.path):
                time.sleep(0.01)
            self.step = -1  # once: a heal that moves the step back past it does not hold again
