"""RunDir: the one reader of a run directory (`training.checkpoint_dir`).

    run = RunDir("runs/tiny")
    run.is_run()                     # whether `train` wrote here (the one rule; no torch imported)
    run.check()                      # ...and it holds checkpoints; else one CheckpointError line
    pick = run.resolve(None)         # the newest VERIFIED step (pick.notes: the newer ones skipped)
    pick = run.resolve(400)          # exactly step 400: CheckpointError if absent or damaged
    state = run.run_state(pick.step) # its RunState (checkpoint/run_state.py)
    got = run.load(None, torch.float32)  # a step verified once: meta, config, model, notes (loaded.py)
    plan = run.plan_resume("latest") # what a starting trainer does here (checkpoint/resume.py)

Every command that reads a run (generate, eval, serve, export, inspect, train --init-from, the quickstart)
and the write checks of `train` (mamba3lite/outdir.py, commands/train.py) ask this class, so "is this a
run directory", "is this config.yaml the run's", "which step" and "load it" are each decided in one place:

    is a run directory   it holds what `train` writes: a checkpoint file (or the temp file of one being
                         written), the run record (run.json), the metrics log (metrics.jsonl), or a
                         config.yaml whose first line is the resolved-config header `train` writes (a
                         config.yaml of the user's own does not make a directory a run)
    its steps            `CheckpointManager.list_steps()`
    verified             `CheckpointManager.status()` / `latest_step()`: a step counts when every file it
                         needs matches its meta; a newer damaged step is skipped with a note naming the
                         file. The manager owns verification, so a checkpoint format it learns (a sharded
                         step, say) is read here without a change.
    loaded               `load`: the one road from a step to a model (checkpoint/loaded.py); the step is
                         verified once, by `resolve`, and what that check read is what is loaded
    resume               `plan_resume`: the one decision of where a starting run continues from

The names and patterns of the files are in mamba3lite/rundir.py; this module reads them. A method that
needs the checkpoint manager imports it (and torch) when first called: `is_run` stays cheap for
`inspect` and `outdir`, which run without torch.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from mamba3lite import intake, rundir
from mamba3lite.config import RESOLVED_HEADER
from mamba3lite.errors import CheckpointError

if TYPE_CHECKING:  # torch-importing modules, loaded on first use (see the module docstring)
    import torch

    from mamba3lite.checkpoint.loaded import LoadedStep
    from mamba3lite.checkpoint.manager import CheckpointManager
    from mamba3lite.checkpoint.resume import ResumePlan
    from mamba3lite.checkpoint.run_state import RunState
    from mamba3lite.checkpoint.verify import CheckpointStatus

# What an error says a run directory holds when it holds none (the pattern of mamba3lite/rundir.py).
_NO_CHECKPOINTS = "no model_step_N.safetensors / meta_step_N.json"


@dataclass
class StepPick:
    """A step chosen by `RunDir.resolve`: `step`, `notes` (one line per newer step skipped because it
    does not verify; empty for an explicit step) and `status`, the check that verified it (its parsed
    meta included), which `load` trusts instead of checking the step again."""

    step: int
    notes: list[str] = field(default_factory=list)
    status: CheckpointStatus | None = None


class RunDir:
    """One run directory, read (see the module docstring). Constructing one touches nothing on disk."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._ckpt: CheckpointManager | None = None

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    # ------------------------------------------------------------------------------ what it is
    @staticmethod
    def is_checkpoint_file(name: str) -> bool:
        """Whether the file name `name` is one of a step's files or the temp file of one being written."""
        return rundir.step_of(name) is not None or rundir.is_temp_file(name)

    def is_run(self) -> bool:
        """Whether `train` wrote here (the rule in the module docstring); False for a path that is not a
        directory. Reads names and, at most, the first line of config.yaml."""
        if not self.path.is_dir():
            return False
        for p in self.path.iterdir():
            if self.is_checkpoint_file(p.name) or p.name in (rundir.RUN_RECORD_NAME, rundir.METRICS_NAME):
                return True
        return self.has_resolved_config()

    def has_resolved_config(self) -> bool:
        """Whether the directory's config.yaml is the resolved config `train` writes (its first line is
        the header config.py's `write_resolved_config` writes), not a config file of the user's own."""
        config = self.path / rundir.CONFIG_NAME
        if not config.is_file():
            return False
        header = RESOLVED_HEADER.encode("utf-8")
        return intake.read_prefix(config, intake.CONFIG, len(header)) == header

    def check(self) -> RunDir:
        """Self, when the path is a directory holding checkpoints; else one CheckpointError line saying
        what the path is instead (missing, a file, not a run directory, a run with no checkpoint yet)."""
        p = self.path
        if not p.exists():
            raise CheckpointError(
                f"checkpoint directory {p} does not exist; pass the --checkpoint-dir of a `mamba3lite train` "
                "run (e.g. mamba3lite-quickstart/run)"
            )
        if not p.is_dir():
            what = "a file" if p.is_file() else intake.describe_mode(p.stat().st_mode)
            raise CheckpointError(f"{p} is {what}, not a checkpoint directory; pass the run directory")
        if self.steps():
            return self
        if self.is_run():
            raise CheckpointError(
                f"{p} holds no checkpoints yet ({_NO_CHECKPOINTS}): the run has not saved a step; train "
                "first, or pass the --checkpoint-dir of another run"
            )
        raise CheckpointError(
            f"{p} holds no checkpoints ({_NO_CHECKPOINTS}) and is not a run directory; pass the "
            "--checkpoint-dir of a `mamba3lite train` run"
        )

    # ----------------------------------------------------------------------------------- steps
    @property
    def ckpt(self) -> CheckpointManager:
        """The directory's CheckpointManager (one per RunDir: a file hashed once is not hashed again)."""
        if self._ckpt is None:
            from mamba3lite.checkpoint.manager import CheckpointManager

            self._ckpt = CheckpointManager(self.path)
        return self._ckpt

    def steps(self) -> list[int]:
        """Every step with at least one of its files here, ascending (verified or not)."""
        return self.ckpt.list_steps()

    def loadable_steps(self, *, need_optimizer: bool = False) -> list[int]:
        """The steps that can be loaded, ascending. `need_optimizer=False`: the weights alone count
        (generate, eval, export); True: a step training can resume from."""
        return self.ckpt.verified_steps(need_optimizer=need_optimizer)

    def latest(self, *, need_optimizer: bool = False) -> StepPick | None:
        """The newest verified step and the notes on each newer one skipped, or None when none verifies."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            status = self.ckpt.latest_status(need_optimizer=need_optimizer)
        notes = [str(w.message) for w in caught]
        return None if status is None else StepPick(status.step, notes, status)

    def resolve(self, step: int | None, *, need_optimizer: bool = False) -> StepPick:
        """`step` ("--step N") if it is here and verifies, or with None the newest verified step: the one
        "step or latest" of every command. One CheckpointError line otherwise: a negative step, a step
        that does not exist, one that does not verify (naming the bad file), none that verifies."""
        if step is None:
            if (pick := self.latest(need_optimizer=need_optimizer)) is not None:
                return pick
            problems = "; ".join(
                problem
                for s in self.steps()
                for problem in self.ckpt.status(s, need_optimizer=need_optimizer).problems
            )
            raise CheckpointError(f"no checkpoint in {self.path} verifies: {problems or 'none is there'}")
        if step < 0:
            raise CheckpointError(f"--step must be >= 0, got {step}")
        if step not in self.steps():
            raise CheckpointError(
                f"there is no checkpoint of step {step} in {self.path}; loadable steps: "
                f"{self.loadable_steps(need_optimizer=need_optimizer) or 'none'}"
            )
        status = self.ckpt.status(step, need_optimizer=need_optimizer)
        if not status.loadable:
            raise CheckpointError(
                f"checkpoint step {step} in {self.path} cannot be loaded: {'; '.join(status.problems)}; "
                f"loadable steps: {self.loadable_steps(need_optimizer=need_optimizer) or 'none'}"
            )
        return StepPick(step, status=status)

    # ----------------------------------------------------------------------------------- loading
    def load(self, step: int | None = None, dtype: torch.dtype | None = None) -> LoadedStep:
        """Checkpoint `step` (default: the newest that verifies, the damaged newer ones noted) as a
        `LoadedStep` (checkpoint/loaded.py): its meta, its Config, the model with its weights (the
        average for a run that averaged) on the CPU at `dtype` (None: the widest dtype the step stores,
        so that no value is rounded), and notes. The step is verified once, by `resolve`. One
        CheckpointError line for anything wrong, as `check` and `resolve` say it; a training run's
        retention that deletes the newest step between its choice and its load: the choice is made again."""
        from mamba3lite.checkpoint.loaded import load_verified

        self.check()
        notes: list[str] = []
        for attempt in range(1 if step is not None else 3):
            pick = self.resolve(step)
            notes += pick.notes
            assert pick.status is not None
            try:
                loaded = load_verified(self.ckpt, pick.status, dtype)
                break
            except CheckpointError:
                if step is not None or attempt == 2 or pick.step in self.steps():
                    raise
                notes.append(
                    f"step {pick.step} was removed while loading it (a running training's retention?)"
                )
        loaded.notes[:0] = notes
        return loaded

    # --------------------------------------------------------------------------------- reading
    def read_meta(self, step: int) -> dict:
        """The parsed meta of `step` (CheckpointError naming the file if missing or unreadable). Not
        verified against the other files: `resolve` a step first to trust it."""
        return self.ckpt.read_meta(step)

    def run_state(self, step: int) -> RunState:
        """The RunState that step `step`'s meta records (absent fields: their defaults)."""
        from mamba3lite.checkpoint.run_state import RunState

        return RunState.from_meta(self.read_meta(step))

    # ---------------------------------------------------------------------------------- resume
    def plan_resume(self, resume: str | int) -> ResumePlan:
        """What a run starting here with `resume` ("latest", "none" or a step) does: checkpoint/resume.py's
        `plan_resume`, the decision the trainer carries out."""
        from mamba3lite.checkpoint.resume import plan_resume

        return plan_resume(self.ckpt, resume)

    def resume_step(self, resume: str | int) -> int | None:
        """The step a run starting here with `resume` continues from, None for a fresh start; the plan's
        refusal (a step never saved, checkpoints that do not verify, "none" over checkpoints) as one
        CheckpointError line. Decided by `plan_resume`, so it is the step the trainer then loads; the
        notes on skipped damaged steps are left to the trainer, which reports its own choice."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = self.plan_resume(resume)
        if plan.refusal is not None:
            raise CheckpointError(plan.refusal)
        return plan.target if plan.target >= 0 else None
