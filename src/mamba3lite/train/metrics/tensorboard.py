"""The TensorBoard sink: each train and eval row's scalars (`row_scalars`) to event files in RUN/tb
(`rundir.TENSORBOARD_DIRNAME`), at the row's step, flushed per row as metrics.jsonl is.

Never fatal: a missing or broken `tensorboard` install, or an unwritable directory, is one warning and
the run goes on without it. The event file is opened at the first train or eval row, not when the sink
is built: a `train` that is refused after its logger exists (a checkpoint that does not fit the model,
say) leaves no `tb/events...` file in the run directory.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from mamba3lite.train.metrics.sink import row_scalars


class TensorBoardSink:
    """Scalars to DIR/tb when `tensorboard` is installed (else a warning and nothing)."""

    def __init__(self, log_dir: str | Path) -> None:
        self.log_dir = Path(log_dir)
        self._w = None
        self._failed = False
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._writer_cls = SummaryWriter
        except Exception as e:  # ImportError (no tensorboard) or a broken install: never fatal
            self._failed = True
            warnings.warn(
                f"TensorBoard disabled ({e}); `pip install 'mamba3lite[tensorboard]'` to enable", stacklevel=2
            )

    def _writer(self):
        if self._w is None and not self._failed:
            try:
                self._w = self._writer_cls(log_dir=str(self.log_dir))
            except Exception as e:  # an unwritable tb/: the run goes on without TensorBoard
                self._failed = True
                warnings.warn(f"TensorBoard disabled ({type(e).__name__}: {e})", stacklevel=3)
        return self._w

    def write(self, row: dict) -> None:
        if row.get("kind") == "event" or (w := self._writer()) is None:
            return
        for tag, value in row_scalars(row).items():
            w.add_scalar(tag, value, row["step"])
        w.flush()  # a row is on disk when it is written, as in metrics.jsonl

    def close(self) -> None:
        if self._w is not None:
            self._w.close()
