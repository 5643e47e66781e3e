"""What a starting run says about itself: pure functions of its settings and its sampler.

epoch_summary(sampler)        an epoch's size in steps and the windows each epoch skips
start_warnings(...)           settings that make the run other than it looks
"""

from __future__ import annotations


def epoch_summary(sampler) -> str:
    """An epoch's size in steps, and the windows each epoch skips (made visible: the seed's DataLoader
    dropped them silently). `sampler`: a WindowSampler."""
    s = sampler
    text = f"epoch {s.epoch} of {s.batches_per_epoch:,} steps over {s.n_windows:,} windows"
    if s.tail_per_epoch:
        text += (
            f", {s.tail_per_epoch:,} skipped per epoch (n_windows % global batch {s.global_batch_size}; "
            f"{'different ones each epoch' if s.shuffle else 'always the last ones'})"
        )
    return text


def start_message(step: int, goal: str, dist, tc, sampler, scan: str | None) -> str:
    """The "start" event's text: from where to where (`goal`: the schedule's, e.g. "step 2000"), on
    what, the step's tokens, the epoch, the scan backend that runs. `dist`: the DistInfo; `tc`: the
    TrainingConfig."""
    what = "resumed" if step else "start"
    return (
        f"{what} at step {step} -> {goal} on {dist.world_size} x {dist.device}; "
        f"{tc.tokens_per_step():,} tokens/step; {epoch_summary(sampler)}" + (f"; {scan} scan" if scan else "")
    )


def start_warnings(tc, step: int, until_step: int | None, no_val_reason: str | None, schedule) -> list[str]:
    """Settings that make the run other than it looks: no validation although evaluation is on
    (`no_val_reason`: why there is none, None when there is validation data), a warmup that never
    reaches the peak learning rate, nothing left to train. `tc`: the TrainingConfig; `schedule`: the
    run's (schedule.py)."""
    out = []
    if tc.eval_every and no_val_reason is not None:
        out.append(f"no validation data, so training.eval_every has no effect: {no_val_reason}")
    if tc.warmup_steps > tc.max_steps and schedule.clock is None:
        peak = schedule.lr(tc.max_steps - 1)
        out.append(
            f"training.warmup_steps {tc.warmup_steps} > training.max_steps {tc.max_steps}: the learning "
            f"rate only warms up, to {peak:.3g} instead of training.lr {tc.lr:g}; lower warmup_steps"
        )
    if until_step is None and (why := schedule.nothing_left(step)) is not None:
        out.append(why)
    return out
