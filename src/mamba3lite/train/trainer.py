"""Pretrainer: the training loop.

One optimizer step = `gradient_accumulation_steps` micro-steps of `micro_batch_size` windows on each
process. The global batch (micro × accumulation × world size windows) is drawn by `WindowSampler`,
whose order is a pure function of (seed, epoch, consumed), so it is the same for any world size.

    build          data (data.py), model, optimizer, sampler, checkpoint manager
    train()        lock the run directory, plan and apply the resume (checkpoint/resume.py), write
                   the run record (run_record.py), then loop: train_step, every `eval_every` steps
                   evaluate, every `save_every` steps save_checkpoint; stop at max_steps or when the
                   stop flag (stop.py) is set, with a checkpoint
    train_step()   per micro-step: forward under autocast (bf16 when configured), the non-finite
                   guard (nonfinite.py: skip or roll back), backward; then gradients averaged across
                   ranks (one explicit all-reduce; see distributed.py), global-norm clipping (the
                   pre-clip norm is logged), lr = `lr_at(step)` (a pure function: the "scheduler
                   state" is the step), AdamW, and one `logger.log_step`

A rollback goes back to the newest verified checkpoint (model, optimizer, RNG, counters) and on with
the data AFTER the failure: the batches drawn since the checkpoint are skipped (the event says which).
When only some micro-steps of a step were skipped, the gradient is rescaled to the mean over the good
ones. SIGTERM/SIGINT only set the stop flag; after the current step all ranks agree, a checkpoint is
written, a "stop" event logged, and `train()` returns (exit code 0).

Resume is exact: model, optimizer (by parameter name), sampler position, Python/numpy/torch RNG states,
step and token counters are in the checkpoint, so N steps == N/2 + resume + N/2 bit for bit (fp32, CPU).
Only rank 0 writes files; the other ranks log to a logger that discards (`TrainingLogger.disabled`).
Fault injection for tests: faults.py.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mamba3lite.config import Config
from mamba3lite.data.shards import MANIFEST_NAME, has_manifest
from mamba3lite.downstream.in_loop import in_loop_evaluator
from mamba3lite.errors import CheckpointError, ConfigError, DataError
from mamba3lite.evaluate import spread_picks, window_loss_sum
from mamba3lite.malloc import keep_freed_memory
from mamba3lite.train import distributed as D
from mamba3lite.train.checkpoint import CheckpointManager, RunLock, capture_rng_state, restore_rng_state
from mamba3lite.train.checkpoint.resume import ResumePlan, plan_resume, resume_warnings
from mamba3lite.train.data import (
    build_train_data,
    build_val_data,
    check_data_matches,
    check_fits_global_batch,
)
from mamba3lite.train.faults import INJECT_ENV, FaultInjector, parse_injection
from mamba3lite.train.logging import TrainingLogger, build_logger, peak_flops
from mamba3lite.train.nonfinite import OK, ROLLBACK, NonFiniteGuard
from mamba3lite.train.optim import apply_optimizer_settings, build_optimizer, lr_at, set_lr
from mamba3lite.train.run_record import code_version, data_identity, run_records_problem, write_run_records
from mamba3lite.train.stop import StopFlag

__all__ = ["INJECT_ENV", "Pretrainer", "TrainResult", "code_version", "parse_injection"]


@dataclass
class TrainResult:
    """What `Pretrainer.train()` did."""

    step: int  # optimizer steps completed (the run's global step)
    tokens_seen: int
    stopped: bool  # ended early by a signal (a checkpoint was written)
    history: list[tuple[int, float | None]] = field(default_factory=list)  # (step, loss) this call
    last_eval: dict | None = None
    steady_tokens_per_s: float | None = None
    rollbacks: int = 0


@dataclass
class Progress:
    """Where the run is: the counters a checkpoint restores, and what this `train()` call did."""

    step: int = 0  # optimizer steps completed
    tokens_seen: int = 0
    last_eval: dict | None = None  # {"step", "val_loss", ...} of the newest evaluation
    evaluated_at: int = -1  # the step of the last evaluation (its loss finite or not)
    last_saved: int = -1  # the step of the newest checkpoint this run wrote or loaded
    history: list[tuple[int, float | None]] = field(default_factory=list)  # (step, loss) this call


@dataclass
class TrainData:
    """The datasets of a run, and why there is no validation data when there is none."""

    train: Any
    val: Any
    no_val_reason: str = ""


class Pretrainer:
    """Builds everything from a `Config` and runs `train()`.

    Args:
        config: the resolved config. `training.checkpoint_dir` is the run directory.
        resume: "latest" (newest verified checkpoint, or a fresh start), "none" (fresh; refuses a
            directory that already holds checkpoints), or a step number (exactly that checkpoint).
        dist: from `distributed.init_distributed()`; default: one process on `training.device`.
        model, train_data, val_data: injected instead of built from the config (tests).
        stop: the run's stop flag (`mamba3lite train` installs it before building); default: a new
            one, whose signal handlers `train()` installs for its duration.
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
    ) -> None:
        if not (resume in ("latest", "none") or (isinstance(resume, int) and resume >= 0)):
            raise ConfigError(f"resume must be 'latest', 'none' or a step number >= 0, got {resume!r}")
        self.cfg, self.resume = config, resume
        self.dist = dist or D.DistInfo(device=D.pick_device(config.training.device))
        self.stop = stop or StopFlag(announce=self.dist.is_main)
        tc = self.tc
        if self.device.type == "cpu":
            keep_freed_memory()  # ~25% faster CPU steps: see mamba3lite/malloc.py
        if has_manifest(tc.checkpoint_dir):
            raise ConfigError(
                f"training.checkpoint_dir {tc.checkpoint_dir} is a dataset directory (it holds "
                f"{MANIFEST_NAME}): checkpoints would be mixed into the dataset; point --checkpoint-dir "
                "at a run directory"
            )
        self.faults = FaultInjector.from_env(self.dist.rank)
        _seed_everything(tc.seed)
        self.data = self._build_data(train_data, val_data)
        self.raw_model, self.model, self.optimizer = self._build_model(model)
        check_fits_global_batch(len(self.data.train), self.global_windows, tc.max_seq_len)
        # Downstream benchmarks (training.eval_tasks): all they need is checked now, not at step 4,000.
        manifest = getattr(self.data.train, "manifest", None)
        tok_name = (manifest.tokenizer or {}).get("name") if manifest is not None else None
        self.downstream = in_loop_evaluator(
            config, tok_name, bf16=self.autocast_dtype is not None, rank=self.dist.rank,
            world_size=self.dist.world_size,
        )  # fmt: skip
        from mamba3lite.data import WindowSampler

        self.sampler = WindowSampler(
            len(self.data.train),
            self.global_windows,
            rank=self.dist.rank,
            world_size=self.dist.world_size,
            seed=tc.seed,
            shuffle=True,
        )
        self.ckpt = CheckpointManager(tc.checkpoint_dir, keep_last_n=tc.keep_last_n)
        self.guard = NonFiniteGuard(tc.nan_guard_max_consecutive, tc.max_rollbacks)
        self.progress = Progress()
        self.logger = TrainingLogger.disabled()  # the real one is opened by train(), on rank 0
        self.wandb_run_id: str | None = None
        self._code_version: dict | None = None

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

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.raw_model.parameters() if p.requires_grad]

    @property
    def global_windows(self) -> int:
        return self.tc.windows_per_step(self.dist.world_size)

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return torch.bfloat16 if self.tc.dtype == "bf16" else None

    # ---------------------------------------------------------------------------------- building
    def _build_data(self, train_data: Any, val_data: Any) -> TrainData:
        train = train_data if train_data is not None else self._build_train_data()
        val, why = (val_data, "") if val_data is not None else build_val_data(self.cfg, train)
        check_data_matches(self.cfg, train, val)
        return TrainData(train, val, why)

    def _build_train_data(self) -> Any:
        return build_train_data(self.cfg)

    def _build_model(self, model: torch.nn.Module | None) -> tuple[torch.nn.Module, Any, Any]:
        """(raw model on the device, the model the step runs: DDP-wrapped and compiled as configured,
        its AdamW). The place where a fresh run's initial weights would be loaded."""
        tc = self.tc
        if model is None:
            from mamba3lite.model import Mamba3Transformer
            from mamba3lite.model.memory import check_model_fits

            check_model_fits(self.cfg.model, self.device)
            model = Mamba3Transformer(self.cfg.model)
        raw = model.to(self.device)
        if hasattr(raw, "set_scan_impl"):
            # The scan backend is chosen here, where the device is known: a `triton` that cannot run
            # on it is one ConfigError now, before anything is written or compiled.
            raw.set_scan_impl(self.cfg.model.scan_impl, self.device)
        if hasattr(raw, "grad_checkpointing"):
            raw.grad_checkpointing = tc.grad_checkpointing
        wrapped = D.wrap_ddp(raw, self.dist)
        if tc.compile:
            wrapped = torch.compile(wrapped)
        optimizer = build_optimizer(raw, tc)
        return raw, wrapped, optimizer

    def _data_identity(self) -> dict | None:
        path = None if self.cfg.data.dummy else self.cfg.data.train_data_path
        return data_identity(getattr(self.data.train, "manifest", None), path)

    def _sched_kw(self) -> dict:
        tc = self.tc
        return {"lr": tc.lr, "min_lr": tc.min_lr, "warmup_steps": tc.warmup_steps, "max_steps": tc.max_steps}

    # -------------------------------------------------------------------------------------- run
    def request_stop(self, reason: str = "signal") -> None:
        """Ask `train()` to stop after the current step, as SIGTERM does (checkpoint, "stop" event that
        says "stopped by `reason`"). Thread-safe: e.g. a timer thread enforcing a wall-clock budget (the
        quickstart's, reason "the time budget")."""
        self.stop.request(reason)

    def train(self, until_step: int | None = None) -> TrainResult:
        """Train to `training.max_steps` (or to `until_step`, then save: a resumable pause). Holds the
        run-directory lock for the whole call. Returns a `TrainResult`."""
        target = self.tc.max_steps if until_step is None else min(until_step, self.tc.max_steps)
        # Handlers from the start: a SIGTERM while a big checkpoint is verified and restored must stop
        # cleanly.
        with self._run_lock(), self.stop.installed():
            try:
                self._start(target, until_step)
                stopped = self._loop(target)
                self._finish(stopped)
            except Exception as e:
                with contextlib.suppress(Exception):
                    self.logger.flush()  # the steps since the last row (superseded if they were not saved)
                    self.logger.event(
                        self.step, "error", f"{type(e).__name__}: {e}", tokens_total=self.tokens_seen
                    )
                raise
            finally:
                self.logger.close()
        return TrainResult(
            step=self.step,
            tokens_seen=self.tokens_seen,
            stopped=stopped,
            history=list(self.progress.history),
            last_eval=self.last_eval,
            steady_tokens_per_s=self.logger.steady_tokens_per_s(),
            rollbacks=self.rollbacks,
        )

    def _loop(self, target: int) -> bool:
        """Train until `target` or the stop flag (then True); evaluate at the end."""
        stopped = False
        try:
            while self.step < target and not stopped:
                if self.train_step():
                    self._periodic()
                stopped = D.any_rank(self.stop.is_set(), self.dist)
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
        if self.step % tc.save_every == 0:
            # A step a run can resume from ends a window: a resume or rollback to it then supersedes
            # whole rows of the abandoned steps, never kept ones.
            self.logger.flush()
        t0 = time.time()
        # Evaluate first: a checkpoint written at an evaluation step carries that evaluation (its meta's
        # last_eval, what `inspect` and a resume report).
        if tc.eval_every and self.step % tc.eval_every == 0:
            self.evaluate()
        # every rank scores its share of the benchmarks' items; rank 0 writes the row
        self.downstream.maybe_evaluate(self.step, self.raw_model, self.logger, self.tokens_seen)
        if self.step % tc.save_every == 0:
            self.save_checkpoint()
        self.logger.exclude_time(time.time() - t0)

    @contextlib.contextmanager
    def _run_lock(self) -> Iterator[None]:
        """The run directory's lock, taken by rank 0; a refusal is raised on every rank."""
        lock = RunLock(self.run_dir)
        error: CheckpointError | None = None
        if self.dist.is_main:
            try:
                lock.acquire()
            except CheckpointError as e:
                error = e
        if D.any_rank(error is not None, self.dist):
            raise error or CheckpointError(f"{self.run_dir} is in use by another trainer")
        try:
            yield
        finally:
            lock.release()

    def _start(self, target: int, until_step: int | None) -> None:
        """Resume (or start afresh), open the logger and the run record, and say what will happen."""
        plan = self._plan_resume()
        self.logger = self._open_logger(plan.target)
        self._apply_resume(plan)
        if self.dist.is_main:  # after the resume's checks: a refused resume leaves the records as they were
            start = {"world_size": self.dist.world_size, "resume": self.resume, "device": str(self.device)}
            self._code_version = write_run_records(self.cfg, self.run_dir, start, self._data_identity())
        what = "resumed" if self.step else "start"
        # The scan backend that runs (model.scan_impl `auto` resolves per device): the run says which.
        scan = getattr(self.raw_model, "scan_impl", None)
        self.logger.event(
            self.step,
            "start",
            f"{what} at step {self.step} -> {target} on {self.dist.world_size} x {self.device}; "
            f"{self.tc.tokens_per_step(self.dist.world_size):,} tokens/step; {self._epoch_summary()}"
            + (f"; {scan} scan" if scan else ""),
            tokens_total=self.tokens_seen,
            **({"scan_impl": scan} if scan else {}),
        )
        for warning in self._start_warnings(target, until_step):
            self._event("warning", warning)
        self.logger.restart_window(self.step)
        self.progress.history = []

    def _finish(self, stopped: bool) -> None:
        self._save_unsaved()
        if stopped:
            self._event(
                "stop",
                f"stopped by {self.stop.reason} at step {self.step}; checkpoint saved, `mamba3lite train` "
                "resumes from it",
            )
        else:
            self._event("end", f"reached step {self.step}")

    def _event(self, kind: str, message: str) -> None:
        self.logger.event(self.step, kind, message, tokens_total=self.tokens_seen)

    def _start_warnings(self, target: int, until_step: int | None) -> list[str]:
        """Settings that make the run other than it looks: no validation although evaluation is on, a
        warmup that never reaches the peak learning rate, nothing left to train."""
        tc, out = self.tc, []
        if tc.eval_every and self.val_data is None:
            out.append(f"no validation data, so training.eval_every has no effect: {self.data.no_val_reason}")
        if tc.warmup_steps > tc.max_steps:
            peak = lr_at(tc.max_steps - 1, **self._sched_kw())
            out.append(
                f"training.warmup_steps {tc.warmup_steps} > training.max_steps {tc.max_steps}: the learning "
                f"rate only warms up, to {peak:.3g} instead of training.lr {tc.lr:g}; lower warmup_steps"
            )
        if self.step >= target and until_step is None:
            out.append(
                f"the run is at step {self.step}, not before training.max_steps {tc.max_steps}: nothing to "
                "train; raise --max-steps to continue it"
            )
        return out

    def _epoch_summary(self) -> str:
        """An epoch's size in steps, and the windows each epoch skips (made visible: the seed's DataLoader
        dropped them silently)."""
        s = self.sampler
        text = f"epoch {s.epoch} of {s.batches_per_epoch:,} steps over {s.n_windows:,} windows"
        if s.tail_per_epoch:
            text += (
                f", {s.tail_per_epoch:,} skipped per epoch (n_windows % global batch {s.global_batch_size}; "
                f"{'different ones each epoch' if s.shuffle else 'always the last ones'})"
            )
        return text

    def _open_logger(self, resume_target: int) -> TrainingLogger:
        """Rank 0's logger (the others keep the disabled one); a resumed run continues its W&B run."""
        if not self.dist.is_main:
            return self.logger
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if resume_target >= 0:
            with contextlib.suppress(CheckpointError):
                self.wandb_run_id = self.ckpt.read_meta(resume_target).get("wandb_run_id")
        tc = self.tc
        peak = peak_flops(self.device, tc.peak_tflops)
        flops = None
        with contextlib.suppress(ImportError, KeyError):
            from mamba3lite.model import model_flops_per_token

            flops = model_flops_per_token(self.cfg.model, tc.max_seq_len)["train"]
        logger = build_logger(
            self.run_dir,
            log_every=tc.log_every,
            flops_per_token=flops,
            # tokens/s is the rate of all processes together, so the peak is all their devices'
            peak_flops_per_s=None if peak is None else peak * self.dist.world_size,
            device=self.device,
            max_steps=tc.max_steps,
            start_step=self.step,
            progress=tc.progress,
            wandb_run_id=self.wandb_run_id,
            config=self.cfg.to_dict(),
        )
        self.wandb_run_id = logger.wandb_run_id or self.wandb_run_id
        return logger

    # ------------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self) -> None:
        """Write the checkpoint of the current step (rank 0 writes; all ranks wait)."""
        if self.dist.is_main:
            self.ckpt.save(self.step, self.raw_model, self.optimizer, self._checkpoint_meta())
        D.barrier(self.dist)
        self.progress.last_saved = self.step
        self.guard.on_saved(self.step)

    def _checkpoint_meta(self) -> dict:
        return {
            "config": self.cfg.to_dict(),
            "tokens_seen": self.tokens_seen,
            "scheduler": {
                "kind": "warmup_cosine",
                "step": self.step,
                "lr": lr_at(max(self.step - 1, 0), **self._sched_kw()),
            },
            "sampler": self.sampler.state_dict(),
            "rng": capture_rng_state(),
            "data": self._data_identity(),
            "metrics": self.logger.last_row,
            "last_eval": self.last_eval,
            "wandb_run_id": self.wandb_run_id,
            "world_size": self.dist.world_size,
            "global_batch_windows": self.global_windows,
            "rollbacks": self.rollbacks,
            "code_version": self._code_version,
        }

    def _save_unsaved(self) -> bool:
        """Save the current step unless it is step 0 or saved already; True if it saved."""
        if self.step == 0 or self.progress.last_saved == self.step:
            return False
        self.save_checkpoint()
        return True

    def _save_before_data_error(self) -> None:
        """A damaged batch stops the run (on every rank: `_damaged_on_any_rank`), but the steps done since
        the last checkpoint are good: save them, so that the run resumes here once the data is repaired."""
        if self._save_unsaved():
            self._event(
                "save",
                f"saved step {self.step} before stopping on a damaged batch; repair the data and run the "
                "same command to resume from it",
            )

    def _plan_resume(self) -> ResumePlan:
        """The resume plan, made on rank 0, its target broadcast. A refusal is raised on every rank (rank
        0 raising alone would leave the others waiting in the broadcast)."""
        plan = plan_resume(self.ckpt, self.resume) if self.dist.is_main else ResumePlan()
        if self.dist.is_main and plan.refusal is None:  # before the logger or the resume changes them
            plan.refusal = run_records_problem(self.run_dir)
        if D.any_rank(plan.refusal is not None, self.dist):
            raise CheckpointError(plan.refusal or "rank 0 refused to resume (its output says why)")
        plan.target = D.broadcast_int(plan.target, self.dist)
        return plan

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
        self._restore(plan.target)
        note = ""
        if self.dist.is_main and plan.torn:
            for s in plan.torn:
                self.ckpt.delete(s)
            note = f"; unfinished save(s) of step(s) {plan.torn} (no meta) deleted"
        if self.dist.is_main and plan.newer:
            where = self.ckpt.move_aside(plan.newer, from_step=plan.target)
            note += f"; newer checkpoints {plan.newer} moved to {where}"
        marked = self.logger.supersede_after(plan.target)
        self._event(
            "resume",
            f"resumed from step {plan.target} (tokens {self.tokens_seen:,}){note}; {marked} later metrics "
            "rows superseded",
        )
        D.barrier(self.dist)

    def _restore(self, step: int) -> dict:
        """Load checkpoint `step` into model, optimizer, sampler, RNG and counters (all ranks)."""
        meta = self.ckpt.load(step, self.raw_model, self.optimizer, map_location=self.device)
        facts = {
            "model": self.cfg.to_dict()["model"],
            "data": self._data_identity(),
            "data_path": self.cfg.data.train_data_path,
            "max_seq_len": self.tc.max_seq_len,
            "run_dir": self.run_dir,
        }
        warnings = resume_warnings(meta, facts)  # raises for another model or tokenizer
        p = self.progress
        p.step, p.tokens_seen = int(meta["step"]), int(meta.get("tokens_seen", 0))
        for warning in warnings:
            self.logger.event(self.step, "warning", warning)
        tc = self.tc
        if changed := apply_optimizer_settings(self.optimizer, tc):
            self.logger.event(
                self.step,
                "config",
                f"AdamW settings from the config, not from checkpoint step {step}: {', '.join(changed)}",
            )
        if "sampler" in meta:
            self.sampler.load_state_dict(meta["sampler"])
        else:
            self.logger.event(
                self.step, "warning", "seed-format checkpoint: no sampler state, data order restarts"
            )
        if "rng" in meta:
            restore_rng_state(meta["rng"])
        self.wandb_run_id = meta.get("wandb_run_id") or self.wandb_run_id
        p.last_eval = meta.get("last_eval")
        if isinstance(p.last_eval, dict) and p.last_eval.get("step") == p.step:
            p.evaluated_at = p.step  # a re-run of a finished run does not evaluate (and log) it again
        p.last_saved = p.step
        return meta

    # ------------------------------------------------------------------------------------ steps
    def _next_indices(self) -> list[int]:
        return self.sampler.next_batch()

    def _batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        x_BT, y_BT = self.train_data.get_batch(indices)  # one gather, no per-window tensors
        return x_BT.to(self.device, non_blocking=True), y_BT.to(self.device, non_blocking=True)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def _no_sync(self) -> contextlib.AbstractContextManager:
        inner = getattr(self.model, "_orig_mod", self.model)
        return inner.no_sync() if self.dist.distributed else contextlib.nullcontext()

    def _damaged_on_any_rank(self, mine: DataError | None, what: str) -> DataError | None:
        """The error every rank raises together when any rank's batch was damaged (one rank raising alone
        would leave the others waiting in the next collective), else None."""
        if not D.any_rank(mine is not None, self.dist):
            return None
        return mine or DataError(f"another rank's {what} is damaged (its log names the shard)")

    def train_step(self) -> bool:
        """One optimizer step (accumulation, non-finite guard, all-reduce, clip, AdamW). Returns False
        when the step was abandoned (every micro-step skipped, or a rollback happened)."""
        lr = lr_at(self.step, **self._sched_kw())
        set_lr(self.optimizer, lr)
        batches = self._draw_batches()
        accumulated = self._accumulate(batches)
        if accumulated is None:  # rolled back
            return False
        good, loss_sum, skipped = accumulated
        tokens = self.tc.tokens_per_step(self.dist.world_size)
        self.progress.tokens_seen += tokens
        if good == 0:
            self.optimizer.zero_grad(set_to_none=True)
            self.guard.on_abandoned_step(skipped, tokens)
            return False
        grad_norm = self._reduce_and_clip(good)
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
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.progress.step += 1
        loss_mean = D.mean_across(loss_sum / good, self.dist)
        self.progress.history.append((self.step, loss_mean))
        pending_skipped, pending_tokens = self.guard.take_pending()
        self.logger.log_step(
            self.step,
            loss=loss_mean,
            lr=lr,
            grad_norm=grad_norm,
            tokens_processed=tokens + pending_tokens,
            tokens_total=self.tokens_seen,
            skipped=skipped + pending_skipped,
        )
        return True

    def _draw_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The step's micro-batches on the device. A damaged batch on any rank: DataError on every rank,
        the sampler put back to before the step (nothing of it has happened, so the checkpoint `train`
        writes now resumes exactly here)."""
        mb, accum = self.tc.micro_batch_size, self.tc.gradient_accumulation_steps
        sampler_before = self.sampler.state_dict()
        indices = self._next_indices()
        assert len(indices) == mb * accum, f"sampler gave {len(indices)} windows, expected {mb * accum}"
        if self.sampler.epoch != sampler_before["epoch"]:
            self._event("epoch", f"{self._epoch_summary()} begins at step {self.step + 1}")
        bad: DataError | None = None
        try:
            batches = [self._batch(indices[i * mb : (i + 1) * mb]) for i in range(accum)]
        except DataError as e:  # a shard whose bytes changed since prepare (the message names it)
            batches, bad = [], e
        if (err := self._damaged_on_any_rank(bad, f"batch for step {self.step + 1}")) is not None:
            self.sampler.load_state_dict(sampler_before)
            raise err
        return batches

    def _accumulate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[int, float, int] | None:
        """Forward and backward of each micro-batch the guard lets through: (good, loss sum, skipped),
        or None after a rollback."""
        good, loss_sum, skipped = 0, 0.0, 0
        accum = len(batches)
        for i, (x, y) in enumerate(batches):
            with self._no_sync():
                with self._autocast():
                    loss = self.model(x, y)
                loss = self.faults.apply(loss)
                finite = D.all_agree_finite(loss, self.dist)
                if finite:
                    (loss / accum).backward()
                    good += 1
                    loss_sum += float(loss.detach())
            if (verdict := self.guard.on_loss(finite)) == OK:
                continue
            skipped += 1
            streak = self.guard.nan_streak
            self._event(
                "nan_skip",
                f"non-finite loss at micro-step {i} of step {self.step + 1} skipped ({streak} in a row)",
            )
            if verdict == ROLLBACK:
                self._rollback(f"{streak} consecutive non-finite losses")
                return None
        return good, loss_sum, skipped

    def _reduce_and_clip(self, good: int) -> float:
        """Average the gradients across ranks (over the `good` micro-steps that ran), clip; the norm."""
        params, accum = self.params, self.tc.gradient_accumulation_steps
        D.all_reduce_grads(params, self.dist.world_size)
        if good < accum:  # mean over the micro-batches that ran
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(accum / good)
        max_norm = self.tc.grad_clip if self.tc.grad_clip > 0 else float("inf")
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def _rollback(self, why: str) -> None:
        """Back to the newest checkpoint after `why` (e.g. "5 consecutive non-finite losses"), going on
        with the data after the batches that led here."""
        self.optimizer.zero_grad(set_to_none=True)
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
        loss_sum, count = self._val_loss_sum()
        val_loss = loss_sum / max(count, 1)
        if not math.isfinite(val_loss):
            # A diverging model (or an overflow in the eval's dtype). Not an evaluation to record (the
            # metrics and the checkpoint meta are strict JSON), and no reason to lose the step: say so.
            self._event(
                "eval_nonfinite",
                f"validation loss is {val_loss} at step {self.step} (the model may be diverging); not "
                "recorded as an evaluation",
            )
            return None
        out = {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 700.0)), "val_windows": int(count)}
        bpt = getattr(self.val_data, "bytes_per_token", None)
        if bpt:
            out["val_bpb"] = val_loss / math.log(2) / bpt
        self.progress.last_eval = {"step": self.step, **out}
        self.logger.log_eval(self.step, self.tokens_seen, out)
        return out

    def _val_loss_sum(self) -> tuple[float, float]:
        """(sum of window losses, windows) over all ranks; DataError on every rank for a damaged shard."""
        tc = self.tc
        n = len(self.val_data)
        total = min(tc.eval_batches * tc.micro_batch_size, n)
        mine = spread_picks(n, total)[self.dist.rank :: self.dist.world_size]
        self.raw_model.eval()
        bad: DataError | None = None
        try:
            use_autocast = self.autocast_dtype is not None
            loss_sum = window_loss_sum(
                self.raw_model, self.val_data, mine, tc.micro_batch_size, self.device, use_autocast
            )
        except DataError as e:  # a damaged val shard
            loss_sum, bad = 0.0, e
        finally:
            self.raw_model.train()
        if (err := self._damaged_on_any_rank(bad, "validation batch")) is not None:
            raise err
        loss_sum, count = D.sum_across([loss_sum, float(len(mine))], self.dist)
        return loss_sum, count


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
