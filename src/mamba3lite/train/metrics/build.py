"""The standard logger of a run, its sinks named by the config's `logging.sinks`.

    console      one line per row on stdout (`console.py`)
    jsonl        RUN/metrics.jsonl (`jsonl.py`); required: plot, inspect and resume read it
    tensorboard  RUN/tb event files (`tensorboard.py`; the tensorboard extra)
    wandb        Weights & Biases, project `logging.wandb_project` (`wandb.py`; the wandb extra)
    progress     a tqdm bar, shown when stderr is a terminal and `training.progress` is on
    auto         console, jsonl and progress, tensorboard when it is installed, wandb when a project is
                 set (the default: what a run did before sinks were configurable)

`resolve_sinks(cfg)` turns the list into the sinks a run gets and is the check: a sink named
explicitly whose package is missing is a ConfigError with the install hint (under `auto` a missing
TensorBoard is silently left out, and W&B's absence is the sink's warning). Call it early (before a
run changes anything) to refuse such a config at once; `build_logger` calls it again. The builder reads
no environment variable: `WANDB_PROJECT` and `WANDB_RUN_NAME` are resolved into the config
(`LoggingConfig`).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from mamba3lite.config import LOGGING_SINKS, LoggingConfig
from mamba3lite.errors import ConfigError
from mamba3lite.rundir import METRICS_NAME, TENSORBOARD_DIRNAME
from mamba3lite.train.metrics.console import ConsoleSink
from mamba3lite.train.metrics.jsonl import JsonlSink
from mamba3lite.train.metrics.logger import TrainingLogger
from mamba3lite.train.metrics.progress import ProgressBar
from mamba3lite.train.metrics.sink import Sink

# The package each optional sink needs (imported to check: a broken install counts as missing).
_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


def _importable(package: str) -> bool:
    try:
        __import__(package)
    except ImportError:
        return False
    return True


def resolve_sinks(cfg: LoggingConfig) -> list[str]:
    """The sinks a run with `cfg` gets, in `LOGGING_SINKS` order (see the module docstring); a
    ConfigError for a named sink whose package is missing."""
    named = {name for name in cfg.sinks if name != "auto"}
    for name in sorted(named & _PACKAGES.keys()):
        if not _importable(_PACKAGES[name]):
            raise ConfigError(
                f"logging.sinks names {name}, but the {_PACKAGES[name]} package is not installed: "
                f"pip install 'mamba3lite[{name}]' (or leave {name} out of logging.sinks)"
            )
    if "auto" in cfg.sinks:
        named |= {"console", "jsonl", "progress"}
        if _importable("tensorboard"):
            named.add("tensorboard")
        if cfg.wandb_project:
            named.add("wandb")
    return [name for name in LOGGING_SINKS if name in named]


def build_logger(
    run_dir: str | Path,
    *,
    log_every: int,
    flops_per_token: float | None,
    peak_flops_per_s: float | None,
    device: Any,
    max_steps: int,
    start_step: int,
    progress: bool,
    wandb_run_id: str | None = None,
    config: dict | None = None,
    logging_config: LoggingConfig | None = None,
) -> TrainingLogger:
    """The logger of the run in `run_dir` with the sinks of `logging_config` (default `LoggingConfig()`:
    `auto`, the W&B project from the environment). `progress` is `training.progress`; `wandb_run_id`
    continues a W&B run; `config` is the resolved config W&B records."""
    cfg = logging_config if logging_config is not None else LoggingConfig()
    names = resolve_sinks(cfg)
    run_dir = Path(run_dir)
    bar = ProgressBar(total=max_steps, initial=start_step, enabled=progress and "progress" in names)
    sinks: list[Sink] = []
    if "console" in names:
        sinks.append(ConsoleSink(bar.print_fn))
    if "tensorboard" in names:
        from mamba3lite.train.metrics.tensorboard import TensorBoardSink

        sinks.append(TensorBoardSink(run_dir / TENSORBOARD_DIRNAME))
    if "wandb" in names:
        from mamba3lite.train.metrics.wandb import WandbSink

        assert cfg.wandb_project, "LoggingConfig refuses wandb without a project"
        sinks.append(
            WandbSink(cfg.wandb_project, run_id=wandb_run_id, config=config, name=cfg.wandb_run_name)
        )
    return TrainingLogger(
        log_every=log_every,
        sinks=sinks,
        jsonl=JsonlSink(run_dir / METRICS_NAME),
        flops_per_token=flops_per_token,
        peak_flops_per_s=peak_flops_per_s,
        device=device,
        progress=bar,
    )


def run_logger(cfg, run_dir: str | Path, *, device: Any, world_size: int, start_step: int,
               wandb_run_id: str | None) -> TrainingLogger:  # fmt: skip
    """The logger of a training run of the resolved config `cfg` (a `Config`): its cadence, its sinks
    (`cfg.logging`), and MFU from the model's FLOPs per token over the peak of all `world_size` devices
    (tokens/s is the rate of all processes together)."""
    from mamba3lite.model.hardware import peak_flops

    tc = cfg.training
    peak = peak_flops(device, tc.peak_tflops)
    flops = None
    with contextlib.suppress(ImportError, KeyError):
        from mamba3lite.model import model_flops_per_token

        flops = model_flops_per_token(cfg.model, tc.max_seq_len)["train"]
    return build_logger(
        run_dir,
        log_every=tc.log_every,
        flops_per_token=flops,
        peak_flops_per_s=None if peak is None else peak * world_size,
        device=device,
        max_steps=tc.max_steps,
        start_step=start_step,
        progress=tc.progress,
        wandb_run_id=wandb_run_id,
        config=cfg.to_dict(),
        logging_config=cfg.logging,
    )
