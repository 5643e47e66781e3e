"""What the quickstart takes and what it returns, and the checks of what it takes."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mamba3lite.errors import ConfigError

DEFAULT_WORKDIR = "mamba3lite-quickstart"
DEFAULT_SOURCE = "stdlib"
# "auto": the recipe (quickstart/recipe.py) picks the shape by measurement; a preset or a file is used
# as it is (the vocabulary always comes from the dataset).
DEFAULT_CONFIG = "auto"
# No trailing space: a trailing " " is a token of its own that a model of Python source continues with
# more indentation (token healing, on by default, backs up over it; see mamba3lite/token_healing.py).
DEFAULT_PROMPT = "def"
MAX_MINUTES = 1e6  # ~2 years: any real budget, and far from float overflow and threading.TIMEOUT_MAX
# Config fields the quickstart sets itself (its dataset and vocabulary, its run directory, its time
# budget, the step cap and the cadence): a --set of one of them would be silently replaced, so it is refused.
# training.warmup_fraction is not here (the warmup of a run by the clock is the config's), nor
# training.log_every (the plan uses it as an upper limit).
CONTROLLED_FIELDS = (
    "data.*",
    "model.vocab_size",
    "model.eos_id",
    "training.checkpoint_dir",
    "training.max_steps",
    "training.time_budget_minutes",
    "training.eval_every",
    "training.eval_batches",
    "training.save_every",
)


@dataclass
class QuickstartOptions:
    """What `mamba3lite quickstart` takes (see its --help)."""

    minutes: float = 5.0
    workdir: str = DEFAULT_WORKDIR
    config: str = DEFAULT_CONFIG
    overrides: list[str] = field(default_factory=list)
    max_docs: int | None = None  # a slice of the corpus: at most this many files
    prompt: str = DEFAULT_PROMPT
    sample_tokens: int = 100
    seed: int = 0
    source: str = DEFAULT_SOURCE  # any source `prepare` accepts
    tokenizer: str = "trained"  # "trained" (a BPE of `vocab` ids fit to the train split) or "gpt2"
    vocab: int | None = None  # ids of the trained tokenizer; None: the recipe's
    token_healing: bool = True


@dataclass(frozen=True)
class TrainingShare:
    """What the training made of the quickstart's time (the summary's "training" line)."""

    trained_s: float  # seconds the trainer trained (its clock: steps, periodic evaluations, checkpoints)
    given_s: float  # seconds of training it was given (what the minutes left after the calibration)
    minutes_s: float  # the quickstart's whole budget, --minutes, in seconds
    progress: float  # the share of the learning-rate schedule done at the end (1: ended at the deadline)
    before_s: float = 0.0  # seconds before training: the data, the recipe, the calibration
    short_why: str = ""  # why training ended before its time ("stopped by signal"), "" when it did not


@dataclass
class QuickstartResult:
    """What the quickstart did (the summary's numbers)."""

    data_path: Path
    run_dir: Path
    data_reused: bool
    start_step: int
    end_step: int
    tokens_seen: int
    start_eval: dict
    end_eval: dict
    sample: str
    plot: Path | None
    seconds: float
    training: TrainingShare
    options: QuickstartOptions = field(default_factory=QuickstartOptions)  # what the run was given
    baselines: dict | None = None  # report/baselines.py: the compressors on the same val text
    recipe: str = ""  # what was chosen and why (one line), "" for a given config


def check_overrides(overrides: list[str]) -> None:
    """Refuse a --set of a field the quickstart sets itself (CONTROLLED_FIELDS); a malformed one is left
    to the config's own parsing, which names the problem."""
    for item in overrides:
        section, _, name = item.partition("=")[0].partition(".")
        section, name = section.strip(), name.strip()
        if (section == "data" and name) or f"{section}.{name}" in CONTROLLED_FIELDS:
            raise ConfigError(
                f"--set {item!r}: the quickstart sets {section}.{name} itself (it sets "
                f"{', '.join(CONTROLLED_FIELDS)}); use `mamba3lite train` to choose it"
            )


def check_options(opts: QuickstartOptions) -> None:
    """One ConfigError naming the first option out of range, before any work."""
    if not 0 < opts.minutes <= MAX_MINUTES:  # also refuses nan and inf
        raise ConfigError(f"--minutes must be > 0 and at most {MAX_MINUTES:,.0f}, got {opts.minutes}")
    if opts.max_docs is not None and opts.max_docs < 1:
        raise ConfigError(f"--max-docs must be >= 1, got {opts.max_docs}")
    if opts.tokenizer not in ("trained", "gpt2"):
        raise ConfigError(f"--tokenizer must be trained or gpt2, got {opts.tokenizer!r}")
    if opts.vocab is not None:
        if opts.tokenizer == "gpt2":
            raise ConfigError("--vocab sizes a trained tokenizer; --tokenizer gpt2 has its own 50,257 ids")
        from mamba3lite.tokenizer_train import check_n_ids

        try:
            check_n_ids(opts.vocab)
        except ConfigError as e:  # prepare's flag is --train-tokenizer; the quickstart's is --vocab
            raise ConfigError(str(e).replace("--train-tokenizer", "--vocab")) from None
    check_overrides(opts.overrides)
    workdir = Path(opts.workdir)
    if workdir.exists() and not workdir.is_dir():
        raise ConfigError(f"--workdir {workdir} exists and is not a directory; choose another --workdir")
