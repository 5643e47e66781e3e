"""Pretrainer: the training loop. Commands build it through the one training entry (entry.py), which
makes every check first; what a checkpoint records of the run is one RunState (checkpoint/run_state.py);
what the run logs goes through one logger to the sinks of `logging.sinks` (metrics/).

One optimizer step is the global batch, `training.global_windows` windows over all processes: each
process runs `accum` micro-steps of `micro_batch_size` windows (accum = global / (micro × processes),
`TrainingConfig.accumulation`). The windows are drawn by `WindowSampler`, whose order is a pure function
of (seed, epoch, consumed), so a run continues the same batches at any world size.

    build          data (data.py), model (model_setup.py), optimizer, the steps' input (step_input.py:
                   sampler, prefetcher), the schedule (schedule.py), checkpoint manager
    train()        lock the run directory, plan and apply the resume (loading.py), write the run
                   record (run_record.py), then loop: train_step, every `eval_every` steps
                   evaluate, every `save_every` steps save_checkpoint; stop at the schedule's end
                   (schedule.py: max_steps, or the time budget spent) or when the stop flag (stop.py)
                   is set, with a checkpoint
    train_step()   per micro-step: forward under autocast (bf16 when configured), the loss admitted
                   by the step's tally (zero where any rank's is non-finite), backward, during which
                   the strategy reduces the gradients (parallel/: DDP's reducer on the last micro-step,
                   FSDP's reduce-scatter); then rescale for skipped micro-steps, global-norm clipping
                   (the pre-clip norm is logged), ONE agreement and host read of the step's numbers
                   (parallel/tally.py), the non-finite guard's verdicts (nonfinite.py: skip or roll
                   back), lr = `schedule.lr(step)` (a pure function of the step, or of the share of the
                   time budget spent), the optimizer step, and one `logger.log_step`; when that closes
                   a window, the thread watch (threads.py: a CPU run's thread count follows the
                   machine's load) sees its row

A rollback goes back to the newest verified checkpoint (model, optimizer, RNG, counters) and on with
the data AFTER the failure: the batches drawn since the checkpoint are skipped (the event says which).
When only some micro-steps of a step were skipped, the gradient is rescaled to the mean over the good
ones. SIGTERM/SIGINT only set the stop flag; after the current step all ranks agree, a checkpoint is
written, a "stop" event logged, and `train()` returns (exit code 0).

Resume is exact: model, optimizer (by parameter name), sampler position, Python/numpy/torch RNG states,
step and token counters are in the checkpoint, so N steps == N/2 + resume + N/2 bit for bit (fp32, CPU).
Rank 0 writes the metrics and run records (the other ranks: `TrainingLogger.disabled`) and the
checkpoints of replicated runs; a sharded run's every rank its own shards, rank 0 the meta last.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mamba3lite.checkpoint import CheckpointManager, RunLock, RunState
from mamba3lite.checkpoint.resume import ResumePlan, resume_warnings
from mamba3lite.config import Config
from mamba3lite.downstream.in_loop import in_loop_evaluator
from mamba3lite.errors import ConfigError, DataError
from mamba3lite.malloc import keep_freed_memory
from mamba3lite.model.precision import resolve_precision
from mamba3lite.train.averaging import build_average
from mamba3lite.train.data import (
    build_train_data,
    build_val_data,
    check_data_matches,
    check_fits_global_batch,
)
from mamba3lite.train.faults import INJECT_ENV, FaultInjector, StepHold, parse_injection
from mamba3lite.train.loading import agreed_resume_plan, resume_facts
from mamba3lite.train.metrics import TrainingLogger, run_logger
from mamba3lite.train.model_setup import build_model
from mamba3lite.train.nonfinite import OK, ROLLBACK, NonFiniteGuard
from mamba3lite.train.notes import epoch_summary, start_message, start_warnings
from mamba3lite.train.optim import apply_optimizer_settings, build_optimizer, set_lr
from mamba3lite.train.parallel import Parallelism, StepOutcome
from mamba3lite.train.parallel import process_group as D
from mamba3lite.train.parallel.replicas import StepNews, config_fingerprint
from mamba3lite.train.progress import Progress, TrainData, TrainResult
from mamba3lite.train.run_record import (
    RunRecord,
    check_not_a_dataset,
    code_version,
    data_identity,
    write_run_records,
)
from mamba3lite.train.schedule import build_schedule
from mamba3lite.train.step_input import StepInput
from mamba3lite.train.stop import AgreedStop, StopFlag
from mamba3lite.train.threads import NoThreadWatch, thread_watch
from mamba3lite.train.validation import nonfinite_note, validate
from mamba3lite.train.watchdog import NoWatchdog, Watchdog

__all__ = ["INJECT_ENV", "Pretrainer", "TrainResult", "code_version", "parse_injection"]


class Pretrainer:
    """Builds everything from a `Config` and runs `train()`.

    Args:
        config: the resolved config. `training.checkpoint_dir` is the run directory.
        resume: "latest" (newest verified checkpoint, or a fresh start), "none" (fresh; refuses a
            directory that already holds checkpoints), or a step number (exactly that checkpoint).
        dist: from `parallel.init_distributed()`; default: one process on `training.device`.
        parallelism: the seam (parallel/seam.py); default: built from the config for `dist`.
        model, train_data, val_data: injected instead of built from the config (tests).
        stop: the run's stop flag (`mamba3lite train` installs it before building); default: a new
            one, whose signal handlers `train()` installs for its duration.
        now: the clock of a run with `training.time_budget_minutes` (schedule.py; tests inject one).
        watchdog: a torchrun rank's (watchdog.py), told of each step, evaluation and save; default none.
    """

    def __init__(
        self,
        config: Config,
        *,
        resume: str | int = "latest",
        dist: D.DistInfo | None = None,
        model: torch.nn.Module | None = None,
        train_data: Any = None,
        val_data: Any = None,
        stop: StopFlag | None = None,
        parallelism: Parallelism | None = None,
        now: Callable[[], float] = time.monotonic,
        watchdog: Watchdog | NoWatchdog | None = None,
    ) -> None:
        if not (resume in ("latest", "none") or (isinstance(resume, int) and resume >= 0)):
            raise ConfigError(f"resume must be 'latest', 'none' or a step number >= 0, got {resume!r}")
        self.cfg, self.record = config, RunRecord(resume)
        self.watchdog = watchdog or NoWatchdog()  # a torchrun rank's: pet at each step, eval and save
        self.dist = dist or D.DistInfo(device=D.pick_device(config.training.device))
        flag = stop or StopFlag(announce=self.dist.is_main)
        # the stop flags agreed on by every rank (stop.py); one process: its own flag
        self.stopping = AgreedStop(
            flag, (lambda v: D.any_rank(v, self.dist)) if self.dist.distributed else None
        )
        tc = self.tc
        # training.dtype for this device (auto: bf16 only where it is native); the start says which and why
        self.precision = resolve_precision(tc.dtype, self.device)
        # How the model is spread over the processes: one object, built once (a bad layout is a
        # ConfigError now, before anything is built).
        self.par = parallelism or Parallelism.from_config(config, self.dist)
        accum = self.accum  # a global batch that does not split is a ConfigError now, before any build
        if self.device.type == "cpu":
            keep_freed_memory()  # ~25% faster CPU steps: see mamba3lite/malloc.py
        check_not_a_dataset(tc.checkpoint_dir)
        self.faults = FaultInjector.from_env(self.dist.rank)
        self.hold = StepHold.from_env()
        _seed_everything(tc.seed)
        self.data = self._build_data(train_data, val_data)
        self.raw_model, self.model = build_model(self.cfg, self.dist, self.par, model)
        self.optimizer = build_optimizer(self.raw_model, tc)
        # The average of the weights that users of the checkpoints read (averaging.py; off: NoAverage).
        self.average = build_average(
            self.raw_model, tc.ema_decay, self.par.name if self.par.is_sharded else None
        )
        check_fits_global_batch(len(self.data.train), self.global_windows, tc.max_seq_len)
        self.downstream = self._build_downstream()
        # The windows of the steps, produced ahead on a thread; its sampler is the position of the batches
        # consumed, what checkpoints record (step_input.py).
        self.input = StepInput(self.data.train, tc, self.par, accum, self.device)
        self.ckpt = CheckpointManager(tc.checkpoint_dir, keep_last_n=tc.keep_last_n)
        self.guard = NonFiniteGuard(tc.nan_guard_max_consecutive, tc.max_rollbacks)
        # lr and end by steps, or by the clock (training.time_budget_minutes); train() sets its target
        self.schedule = build_schedule(tc, tc.max_steps, now)
        self.progress = Progress()
        self.logger = TrainingLogger.disabled()  # the real one is opened by train(), on rank 0
        self.threads = NoThreadWatch()  # the real one is built by train() (steps outside it: none)
        # Replica groups (training.fault_tolerance): a joiner receives this live state from a healthy peer
        self.par.replicas.attach(self._live_state, self._load_live_state,
                                 config_fingerprint(config, self.dist.world_size))  # fmt: skip

    # ---------------------------------------------------------------------------- derived values
    tc = property(lambda self: self.cfg.training)
    device = property(lambda self: self.dist.device)
    run_dir = property(lambda self: Path(self.cfg.training.checkpoint_dir))
    train_data = property(lambda self: self.data.train)
    val_data = property(lambda self: self.data.val)
    step = property(lambda self: self.progress.step)
    tokens_seen = property(lambda self: self.progress.tokens_seen)
    last_eval = property(lambda self: self.progress.last_eval)
    rollbacks = property(lambda self: self.guard.rollbacks)
    stop = property(lambda self: self.stopping.flag)
    sampler = property(lambda self: self.input.sampler)
    prefetcher = property(lambda self: self.input.prefetcher)
    # micro-steps per optimizer step on this process: the global batch over the data-parallel size
    accum = property(lambda self: self.tc.accumulation(self.par.dp_size))

    params = property(lambda self: [p for p in self.raw_model.parameters() if p.requires_grad])
    global_windows = property(lambda self: self.tc.global_windows)
    autocast_dtype = property(lambda self: self.precision.dtype)

    # ---------------------------------------------------------------------------------- building
    def _build_data(self, train_data: Any, val_data: Any) -> TrainData:
        train = train_data if train_data is not None else self._build_train_data()
        val, why = (val_data, "") if val_data is not None else build_val_data(self.cfg, train)
        check_data_matches(self.cfg, train, val)
        return TrainData(train, val, why)

    def _build_downstream(self) -> Any:
        """The in-loop downstream benchmarks (training.eval_tasks): all they need is checked now, not at
        step 4,000."""
        manifest = getattr(self.data.train, "manifest", None)
        tok_name = (manifest.tokenizer or {}).get("name") if manifest is not None else None
        return in_loop_evaluator(
            self.cfg, tok_name, bf16=self.autocast_dtype is not None, rank=self.dist.rank,
            world_size=self.dist.world_size,
        )  # fmt: skip

    def _build_train_data(self) -> Any:  # its own method: a test signals the process while data builds
        return build_train_data(self.cfg)

    def _data_identity(self) -> dict | None:
        path = None if self.cfg.data.dummy else self.cfg.data.train_data_path
        return data_identity(getattr(self.data.train, "manifest", None), path)

    # -------------------------------------------------------------------------------------- run
    def request_stop(self, reason: str = "signal") -> None:
        """Ask `train()` to stop after the current step, as SIGTERM does (checkpoint, "stop" event that
        says "stopped by `reason`"). Thread-safe: e.g. from a caller's timer thread."""
        self.stop.request(reason)

    def train(self, until_step: int | None = None) -> TrainResult:
        """Train to `training.max_steps`, or for `training.time_budget_minutes` (or to `until_step`, then
        save: a resumable pause). Holds the run-directory lock for the whole call. Returns a `TrainResult`."""
        target = self.tc.max_steps if until_step is None else min(until_step, self.tc.max_steps)
        self.schedule.target = target
        # Handlers from the start: a SIGTERM while a big checkpoint is verified and restored must stop
        # cleanly.
        busy = f"{self.run_dir} is in use by another trainer"
        with D.held_on_rank0(RunLock(self.run_dir), self.dist, busy), self.stop.installed():
            try:
                self._start(target, until_step)
                stopped = self._loop(target)
                self._finish(stopped)
                self.ckpt.finish_pending()  # the last checkpoint's meta before train() returns
            except Exception as e:
                with contextlib.suppress(Exception):
                    self.ckpt.finish_pending()  # what was written is a good checkpoint: commit it
                with contextlib.suppress(Exception):
                    self.logger.flush()  # the steps since the last row (superseded if they were not saved)
                    self.logger.event(
                        self.step, "error", f"{type(e).__name__}: {e}", tokens_total=self.tokens_seen
                    )
                raise
            finally:
                self.par.replicas.shutdown()
                self.prefetcher.close()
                self.threads.restore()  # the caller's thread count again (a resume measures anew)
                self.logger.close()
        clock = None if (c := self.schedule.clock) is None else {**c.state_dict(), "run_s": c.run_s}
        return TrainResult(step=self.step, tokens_seen=self.tokens_seen, stopped=stopped,
                           history=list(self.progress.history), last_eval=self.last_eval,
                           steady_tokens_per_s=self.logger.steady_tokens_per_s(),
                           rollbacks=self.guard.state_dict()["rollbacks"], clock=clock)  # fmt: skip

    def _loop(self, target: int) -> bool:
        """Train until the schedule's end (`target`, or the time budget spent) or the stop flag (then
        True); evaluate at the end."""
        stopped = False
        self.schedule.start()
        try:
            while not self.schedule.done(self.step) and not stopped:
                if self.train_step():
                    self.watchdog.pet(f"step {self.step}")
                    self._periodic()
                stopped = self.stopping.now()
            self.logger.flush()
            if (
                not stopped
                and self.tc.eval_every
                and self.step > 0
                and self.progress.evaluated_at != self.step
            ):
                self.evaluate()  # the run's final numbers, even when max_steps is off the eval cadence
        except DataError:  # a damaged training or validation batch, seen by all ranks together
            self.logger.flush()  # the steps about to be saved keep their rows
            self._save_before_data_error()
            raise
        return stopped

    def _periodic(self) -> None:
        """After a step: the evaluation and the checkpoint due at it (their time is not training time)."""
        tc = self.tc
        if self.step % tc.save_every == 0 or (tc.eval_every and self.step % tc.eval_every == 0):
            self.stopping.unsettle()  # time passes outside the step: agree on the stop flags anew
        if self.step % tc.save_every == 0:
            # A step a run can resume from ends a window: a resume or rollback to it then supersedes
            # whole rows of the abandoned steps, never kept ones.
            self.logger.flush()
        t0 = time.time()
        # Evaluate first: a checkpoint written at an evaluation step carries that evaluation (its meta's
        # last_eval, what `inspect` and a resume report).
        if tc.eval_every and self.step % tc.eval_every == 0:
            self.evaluate()
            self.watchdog.pet(f"the evaluation at step {self.step}")
        # every rank scores its share of the benchmarks' items; rank 0 writes the row
        self.downstream.maybe_evaluate(self.step, self.raw_model, self.logger, self.tokens_seen)
        if self.step % tc.save_every == 0:
            self.save_checkpoint()
            self.watchdog.pet(f"the checkpoint of step {self.step}")
        self.logger.exclude_time(time.time() - t0)

    def _start(self, target: int, until_step: int | None) -> None:
        """Resume (or start afresh), open the logger and the run record, and say what will happen."""
        plan = agreed_resume_plan(self.ckpt, self.record.resume, self.run_dir, self.dist)
        self.logger = self._open_logger(plan.target)
        self._apply_resume(plan)
        if self.dist.is_main:  # after the resume's checks: a refused resume leaves the records as they were
            start = {"world_size": self.dist.world_size, "resume": self.record.resume,
                     "device": str(self.device), "dtype": self.precision.name,
                     "dtype_reason": self.precision.reason}  # fmt: skip
            self.record.code_version = write_run_records(self.cfg, self.run_dir, start, self._data_identity())
        # The scan backend that runs (model.scan_impl `auto` resolves per device): the run says which.
        scan = getattr(self.raw_model, "scan_impl", None)
        goal = self.schedule.goal(self.step)
        message = start_message(self.step, goal, self.dist, self.tc, self.sampler, scan)
        message += f"; compute {self.precision.reason}"
        if self.dist.distributed:  # which strategy `auto` chose, and the mesh
            message += f"; parallelism {self.par.name} ({self.par.describe()})"
        scan_field = {"scan_impl": scan} if scan else {}
        self.logger.event(self.step, "start", message, tokens_total=self.tokens_seen, **scan_field)
        no_val = None if self.val_data is not None else self.data.no_val_reason
        slow_bf16 = [self.precision.warning] if self.precision.warning else []
        for warning in slow_bf16 + start_warnings(self.tc, self.step, until_step, no_val, self.schedule):
            self._event("warning", warning)
        self.logger.restart_window(self.step)
        self.progress.history = []
        # A CPU run's thread count follows the machine's load (threads.py; elsewhere a watch that does
        # nothing), from the count the caller chose (the quickstart's calibration: the faster one).
        self.threads = thread_watch(self.device, self.dist.world_size, self.tc.cpu_threads_watch)

    def _finish(self, stopped: bool) -> None:
        self._save_unsaved()
        if stopped:
            self._event(
                "stop",
                f"stopped by {self.stop.reason} at step {self.step}; checkpoint saved, `mamba3lite train` "
                "resumes from it",
            )
        elif (clock := self.schedule.clock) is not None and clock.progress() >= 1.0:
            self._event("end", f"the time budget is spent at step {self.step} ({clock.run_s / 60:.2f} min "
                        "trained in this run)")  # fmt: skip
        else:
            self._event("end", f"reached step {self.step}")

    def _event(self, kind: str, message: str) -> None:
        self.logger.event(self.step, kind, message, tokens_total=self.tokens_seen)

    def _open_logger(self, resume_target: int) -> TrainingLogger:
        """Rank 0's logger (the others keep the disabled one); a resumed run continues its W&B run."""
        if not self.dist.is_main:
            return self.logger
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.record.continue_wandb(self.ckpt, resume_target)
        logger = run_logger(self.cfg, self.run_dir, device=self.device, world_size=self.dist.world_size,
                            start_step=self.step, wandb_run_id=self.record.wandb_run_id)  # fmt: skip
        self.record.wandb_run_id = logger.wandb_run_id or self.record.wandb_run_id
        return logger

    # ------------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self) -> None:
        """Write the checkpoint of the current step through the manager, which chooses the format from the
        model: a sharded model's every rank writes its own shards (training goes on while they are
        written when training.async_checkpoint; the meta follows), else rank 0 writes while all wait."""
        if self.ckpt.every_rank_saves(self.raw_model):
            self.ckpt.save(self.step, self.raw_model, self.optimizer, self._run_state(),
                           async_save=self.tc.async_checkpoint)  # fmt: skip
        else:
            if self.dist.is_main:
                self.ckpt.save(self.step, self.raw_model, self.optimizer, self._run_state(),
                               average=self.average.averaged_state(self.raw_model))  # fmt: skip
            D.barrier(self.dist)
        self.progress.last_saved = self.step
        self.guard.on_saved(self.step)

    def _run_state(self) -> RunState:
        """What the checkpoint of the current step records of the run (its meta: run_state.py)."""
        return RunState(
            step=self.step,
            config=self.cfg.to_dict(),
            tokens_seen=self.tokens_seen,
            scheduler=self.schedule.record(self.step),
            clock=None if self.schedule.clock is None else self.schedule.clock.state_dict(),
            average=None if not self.average.updates else {"decay": self.average.decay,
                                                           "updates": self.average.updates},
            sampler=self.sampler.state_dict(),
            rng=self.record.rng.state_dict(),
            data=self._data_identity(),
            metrics=self.logger.last_row,
            last_eval=self.last_eval,
            wandb_run_id=self.record.wandb_run_id,
            world_size=self.dist.world_size,
            global_batch_windows=self.global_windows,
            rollbacks=self.guard.state_dict()["rollbacks"],
            code_version=self.record.code_version,
            replicas=self.par.replicas.state_dict(),
        )  # fmt: skip

    def _save_unsaved(self) -> bool:
        """Save the current step unless it is step 0 or saved already; True if it saved."""
        if self.step == 0 or self.progress.last_saved == self.step:
            return False
        self.save_checkpoint()
        return True

    def _save_before_data_error(self) -> None:
        """A damaged batch stops the run (on every rank together, after the step's agreement:
        `StepInput.damaged_error`), but the steps done since the last checkpoint are good: save them, so
        that the run resumes here once the data is repaired."""
        if self._save_unsaved():
            self._event(
                "save",
                f"saved step {self.step} before stopping on a damaged batch; repair the data and run the "
                "same command to resume from it",
            )

    def _apply_resume(self, plan: ResumePlan) -> None:
        if plan.target < 0:
            # A fresh start; rows in metrics.jsonl are an earlier attempt's that died before its first
            # checkpoint: this run replaces them.
            if marked := self.logger.supersede_after(0):
                self._event(
                    "restart",
                    f"no checkpoint to resume: starting at step 0; {marked} metrics rows of an earlier "
                    "attempt superseded",
                )
            return
        state = self._restore(plan.target)
        if self.schedule.clock is not None:  # the share of the time budget spent goes on (not on rollback)
            self.schedule.clock.load_state_dict(state.clock)
        self.guard.load_state_dict({"rollbacks": state.rollbacks})
        note = plan.tidy(self.ckpt) if self.dist.is_main else ""
        marked = self.logger.supersede_after(plan.target)
        self._event(
            "resume",
            f"resumed from step {plan.target} (tokens {self.tokens_seen:,}){note}; {marked} later metrics "
            "rows superseded",
        )
        D.barrier(self.dist)

    def _restore(self, step: int) -> RunState:
        """Load checkpoint `step` into model, optimizer, sampler, RNG and counters (all ranks)."""
        # The manager's one loader: either format into this strategy at this world size (resharded).
        meta = self.ckpt.load(step, self.raw_model, self.optimizer, map_location=self.device)
        # raises for another model or tokenizer
        warnings = resume_warnings(meta, resume_facts(self.cfg, self._data_identity(), self.run_dir))
        state, p = RunState.from_meta(meta), self.progress
        p.step, p.tokens_seen = int(state.step), int(state.tokens_seen)
        # The average goes back with the weights (a checkpoint without one: averaging starts anew).
        weights = self.ckpt.read_average(step) if state.average else None
        self.average.load_state_dict({"updates": state.average["updates"], "weights": weights} if weights
                                     else {"updates": 0, "weights": {}})  # fmt: skip
        for warning in warnings:
            self.logger.event(self.step, "warning", warning)
        tc = self.tc
        if changed := apply_optimizer_settings(self.optimizer, tc):
            self.logger.event(
                self.step,
                "config",
                f"optimizer settings from the config, not from checkpoint step {step}: {', '.join(changed)}",
            )
        if state.sampler is not None:
            self.sampler.load_state_dict(state.sampler)
        else:
            self.logger.event(
                self.step, "warning", "seed-format checkpoint: no sampler state, data order restarts"
            )
        if (rng := state.rng_of(self.dist.rank)) is not None:
            self.record.rng.load_state_dict(rng)
        self.par.replicas.load_state_dict(state.replicas, p.step)
        self.record.wandb_run_id = state.wandb_run_id or self.record.wandb_run_id
        p.last_eval = state.last_eval
        if isinstance(p.last_eval, dict) and p.last_eval.get("step") == p.step:
            p.evaluated_at = p.step  # a re-run of a finished run does not evaluate (and log) it again
        p.last_saved = p.step
        return state

    # ------------------------------------------------------------------------------------ steps
    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def train_step(self) -> bool:
        """One optimizer step (accumulation, reduction, clip, one agreement, the non-finite guard,
        the optimizer). Returns False when the step was abandoned (every micro-step skipped, a
        non-finite gradient norm, or a rollback)."""
        self.hold.before(self.step)
        if (news := self.par.replicas.begin_step(self.step)) is not None:  # the quorum; a heal lands here
            self._quorum_news(news)
        lr = self.schedule.lr(self.step)
        set_lr(self.optimizer, lr)
        batches = self.input.draw(
            lambda: self._event("epoch", f"{epoch_summary(self.sampler)} begins at step {self.step + 1}")
        )
        tally = self._accumulate(batches)
        max_norm = self.tc.grad_clip if self.tc.grad_clip > 0 else float("inf")
        norm = self.par.reduce_and_clip(self.params, tally, max_norm, self.accum)
        outcome = tally.settle(norm, stop=self.stop.is_set(), damaged=self.input.damage is not None)
        # the loss the run logs: the mean over the replica groups of the step (one group: its own)
        loss_mean = self.par.replicas.mean_loss(outcome.loss_mean)
        self.stopping.settled = outcome.stop
        if outcome.damaged:
            self.optimizer.zero_grad(set_to_none=True)
            raise self.input.damaged_error(self.step + 1)
        if not self._judge_losses(outcome):  # rolled back
            return False
        skipped, good, grad_norm = len(outcome.finite) - outcome.good, outcome.good, outcome.grad_norm
        # the windows the step trains on: the global batch, or the slots of the replica groups taking part
        tokens = round(self.tc.tokens_per_step() * self.par.replicas.tokens_share())
        self.progress.tokens_seen += tokens
        if good == 0:
            self.optimizer.zero_grad(set_to_none=True)
            self.guard.on_abandoned_step(skipped, tokens)
            return False
        if (verdict := self.guard.on_grad_norm(math.isfinite(grad_norm))) != OK:
            # finite losses, overflowing backward: skipped like a non-finite loss
            self.optimizer.zero_grad(set_to_none=True)
            streak = self.guard.bad_grad_streak
            self._event(
                "nan_skip",
                f"non-finite gradient norm at step {self.step + 1}; optimizer step skipped "
                f"({streak} in a row)",
            )
            if verdict == ROLLBACK:
                self._rollback(f"{streak} consecutive non-finite gradient norms")
            else:
                self.guard.on_abandoned_step(skipped + good, tokens)
            return False
        if not self.par.replicas.commit():  # the quorum did not agree: the step never happened
            self._uncommitted(tokens)
            return False
        self._apply_step(lr, loss_mean, grad_norm, tokens, skipped)
        return True

    def _apply_step(self, lr: float, loss: float, grad_norm: float, tokens: int, skipped: int) -> None:
        """The optimizer step of a step that counts, and its row: `loss` the step's mean loss, `tokens`
        the tokens it trained on, `skipped` its skipped micro-steps."""
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.average.update(self.raw_model)
        self.progress.step += 1
        self.par.replicas.record_commit(self.step)
        self.progress.history.append((self.step, loss))
        pending_skipped, pending_tokens = self.guard.take_pending()
        row = self.logger.log_step(
            self.step,
            loss=loss,
            lr=lr,
            grad_norm=grad_norm,
            tokens_processed=tokens + pending_tokens,
            tokens_total=self.tokens_seen,
            skipped=skipped + pending_skipped,
            data_wait_s=self.input.take_wait(),
        )
        self.threads.after_window(row, self.logger)  # the next window's thread count (None: no window closed)

    def _uncommitted(self, tokens: int) -> None:
        """A step the replica groups did not commit (a peer failed during it, or too few took part):
        no optimizer step, its tokens uncounted and its data position undone, so it is drawn again."""
        self.optimizer.zero_grad(set_to_none=True)
        self.progress.tokens_seen -= tokens
        self.input.undo()
        self._event("uncommitted", f"step {self.step + 1} did not commit (a replica group failed or too few "
                    "took part); it runs again")  # fmt: skip

    def _quorum_news(self, news: StepNews) -> None:
        """Events for what a quorum changed: who takes part, a heal received or sent."""
        groups = self.par.replicas.groups
        if news.healed_from_step is not None:
            self.logger.restart_window(self.step)
            self.logger.event(
                self.step,
                "heal",
                f"healed from a live peer in {news.heal_s:.2f} s: step {news.healed_from_step} -> "
                f"{self.step} (model, optimizer, schedule, data position, RNG)",
                tokens_total=self.tokens_seen,
                from_step=news.healed_from_step,
                heal_s=news.heal_s,
                state_digest=news.heal_digest,
            )
        if news.sent_digest:
            self.logger.event(
                self.step,
                "heal_sent",
                f"sent the state of step {self.step} to a joining replica group",
                tokens_total=self.tokens_seen,
                state_digest=news.sent_digest,
            )
        if news.participants is not None:
            self.logger.event(
                self.step, "quorum",
                f"{len(news.participants)} of {groups} replica groups take part from step {self.step + 1}: "
                f"groups {', '.join(map(str, news.participants))}", tokens_total=self.tokens_seen,
                participants=news.participants, quorum=len(news.participants),
            )  # fmt: skip

    def _live_state(self) -> dict:
        """What a joining replica group receives from this one (replicas.py): the model, the optimizer (its
        lr included), the counters, the data position, the RNG, the guard and the participation so far."""
        return {
            **self.par.live_state(self.optimizer),  # "model", "optimizer": whole, or this rank's shards
            "run": {"step": self.step, "tokens_seen": self.tokens_seen, "sampler": self.sampler.state_dict(),
                    "rng": self.record.rng.state_dict(), "guard": self.guard.state_dict(),
                    "replicas": self.par.replicas.state_dict()},
        }  # fmt: skip

    def _load_live_state(self, state: dict) -> None:
        """Take a healthy peer's live state (`_live_state`'s) in place of this group's."""
        run = state["run"]
        self.par.load_live_state(self.optimizer, state)
        self.progress.step, self.progress.tokens_seen = int(run["step"]), int(run["tokens_seen"])
        self.sampler.load_state_dict(run["sampler"])
        self.record.rng.load_state_dict(run["rng"])
        self.guard.load_state_dict(run["guard"])
        self.par.replicas.load_state_dict(run["replicas"], self.step)

    def _accumulate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]):
        """Forward and backward of every micro-batch, each loss admitted by the step's tally (zero
        where any rank's is non-finite: parallel/tally.py); the tally, read once by `settle`."""
        tally, accum = self.par.tally(), len(batches)
        usable = self.input.damage is None
        for i, (x, y) in enumerate(batches):
            with self.par.micro_step(last=i == accum - 1):
                with self._autocast():
                    loss = self.model(x, y)
                loss = self.faults.apply(loss)
                (tally.admit(loss, usable) / accum).backward()
        return tally

    def _judge_losses(self, outcome: StepOutcome) -> bool:
        """The guard's verdict on each micro-step's agreed loss, in order: events for the skipped ones;
        False after a rollback."""
        for i, finite in enumerate(outcome.finite):
            if (verdict := self.guard.on_loss(finite)) == OK:
                continue
            streak = self.guard.nan_streak
            self._event(
                "nan_skip",
                f"non-finite loss at micro-step {i} of step {self.step + 1} skipped ({streak} in a row)",
            )
            if verdict == ROLLBACK:
                self._rollback(f"{streak} consecutive non-finite losses")
                return False
        return True

    def _rollback(self, why: str) -> None:
        """Back to the newest checkpoint after `why` (e.g. "5 consecutive non-finite losses"), going on
        with the data after the batches that led here."""
        self.optimizer.zero_grad(set_to_none=True)
        self.ckpt.finish_pending()  # a sharded save still being written is the newest checkpoint
        self.ckpt.forget_hashes()  # the files were written (and hashed) maybe hours ago: check them anew
        latest = self.ckpt.latest_step() if self.dist.is_main else None
        target = D.broadcast_int(-1 if latest is None else latest, self.dist)
        self.guard.check_rollback(target, why, self.step + 1, self.run_dir)
        from_step = self.step
        data_position = self.sampler.state_dict()  # after the batches that led here: skip them
        self._restore(target)
        self.sampler.load_state_dict(data_position)
        self.guard.on_rolled_back(target)
        marked = self.logger.supersede_after(target)
        self._event(
            "rollback",
            f"{why} at step {from_step + 1}: rolled back to step {target} and skipping the data of steps "
            f"{target + 1}-{from_step + 1}; {marked} rows superseded",
        )
        self.logger.restart_window(self.step)
        D.barrier(self.dist)

    # ------------------------------------------------------------------------------- evaluation
    @torch.no_grad()
    def evaluate(self) -> dict | None:
        """Mean loss over `eval_batches` micro-batches of windows spread evenly over the validation set
        (deterministic; split across ranks); perplexity; bits per byte when the dataset knows bytes.
        Every evaluation of the run goes through here (periodic and final)."""
        if self.val_data is None:
            return None
        self.progress.evaluated_at = self.step
        use_autocast = self.autocast_dtype is not None
        with self.par.whole_windows():  # every rank scores whole windows (exact; no exchange)
            sharded = self.par.is_sharded
            out = validate(self.raw_model, self.val_data, self.tc, self.dist, use_autocast, sharded)
        if not math.isfinite(out["val_loss"]):
            # not an evaluation to record (metrics and meta are strict JSON), and no reason to lose the step
            self._event("eval_nonfinite", nonfinite_note(out["val_loss"], self.step))
            return None
        self.progress.last_eval = {"step": self.step, **out}
        self.logger.log_eval(self.step, self.tokens_seen, out)
        return out


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
