"""Every name under a run directory (`training.checkpoint_dir`), in one place.

    RUN/config.yaml                  the resolved config (CONFIG_NAME)
    RUN/run.json                     the run record: code version, data identity (RUN_RECORD_NAME)
    RUN/metrics.jsonl                one JSON object per logged step, evaluation or event (METRICS_NAME)
    RUN/metrics.png                  `mamba3lite plot`'s picture of metrics.jsonl (PLOT_NAME)
    RUN/tokenizer.json               the run's tokenizer, when it is not GPT-2 (TOKENIZER_NAME)
    RUN/official_padding.safetensors embedding rows an imported model kept aside (PADDING_NAME)
    RUN/tb/                          TensorBoard event files (TENSORBOARD_DIRNAME)
    RUN/superseded/<time>-from-step-N/  checkpoints of an abandoned timeline (SUPERSEDED_DIRNAME)
    RUN/.lock                        held while a trainer owns the directory (LOCK_NAME)
    RUN/{model,optim,meta}_step_N.*  the checkpoints (train/checkpoint/files.py: their pattern)

A module that reads or writes one of these takes its name from here; a new file in a run directory is
one line here plus its use.
"""

from __future__ import annotations

CONFIG_NAME = "config.yaml"
RUN_RECORD_NAME = "run.json"
METRICS_NAME = "metrics.jsonl"
PLOT_NAME = "metrics.png"
TOKENIZER_NAME = "tokenizer.json"
PADDING_NAME = "official_padding.safetensors"
TENSORBOARD_DIRNAME = "tb"
SUPERSEDED_DIRNAME = "superseded"
LOCK_NAME = ".lock"

# Entries that say nothing about whose directory it is (a run lock, a refused start's TensorBoard
# directory, an abandoned timeline): outdir.check_may_write does not count them.
NEUTRAL_ENTRIES = frozenset({LOCK_NAME, TENSORBOARD_DIRNAME, SUPERSEDED_DIRNAME})
