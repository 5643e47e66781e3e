"""The quickstart: the whole pipeline on one machine in a bounded time, with real learning to show.

    prepare   the `stdlib` corpus (this interpreter's standard-library sources) -> WORKDIR/data/stdlib
    train     the `tiny` preset for what is left of the time budget      -> WORKDIR/run (run directory),
              through the one training entry (train/entry.py): the checks of `mamba3lite train`
    evaluate  validation loss and bits per byte, before and after training
    sample    a continuation of "def" from the newest checkpoint
    plot      WORKDIR/run/metrics.png (when matplotlib is installed)

Time budget (`minutes`). The trainer runs to `training.max_steps`; its cosine schedule ends there, and a
schedule that ends is worth more than one cut short. So the quickstart measures what a training step
costs on this machine (a few steps of a throw-away trainer of the same config, which also provides the
"before" evaluation of the untrained model) and sets max_steps so that training, its periodic
evaluations and checkpoints, the final evaluation, the sample and the plot fit in what is left after
preparing the data (see PLAN_FRACTION). The measurement is made under whatever else the machine
is doing; if the machine gets slower during the run, a timer stops the trainer cleanly
(the run's stop flag: the step finishes, a checkpoint is written) when only the time for the
final evaluation, the sample and the plot is left, and the summary says so. Ctrl-C or SIGTERM while
training (the probe included) stops it the same way, and the quickstart then evaluates, samples and plots
what was trained (exit 0, as `mamba3lite train` after a stop).

Re-running reuses WORKDIR: the dataset when its manifest and every shard verify, the run by resuming
from its newest verified checkpoint and training for another `minutes` (max_steps is extended, so the
learning rate rises again part of the way: a warm restart of the cosine schedule).
"""

from __future__ import annotations

import math
import os
import shlex
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mamba3lite.data.splits import val_split_holds_window
from mamba3lite.errors import CheckpointError, ConfigError, DataError

DEFAULT_WORKDIR = "mamba3lite-quickstart"
DEFAULT_CONFIG = "tiny"
# No trailing space: GPT-2 puts a word's leading space inside the word's token (" main"), so a lone
# trailing " " token is the indentation token, and a model of Python source continues "def " with
# more indentation; "def" is continued with " name(...".
DEFAULT_PROMPT = "def"
QUICKSTART_VAL_FRACTION = 0.02  # ~33k validation tokens (10 documents) from the full stdlib
CALIBRATION_STEPS = 3  # timed steps per setting (after one untimed warm-up step)
EVAL_WINDOWS = 32  # windows (of max_seq_len) per before/after evaluation
# Steps are planned for 1.25x the time measured to be left: a step's cost measured in a few steps
# overestimated the run's by up to 2x on a busy machine, and ending early wastes the budget, while the
# timer's clean stop when time is up costs little: the last fifth of a cosine schedule is already near
# min_lr.
PLAN_FRACTION = 1.25
PERIODIC_EVALS = 3  # validation rows the trainer writes during the run (for the plot), each half
# the windows of the before/after evaluation
MAX_MINUTES = 1e6  # ~2 years: any real budget, and far from float overflow and threading.TIMEOUT_MAX
# Config fields the quickstart sets itself (its dataset, its run directory, the planned steps and their
# cadence): a --set of one of them would be silently replaced, so it is refused. training.warmup_steps and
# training.log_every are not here: the plan uses them as upper limits.
CONTROLLED_FIELDS = (
    "data.*",
    "training.checkpoint_dir",
    "training.max_steps",
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
    steps_planned: int
    stopped_by: str | None = None  # "signal" or "time" when training ended before the plan, else None
    options: QuickstartOptions = field(default_factory=QuickstartOptions)  # what the run was given


def ensure_dataset(out: Path, max_docs: int | None, log: Callable[[str], None]) -> tuple[Path, bool]:
    """The stdlib dataset in `out`: reused when it was made from the same slice (`max_docs`) and its
    manifest and every shard verify, else prepared (replacing the old one). Returns (path, reused)."""
    from mamba3lite.data.prepare import prepare
    from mamba3lite.data.shards import Manifest, has_manifest, verify_dataset

    if has_manifest(out):
        problems = verify_dataset(out)
        if problems:
            log(f"data      {out} does not verify ({problems[0]}); preparing it again")
        elif Manifest.load(out).extra.get("prepare", {}).get("max_docs") != max_docs:
            log(f"data      {out} was made from another slice of the corpus; preparing it again")
        else:
            log(f"data      reusing {out} (manifest and shards verify)")
            return out, True
    what = f"the first {max_docs} files of " if max_docs else ""
    log(f"data      preparing {what}the stdlib corpus -> {out}")
    summary = prepare(
        ["stdlib"],
        out,
        val_fraction=QUICKSTART_VAL_FRACTION,
        max_docs=max_docs,
        overwrite=True,
        progress=False,
    )
    log(summary.table())
    return out, False


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


def _fmt_eval(ev: dict) -> str:
    bpb = f", {ev['bits_per_byte']:.3f} bits/byte" if ev.get("bits_per_byte") is not None else ""
    return f"{ev['split']} loss {ev['loss']:.3f}{bpb}"


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


@dataclass(frozen=True)
class Calibration:
    """What the calibration measured on this machine, before training."""

    step_s: float  # seconds per optimizer step (see _time_steps)
    eval_s: float  # seconds for one before/after evaluation
    sample_s: float  # seconds the final sample will take
    n_params: int
    threads: str  # the thread count chosen on CPU and why, or ""
    start_eval: dict  # the "before" evaluation


@dataclass(frozen=True)
class Plan:
    """How many optimizer steps to train, for a measured cost per step."""

    n_steps: int
    s_per_step: float


def plan_steps(measured_s_per_step: float, budget_s: float) -> Plan:
    """Steps for `budget_s` seconds of training at `measured_s_per_step`: planned for PLAN_FRACTION of
    the budget (the timer stops a run that still goes on when it is spent), and at least one step, even
    with no time left."""
    return Plan(max(1, int(PLAN_FRACTION * budget_s / measured_s_per_step)), measured_s_per_step)


def checkpoint_s(n_params: int) -> float:
    """A rough cost of writing one checkpoint: ~12 bytes/parameter (weights + AdamW moments) at 150 MB/s."""
    return 1.0 + 12 * n_params / 150e6


@dataclass(frozen=True)
class Budget:
    """The time budget once calibrated: what remains before `deadline`, minus the final evaluation, the
    sample and the plot (`reserve_s`), pays for steps, the periodic evaluations and the checkpoints
    (`overhead_s`)."""

    deadline: float  # time.monotonic() by which the quickstart should be done
    reserve_s: float
    overhead_s: float

    @classmethod
    def after(cls, cal: Calibration, deadline: float, minutes: float) -> Budget:
        reserve = cal.eval_s + cal.sample_s + 5.0 + 0.03 * 60.0 * minutes
        return cls(deadline, reserve, PERIODIC_EVALS * cal.eval_s / 2 + 3 * checkpoint_s(cal.n_params))

    def steps_for(self, s_per_step: float) -> Plan:
        """The plan for what is left of the budget now."""
        return plan_steps(s_per_step, self.deadline - time.monotonic() - self.reserve_s - self.overhead_s)

    def stop_in_s(self) -> float:
        """Seconds until training must stop to leave `reserve_s`."""
        return max(0.0, self.deadline - self.reserve_s - time.monotonic())


def warmup_for(n_steps: int, warmup_steps: int, start_step: int) -> int:
    """A fresh run warms up for at most a fifth of its planned steps; a resumed one keeps the config's."""
    return min(warmup_steps, max(1, n_steps // 5)) if start_step == 0 else warmup_steps


def probe_steps(warmup: int, start_step: int, n_steps: int) -> int:
    """Steps of the probe (0: none). The throw-away trainer's steps can run slower (or faster) than the
    real run's, so a fresh run's first `warmup` steps (its learning rate there does not depend on
    max_steps) are timed to re-plan the rest, when the plan is long enough to be worth the extra
    checkpoint written and read back."""
    return warmup if start_step == 0 and n_steps >= 4 * warmup else 0


def run_settings(
    n_steps: int, *, probe: bool, start_step: int, warmup: int, log_every: int, eval_batches: int
):
    """The training fields of a run of `n_steps` more steps (the fields in CONTROLLED_FIELDS, warmup and
    log cadence): periodic evaluations at most PERIODIC_EVALS, each half the windows of the before/after
    one; a checkpoint halfway and at the end; a probe logs every step and does not evaluate."""
    return {
        "max_steps": start_step + n_steps,
        "warmup_steps": warmup,
        "eval_every": 0 if probe else max(1, math.ceil(n_steps / PERIODIC_EVALS)),
        "eval_batches": max(1, eval_batches // 2),
        "save_every": max(1, n_steps // 2),
        "log_every": 1 if probe else max(1, min(log_every, n_steps // 20 or 1)),
    }


class BudgetTimer:
    """Sets the quickstart's stop flag when the budget is spent (`StopFlag.request`: the trainer finishes
    its step and writes a checkpoint). Every trainer of the quickstart shares that flag, so one started
    after the timer fired stops after its first step. Its state: the flag and whether it fired."""

    REASON = "the time budget"

    def __init__(self, delay_s: float, stop) -> None:
        self.stop = stop
        self._timer = threading.Timer(delay_s, self._fire)
        self._timer.daemon = True
        self._fired = threading.Event()

    def _fire(self) -> None:
        self._fired.set()
        self.stop.request(self.REASON)

    @property
    def fired(self) -> bool:
        return self._fired.is_set()

    def __enter__(self) -> BudgetTimer:
        self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self._timer.cancel()


def eval_split(manifest, max_seq_len: int) -> str:
    """The split the before/after evaluations use: val when it holds more than one window's tokens."""
    return "val" if val_split_holds_window(manifest, max_seq_len) else "train"


@dataclass(frozen=True)
class _Evaluator:
    """The before/after evaluation: EVAL_WINDOWS windows of `split` of the dataset."""

    data_path: Path
    split: str
    max_seq_len: int
    batch_size: int
    max_batches: int
    dtype: str
    vocab_hash: str | None
    tokenizer_name: str

    def __call__(self, model) -> dict:
        from mamba3lite.evaluate import evaluate_model

        r = evaluate_model(
            model,
            self.data_path,
            max_seq_len=self.max_seq_len,
            batch_size=self.batch_size,
            max_batches=self.max_batches,
            split=self.split,
            dtype=self.dtype,
            vocab_hash=self.vocab_hash,
            tokenizer_name=self.tokenizer_name,
        )
        return r.to_dict()


def calibrate(
    cfg, run_dir: Path, start_step: int, evaluate: _Evaluator, opts: QuickstartOptions, stop
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
            generate_text(calib.raw_model, tok, opts.prompt, max_new_tokens=4, seed=opts.seed)
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
                n_steps = probe + budget.steps_for(measured).n_steps
                log(f"re-plan   {measured:.2f} s/step in the first {probe} steps -> {n_steps} steps in all")
        if result is None or not (timer.fired or result.stopped):  # >= 1 step, even with no time
            result = train(n_steps, False)
    stopped_by = None  # a run short of its plan without a signal (or a stop request) met the timer
    if result.stopped or result.step < start_step + n_steps:
        stopped_by = "time" if timer.fired else "signal"
    return result, n_steps, stopped_by


def _check_options(opts: QuickstartOptions) -> None:
    if not 0 < opts.minutes <= MAX_MINUTES:  # also refuses nan and inf
        raise ConfigError(f"--minutes must be > 0 and at most {MAX_MINUTES:,.0f}, got {opts.minutes}")
    if opts.max_docs is not None and opts.max_docs < 1:
        raise ConfigError(f"--max-docs must be >= 1, got {opts.max_docs}")
    check_overrides(opts.overrides)
    workdir = Path(opts.workdir)
    if workdir.exists() and not workdir.is_dir():
        raise ConfigError(f"--workdir {workdir} exists and is not a directory; choose another --workdir")


def _evaluator(cfg, data_path: Path, log) -> _Evaluator:
    from mamba3lite.data.shards import Manifest

    tc, manifest = cfg.training, Manifest.load(data_path)
    split = eval_split(manifest, tc.max_seq_len)
    if split == "train":
        log("note      the validation split is too small for one window; evaluating on the train split")
    return _Evaluator(
        data_path, split, tc.max_seq_len, tc.micro_batch_size, max(1, EVAL_WINDOWS // tc.micro_batch_size),
        tc.dtype, manifest.tokenizer.get("vocab_hash"), manifest.tokenizer.get("name", "gpt2"),
    )  # fmt: skip


def _log_stop(stopped_by: str | None, step: int, planned: int, log) -> None:
    if stopped_by == "time":
        log(
            f"note      the time budget ran out at step {step} of {planned} planned "
            "(planned for 1.25x the time left): stopped cleanly, checkpoint written"
        )
    elif stopped_by == "signal":
        log(
            f"note      stopped by signal at step {step} of {planned} planned: "
            "checkpoint written; evaluating, sampling and plotting it (Ctrl-C again to quit now)"
        )


def _finish(
    run_dir: Path, evaluate: _Evaluator, opts: QuickstartOptions, log
) -> tuple[dict, str, Path | None]:
    """The "after" evaluation, the sample and the plot of the newest checkpoint."""
    from mamba3lite.generation import generate_text
    from mamba3lite.pretrained import load_pretrained

    loaded = load_pretrained(run_dir)
    end_eval = evaluate(loaded.model)
    log(f"after     step {loaded.step}: {_fmt_eval(end_eval)}")
    tok = loaded.load_tokenizer()
    log(f"sample    (prompt {opts.prompt!r}, temperature 0.8, top-k 50, seed {opts.seed}):\n")
    sample = generate_text(
        loaded.model, tok, opts.prompt, max_new_tokens=opts.sample_tokens, temperature=0.8, top_k=50,
        seed=opts.seed,
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


def run_quickstart(opts: QuickstartOptions, log: Callable[[str], None] = print) -> QuickstartResult:
    """Prepare, train for the budget, evaluate, sample, plot (see the module docstring)."""
    from mamba3lite.checkpoint import CheckpointManager
    from mamba3lite.config import load_config

    _check_options(opts)
    t_start = time.monotonic() - _process_age_s()  # the budget includes Python's and torch's start-up
    deadline = t_start + 60.0 * opts.minutes
    cfg = load_config(opts.config, opts.overrides)  # a bad config fails before anything is written
    workdir = Path(opts.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    data_path, reused = ensure_dataset(workdir / "data" / "stdlib", opts.max_docs, log)
    run_dir = workdir / "run"
    cfg = cfg.replace("data", train_data_path=str(data_path), val_data_path=None, dummy=False)
    cfg = cfg.replace("training", checkpoint_dir=str(run_dir))
    # train's checks (train/entry.py) on the real run directory before the calibration spends time:
    # a busy run directory, data whose tokenizer does not fit the model
    from mamba3lite.train.entry import TrainOptions, prepare_run

    prepare_run(cfg, TrainOptions())
    evaluate = _evaluator(cfg, data_path, log)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a damaged newest checkpoint: the trainer reports its own choice
        start_step = CheckpointManager(run_dir).latest_step() or 0

    from mamba3lite.train.stop import StopFlag

    stop = StopFlag()  # one for the whole quickstart: its signals and its timer stop whichever trainer runs
    cal = calibrate(cfg, run_dir, start_step, evaluate, opts, stop)
    if cal.threads:
        log(f"threads   {cal.threads}")
    vocab = cfg.model.vocab_size
    log(f"before    step {start_step}: {_fmt_eval(cal.start_eval)}  (ln {vocab:,} = {math.log(vocab):.2f})")
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
        data_path=data_path,
        run_dir=run_dir,
        data_reused=reused,
        start_step=start_step,
        end_step=result.step,
        tokens_seen=result.tokens_seen,
        start_eval=cal.start_eval,
        end_eval=end_eval,
        sample=sample,
        plot=plot,
        seconds=time.monotonic() - t_start,
        steps_planned=n_steps,
        stopped_by=stopped_by,
        options=opts,
    )


def summary_text(r: QuickstartResult) -> str:
    """The closing summary: numbers, where things are, what to try next (commands that name this run's
    --workdir, --config, --set and --max-docs when they are not the defaults, so they act on this run)."""
    s, e, o = r.start_eval, r.end_eval, r.options

    def bpb(ev: dict) -> str:
        return f"{ev['bits_per_byte']:.3f}" if ev.get("bits_per_byte") is not None else "n/a"

    run, data = shlex.quote(str(r.run_dir)), shlex.quote(str(r.data_path))
    config = ["--config", o.config, *(a for item in o.overrides for a in ("--set", item))]
    again = ["mamba3lite", "quickstart", "--minutes", "5"]  # without these options it is another run
    again += ["--workdir", o.workdir] if o.workdir != DEFAULT_WORKDIR else []
    again += config if config != ["--config", DEFAULT_CONFIG] else []
    again += ["--max-docs", str(o.max_docs)] if o.max_docs is not None else []
    if e["split"] == "val":
        loss = f"val loss      {s['loss']:.3f} -> {e['loss']:.3f} nats/token   "
        where = f"on {e['tokens']:,} val tokens"
    else:
        loss = f"train loss    {s['loss']:.3f} -> {e['loss']:.3f} nats/token   "
        where = f"on {e['tokens']:,} {e['split']} tokens: no usable val split"
    stopped = {"signal": "   (stopped by signal)", "time": "   (stopped: time budget ran out)"}
    lines = [
        "",
        "── quickstart summary ─────────────────────────────────────────────────────────",
        f"time          {r.seconds / 60:.1f} min",
        f"steps         {r.start_step} -> {r.end_step}   tokens seen {r.tokens_seen:,}"
        + stopped.get(r.stopped_by or "", ""),
        f"{loss}(bits/byte {bpb(s)} -> {bpb(e)}; {where})",
        f"dataset       {data}" + ("  (reused)" if r.data_reused else ""),
        f"run directory {run}   (checkpoints, config.yaml, metrics.jsonl)",
        f"plot          {r.plot}" if r.plot else "plot          (none: pip install 'mamba3lite[plot]')",
        "",
        "next:",
        f"  mamba3lite generate --checkpoint-dir {run} --prompt 'import' --max-new-tokens 200",
        f"  mamba3lite eval --checkpoint-dir {run} --data-path {data}",
        f"  mamba3lite inspect {run}",
        f"  mamba3lite train {shlex.join(config)} --data-path {data} --checkpoint-dir {run} --max-steps "
        f"{r.end_step + 500}",
        f"  {shlex.join(again)}   (again: continues this run)",
    ]
    return "\n".join(lines)
