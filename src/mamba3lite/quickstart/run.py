"""The quickstart's run: prepare, choose the recipe, calibrate, train for the budget, evaluate, sample,
plot (the package docstring says what each step does and why)."""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from mamba3lite.errors import CheckpointError, ConfigError, DataError
from mamba3lite.quickstart import recipe
from mamba3lite.quickstart.budget import (
    REPLAN_FRACTION,
    Budget,
    BudgetTimer,
    Calibration,
    Plan,
    probe_steps,
    run_settings,
    warmup_for,
)
from mamba3lite.quickstart.dataset import EVAL_WINDOWS, Evaluator, dataset_name, ensure_dataset, evaluator
from mamba3lite.quickstart.options import DEFAULT_SOURCE, QuickstartOptions, QuickstartResult, check_options
from mamba3lite.quickstart.summary import fmt_eval

CALIBRATION_STEPS = 3  # timed steps per setting (after one untimed warm-up step)
# The share of what is left after preparing the data that the shape rule counts as training time (the
# calibration, the evaluations, checkpoints, the sample and the plot take the rest).
TRAIN_SHARE = 0.8
BASELINES_WAIT_S = 60.0  # at most this long for the compressors' child process after the sample


def _process_age_s() -> float:
    """Seconds since this process started (Linux /proc; 0 where unavailable)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat(5), in clock ticks
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, uptime - started)


def _time_steps(trainer, cpu: bool) -> tuple[float, str]:
    """Seconds per optimizer step of `trainer`: the median of CALIBRATION_STEPS timed steps (a busy
    machine gives a few slow outliers; the timer guards against the plan running long). On CPU both
    torch's default thread count and one thread are timed, each after one untimed step, and the faster
    is kept (`torch.set_num_threads`): a model this small runs many small ops, and on a busy machine
    every op of a multi-threaded run waits for its slowest thread. Returns (s/step, a note or "")."""
    import statistics

    import torch

    def timed() -> float:
        trainer.train_step()  # untimed: first step after a change of thread count
        times = []
        for _ in range(CALIBRATION_STEPS):
            t0 = time.monotonic()
            trainer.train_step()
            times.append(time.monotonic() - t0)
        return statistics.median(times)

    default = torch.get_num_threads()
    if not cpu or default == 1:
        return timed(), ""
    results = {default: timed()}
    torch.set_num_threads(1)
    results[1] = timed()
    best = min(results, key=results.get)
    torch.set_num_threads(best)
    note = ", ".join(f"{n} thread{'s' * (n > 1)}: {sec:.2f} s/step" for n, sec in results.items())
    return results[best], f"{best} ({note})"


def _logged_step_s(run_dir: Path, after_step: int, upto_step: int) -> float | None:
    """Mean seconds per step of the logged steps (after_step, upto_step] of `run_dir`'s metrics, the
    start-up window left out (it includes building and loading); None without such rows."""
    from mamba3lite.train.metrics import read_metrics

    rows = [
        r
        for r in read_metrics(run_dir).train
        if after_step < r["step"] <= upto_step and not r.get("warmup_window") and r.get("window_steps")
    ]
    steps = sum(r["window_steps"] for r in rows)
    return sum(r["window_seconds"] for r in rows) / steps if steps else None


def calibrate(
    cfg, run_dir: Path, start_step: int, evaluate: Evaluator, opts: QuickstartOptions, stop
) -> Calibration:
    """Measure a step, an evaluation and the sample with a throw-away trainer of the same config, built
    by the one training entry in a scratch directory (nothing written to the run directory). Its
    untrained model is also what "before" means on a fresh start; a resumed run's "before" is its
    newest checkpoint."""
    from mamba3lite.generation import generate_text
    from mamba3lite.pretrained import load_pretrained
    from mamba3lite.tokenizer import load_tokenizer
    from mamba3lite.train.entry import TrainOptions, training_session

    with tempfile.TemporaryDirectory(prefix="mamba3lite-calibrate-") as scratch:
        scratch_cfg = cfg.replace("training", checkpoint_dir=scratch, progress=False)
        with training_session(scratch_cfg, TrainOptions(resume="none"), stop) as calib:
            t0 = time.monotonic()
            if start_step:
                loaded = load_pretrained(run_dir, start_step, device=calib.device)
                start_eval = evaluate(loaded.model)
                del loaded
            else:
                start_eval = evaluate(calib.raw_model)
            eval_s = time.monotonic() - t0
            step_s, threads = _time_steps(calib, cpu=calib.device.type == "cpu")
            tok = load_tokenizer(evaluate.tokenizer_name)
            t0 = time.monotonic()
            generate_text(calib.raw_model, tok, opts.prompt, max_new_tokens=4, seed=opts.seed,
                          token_healing=opts.token_healing)  # fmt: skip
            sample_s = (time.monotonic() - t0) / 4 * opts.sample_tokens
            n_params = sum(p.numel() for p in calib.raw_model.parameters())
            del calib
    return Calibration(step_s, eval_s, sample_s, n_params, threads, start_eval)


def _train(
    cfg, run_dir: Path, start_step: int, plan: Plan, budget: Budget, stop, log
) -> tuple[object, int, str | None]:
    """Train for the plan (re-planned after the probe) through the one training entry, stopped by the
    budget's timer when time is up. Returns (the train result, the steps planned, "time" / "signal" when
    stopped short, else None)."""
    from mamba3lite.train.entry import TrainOptions, run_training

    tc, n_steps = cfg.training, plan.n_steps
    warmup = warmup_for(n_steps, tc.warmup_steps, start_step)
    probe = probe_steps(warmup, start_step, n_steps)
    eval_batches = max(1, EVAL_WINDOWS // tc.micro_batch_size)

    def train(n: int, is_probe: bool, until_step: int | None = None):
        fields = run_settings(
            n, probe=is_probe, start_step=start_step, warmup=warmup, log_every=tc.log_every,
            eval_batches=eval_batches,
        )  # fmt: skip
        return run_training(cfg.replace("training", **fields), TrainOptions(), stop, until_step)

    with BudgetTimer(budget.stop_in_s(), stop) as timer:
        # A probe stopped by a signal (Ctrl-C, SIGTERM) ends the training as the main run's stop would.
        result = None
        if probe:
            result = train(n_steps, True, until_step=start_step + probe)
            measured = _logged_step_s(run_dir, start_step, start_step + probe)
            if measured and not timer.fired and not result.stopped:
                n_steps = probe + budget.steps_for(measured, REPLAN_FRACTION).n_steps
                log(f"re-plan   {measured:.2f} s/step in the first {probe} steps -> {n_steps} steps in all")
        if result is None or not (timer.fired or result.stopped):  # >= 1 step, even with no time
            result = train(n_steps, False)
    stopped_by = None  # a run short of its plan without a signal (or a stop request) met the timer
    if result.stopped or result.step < start_step + n_steps:
        stopped_by = "time" if timer.fired else "signal"
    return result, n_steps, stopped_by


def _log_stop(stopped_by: str | None, step: int, planned: int, log) -> None:
    if stopped_by == "time":
        log(
            f"note      the time budget ran out at step {step} of {planned} planned: stopped cleanly, "
            "checkpoint written"
        )
    elif stopped_by == "signal":
        log(
            f"note      stopped by signal at step {step} of {planned} planned: "
            "checkpoint written; evaluating, sampling and plotting it (Ctrl-C again to quit now)"
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


def _base_config(opts: QuickstartOptions, manifest, data_path: Path, run_dir: Path):
    """The config before the recipe's shape: the preset (the `tiny` preset's cadence under `auto`, with
    the recipe's vocabulary-independent settings), the dataset's vocabulary, its data and run
    directory, then the user's --set items."""
    from mamba3lite.config import load_config

    auto = opts.config == "auto"
    cfg = load_config("tiny" if auto else opts.config)
    items = recipe.recipe_overrides() if auto else []
    items += [f"model.vocab_size={manifest.vocab_size}", f"model.eos_id={manifest.eos_id}"]
    cfg = cfg.with_overrides(items)
    cfg = cfg.replace("data", train_data_path=str(data_path), val_data_path=None, dummy=False)
    return cfg.replace("training", checkpoint_dir=str(run_dir)).with_overrides(opts.overrides)


def _choose_model(cfg, opts: QuickstartOptions, run_dir: Path, deadline: float, log) -> tuple[object, str]:
    """(cfg with its model shape, what was chosen and why). A resumed run keeps its recorded shape; a
    given config (or a --set of the shape) keeps its own; else the recipe measures the shapes here."""
    from mamba3lite.train.entry import resumed_checkpoint

    if (resumed := resumed_checkpoint(cfg, "latest")) is not None:
        step, model = resumed
        cfg = cfg.replace("model", **model).with_overrides(
            [o for o in opts.overrides if o.strip().startswith("model.")]
        )
        return cfg, f"the run's own shape ({cfg.model.d_model}x{cfg.model.n_layers}, checkpoint step {step})"
    pinned = any(o.strip().startswith(("model.d_model", "model.n_layers")) for o in opts.overrides)
    if opts.config != "auto" or pinned:
        return cfg, f"the config's shape ({cfg.model.d_model}x{cfg.model.n_layers})"
    train_s = TRAIN_SHARE * max(0.0, deadline - time.monotonic())
    shape, why = recipe.choose_shape(recipe.measure_shapes(cfg, train_s), train_s)
    return cfg.with_overrides([*shape.overrides(), *opts.overrides]), why


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
    from mamba3lite.checkpoint.run_dir import RunDir
    from mamba3lite.config import load_config
    from mamba3lite.data.shards import Manifest
    from mamba3lite.report.baselines import start_baselines
    from mamba3lite.train.entry import TrainOptions, check_run_directory, prepare_run
    from mamba3lite.train.stop import StopFlag

    check_options(opts)
    t_start = time.monotonic() - _process_age_s()  # the budget includes Python's and torch's start-up
    deadline = t_start + 60.0 * opts.minutes
    load_config("tiny" if opts.config == "auto" else opts.config, opts.overrides)  # fails before any work
    data_path, reused, run_dir = _data_and_run(opts, log)
    # the compressors read the same val text meanwhile, in a child process at the lowest priority
    cache = Path(opts.workdir) / "baselines" / f"{data_path.name}.json"
    baselines = start_baselines(data_path, cache)
    cfg = _base_config(opts, Manifest.load(data_path), data_path, run_dir)
    # train's checks (train/entry.py) on the real run directory before the shapes are measured and the
    # calibration spends time: a busy run directory; then, on the model chosen (a resumed run's own),
    # data whose tokenizer does not fit it
    check_run_directory(cfg, TrainOptions())
    cfg, why = _choose_model(cfg, opts, run_dir, deadline, log)
    prepare_run(cfg, TrainOptions())
    log(f"recipe    {_recipe_line(cfg)}; shape: {why}")
    evaluate = evaluator(cfg, data_path, log)
    start_step = RunDir(run_dir).resume_step("latest") or 0  # the step the trainer resumes from

    stop = StopFlag()  # one for the whole quickstart: its signals and its timer stop whichever trainer runs
    cal = calibrate(cfg, run_dir, start_step, evaluate, opts, stop)
    if cal.threads:
        log(f"threads   {cal.threads}")
    vocab_size = cfg.model.vocab_size
    ln_v = f"(ln {vocab_size:,} = {math.log(vocab_size):.2f})"
    log(f"before    step {start_step}: {fmt_eval(cal.start_eval)}  {ln_v}")
    budget = Budget.after(cal, deadline, opts.minutes)
    plan = budget.steps_for(cal.step_s)
    tokens = plan.n_steps * cfg.training.tokens_per_step()
    log(f"plan      {cal.step_s:.2f} s/step measured -> {plan.n_steps} steps ({tokens:,} tokens)")
    try:
        result, n_steps, stopped_by = _train(cfg, run_dir, start_step, plan, budget, stop, log)
    except CheckpointError as e:
        raise CheckpointError(f"{e} (the quickstart's run is {run_dir}; use another --workdir)") from None
    _log_stop(stopped_by, result.step, start_step + n_steps, log)

    end_eval, sample, plot = _finish(run_dir, evaluate, opts, log)
    return QuickstartResult(
        data_path=data_path, run_dir=run_dir, data_reused=reused, start_step=start_step,
        end_step=result.step, tokens_seen=result.tokens_seen, start_eval=cal.start_eval,
        end_eval=end_eval, sample=sample, plot=plot, seconds=time.monotonic() - t_start,
        steps_planned=n_steps, stopped_by=stopped_by, options=opts,
        baselines=_baselines(baselines, cache, log), recipe=why,
    )  # fmt: skip


def _recipe_line(cfg) -> str:
    m, t = cfg.model, cfg.training
    lr = f"lr {t.lr:g}" + (f", muon lr {t.muon_lr:g}" if t.muon_lr is not None else "")
    return (
        f"vocab {m.vocab_size:,}, {m.d_model}x{m.n_layers} (d_state {m.d_state}), {t.optimizer} {lr}, "
        f"{t.micro_batch_size} x {t.max_seq_len} tokens/step"
    )


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
