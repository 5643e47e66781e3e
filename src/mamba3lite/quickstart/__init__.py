"""The quickstart: the whole pipeline on one machine in a bounded time, with real learning to show.

    prepare   the source (default `stdlib`: this interpreter's standard-library sources, or any source
              `prepare` accepts: --source) with a byte-level BPE fit to its train split
              (--vocab ids; --tokenizer gpt2 for GPT-2's) -> WORKDIR/data/<source>-<tokenizer>
    recipe    the optimizer, learning rate and batch of recipe.py, and the largest model shape that
              reads enough tokens per parameter in the time left at the speed measured here
              (--config PRESET|FILE: that config as it is)
    train     for what is left of the time budget -> WORKDIR/run (the run directory), through the one
              training entry (train/entry.py): the checks of `mamba3lite train`, made once (plan.py)
    evaluate  validation loss and bits per byte on the whole val split, before and after training, beside
              zlib, xz and xz given the training text on the same val text (report/baselines.py)

Which number is which. During training the trainer evaluates PERIODIC_EVALS times (budget.py) on a
fixed, evenly spread half of the val windows, for the curve of the plot, and its console line says so
("subset 288 of 570 val windows"); before and after, and in the summary, the number is the whole split's
("on the whole val split, 570 windows"). A framework user expects both: a cheap curve during the run
on the same windows each time (so its points compare with each other), and one final number on every
held-out window (the one to compare with the compressors, read on the same text). Half the windows is
what the budget already pays for, and close to the whole split's number: on a 100-step model and the
stdlib's 168 val windows of 128 tokens, the two evenly spread halves were 0.4% and 0.2% off the whole
split's bits per byte, where evenly spread sets of 16 windows (the earlier periodic evaluation) were
up to 3% off. What difference is left at the last step is the subset's sampling, and both lines say
which number is which.
    sample    a continuation of "def" from the newest checkpoint (token healing on)
    plot      WORKDIR/run/metrics.png (when matplotlib is installed)

Time budget (`minutes`): budget.py. The clock is the budget: the trainer trains for the time left once
the data, the recipe and the calibration (a throw-away trainer of the same config, which also gives the
"before" evaluation of the untrained model) are done, less the time the final evaluation, the sample and
the plot need (`training.time_budget_minutes`). Its warmup and decay follow the share of that time spent
and it stops when the time is spent, so a busy spell costs steps, never the end of the schedule: the
steps are an outcome, and the summary says what share of the minutes trained. Ctrl-C or SIGTERM while
training stops it cleanly (a checkpoint), and the quickstart then evaluates, samples and plots what was
trained (exit 0, as `mamba3lite train` after a stop).

Re-running reuses WORKDIR: the dataset when its manifest and every shard verify and it was made from the
same source and tokenizer request, the run by resuming from its newest verified checkpoint (its own
shape) and training for another `minutes`: a schedule stopped before its end goes on from where it
stopped and ends at the new deadline; a finished one starts again part of the way (a warm restart: the
learning rate rises again); the compressors' numbers from WORKDIR/baselines/.

    options.py   QuickstartOptions, QuickstartResult, the checks of the options
    dataset.py   the dataset (prepared or reused) and the before/after evaluation
    recipe.py    vocabulary, shape, optimizer, learning rate and batch: chosen by measurement
    budget.py    the time budget: the training time, the cadence
    calibrate.py what a step, an evaluation and the sample cost here (a throw-away trainer)
    plan.py      QuickstartPlan: the run resolved once (config, checks, shape, calibration, budget)
    run.py       run_quickstart: the steps above in order
    summary.py   the closing summary
"""

from mamba3lite.quickstart.options import (
    CONTROLLED_FIELDS,
    DEFAULT_PROMPT,
    DEFAULT_WORKDIR,
    QuickstartOptions,
    QuickstartResult,
    check_overrides,
)
from mamba3lite.quickstart.run import run_quickstart
from mamba3lite.quickstart.summary import summary_text

__all__ = [
    "CONTROLLED_FIELDS",
    "DEFAULT_PROMPT",
    "DEFAULT_WORKDIR",
    "QuickstartOptions",
    "QuickstartResult",
    "check_overrides",
    "run_quickstart",
    "summary_text",
]
