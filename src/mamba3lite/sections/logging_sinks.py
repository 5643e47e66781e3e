"""LoggingConfig: the `logging:` section of a run's config (where the metrics rows go; one sink each in
train/metrics/)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from mamba3lite.errors import ConfigError, did_you_mean_hint
from mamba3lite.sections.fields import doc

LOGGING_SINKS = ("console", "tensorboard", "wandb", "progress", "jsonl")  # the order rows reach them


@dataclass
class LoggingConfig:
    """Where the metrics rows go (how often: training.log_every); `auto` is every sink that is available."""

    sinks: list[str] = doc(  # noqa: RUF009 (doc gives a list default its default_factory)
        ["auto"],
        "metrics sinks: console, jsonl (RUN/metrics.jsonl; required), tensorboard (RUN/tb), wandb, progress "
        "(a bar when stderr is a terminal and training.progress is on); auto = console, jsonl, progress, "
        "tensorboard when it is installed and wandb when a project is set, plus any named beside it. A "
        "named sink whose package is missing is an error",
    )
    wandb_project: str | None = doc(
        None,
        "Weights & Biases project of the wandb sink; unset: the WANDB_PROJECT environment variable (if "
        "that is unset too, auto has no wandb)",
    )
    wandb_run_name: str | None = doc(
        None, "display name of the W&B run; unset: the WANDB_RUN_NAME environment variable, else W&B's own"
    )

    def __post_init__(self) -> None:
        # The environment is read here, where the config is resolved (and recorded in config.yaml), not
        # by the logger's builder.
        self.wandb_project = self.wandb_project or os.environ.get("WANDB_PROJECT") or None
        self.wandb_run_name = self.wandb_run_name or os.environ.get("WANDB_RUN_NAME") or None
        names = [str(s).strip() for s in self.sinks]
        for name in names:
            if name not in (*LOGGING_SINKS, "auto"):
                known = ("auto", *LOGGING_SINKS)
                hint = did_you_mean_hint(name, known, otherwise=f"; known: {', '.join(known)}")
                raise ConfigError(f"logging.sinks: unknown sink `{name}`{hint}")
        if len(set(names)) != len(names) or not names:
            raise ConfigError(f"logging.sinks must name distinct sinks, got {list(self.sinks)}")
        if "auto" not in names and "jsonl" not in names:
            raise ConfigError(
                f"logging.sinks must include jsonl (or auto), got {names}: RUN/metrics.jsonl is the "
                "record that plot, inspect and resume read"
            )
        if "wandb" in names and not self.wandb_project:
            raise ConfigError(
                "logging.sinks names wandb but no project is set: set logging.wandb_project (or the "
                "WANDB_PROJECT environment variable)"
            )
        self.sinks = names
