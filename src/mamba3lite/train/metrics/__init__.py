"""Training metrics: one call per step, window averages, one row fanned out to the sinks.

    window.py       the window of steps between two train rows and the row that averages them (+ MFU)
    logger.py       TrainingLogger: accumulates steps into windows, writes each row to every sink
    sink.py         the Sink contract, NullSink ("off"), row_scalars (TensorBoard's and W&B's view)
    console.py      the console line (format_console; downstream_summary)
    jsonl.py        RUN/metrics.jsonl: the sink (torn-tail repair, supersede), the row schema, the reader
    tensorboard.py  RUN/tb event files
    wandb.py        Weights & Biases
    progress.py     the tqdm bar (only on a terminal)
    memory.py       the peak-memory probe of a train row
    build.py        build_logger / resolve_sinks: the sinks of `logging.sinks` (config.LoggingConfig);
                    run_logger: a training run's logger from its resolved config

The peak FLOP/s table MFU divides by is `mamba3lite.model.hardware` (`peak_flops`, also importable from
here lazily: it is the one name of this package that imports torch when called). Importing the package
imports neither torch nor numpy (`plot` and `inspect` read metrics.jsonl through it).
"""

from __future__ import annotations

from typing import Any

from mamba3lite.train.metrics.build import build_logger, resolve_sinks, run_logger
from mamba3lite.train.metrics.console import ConsoleSink, downstream_summary, format_console
from mamba3lite.train.metrics.jsonl import JsonlSink, RunMetrics, check_row, metrics_path, read_metrics
from mamba3lite.train.metrics.logger import TrainingLogger
from mamba3lite.train.metrics.memory import peak_memory_mb
from mamba3lite.train.metrics.progress import ProgressBar
from mamba3lite.train.metrics.sink import NullSink, Sink, row_scalars
from mamba3lite.train.metrics.tensorboard import TensorBoardSink
from mamba3lite.train.metrics.wandb import WandbSink

__all__ = [
    "ConsoleSink",
    "JsonlSink",
    "NullSink",
    "ProgressBar",
    "RunMetrics",
    "Sink",
    "TensorBoardSink",
    "TrainingLogger",
    "WandbSink",
    "build_logger",
    "check_row",
    "downstream_summary",
    "format_console",
    "metrics_path",
    "peak_flops",
    "peak_memory_mb",
    "read_metrics",
    "resolve_sinks",
    "row_scalars",
    "run_logger",
]


def __getattr__(name: str) -> Any:
    if name == "peak_flops":  # model/ (its package imports torch): only when asked for
        from mamba3lite.model.hardware import peak_flops

        return peak_flops
    raise AttributeError(f"module 'mamba3lite.train.metrics' has no attribute {name!r}")
