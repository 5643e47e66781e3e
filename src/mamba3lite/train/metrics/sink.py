"""The sink contract: what every destination of metrics rows implements, and the rows' scalars.

A row is a flat dict: `kind` ("train" | "eval" | "event"), `step`, `time` (unix s), mostly `tokens`,
then the kind's values (see `logger.py` for a train row's fields). A sink gets every row through
`write(row)` and is closed once by `close()`; it never raises for a destination that fails at run time
(a full disk for the console aside): an optional sink warns and disables itself. `NullSink` is "off"
(STYLE rule 11: a sink that does nothing, not an `if` in the loop).

`row_scalars(row)` is the one view of a row as named scalars that the TensorBoard and W&B sinks log.
"""

from __future__ import annotations

from typing import Protocol


class Sink(Protocol):
    def write(self, row: dict) -> None: ...
    def close(self) -> None: ...


class NullSink:
    """A sink that drops every row (the other ranks' logger, a test's)."""

    def write(self, row: dict) -> None:
        pass

    def close(self) -> None:
        pass


def row_scalars(row: dict) -> dict[str, float]:
    """A train or eval row's numbers as `{"train/loss": ...}` / `{"eval/val_loss": ...}` (prefix by
    kind; `step` and `time` are the axis, not values; booleans such as `warmup_window` are flags, not
    scalars). An event row has none: {}."""
    if row.get("kind") == "event":
        return {}
    prefix = "train" if row["kind"] == "train" else "eval"
    return {
        f"{prefix}/{k}": v
        for k, v in row.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step", "time")
    }
