"""The non-finite guard: what a NaN/Inf loss or gradient norm does to the run.

If a micro-step's loss is non-finite on ANY rank, every rank skips that micro-step: its backward
still runs (the strategy's collectives pair up on every rank) but on a loss masked to an exact zero, so
it adds nothing to the gradients (train/parallel/tally.py); the step's gradient is the mean over the
micro-steps that counted. After `max_consecutive` consecutive skipped
micro-steps, or as many consecutive steps whose losses were finite but whose gradient norm was not,
the run rolls back to the newest verified checkpoint and goes on with the data AFTER the failure (as
large runs skip the data around a loss spike: replaying it would most often diverge the same way).
After `max_rollbacks` rollbacks that did not lead to a newer checkpoint, the run stops.

The guard holds the counters and decides; the trainer does what it says (skip, roll back) and
reports. Verdicts: OK, SKIP, ROLLBACK.
"""

from __future__ import annotations

from mamba3lite.errors import TrainingError

OK, SKIP, ROLLBACK = "ok", "skip", "rollback"


class NonFiniteGuard:
    """Streaks of non-finite losses and gradient norms, rollbacks, and the work of skipped steps."""

    def __init__(self, max_consecutive: int, max_rollbacks: int) -> None:
        self.max_consecutive = max_consecutive
        self.max_rollbacks = max_rollbacks
        self.nan_streak = 0  # consecutive micro-steps with a non-finite loss
        self.bad_grad_streak = 0  # consecutive steps with finite losses but a non-finite gradient norm
        self.rollbacks = 0
        self._without_progress = 0  # rollbacks since a save past `_floor`
        self._floor = -1  # a save past this step counts as progress
        self.pending_skipped = 0  # micro-steps skipped since the last optimizer step
        self.pending_tokens = 0  # their tokens (processed, not learned from)

    def on_loss(self, finite: bool) -> str:
        """One micro-step's loss (finite on every rank or not): OK, SKIP or ROLLBACK."""
        if finite:
            self.nan_streak = 0
            return OK
        self.nan_streak += 1
        return ROLLBACK if self.nan_streak >= self.max_consecutive else SKIP

    def on_grad_norm(self, finite: bool) -> str:
        """One step's gradient norm, after finite losses: OK, SKIP or ROLLBACK. Counted per step: the
        finite losses of its micro-steps have just reset the loss streak."""
        if finite:
            self.bad_grad_streak = 0
            return OK
        self.bad_grad_streak += 1
        return ROLLBACK if self.bad_grad_streak >= self.max_consecutive else SKIP

    def on_abandoned_step(self, skipped: int, tokens: int) -> None:
        """A step whose optimizer update did not happen: its work is reported with the next step."""
        self.pending_skipped += skipped
        self.pending_tokens += tokens

    def take_pending(self) -> tuple[int, int]:
        """(skipped micro-steps, tokens) of the abandoned steps since the last update; resets them."""
        out = (self.pending_skipped, self.pending_tokens)
        self.pending_skipped = self.pending_tokens = 0
        return out

    def check_rollback(self, target: int, why: str, at_step: int, run_dir: object) -> None:
        """TrainingError when the run cannot roll back to `target` (-1: no checkpoint), or has rolled
        back `max_rollbacks` times without a newer checkpoint."""
        if target < 0:
            raise TrainingError(
                f"{why} at step {at_step} and no checkpoint in {run_dir} to roll back to; lower "
                "training.lr, check the data, or save earlier (training.save_every)"
            )
        if self._without_progress + 1 > self.max_rollbacks:
            raise TrainingError(
                f"non-finite losses again after {self._without_progress} rollback(s) to step {target} "
                f"without progress (training.max_rollbacks = {self.max_rollbacks}); lower training.lr or "
                "check the data around this step"
            )

    def on_rolled_back(self, target: int) -> None:
        self.rollbacks += 1
        self._without_progress += 1
        self._floor = max(self._floor, target)
        self.nan_streak = self.bad_grad_streak = 0
        self.pending_skipped = self.pending_tokens = 0

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the guard: the run's rollbacks so far (the streaks and the work
        pending end with the step that is saved)."""
        return {"rollbacks": self.rollbacks}

    def load_state_dict(self, state: dict) -> None:
        """A resumed run goes on counting its rollbacks (a rollback itself does not load this: its
        count goes on from the process's own)."""
        self.rollbacks = int(state.get("rollbacks") or 0)

    def on_saved(self, step: int) -> None:
        """A checkpoint of `step`: past every step rolled back to, it is progress."""
        if step > self._floor:
            self._without_progress = 0
