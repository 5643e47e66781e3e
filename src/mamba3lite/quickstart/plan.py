"""The quickstart resolved once: everything its training needs, decided before it starts, in one
frozen `QuickstartPlan` that flows from the calibration to the run, the "after" evaluation and the
summary.

    resolve_plan(...)   the config (the preset loaded once, the recipe, the dataset's vocabulary, the
                        user's --set items), the run prepared once by the one training entry
                        (train/entry.py `prepare_run`: the run directory, the data's tokenizer, the
                        sinks, --init-from), the step it resumes from, its shape (the run's own, the
                        config's, or measured here), the evaluator, the calibration, the budget

The calibration's throw-away trainer and the run both train `plan.prepared`, changing
only the fields the checks do not read (`PreparedRun.with_training`, `in_scratch_dir`): nothing is
loaded, checked or verified twice.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from mamba3lite.checkpoint.run_dir import RunDir
from mamba3lite.checkpoint.run_state import RunState
from mamba3lite.data.shards import Manifest
from mamba3lite.quickstart import recipe
from mamba3lite.quickstart.budget import Budget, Calibration, Plan
from mamba3lite.quickstart.calibrate import calibrate
from mamba3lite.quickstart.compile_choice import plan_compile
from mamba3lite.quickstart.dataset import Evaluator, evaluator
from mamba3lite.quickstart.options import QuickstartOptions
from mamba3lite.quickstart.summary import fmt_eval
from mamba3lite.train.entry import PreparedRun, TrainOptions, prepare_run

# The share of what is left after preparing the data that the shape rule counts as training time (the
# calibration, the evaluations, checkpoints, the sample and the plot take the rest).
TRAIN_SHARE = 0.8


@dataclass(frozen=True)
class QuickstartPlan:
    """The quickstart's run, resolved once (see the module docstring)."""

    prepared: PreparedRun  # the run as train/entry.py checked it; its config is the final one
    manifest: Manifest  # the dataset's
    data_path: Path
    data_reused: bool  # the dataset was reused, not prepared again
    run_dir: Path
    start_step: int  # the step the trainer resumes from (0: a fresh run)
    shape_why: str  # the model shape and why it was chosen, one line
    # Which training step path runs (eager, or torch.compile) and why, printed in the plan line
    # (compile_choice.plan_compile: compiled only when its measured gain repays its compile time).
    step_path: str
    evaluate: Evaluator  # the before/after evaluation (the whole val split)
    calibration: Calibration
    budget: Budget
    steps: Plan  # the steps expected at the calibration's speed: the cadence (the clock ends the run)
    recorded_clock: dict | None = None  # the time budget's record in the checkpoint resumed from

    @property
    def cfg(self):
        return self.prepared.cfg

    @property
    def eval_batches(self) -> int:
        """Micro-batches of the before/after evaluation: the periodic evaluations score a fixed, evenly
        spread half of its windows (budget.run_settings; the budget pays for that)."""
        windows = self.calibration.start_eval.get("windows") or 1
        return max(1, math.ceil(windows / self.cfg.training.micro_batch_size))


def base_config(preset, opts: QuickstartOptions, manifest: Manifest, data_path: Path, run_dir: Path):
    """The config before the recipe's shape: `preset` (as loaded: the `tiny` preset's cadence under
    `auto`, with the recipe's vocabulary-independent settings), the dataset's vocabulary, its data and
    run directory, then the user's --set items."""
    items = recipe.recipe_overrides() if opts.config == "auto" else []
    items += [f"model.vocab_size={manifest.vocab_size}", f"model.eos_id={manifest.eos_id}"]
    cfg = preset.with_overrides(items)
    cfg = cfg.replace("data", train_data_path=str(data_path), val_data_path=None, dummy=False)
    return cfg.replace("training", checkpoint_dir=str(run_dir)).with_overrides(opts.overrides)


def choose_model(
    prepared: PreparedRun, opts: QuickstartOptions, deadline: float, state: RunState | None
) -> tuple[PreparedRun, str]:
    """(the prepared run with its model shape, what was chosen and why). A resumed run (`state`: the
    record of the checkpoint it resumes from) keeps its recorded shape; an --init-from source, a given
    config (or a --set of the shape) keep their own; else the recipe measures the shapes here."""
    cfg = prepared.cfg
    step = 0 if state is None else state.step
    if state is not None:
        recorded = state.config.get("model")
        if isinstance(recorded, dict):  # a seed-format step records none: the config's shape
            own = cfg.replace("model", **recorded).with_overrides(
                [o for o in opts.overrides if o.strip().startswith("model.")]
            )
            if prepared.init_model is None:
                prepared = prepared.with_model(**asdict(own.model))
            m = prepared.cfg.model
            return prepared, f"the run's own shape ({m.d_model}x{m.n_layers}, checkpoint step {step})"
    m = cfg.model
    if prepared.init_model is not None:
        return prepared, f"the --init-from model's shape ({m.d_model}x{m.n_layers})"
    pinned = any(o.strip().startswith(("model.d_model", "model.n_layers")) for o in opts.overrides)
    if opts.config != "auto" or pinned or step:
        return prepared, f"the config's shape ({m.d_model}x{m.n_layers})"
    train_s = TRAIN_SHARE * max(0.0, deadline - time.monotonic())
    shape, why = recipe.choose_shape(recipe.measure_shapes(cfg, train_s), train_s)
    shaped = cfg.with_overrides([*shape.overrides(), *opts.overrides])
    return prepared.with_model(**asdict(shaped.model)), why


def resumed_state(run_dir: Path) -> RunState | None:
    """The record of the checkpoint the run resumes from (its newest, verified once, here), or None
    for a fresh run."""
    run = RunDir(run_dir)
    step = run.resume_step("latest")
    return None if step is None else run.run_state(step)


def resolve_plan(
    opts: QuickstartOptions,
    preset,
    data_path: Path,
    data_reused: bool,
    run_dir: Path,
    deadline: float,
    stop,
    log,
) -> QuickstartPlan:
    """Resolve the quickstart's run once (see the module docstring), logging the recipe, the threads,
    the "before" evaluation and the plan."""
    manifest = Manifest.load(data_path)
    cfg = base_config(preset, opts, manifest, data_path, run_dir)
    # train's checks (train/entry.py), once, on the real run directory before the shapes are measured and
    # the calibration spends time: a busy run directory, data whose tokenizer does not fit the model (the
    # model chosen below, a resumed run's own, is checked again against it: PreparedRun.with_model)
    prepared = prepare_run(cfg, TrainOptions())
    state = resumed_state(run_dir)
    prepared, why = choose_model(prepared, opts, deadline, state)
    start_step = 0 if state is None else state.step
    cfg = prepared.cfg
    log(f"recipe    {_recipe_line(cfg)}; shape: {why}")
    evaluate = evaluator(cfg, data_path, log, manifest)

    cal = calibrate(prepared, start_step, evaluate, opts, stop)
    if cal.threads:
        log(f"threads   {cal.threads}")
    ln_v = f"(ln {cfg.model.vocab_size:,} = {math.log(cfg.model.vocab_size):.2f})"
    log(f"before    step {start_step}: {fmt_eval(cal.start_eval)}  {ln_v}")
    budget = Budget.after(cal, deadline, opts.minutes)
    path = plan_compile(cfg, budget.train_s())
    if path.compile and not cfg.training.compile:
        prepared = prepared.with_training(compile=True)
    step_path = path.reason
    steps = budget.expected(cal.step_s)  # at eager's speed: the cadence only (the clock ends the run)
    recorded_clock = None if state is None else state.clock
    log(
        f"plan      train {budget.train_s() / 60:.2f} min by the clock{_continues(recorded_clock)}: "
        f"{cal.step_s:.2f} s/step measured, ~{steps.n_steps:,} steps expected; step path: {step_path}"
    )
    return QuickstartPlan(
        prepared=prepared, manifest=manifest, data_path=data_path, data_reused=data_reused,
        run_dir=run_dir, start_step=start_step, shape_why=why, step_path=step_path, evaluate=evaluate,
        calibration=cal, budget=budget, steps=steps, recorded_clock=recorded_clock,
    )  # fmt: skip


def _continues(clock: dict | None) -> str:
    """What the schedule does with the run's recorded time budget: go on, or start again."""
    if not clock:
        return ""
    progress = clock.get("progress")
    if isinstance(progress, (int, float)) and 0 <= progress < 1:
        return f", its schedule going on from {progress:.0%}"
    return ", its finished schedule warmly restarted"


def _recipe_line(cfg) -> str:
    m, t = cfg.model, cfg.training
    lr = f"lr {t.lr:g}" + (f", muon lr {t.muon_lr:g}" if t.muon_lr is not None else "")
    return (
        f"vocab {m.vocab_size:,}, {m.d_model}x{m.n_layers} (d_state {m.d_state}), {t.optimizer} {lr}, "
        f"{t.micro_batch_size} x {t.max_seq_len} tokens/step"
    )
