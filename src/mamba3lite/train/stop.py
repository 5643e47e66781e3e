"""The stop flag: SIGTERM / SIGINT (or a caller, e.g. a time budget) ask a run to stop after its step.

One `StopFlag` per run. `mamba3lite train` installs it once, for SIGTERM, around everything it does
(building the data and model, verifying and restoring a checkpoint, training), and passes it to the
trainer; the trainer adds SIGINT for the duration of `train()` (a Ctrl-C while the model is built
stays a plain interrupt). `installed()` is re-entrant per signal, so a signal is handled by this
flag from the outermost `installed()` that named it until that one exits. Off the main thread
(where Python cannot install handlers) `installed()` does nothing and the flag is only set by calls.
A second Ctrl-C after the first raises KeyboardInterrupt: stop now.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any


class StopFlag:
    """Set by a signal or `request(reason)`; the training loop checks `is_set()` after each step."""

    def __init__(self, announce: bool = True) -> None:
        """announce: print a line when a signal sets the flag (rank 0 of a run)."""
        self._event = threading.Event()
        self.reason = "signal"
        self.announce = announce
        self._handled: set[int] = set()

    def request(self, reason: str = "signal") -> None:
        """Ask the run to stop after the current step. Thread-safe; the first reason is kept."""
        if not self._event.is_set():
            self.reason = reason
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.request()
        if self.announce:
            print(
                f"received {signal.Signals(signum).name}: stopping after this step (saving a checkpoint)",
                flush=True,
            )

    @contextlib.contextmanager
    def installed(self, *signums: int, on_exit: Any = None) -> Iterator[StopFlag]:
        """Handle `signums` (default SIGTERM and SIGINT) with this flag inside the block; then restore
        the previous handlers, or set `on_exit` (e.g. signal.SIG_IGN) for them instead."""
        mine: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in signums or (signal.SIGTERM, signal.SIGINT):
                if sig not in self._handled:
                    mine[sig] = signal.signal(sig, self._on_signal)
                    self._handled.add(sig)
        try:
            yield self
        finally:
            for sig, previous in mine.items():
                signal.signal(sig, previous if on_exit is None else on_exit)
                self._handled.discard(sig)


class AgreedStop:
    """Whether every rank stops now. One process (`any_rank` None): its flag. Several: the flags as the
    step's one agreement read them (`settled`: no collective of its own in steady state; a flag set
    after that read, while the optimizer stepped, stops the run after the next step), or, after work
    outside the step (evaluation, save: `unsettle()`), a fresh agreement through `any_rank`."""

    def __init__(self, flag: StopFlag, any_rank: Callable[[bool], bool] | None) -> None:
        self.flag, self.any_rank = flag, any_rank
        self.settled: bool | None = None  # the stop flags as the last step's agreement read them

    def unsettle(self) -> None:
        """Time passes outside the step: the next `now()` agrees on the flags anew."""
        self.settled = None

    def now(self) -> bool:
        settled, self.settled = self.settled, None
        if self.any_rank is None:
            return self.flag.is_set()
        return settled if settled is not None else self.any_rank(self.flag.is_set())
