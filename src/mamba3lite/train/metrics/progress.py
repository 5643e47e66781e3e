"""The progress bar: tqdm's steps, rate, ETA and last loss on stderr, only where stderr is an
interactive terminal (a log file gets no carriage-return noise) and the config asks for it.

Not a row sink: the logger moves it at every optimizer step (`update`) and restarts it after a resume
or rollback (`restart`), so rate and ETA are of the steps actually run. A bar that is not shown is a
bar whose every method does nothing (`ProgressBar.off()`): the logger never asks whether there is one.
While a bar is shown, lines are printed through `print_fn` (tqdm.write) so the bar is not torn.
"""

from __future__ import annotations

import sys
from collections.abc import Callable


class ProgressBar:
    """tqdm bar (steps, ETA, last loss) when `enabled` and stderr is a TTY; otherwise nothing."""

    def __init__(self, total: int, initial: int, enabled: bool) -> None:
        self._bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, leave=True)

    @classmethod
    def off(cls) -> ProgressBar:
        """A bar that is never shown."""
        return cls(total=0, initial=0, enabled=False)

    @property
    def print_fn(self) -> Callable[[str], None] | None:
        if self._bar is None:
            return None
        from tqdm import tqdm

        return lambda s: tqdm.write(s)

    def restart(self, step: int) -> None:
        """Count from `step` anew (after a resume or rollback): the rate and ETA are of the steps run
        from now, not of the resumed ones counted as done in no time."""
        if self._bar is not None:
            self._bar.reset(total=self._bar.total)
            self._bar.initial = self._bar.n = step
            self._bar.refresh()

    def update(self, step: int, loss: float | None) -> None:
        if self._bar is not None:
            self._bar.n = step
            if loss is not None:
                self._bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
            self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
