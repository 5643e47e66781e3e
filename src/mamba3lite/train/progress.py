"""Where a run is, and what a `Pretrainer.train()` call did: plain records, no behaviour.

Progress      the counters a checkpoint restores (step, tokens) and this call's bookkeeping
TrainData     the datasets of a run, and why there is no validation data when there is none
TrainResult   what train() returns
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TrainResult:
    """What `Pretrainer.train()` did."""

    step: int  # optimizer steps completed (the run's global step)
    tokens_seen: int
    stopped: bool  # ended early by a signal (a checkpoint was written)
    history: list[tuple[int, float | None]] = field(default_factory=list)  # (step, loss) this call
    last_eval: dict | None = None
    steady_tokens_per_s: float | None = None
    rollbacks: int = 0  # of the run, earlier calls' (recorded in its checkpoints) included
    # a run by the clock (training.time_budget_minutes): its record at the end (train/clock.py: budget_s,
    # spent_s, progress) and this call's training seconds as "run_s"; None for a run of steps
    clock: dict | None = None


@dataclass
class Progress:
    """Where the run is: the counters a checkpoint restores, and what this `train()` call did."""

    step: int = 0  # optimizer steps completed
    tokens_seen: int = 0
    last_eval: dict | None = None  # {"step", "val_loss", ...} of the newest evaluation
    evaluated_at: int = -1  # the step of the last evaluation (its loss finite or not)
    last_saved: int = -1  # the step of the newest checkpoint this run wrote or loaded
    history: list[tuple[int, float | None]] = field(default_factory=list)  # (step, loss) this call


@dataclass
class TrainData:
    """The datasets of a run, and why there is no validation data when there is none."""

    train: Any
    val: Any
    no_val_reason: str = ""
