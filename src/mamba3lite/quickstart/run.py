"""The quickstart's run: prepare the dataset, resolve the plan (plan.py: the recipe, the checks, the
calibration, the budget), train for the budget, evaluate, sample, plot (the package docstring says what
each step does and why)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from mamba3lite.errors import CheckpointError, ConfigError, DataError
from mamba3lite.quickstart import recipe
from mamba3lite.quickstart.budget import MIN_TRAIN_S, run_settings, training_minutes
from mamba3lite.quickstart.dataset import Evaluator, dataset_name, ensure_dataset
from mamba3lite.quickstart.options import (
    DEFAULT_SOURCE,
    QuickstartOptions,
    QuickstartResult,
    TrainingShare,
    check_options,
)
from mamba3lite.quickstart.plan import QuickstartPlan, resolve_plan
from mamba3lite.quickstart.summary import fmt_eval

BASELINES_WAIT_S = 60.0  # at most this long for the compressors' child process after the sample
# Python's and torch's start-up takes seconds; a process older than this when the quickstart starts was
# started for something else (a notebook, a test runner) and its age is not the quickstart's to pay.
STARTUP_MAX_S = 60.0


def _process_age_s() -> float:
    """Seconds since this process started (Linux /proc; 0 where unavailable)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat(5), in clock ticks
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, uptime - started)


def _startup_s() -> float:
    """The start-up the budget includes: this process's age, unless it is older than STARTUP_MAX_S."""
    age = _process_age_s()
    return age if age <= STARTUP_MAX_S else 0.0


def _train(plan: QuickstartPlan, stop) -> tuple[object, float]:
    """Train through the one training entry for the time left (budget.py: the clock is the budget; a
    run stopped before the end of its schedule goes on from where it stopped). Returns (the train
    result, the seconds of training it was given)."""
    from mamba3lite.train.entry import run_training

    train_s = plan.budget.train_s()
    fields = run_settings(
        plan.steps.n_steps, start_step=plan.start_step, log_every=plan.cfg.training.log_every,
        eval_batches=plan.eval_batches, minutes=training_minutes(train_s, plan.recorded_clock),
    )  # fmt: skip
    return run_training(plan.prepared.with_training(**fields), stop=stop), train_s


def _log_stop(result, log) -> None:
    if result.stopped:
        log(
            f"note      stopped by signal at step {result.step}: checkpoint written; evaluating, sampling "
            "and plotting it (Ctrl-C again to quit now)"
        )


def _finish(
    run_dir: Path, evaluate: Evaluator, opts: QuickstartOptions, log
) -> tuple[dict, str, Path | None]:
    """The "after" evaluation, the sample and the plot of the newest checkpoint."""
    from mamba3lite.generation import generate_text
    from mamba3lite.pretrained import load_pretrained

    loaded = load_pretrained(run_dir)
    end_eval = evaluate(loaded.model)
    log(f"after     step {loaded.step}: {fmt_eval(end_eval)}")
    if loaded.weights != "trained":
        log(f"weights   {loaded.weights}: what the evaluation above and the sample use")
    tok = loaded.load_tokenizer()
    log(f"sample    (prompt {opts.prompt!r}, temperature 0.8, top-k 50, seed {opts.seed}):\n")
    sample = generate_text(
        loaded.model, tok, opts.prompt, max_new_tokens=opts.sample_tokens, temperature=0.8, top_k=50,
        seed=opts.seed, token_healing=opts.token_healing,
    )  # fmt: skip
    log(opts.prompt + sample.text)
    log("")
    plot = None
    try:
        from mamba3lite.report.plot import plot_run

        plot = plot_run(run_dir)
    except (ConfigError, DataError) as e:
        log(f"note      no plot: {e}")
    return end_eval, sample.text, plot


def _data_and_run(opts: QuickstartOptions, log) -> tuple[Path, bool, Path]:
    """(the dataset, whether it was reused, the run directory): WORKDIR/data/<source>-<tokenizer> and
    WORKDIR/run for the default source and tokenizer, WORKDIR/run-<source>-<tokenizer> for others."""
    workdir = Path(opts.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    vocab = None if opts.tokenizer == "gpt2" else (opts.vocab or recipe.VOCAB)
    name = dataset_name(opts.source, vocab)
    data_path, reused = ensure_dataset(workdir / "data" / name, opts.source, opts.max_docs, vocab, log)
    default_data = opts.source == DEFAULT_SOURCE and opts.tokenizer == "trained" and opts.vocab is None
    return data_path, reused, workdir / ("run" if default_data else f"run-{name}")


def run_quickstart(opts: QuickstartOptions, log: Callable[[str], None] = print) -> QuickstartResult:
    """Prepare, choose the recipe, train for the budget, evaluate, sample, plot (see the package
    docstring)."""
    from mamba3lite.config import load_config
    from mamba3lite.report.baselines import start_baselines
    from mamba3lite.train.stop import StopFlag

    check_options(opts)
    t_start = time.monotonic() - _startup_s()  # the budget includes Python's and torch's start-up
    deadline = t_start + 60.0 * opts.minutes
    preset = load_config("tiny" if opts.config == "auto" else opts.config)  # the one load of the config
    preset.with_overrides(opts.overrides)  # the --set items fail before any work
    data_path, reused, run_dir = _data_and_run(opts, log)
    # the compressors read the same val text meanwhile, in a child process at the lowest priority
    cache = Path(opts.workdir) / "baselines" / f"{data_path.name}.json"
    baselines = start_baselines(data_path, cache)
    stop = StopFlag()  # one for the whole quickstart: its signals stop whichever trainer runs
    plan = resolve_plan(opts, preset, data_path, reused, run_dir, deadline, stop, log)
    before_s = time.monotonic() - t_start  # the data, the recipe and the calibration
    try:
        result, train_s = _train(plan, stop)
    except CheckpointError as e:
        raise CheckpointError(f"{e} (the quickstart's run is {run_dir}; use another --workdir)") from None
    _log_stop(result, log)

    end_eval, sample, plot = _finish(run_dir, plan.evaluate, opts, log)
    return QuickstartResult(
        data_path=data_path, run_dir=run_dir, data_reused=reused, start_step=plan.start_step,
        end_step=result.step, tokens_seen=result.tokens_seen, start_eval=plan.calibration.start_eval,
        end_eval=end_eval, sample=sample, plot=plot, seconds=time.monotonic() - t_start,
        training=_training_share(result, train_s, 60.0 * opts.minutes, before_s), options=opts,
        baselines=_baselines(baselines, cache, log), recipe=plan.shape_why,
    )  # fmt: skip


def _training_share(result, train_s: float, minutes_s: float, before_s: float) -> TrainingShare:
    """What the training made of its time: the seconds it trained, of the time it was given and of the
    quickstart's minutes, and why it ended before the end of its time when it did."""
    clock = result.clock or {}
    trained_s = float(clock.get("run_s", 0.0))
    why = ""
    if result.stopped:
        why = "stopped by signal"
    elif clock.get("progress", 0.0) < 1.0:
        why = f"the trainer's cap of {result.step:,} steps (training.max_steps)"
    elif train_s <= 2 * MIN_TRAIN_S:
        why = "the data, the recipe and the calibration took the whole budget"
    return TrainingShare(trained_s=trained_s, given_s=train_s, minutes_s=minutes_s, before_s=before_s,
                         progress=float(clock.get("progress", 0.0)), short_why=why)  # fmt: skip


def _baselines(proc, cache: Path, log) -> dict | None:
    """The compressors' numbers the child process wrote for this dataset (waited for at most
    BASELINES_WAIT_S), or None."""
    from mamba3lite.report.baselines import cached

    proc.join(BASELINES_WAIT_S)
    if proc.is_alive():
        proc.terminate()
        log(f"note      the compressors had not finished in time; the next run computes them ({cache})")
        return None
    if proc.exitcode != 0:
        log(f"note      the compressors failed (exit code {proc.exitcode}): no numbers to compare with")
        return None
    return cached(cache)  # the child wrote it for this dataset's texts
