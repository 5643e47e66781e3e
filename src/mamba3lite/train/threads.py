"""ThreadWatch: a CPU run's torch thread count follows the machine's load.

Why. A CPU run keeps the thread count it starts with (torch's default, one per core, or the one the
quickstart's calibration timed as faster). When another job then starts on the machine, every OpenMP
parallel region of a multi-threaded step waits for a thread that is not scheduled: measured on a 2-core
machine, a 2-thread run fell from ~9,000 to ~500 tokens/s for the rest of the run, where 1 thread would
have kept most of its speed.

What. After each logged training window the trainer hands the window's train row to `after_window`.
Its seconds per step (`window_seconds / window_steps`, the numbers the metrics row carries: the logger
has already left evaluations and checkpoint saves out of `window_seconds`) feed `decide`, a pure
function of the watch's state (`ThreadState`) and the observation:

    slow    a window more than SLOW_FACTOR x the best window seen at the current count: the other count
            (1 thread, or back to the run's own) is tried for the next window
    room    at 1 thread while the run's own count is more, once the 1-minute load average leaves the
            CPUs the run's own count needs (within ROOM_MARGIN_CPUS): the run's own count is tried
            (1 thread does not get faster when the other job ends, so the slow rule cannot see it)
    trial   the window after a switch is kept if it was faster than the window that led to it; if not,
            the run goes back, and the next trial waits `backoff` windows, BACKOFF_GROWTH times longer
            after each lost trial (a won trial starts the back-off again at FIRST_BACKOFF_WINDOWS)

A window does not count (`seconds_per_step` is None) when it is a start-up window (`warmup_window`:
building, compiling, loading a checkpoint), holds skipped micro-steps (an abandoned step took time but
is not one of `window_steps`) or is shorter than MIN_WINDOW_SECONDS (noise). Every switch is one
"threads" event (metrics.jsonl and the console): "threads 2 -> 1: 0.71 s/step against 0.24 before (the
machine got busy); ...".

Where. `thread_watch(...)` builds a `ThreadWatch` for a CPU run of one process that starts with more than
one torch thread, with `training.cpu_threads_watch` on and no thread count pinned in the environment
(PINNING_VARIABLES); elsewhere a `NoThreadWatch`, which the trainer calls the same way. A run of several
processes has none: a rank's window time includes waiting for the other ranks, so it would not measure
its own threads.

Exactness. Torch's CPU kernels split sums by thread, so a run that switched is not bit for bit the run
that did not; a comparison that needs bit-exact runs fixes the count (OMP_NUM_THREADS, or the watch off).

State. Not checkpointed: `restore()` (the end of `train()`) puts the run's own count back, so a resumed
run, or the quickstart's run after its calibration, starts from that count and measures the machine as
it is then.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

# A window this many times the best seen at its thread count means contention, not noise: windows of a
# quiet machine differ by tens of percent, a run whose threads wait for a busy core slows several-fold
# (20x measured on 2 cores).
SLOW_FACTOR = 2.0
# Counted windows between a lost trial and the next one, growing BACKOFF_GROWTH times after each lost
# trial: a lost trial costs at most one window at the worse count, so over a run of N windows at most
# about log2(N) windows go to trials that lose, and the count does not flap on a machine whose load
# comes and goes. A won trial also waits this long before the next one (the load average lags a minute).
FIRST_BACKOFF_WINDOWS = 2
BACKOFF_GROWTH = 2
# The load average counts the run's own running threads; going back to the run's own count needs
# (own - current) more idle CPUs, less this margin for the prefetch thread and the average's rounding.
ROOM_MARGIN_CPUS = 0.5
# A window shorter than this does not count: a GC pause, page faults or one scheduler slice given to
# another process can double a 50-ms window, and such windows (a test's tiny model, a probe logging every
# step) gain nothing a switch could win back.
MIN_WINDOW_SECONDS = 1.0
# Set in the environment, these fix torch's thread count: the user chose it, the watch leaves it alone.
PINNING_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


@dataclass(frozen=True)
class ThreadState:
    """What the watch knows: the run's own thread count, the current one, the best (lowest) seconds per
    step seen at each count, the trial in progress (the count before it and the window that led to it),
    and the back-off."""

    own: int  # the count the run started with (torch's default or the caller's choice)
    current: int
    best: Mapping[int, float] = field(default_factory=dict)
    trial_from: tuple[int, float] | None = None  # (count, s/step of the window before the switch)
    wait: int = 0  # counted windows before another trial may start
    backoff: int = FIRST_BACKOFF_WINDOWS  # the wait after the next lost trial


@dataclass(frozen=True)
class Switch:
    """A change of thread count, `before` -> `after`, and why (the event's message)."""

    before: int
    after: int
    why: str

    @property
    def message(self) -> str:
        return f"threads {self.before} -> {self.after}: {self.why}"


def _threads(n: int) -> str:
    return f"{n} thread{'s' * (n != 1)}"


def decide(
    state: ThreadState, s_per_step: float | None, spare_cpus: float | None
) -> tuple[ThreadState, Switch | None]:
    """The state after one logged window that ran at `state.current` threads and took `s_per_step`
    seconds per step (None: a window that does not count), with `spare_cpus` CPUs idle by the load
    average (None: unknown; then the run never returns to its own count without a slow window), and
    the switch to make before the next window (None: keep the count). A pure function (the module
    docstring gives the rules)."""
    if s_per_step is None:
        return state, None
    assert s_per_step > 0 and math.isfinite(s_per_step), s_per_step
    cur, own = state.current, state.own
    best_before = state.best.get(cur)
    best = {**state.best, cur: min(s_per_step, best_before if best_before is not None else math.inf)}
    if state.trial_from is not None:  # this window was the trial
        before, before_s = state.trial_from
        if s_per_step < before_s:  # kept
            return replace(state, best=best, trial_from=None, wait=FIRST_BACKOFF_WINDOWS,
                           backoff=FIRST_BACKOFF_WINDOWS), None  # fmt: skip
        back = replace(state, current=before, best=best, trial_from=None, wait=state.backoff,
                       backoff=state.backoff * BACKOFF_GROWTH)  # fmt: skip
        why = (
            f"{_threads(cur)} {'was' if cur == 1 else 'were'} slower ({s_per_step:.2f} s/step against "
            f"{before_s:.2f} at {_threads(before)}); the next trial after {state.backoff} windows"
        )
        return back, Switch(cur, before, why)
    if state.wait > 0:
        return replace(state, best=best, wait=state.wait - 1), None
    other = 1 if cur == own else own
    if best_before is not None and s_per_step > SLOW_FACTOR * best_before:
        why = (
            f"{s_per_step:.2f} s/step against {best_before:.2f} before (the machine got busy); "
            f"{_threads(other)} for the next window, kept if faster"
        )
    elif cur != own and spare_cpus is not None and spare_cpus >= own - cur - ROOM_MARGIN_CPUS:
        why = (
            f"the load average leaves {spare_cpus:.1f} CPUs idle (the machine has room again); "
            f"{_threads(other)} for the next window, kept if faster than {s_per_step:.2f} s/step"
        )
    else:
        return replace(state, best=best), None
    return replace(state, current=other, best=best, trial_from=(cur, s_per_step)), Switch(cur, other, why)


def seconds_per_step(row: Mapping[str, Any]) -> float | None:
    """A train row's seconds per step, or None when the window does not count: a start-up window, one
    with skipped micro-steps, one shorter than MIN_WINDOW_SECONDS, or a row without the window's numbers."""
    if row.get("warmup_window") or row.get("skipped") or not row.get("window_steps"):
        return None
    seconds = row.get("window_seconds")
    return seconds / row["window_steps"] if seconds and seconds >= MIN_WINDOW_SECONDS else None


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the OS has one, else all of them)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def spare_cpus() -> float | None:
    """The CPUs this process may use minus the 1-minute load average (None without a load average)."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    return usable_cpus() - load


class ThreadWatch:
    """Follows `decide` after each logged window: sets torch's thread count and logs each switch.
    `set_threads` and `spare` are torch.set_num_threads and `spare_cpus` (replaceable in tests)."""

    def __init__(
        self,
        threads: int,
        *,
        set_threads: Callable[[int], None] = torch.set_num_threads,
        spare: Callable[[], float | None] = spare_cpus,
    ) -> None:
        assert threads > 1, threads
        self.state = ThreadState(own=threads, current=threads)
        self._set_threads, self._spare = set_threads, spare

    def after_window(self, row: dict | None, logger: Any) -> None:
        """The train row of a window that just closed (None: no window closed): switch the thread count
        for the next window when `decide` says so, with a "threads" event through `logger`."""
        if row is None:
            return
        # the load average matters only at a count below the run's own: read it only then
        spare = self._spare() if self.state.current != self.state.own else None
        self.state, switch = decide(self.state, seconds_per_step(row), spare)
        if switch is None:
            return
        self._set_threads(switch.after)
        logger.event(row["step"], "threads", switch.message, tokens_total=row.get("tokens"),
                     threads=switch.after, threads_before=switch.before)  # fmt: skip

    def restore(self) -> None:
        """Back to the run's own count, the watch's knowledge forgotten (the end of `train()`)."""
        if self.state.current != self.state.own:
            self._set_threads(self.state.own)
        self.state = ThreadState(own=self.state.own, current=self.state.own)


class NoThreadWatch:
    """Where the watch does not apply (CUDA, one thread, pinned threads, several processes, off): every
    call does nothing."""

    def after_window(self, row: dict | None, logger: Any) -> None:
        pass

    def restore(self) -> None:
        pass


def thread_watch(
    device: torch.device, world_size: int, enabled: bool, environ: Mapping[str, str] = os.environ
) -> ThreadWatch | NoThreadWatch:
    """The watch for a run on `device` with `world_size` processes (`enabled`: training.cpu_threads_watch):
    a `ThreadWatch` over torch's current thread count for a CPU run of one process with more than one
    thread and none of PINNING_VARIABLES set, else a `NoThreadWatch`."""
    threads = torch.get_num_threads()
    pinned = any(environ.get(name) for name in PINNING_VARIABLES)
    if not enabled or device.type != "cpu" or world_size > 1 or threads == 1 or pinned:
        return NoThreadWatch()
    return ThreadWatch(threads)
