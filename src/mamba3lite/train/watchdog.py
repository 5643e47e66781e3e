"""Watchdog: a rank of a torchrun job that stops making progress says where it is stuck, then exits.

Why. A rank that waits forever (a collective whose peer is gone but whose connection is not closed, a
group creation that never completes, a deadlock) holds its devices and prints nothing: torchrun restarts
a job only when a worker exits. Bounded waits (training.dist_timeout_s, dist_init_timeout_s) cover the
collectives; this covers everything else.

What. `pet(what)` records that the run moved (a training step, an evaluation, a checkpoint save), with a
word for where it is. A thread checks every `poll_s`; once `timeout_s` pass without a pet it writes one
line naming the rank, the time and the last progress, then the Python stack of every thread (faulthandler),
and ends the process with EXIT_CODE: torchrun's next restart, or the operator, takes over. A rank stuck
in C code that holds the GIL cannot run that thread; faulthandler's own timer (a C thread, armed at
`timeout_s + FALLBACK_GRACE_S` on every pet) dumps the stacks and exits the process then.

`overdue` is the decision, a pure function of the clock; `NoWatchdog` is the same object that does nothing
(one process, or training.watchdog_s = 0), so the trainer pets without asking which it has.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

EXIT_CODE = 1
# faulthandler's timer fires this long after the Python thread should have: only when that thread could
# not run (the GIL held by a stuck C call).
FALLBACK_GRACE_S = 30.0


def overdue(now: float, last_pet: float, timeout_s: float) -> bool:
    """True when `timeout_s` seconds have passed since `last_pet` (both on one monotonic clock)."""
    return now - last_pet >= timeout_s


class Watchdog:
    """Ends this process with its stacks printed when `timeout_s` pass without `pet`. `clock`, `exit`
    and `out` are the test's to replace."""

    def __init__(
        self,
        timeout_s: float,
        rank: int,
        *,
        poll_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        exit: Callable[[int], object] = os._exit,
        out: TextIO | None = None,
        fallback: bool = True,
    ) -> None:
        assert timeout_s > 0
        self.timeout_s, self.rank = timeout_s, rank
        self.poll_s = poll_s if poll_s is not None else min(5.0, timeout_s / 4)
        self._clock, self._exit, self._out, self._fallback = clock, exit, out, fallback
        self._last, self._what = clock(), "the start"
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Watchdog:
        self._arm_fallback()
        self._thread = threading.Thread(target=self._watch, name="watchdog", daemon=True)
        self._thread.start()
        return self

    def pet(self, what: str) -> None:
        self._last, self._what = self._clock(), what
        self._arm_fallback()

    def stop(self) -> None:
        self._stopped.set()
        if self._fallback:
            faulthandler.cancel_dump_traceback_later()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def check(self) -> bool:
        """One look: fire (and return True) if overdue."""
        if not overdue(self._clock(), self._last, self.timeout_s):
            return False
        out = self._out or sys.stderr
        out.write(
            f"error: rank {self.rank} made no progress for {self.timeout_s:g} s (training.watchdog_s) since "
            f"{self._what}; the Python stacks of its threads follow, then it exits so that torchrun can "
            "restart the job\n"
        )
        out.flush()
        faulthandler.dump_traceback(file=out, all_threads=True)
        out.flush()
        self._exit(EXIT_CODE)
        return True

    def _watch(self) -> None:
        while not self._stopped.wait(self.poll_s):
            if self.check():
                return

    def _arm_fallback(self) -> None:
        if self._fallback:
            faulthandler.dump_traceback_later(
                self.timeout_s + FALLBACK_GRACE_S, exit=True, file=self._out or sys.stderr
            )


class NoWatchdog:
    """The watchdog of a run that has none: every call does nothing."""

    def start(self) -> NoWatchdog:
        return self

    def pet(self, what: str) -> None:
        pass

    def stop(self) -> None:
        pass


def watchdog_for(timeout_s: float, rank: int, distributed: bool) -> Watchdog | NoWatchdog:
    """A started Watchdog for a rank of a torchrun job with training.watchdog_s > 0, else a NoWatchdog."""
    return Watchdog(timeout_s, rank).start() if distributed and timeout_s > 0 else NoWatchdog()
