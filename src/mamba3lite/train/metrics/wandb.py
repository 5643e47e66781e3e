"""The Weights & Biases sink: each train and eval row's scalars (`row_scalars`) at the row's step.

Never fatal: any failure (package missing, auth, network, a failing log call) is a warning and disables
the sink; training never crashes because of W&B. `run_id` is the W&B run's id, stored in checkpoints so
that a resumed run continues the same W&B run (`run_id=` the stored one: `resume="allow"`).
"""

from __future__ import annotations

import warnings

from mamba3lite.train.metrics.sink import row_scalars


class WandbSink:
    """Rows to W&B project `project` (the run named `name`, its config `config`)."""

    def __init__(
        self, project: str, *, run_id: str | None = None, config: dict | None = None, name: str | None = None
    ) -> None:
        self.run_id: str | None = None
        self._wandb = None
        self._run = None
        try:
            import wandb

            self._run = wandb.init(
                project=project, id=run_id, resume="allow" if run_id else None, name=name, config=config
            )
            self._wandb = wandb
            self.run_id = getattr(self._run, "id", None) or run_id
        except Exception as e:
            warnings.warn(f"W&B disabled: {type(e).__name__}: {e}", stacklevel=2)

    def write(self, row: dict) -> None:
        if self._wandb is None:
            return
        try:
            if row["kind"] == "event":
                return
            self._wandb.log(row_scalars(row), step=row["step"])
        except Exception as e:
            warnings.warn(f"W&B logging failed, disabling it: {type(e).__name__}: {e}", stacklevel=2)
            self._wandb = None

    def close(self) -> None:
        if self._wandb is not None:
            try:
                self._wandb.finish()
            except Exception as e:
                warnings.warn(f"W&B finish failed: {e}", stacklevel=2)
