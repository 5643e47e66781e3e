"""Pretrainer: the training loop (the seed's training/pretrain.py with its documented defects fixed).

One optimizer step = `gradient_accumulation_steps` micro-steps of `micro_batch_size` windows on each
process. The global batch (micro × accumulation × world size windows) is drawn by `WindowSampler`,
whose order is a pure function of (seed, epoch, consumed), so it is the same for any world size.

Per micro-step: forward under autocast (bf16 when configured), then the NaN guard: if the loss is
non-finite on ANY rank, every rank skips the micro-step (no backward: gradients and optimizer state are
untouched) and an event is logged. After `nan_guard_max_consecutive` consecutive skipped micro-steps the
run rolls back to the newest verified checkpoint (model, optimizer, RNG, counters) and goes on from
there with the data AFTER the failure: the batches drawn since the checkpoint are skipped, as large
runs skip the data around a loss spike, since replaying them would most often diverge the same way
(the event says which). With no checkpoint it stops with `TrainingError`, and so it does after
`max_rollbacks` rollbacks that did not lead to a newer checkpoint. When only some micro-steps of a step
were skipped, the gradient is rescaled to the mean over the good ones.

Per optimizer step: gradients averaged across ranks (one explicit all-reduce; see distributed.py),
global-norm clipping (the pre-clip norm is logged), lr = `lr_at(step)` (a pure function: the
"scheduler state" is the step), AdamW step, then the logger (every step; it averages windows), periodic
evaluation and checkpoints, and the stop check: SIGTERM/SIGINT only set a flag; after the current step
all ranks agree, a checkpoint is written, a "stop" event logged, and `train()` returns (exit code 0).

Resume is exact: model, optimizer (by parameter name), sampler position, Python/numpy/torch RNG states,
step and token counters are in the checkpoint, so N steps == N/2 + resume + N/2 bit for bit (fp32, CPU).
`resume="latest"` picks the newest VERIFIED checkpoint; an explicit step N loads exactly N (the seed
silently replaced it with the latest: its Pitfall 6); newer checkpoints are moved to their own folder
DIR/superseded/<UTC time>-from-step-N/ (one per abandoned timeline, never overwritten) so that a later
crash cannot resume the abandoned timeline, and their metrics rows are marked superseded. If no
checkpoint in DIR verifies, `resume="latest"` is an error, not a fresh start over them.

Fault injection for tests: the environment variable MAMBA3LITE_INJECT_NONFINITE, read when the
Pretrainer is built, makes chosen micro-steps' losses NaN. Micro-steps are counted per process from 0
in execution order (not restored by resume or rollback, so an injected fault does not recur after a
rollback). Syntax: comma-separated items, each an index `7` or a run `start:count` (`10:5` = 10..14);
optionally prefixed by `rR@` to apply to rank R only (`r1@3` = micro-step 3 on rank 1).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import random
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mamba3lite.config import Config, write_resolved_config
from mamba3lite.data.shards import MANIFEST_NAME
from mamba3lite.downstream.in_loop import in_loop_evaluator
from mamba3lite.errors import CheckpointError, ConfigError, DataError, DataNotFoundError, TrainingError
from mamba3lite.evaluate import check_compatible, short_val_split, spread_picks, window_loss_sum
from mamba3lite.malloc import keep_freed_memory
from mamba3lite.train import distributed as D
from mamba3lite.train.checkpoint import (
    CheckpointManager,
    RunLock,
    capture_rng_state,
    checkpoint_files,
    restore_rng_state,
)
from mamba3lite.train.logging import TrainingLogger, build_logger, peak_flops
from mamba3lite.train.optim import build_optimizer, lr_at, set_lr

INJECT_ENV = "MAMBA3LITE_INJECT_NONFINITE"


def parse_injection(spec: str, rank: int = 0) -> set[int]:
    """Micro-step indices (this process's count) whose loss is made NaN; see the module docstring."""
    out: set[int] = set()
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        if "@" in item:
            who, _, item = item.partition("@")
            if not who.startswith("r") or not who[1:].isdigit():
                raise ConfigError(f"{INJECT_ENV}: bad rank prefix {who!r} (expected rN@...)")
            if int(who[1:]) != rank:
                continue
        try:
            if ":" in item:
                start, count = (int(v) for v in item.split(":"))
                out.update(range(start, start + count))
            else:
                out.add(int(item))
        except ValueError:
            raise ConfigError(f"{INJECT_ENV}: bad item {item!r} (expected N or START:COUNT)") from None
    return out


def code_version() -> dict:
    """Package version and, when running from a git checkout, the commit (and whether it is dirty)."""
    from mamba3lite import __version__

    info: dict[str, Any] = {"package": __version__, "git_commit": None}
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5
        )
        if commit.returncode == 0:
            info["git_commit"] = commit.stdout.strip()
            dirty = subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=here,
                capture_output=True,
                text=True,
                timeout=5,
            )
            info["git_dirty"] = bool(dirty.stdout.strip()) if dirty.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def _manifest_sha256(path: str | None) -> str | None:
    if not path:
        return None
    p = Path(path)
    m = p / MANIFEST_NAME if p.is_dir() else (p if p.name == MANIFEST_NAME else None)
    if m is None or not m.is_file():
        return None
    return hashlib.sha256(m.read_bytes()).hexdigest()


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


class Pretrainer:
    """Builds everything from a `Config` and runs `train()`.

    Args:
        config: the resolved config. `training.checkpoint_dir` is the run directory.
        resume: "latest" (newest verified checkpoint, or a fresh start), "none" (fresh; refuses a
            directory that already holds checkpoints), or a step number (exactly that checkpoint).
        dist: from `distributed.init_distributed()`; default: one process on `training.device`.
        model, train_data, val_data: injected instead of built from the config (tests).
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
    ) -> None:
        self.cfg = config
        tc = config.training
        self.tc = tc
        if not (resume in ("latest", "none") or (isinstance(resume, int) and resume >= 0)):
            raise ConfigError(f"resume must be 'latest', 'none' or a step number >= 0, got {resume!r}")
        self.resume = resume
        self.dist = dist or D.DistInfo(device=D.pick_device(tc.device))
        self.device = self.dist.device
        if self.device.type == "cpu":
            keep_freed_memory()  # ~25% faster CPU steps: see mamba3lite/malloc.py
        self.run_dir = Path(tc.checkpoint_dir)
        if (self.run_dir / MANIFEST_NAME).exists():
            raise ConfigError(
                f"training.checkpoint_dir {self.run_dir} is a dataset directory (it holds {MANIFEST_NAME}): "
                "checkpoints would be mixed into the dataset; point --checkpoint-dir at a run directory"
            )
        self.inject = parse_injection(os.environ.get(INJECT_ENV, ""), self.dist.rank)

        self._seed_everything(tc.seed)
        self.train_data = train_data if train_data is not None else self._build_train_data()
        self._no_val_reason = ""  # why there is no validation data, when there is none
        self.val_data = val_data if val_data is not None else self._build_val_data()
        self._check_data_matches()
        if model is None:
            from mamba3lite.model import Mamba3Transformer

            model = Mamba3Transformer(config.model)
        self.raw_model = model.to(self.device)
        if hasattr(self.raw_model, "grad_checkpointing"):
            self.raw_model.grad_checkpointing = tc.grad_checkpointing
        self.model = D.wrap_ddp(self.raw_model, self.dist)
        if tc.compile:
            self.model = torch.compile(self.model)
        self.params = [p for p in self.raw_model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(
            self.raw_model, lr=tc.lr, weight_decay=tc.weight_decay, betas=tc.betas, eps=tc.eps
        )

        from mamba3lite.data import WindowSampler

        self.global_windows = tc.windows_per_step(self.dist.world_size)
        if len(self.train_data) < self.global_windows:
            raise DataError(
                f"the training data has {len(self.train_data)} windows of {tc.max_seq_len} tokens, fewer "
                f"than one global batch ({self.global_windows} windows = micro_batch_size x "
                "gradient_accumulation_steps x processes); use more data or a smaller batch"
            )
        self.sampler = WindowSampler(
            len(self.train_data),
            self.global_windows,
            rank=self.dist.rank,
            world_size=self.dist.world_size,
            seed=tc.seed,
            shuffle=True,
        )
        self._sampler_iter = iter(self.sampler)
        self._epoch_seen = self.sampler.epoch  # an "epoch" event when the sampler moves past it
        self.ckpt = CheckpointManager(self.run_dir, keep_last_n=tc.keep_last_n)
        self.autocast_dtype = torch.bfloat16 if tc.dtype == "bf16" else None
        # Downstream benchmarks (training.eval_tasks): everything they need is checked now, not at step 4,000.
        manifest = getattr(self.train_data, "manifest", None)
        tok_name = (manifest.tokenizer or {}).get("name") if manifest is not None else None
        self.downstream = in_loop_evaluator(config, tok_name, bf16=self.autocast_dtype is not None)

        self.step = 0
        self.tokens_seen = 0
        self.micro_count = 0  # per process, never restored: the fault-injection clock
        self.nan_streak = 0  # consecutive micro-steps with a non-finite loss
        self.bad_grad_streak = 0  # consecutive steps with finite losses but a non-finite gradient norm
        self._evaluated_at = -1  # the step of the last evaluation (its loss finite or not)
        self.rollbacks = 0
        self._rollbacks_without_progress = 0
        self._rollback_floor = -1  # a save past this step counts as progress
        self._last_saved = -1
        self._pending_skipped = 0
        self._pending_tokens = 0
        self._stop = threading.Event()
        self._stop_reason = "signal"
        self.wandb_run_id: str | None = None
        self.logger = TrainingLogger.disabled()
        self.history: list[tuple[int, float | None]] = []
        self.last_eval: dict | None = None
        self._tokens_per_step = tc.tokens_per_step(self.dist.world_size)
        self._code_version: dict | None = None

    # ---------------------------------------------------------------------------------- building
    @staticmethod
    def _seed_everything(seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)

    def _build_train_data(self) -> Any:
        from mamba3lite.data import PretrainDataset

        dc, tc = self.cfg.data, self.tc
        try:
            return PretrainDataset(
                None if dc.dummy else dc.train_data_path,
                tc.max_seq_len,
                self.cfg.model.vocab_size,
                split="train",
                dummy=dc.dummy,
                seed=tc.seed,
                dtype=None if dc.dummy else dc.token_dtype,
            )
        except DataNotFoundError as e:  # (the seed trained on random tokens here without a word)
            raise DataNotFoundError(f"{e}; random tokens on purpose, for plumbing tests: --dummy") from None

    def _build_val_data(self) -> Any:
        from mamba3lite.data import PretrainDataset
        from mamba3lite.data.shards import Manifest

        dc, tc = self.cfg.data, self.tc
        vocab = self.cfg.model.vocab_size
        if dc.dummy:
            return PretrainDataset(
                None,
                tc.max_seq_len,
                vocab,
                dummy=True,
                seed=tc.seed + 1,
                dummy_tokens=max(tc.eval_batches * tc.micro_batch_size, 8) * tc.max_seq_len + 1,
            )
        if dc.val_data_path:
            p = Path(dc.val_data_path)
            if p.name == MANIFEST_NAME:  # the dataset's manifest file names the dataset, as in `eval`
                p = p.parent
            split = (
                "val" if (p / MANIFEST_NAME).exists() and Manifest.load(p).split_shards("val") else "train"
            )
            if split == "train" and p.resolve() == Path(dc.train_data_path).resolve():
                raise ConfigError(
                    f"data.val_data_path {dc.val_data_path} is the training data, which has no val split: "
                    "validating on it would measure memorisation; point it at held-out data, or unset it"
                )
            return PretrainDataset(p, tc.max_seq_len, vocab, split=split, dtype=dc.token_dtype)
        manifest = getattr(self.train_data, "manifest", None)
        if manifest is not None and manifest.n_tokens("val") > tc.max_seq_len:
            return PretrainDataset(dc.train_data_path, tc.max_seq_len, vocab, split="val")
        if manifest is not None and manifest.n_tokens("val"):
            self._no_val_reason = (
                f"{dc.train_data_path}: {short_val_split(manifest.n_tokens('val'), tc.max_seq_len)}; lower "
                "training.max_seq_len, or prepare with a larger --val-fraction"
            )
        else:
            self._no_val_reason = (
                f"{dc.train_data_path} has no val split; prepare with --val-fraction, or set "
                "data.val_data_path"
            )
        return None

    def _check_data_matches(self) -> None:
        """What `eval` refuses, refused before training: a dataset whose EOS id is not the model's (the
        state resets at EOS, generation stops at it), and validation data of another tokenizer than the
        training data's. (A vocab_size mismatch is the dataset's own error.)"""
        dc, mc = self.cfg.data, self.cfg.model
        train_m = getattr(self.train_data, "manifest", None)
        val_m = getattr(self.val_data, "manifest", None)
        train_tok = (train_m.tokenizer or {}) if train_m is not None else {}
        for m, where, vocab_hash, name in (
            (train_m, f"the training data ({dc.train_data_path})", None, ""),
            (val_m, f"the validation data ({dc.val_data_path or dc.train_data_path})",
             train_tok.get("vocab_hash"), str(train_tok.get("name"))),
        ):  # fmt: skip
            if m is not None:
                check_compatible(
                    m, mc.vocab_size, mc.eos_id, vocab_hash, name, where=where, reference="the training data",
                    eos_fix=f": set model.eos_id={m.eos_id}, or prepare the data with the model's tokenizer",
                )  # fmt: skip

    def _data_identity(self) -> dict | None:
        m = getattr(self.train_data, "manifest", None)
        if m is None:
            return None
        return {
            "tokenizer": m.tokenizer.get("name"),
            "vocab_hash": m.tokenizer.get("vocab_hash"),
            "vocab_size": m.vocab_size,
            "eos_id": m.eos_id,
            "manifest_sha256": _manifest_sha256(self.cfg.data.train_data_path),
        }

    # ------------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self) -> None:
        """Write the checkpoint of the current step (rank 0 writes; all ranks wait)."""
        if self.dist.is_main:
            meta = {
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
            self.ckpt.save(self.step, self.raw_model, self.optimizer, meta)
        D.barrier(self.dist)
        self._last_saved = self.step
        if self.step > self._rollback_floor:
            self._rollbacks_without_progress = 0

    def _restore(self, step: int) -> dict:
        """Load checkpoint `step` into model, optimizer, sampler, RNG and counters (all ranks)."""
        meta = self.ckpt.load(step, self.raw_model, self.optimizer, map_location=self.device)
        saved_cfg = meta.get("config") or {}
        if "model" in saved_cfg:
            mine = self.cfg.to_dict()["model"]
            diff = sorted(
                k for k in set(mine) | set(saved_cfg["model"]) if mine.get(k) != saved_cfg["model"].get(k)
            )
            if diff:
                raise CheckpointError(
                    f"checkpoint step {step} in {self.run_dir} was trained with another model config "
                    f"(differs in model.{', model.'.join(diff)}); use its config or another --checkpoint-dir"
                )
        saved_data, mine_data = meta.get("data") or {}, self._data_identity() or {}
        if (
            saved_data.get("vocab_hash")
            and mine_data.get("vocab_hash")
            and saved_data["vocab_hash"] != mine_data["vocab_hash"]
        ):
            raise CheckpointError(
                f"checkpoint step {step} was trained on tokenizer {saved_data.get('tokenizer')} (vocab hash "
                f"{saved_data['vocab_hash'][:12]}), the data at {self.cfg.data.train_data_path} uses "
                f"{mine_data.get('tokenizer')} ({mine_data['vocab_hash'][:12]})"
            )
        self.step = int(meta["step"])
        self.tokens_seen = int(meta.get("tokens_seen", 0))
        saved_sha, mine_sha = saved_data.get("manifest_sha256"), mine_data.get("manifest_sha256")
        if saved_sha and mine_sha and saved_sha != mine_sha and self.dist.is_main:
            # Same tokenizer, other data (re-prepared, grown): allowed, but the resume is no longer exact.
            self.logger.event(
                self.step,
                "warning",
                f"the training data at {self.cfg.data.train_data_path} changed since checkpoint step {step} "
                "(its manifest differs): training goes on over the new data from the saved position, no "
                "longer an exact continuation of the run",
            )
        saved_len = (saved_cfg.get("training") or {}).get("max_seq_len")
        if saved_len not in (None, self.tc.max_seq_len) and self.dist.is_main:
            # The sampler's position counts windows of the old length in the old permutation.
            self.logger.event(
                self.step,
                "warning",
                f"training.max_seq_len changed from {saved_len} (checkpoint step {step}) to "
                f"{self.tc.max_seq_len}: the windows and their order differ, so the data from here is not a "
                "continuation of the run's (some text comes again, some is skipped this epoch)",
            )
        if (changed := self._apply_optimizer_settings()) and self.dist.is_main:
            self.logger.event(
                self.step,
                "config",
                f"AdamW settings from the config, not from checkpoint step {step}: {', '.join(changed)}",
            )
        if "sampler" in meta:
            self.sampler.load_state_dict(meta["sampler"])
        elif self.dist.is_main:
            self.logger.event(
                self.step, "warning", "seed-format checkpoint: no sampler state, data order restarts"
            )
        self._sampler_iter = iter(self.sampler)
        if "rng" in meta:
            restore_rng_state(meta["rng"])
        self.wandb_run_id = meta.get("wandb_run_id") or self.wandb_run_id
        self.last_eval = meta.get("last_eval")
        if isinstance(self.last_eval, dict) and self.last_eval.get("step") == self.step:
            self._evaluated_at = self.step  # a re-run of a finished run does not evaluate (and log) it again
        self._last_saved = self.step
        return meta

    def _apply_optimizer_settings(self) -> list[str]:
        """AdamW keeps weight_decay, betas and eps in its param groups, so loading a checkpoint's optimizer
        state brings back the settings it was saved with; the run's config (what config.yaml records)
        wins. Groups as `param_groups`: [decayed, not decayed]. Returns the changes, e.g. "eps 1e-08 ->
        1e-06". (lr is set every step from the schedule.)"""
        tc, changed = self.tc, []
        for i, g in enumerate(self.optimizer.param_groups):
            want = {
                "weight_decay": tc.weight_decay if i == 0 else 0.0,
                "betas": tuple(tc.betas),
                "eps": tc.eps,
            }
            for key, value in want.items():
                have = tuple(g[key]) if key == "betas" else g[key]
                if have != value:
                    g[key] = value
                    if i == 0 or key != "weight_decay":
                        changed.append(f"{key} {have} -> {value}")
        return list(dict.fromkeys(changed))

    def _sched_kw(self) -> dict:
        tc = self.tc
        return {"lr": tc.lr, "min_lr": tc.min_lr, "warmup_steps": tc.warmup_steps, "max_steps": tc.max_steps}

    def _pick_resume_target(self) -> int:
        """The step to resume from (-1: fresh start), decided on rank 0 and broadcast. A refusal is raised
        on every rank (rank 0 raising alone would leave the others waiting in the broadcast)."""
        target, refusal = -1, None
        if self.resume not in ("none", "latest"):
            target = int(self.resume)
            # Refused here, before the run's records are opened: a typo'd step must not log an error
            # into a healthy run's metrics.
            if self.dist.is_main and not (st := self.ckpt.status(target)).loadable:
                loadable = self.ckpt.verified_steps()
                if target not in self.ckpt.list_steps():
                    refusal = f"there is no checkpoint of step {target} in {self.run_dir}"
                else:
                    why = "; ".join(st.problems)
                    refusal = f"checkpoint step {target} in {self.run_dir} cannot be loaded: {why}"
                refusal += f". Loadable steps: {loadable or 'none'}"
        elif self.dist.is_main and (steps := self.ckpt.list_steps()):
            if self.resume == "none":
                refusal = (
                    f"{self.run_dir} already holds checkpoints (steps {steps}); use --resume latest to "
                    "continue, or another --checkpoint-dir for a fresh run"
                )
            elif (latest := self.ckpt.latest_step()) is not None:
                target = latest
            elif damaged := [s for s in steps if checkpoint_files(self.run_dir, s)["meta"].exists()]:
                # Saves that finished (their meta, written last, is there) and no longer verify: starting
                # afresh would overwrite them, and retention would delete them. (Steps without a meta are
                # saves killed mid-way, never a checkpoint: a fresh start is right for those.)
                problems = "; ".join(f"step {s}: {', '.join(self.ckpt.status(s).problems)}" for s in damaged)
                refusal = (
                    f"none of the checkpoints in {self.run_dir} verifies ({problems}); nothing was "
                    "changed: restore them from a copy, or move them away to start this run afresh"
                )
        if D.any_rank(refusal is not None, self.dist):
            raise CheckpointError(refusal or "rank 0 refused to resume (its output says why)")
        return D.broadcast_int(target, self.dist)

    def _apply_resume(self, target: int) -> None:
        if target < 0:
            # A fresh start; rows in metrics.jsonl are an earlier attempt's that died before its first
            # checkpoint: this run replaces them.
            if self.dist.is_main and (marked := self.logger.supersede_after(0)):
                self.logger.event(
                    0,
                    "restart",
                    f"no checkpoint to resume: starting at step 0; {marked} metrics rows of an earlier "
                    "attempt superseded",
                    tokens_total=0,
                )
            return
        self._restore(target)
        if self.dist.is_main:
            newer = [s for s in self.ckpt.list_steps() if s > target]
            note = ""
            # A save cut short before its meta (kill -9, disk full) was never a checkpoint: its model and
            # optimizer files are deleted, not kept aside, or every preemption would leave them for good.
            if torn := [s for s in newer if not checkpoint_files(self.ckpt.dir, s)["meta"].exists()]:
                for s in torn:
                    self.ckpt.delete(s)
                newer = [s for s in newer if s not in torn]
                note = f"; unfinished save(s) of step(s) {torn} (no meta) deleted"
            if newer:
                where = self.ckpt.move_aside(newer, from_step=target)
                note += f"; newer checkpoints {newer} moved to {where}"
            marked = self.logger.supersede_after(target)
            self.logger.event(
                self.step,
                "resume",
                f"resumed from step {target} (tokens {self.tokens_seen:,}){note}; {marked} later metrics "
                "rows superseded",
                tokens_total=self.tokens_seen,
            )
        D.barrier(self.dist)

    # ------------------------------------------------------------------------------------ steps
    def _next_indices(self) -> list[int]:
        try:
            return list(next(self._sampler_iter))
        except StopIteration:  # end of an epoch: the sampler moves on to the next one
            self._sampler_iter = iter(self.sampler)
            try:
                return list(next(self._sampler_iter))
            except StopIteration:
                raise TrainingError(
                    "the sampler yields no batch: is the dataset smaller than a global batch?"
                ) from None

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

    def train_step(self) -> bool:
        """One optimizer step (accumulation, NaN guard, all-reduce, clip, AdamW). Returns False when the
        step was abandoned (every micro-step skipped, or a rollback happened)."""
        tc = self.tc
        mb, accum = tc.micro_batch_size, tc.gradient_accumulation_steps
        lr = lr_at(self.step, **self._sched_kw())
        set_lr(self.optimizer, lr)
        sampler_before = self.sampler.state_dict()
        indices = self._next_indices()
        assert len(indices) == mb * accum, f"sampler gave {len(indices)} windows, expected {mb * accum}"
        if self.sampler.epoch != self._epoch_seen:
            self._epoch_seen = self.sampler.epoch
            if self.dist.is_main:
                self.logger.event(
                    self.step,
                    "epoch",
                    f"{self._epoch_summary()} begins at step {self.step + 1}",
                    tokens_total=self.tokens_seen,
                )
        bad: DataError | None = None
        try:
            batches = [self._batch(indices[i * mb : (i + 1) * mb]) for i in range(accum)]
        except DataError as e:  # a shard whose bytes changed since prepare (the message names it)
            batches, bad = [], e
        if (err := self._damaged_on_any_rank(bad, f"batch for step {self.step + 1}")) is not None:
            # Nothing of the step has happened: with the sampler put back to before it, the checkpoint
            # `train` writes now resumes exactly here.
            self.sampler.load_state_dict(sampler_before)
            self._sampler_iter = iter(self.sampler)
            raise err
        good, loss_sum, skipped = 0, 0.0, 0
        for i in range(accum):
            x, y = batches[i]
            with self._no_sync():
                with self._autocast():
                    loss = self.model(x, y)
                if self.micro_count in self.inject:
                    loss = loss * float("nan")
                self.micro_count += 1
                if D.all_agree_finite(loss, self.dist):
                    (loss / accum).backward()
                    good += 1
                    loss_sum += float(loss.detach())
                    self.nan_streak = 0
                    continue
            skipped += 1
            self.nan_streak += 1
            if self.dist.is_main:
                self.logger.event(
                    self.step,
                    "nan_skip",
                    f"non-finite loss at micro-step {i} of step "
                    f"{self.step + 1} skipped ({self.nan_streak} in a row)",
                    tokens_total=self.tokens_seen,
                )
            if self.nan_streak >= tc.nan_guard_max_consecutive:
                self._rollback(f"{self.nan_streak} consecutive non-finite losses")
                return False
        tokens = self._tokens_per_step
        self.tokens_seen += tokens
        if good == 0:
            self.optimizer.zero_grad(set_to_none=True)
            self._pending_skipped += skipped
            self._pending_tokens += tokens
            return False
        D.all_reduce_grads(self.params, self.dist.world_size)
        if good < accum:  # mean over the micro-batches that ran
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(accum / good)
        max_norm = tc.grad_clip if tc.grad_clip > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        if not math.isfinite(grad_norm):  # finite loss, overflowing backward: skip like a NaN loss
            self.optimizer.zero_grad(set_to_none=True)
            # Counted per step: the finite losses of its micro-steps have just reset nan_streak.
            self.bad_grad_streak += 1
            if self.dist.is_main:
                self.logger.event(
                    self.step,
                    "nan_skip",
                    f"non-finite gradient norm at step {self.step + 1}; optimizer step skipped "
                    f"({self.bad_grad_streak} in a row)",
                    tokens_total=self.tokens_seen,
                )
            if self.bad_grad_streak >= tc.nan_guard_max_consecutive:
                self._rollback(f"{self.bad_grad_streak} consecutive non-finite gradient norms")
                return False
            self._pending_skipped += skipped + good
            self._pending_tokens += tokens
            return False
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.bad_grad_streak = 0
        self.step += 1
        loss_mean = D.mean_across(loss_sum / good, self.dist)
        self.history.append((self.step, loss_mean))
        self.logger.log_step(
            self.step,
            loss=loss_mean,
            lr=lr,
            grad_norm=grad_norm,
            tokens_processed=tokens + self._pending_tokens,
            tokens_total=self.tokens_seen,
            skipped=skipped + self._pending_skipped,
        )
        self._pending_skipped = self._pending_tokens = 0
        return True

    def _rollback(self, why: str) -> None:
        """Back to the newest checkpoint after `why` (e.g. "5 consecutive non-finite losses")."""
        self.optimizer.zero_grad(set_to_none=True)
        target = -1
        self.ckpt.forget_hashes()  # the files were written (and hashed) maybe hours ago: check them anew
        if self.dist.is_main:
            latest = self.ckpt.latest_step()
            target = -1 if latest is None else latest
        target = D.broadcast_int(target, self.dist)
        if target < 0:
            raise TrainingError(
                f"{why} at step {self.step + 1} and no checkpoint in "
                f"{self.run_dir} to roll back to; lower training.lr, check the data, or save earlier "
                "(training.save_every)"
            )
        self._rollbacks_without_progress += 1
        if self._rollbacks_without_progress > self.tc.max_rollbacks:
            raise TrainingError(
                f"non-finite losses again after {self._rollbacks_without_progress - 1} rollback(s) to step "
                f"{target} without progress (training.max_rollbacks = {self.tc.max_rollbacks}); lower "
                "training.lr or check the data around this step"
            )
        from_step = self.step
        data_position = self.sampler.state_dict()  # after the batches that led here: skip them
        self._restore(target)
        self.sampler.load_state_dict(data_position)
        self._sampler_iter = iter(self.sampler)
        self.rollbacks += 1
        self._rollback_floor = max(self._rollback_floor, target)
        self.nan_streak = self.bad_grad_streak = 0
        self._pending_skipped = self._pending_tokens = 0
        if self.dist.is_main:
            marked = self.logger.supersede_after(target)
            self.logger.event(
                self.step,
                "rollback",
                f"{why} at step {from_step + 1}: rolled back to step {target} and skipping the data of "
                f"steps {target + 1}-{from_step + 1}; {marked} rows superseded",
                tokens_total=self.tokens_seen,
            )
            self.logger.restart_window(self.step)
        D.barrier(self.dist)

    # ------------------------------------------------------------------------------- evaluation
    @torch.no_grad()
    def evaluate(self) -> dict | None:
        """Mean loss over `eval_batches` micro-batches of windows spread evenly over the validation set
        (deterministic; split across ranks); perplexity; bits per byte when the dataset knows bytes."""
        if self.val_data is None:
            return None
        self._evaluated_at = self.step
        tc = self.tc
        n = len(self.val_data)
        total = min(tc.eval_batches * tc.micro_batch_size, n)
        mine = spread_picks(n, total)[self.dist.rank :: self.dist.world_size]
        self.raw_model.eval()
        bad: DataError | None = None
        try:
            loss_sum = window_loss_sum(
                self.raw_model,
                self.val_data,
                mine,
                tc.micro_batch_size,
                self.device,
                self.autocast_dtype is not None,
            )
        except DataError as e:  # a damaged val shard
            loss_sum, bad = 0.0, e
        finally:
            self.raw_model.train()
        if (err := self._damaged_on_any_rank(bad, "validation batch")) is not None:
            raise err
        count = len(mine)
        loss_sum, count = D.sum_across([loss_sum, float(count)], self.dist)
        val_loss = loss_sum / max(count, 1)
        if not math.isfinite(val_loss):
            # A diverging model (or an overflow in the eval's dtype). Not an evaluation to record (the
            # metrics and the checkpoint meta are strict JSON), and no reason to lose the step: say so.
            if self.dist.is_main:
                self.logger.event(
                    self.step,
                    "eval_nonfinite",
                    f"validation loss is {val_loss} at step {self.step} (the model may be diverging); "
                    "not recorded as an evaluation",
                    tokens_total=self.tokens_seen,
                )
            return None
        out = {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 700.0)), "val_windows": int(count)}
        bpt = getattr(self.val_data, "bytes_per_token", None)
        if bpt:
            out["val_bpb"] = val_loss / math.log(2) / bpt
        self.last_eval = {"step": self.step, **out}
        if self.dist.is_main:
            self.logger.log_eval(self.step, self.tokens_seen, out)
        return out

    # ------------------------------------------------------------------------------------- run
    def request_stop(self, reason: str = "signal") -> None:
        """Ask `train()` to stop after the current step, as SIGTERM does (checkpoint, "stop" event that
        says "stopped by `reason`"). Thread-safe: e.g. a timer thread enforcing a wall-clock budget (the
        quickstart's, reason "the time budget")."""
        if not self._stop.is_set():
            self._stop_reason = reason
        self._stop.set()

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._stop.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.request_stop()
        if self.dist.is_main:
            print(
                f"received {signal.Signals(signum).name}: stopping after this step (saving a checkpoint)",
                flush=True,
            )

    def _write_run_records(self) -> None:
        from mamba3lite.data.shards import atomic_write_json

        write_resolved_config(self.cfg, self.run_dir / "config.yaml")
        self._code_version = code_version()
        info_path = self.run_dir / "run.json"
        info: dict[str, Any] = {}
        with contextlib.suppress(FileNotFoundError, ValueError):
            import json

            info = json.loads(info_path.read_text(encoding="utf-8"))
        if not isinstance(info, dict):  # an edited or foreign run.json: rewritten as ours
            info = {}
        starts = info.get("starts", []) if isinstance(info.get("starts"), list) else []
        starts.append(
            {
                "time": time.time(),
                "code_version": self._code_version,
                "world_size": self.dist.world_size,
                "resume": self.resume,
                "device": str(self.device),
            }
        )
        atomic_write_json(
            info_path,
            {
                "data_path": None if self.cfg.data.dummy else self.cfg.data.train_data_path,
                "val_data_path": self.cfg.data.val_data_path,
                "dummy": self.cfg.data.dummy,
                "data_manifest_sha256": _manifest_sha256(
                    None if self.cfg.data.dummy else self.cfg.data.train_data_path
                ),
                "data": self._data_identity(),
                "code_version": self._code_version,
                "starts": starts[-50:],
            },
        )

    def train(self, until_step: int | None = None) -> TrainResult:
        """Train to `training.max_steps` (or to `until_step`, then save: a resumable pause). Holds the
        run-directory lock for the whole call. Returns a `TrainResult`."""
        tc = self.tc
        target = tc.max_steps if until_step is None else min(until_step, tc.max_steps)
        lock = RunLock(self.run_dir)
        lock_error: CheckpointError | None = None
        if self.dist.is_main:
            try:
                lock.acquire()
            except CheckpointError as e:
                lock_error = e
        if D.any_rank(lock_error is not None, self.dist):
            raise lock_error or CheckpointError(f"{self.run_dir} is in use by another trainer")
        old_handlers: dict[int, Any] = {}
        try:
            # Handlers first: a SIGTERM while a big checkpoint is verified and restored must stop cleanly.
            if threading.current_thread() is threading.main_thread():
                for sig in (signal.SIGTERM, signal.SIGINT):
                    old_handlers[sig] = signal.signal(sig, self._on_signal)
            target_step = self._pick_resume_target()
            if self.dist.is_main:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                if target_step >= 0:  # a resumed run continues the same W&B run
                    with contextlib.suppress(CheckpointError):
                        self.wandb_run_id = self.ckpt.read_meta(target_step).get("wandb_run_id")
                self.logger = self._build_logger()
                self.wandb_run_id = self.logger.wandb_run_id or self.wandb_run_id
            self._apply_resume(target_step)
            if self.dist.is_main:  # after the resume's checks: a refused resume leaves them as they were
                self._write_run_records()
            if self.dist.is_main:
                what = "resumed" if self.step else "start"
                self.logger.event(
                    self.step,
                    "start",
                    f"{what} at step {self.step} -> {target} on "
                    f"{self.dist.world_size} x {self.device}; {self._tokens_per_step:,} tokens/step; "
                    f"{self._epoch_summary()}",
                    tokens_total=self.tokens_seen,
                )
                for warning in self._start_warnings():
                    self.logger.event(self.step, "warning", warning, tokens_total=self.tokens_seen)
                if self.step >= target and until_step is None:
                    self.logger.event(
                        self.step,
                        "warning",
                        f"the run is at step {self.step}, not before training.max_steps {tc.max_steps}: "
                        "nothing to train; raise --max-steps to continue it",
                        tokens_total=self.tokens_seen,
                    )
            self._epoch_seen = self.sampler.epoch
            self.logger.restart_window(self.step)
            stopped = False
            self.history = []
            try:
                while self.step < target:
                    if self.train_step():
                        if self.step % tc.save_every == 0:
                            # A step a run can resume from ends a window: a resume or rollback to it
                            # then supersedes whole rows of the abandoned steps, never kept ones.
                            self.logger.flush()
                        t0 = time.time()
                        # Evaluate first: a checkpoint written at an evaluation step carries that
                        # evaluation (its meta's last_eval, what `inspect` and a resume report).
                        if tc.eval_every and self.step % tc.eval_every == 0:
                            self.evaluate()
                        if self.dist.is_main:
                            self.downstream.maybe_evaluate(
                                self.step, self.raw_model, self.logger, self.tokens_seen
                            )
                        if self.step % tc.save_every == 0:
                            self.save_checkpoint()
                        self.logger.exclude_time(time.time() - t0)
                    if D.any_rank(self._stop.is_set(), self.dist):
                        stopped = True
                        break
                self.logger.flush()
                if not stopped and tc.eval_every and self.step > 0 and self._evaluated_at != self.step:
                    self.evaluate()  # the run's final numbers, even when max_steps is off the eval cadence
            except DataError:  # a damaged training or validation batch, seen by all ranks together
                self.logger.flush()  # the steps about to be saved keep their rows
                self._save_before_data_error()
                raise
            self._save_unsaved()
            if self.dist.is_main:
                if stopped:
                    self.logger.event(
                        self.step,
                        "stop",
                        f"stopped by {self._stop_reason} at step {self.step}; checkpoint "
                        f"saved, `mamba3lite train` resumes from it",
                        tokens_total=self.tokens_seen,
                    )
                else:
                    self.logger.event(
                        self.step, "end", f"reached step {self.step}", tokens_total=self.tokens_seen
                    )
            return TrainResult(
                step=self.step,
                tokens_seen=self.tokens_seen,
                stopped=stopped,
                history=list(self.history),
                last_eval=self.last_eval,
                steady_tokens_per_s=self.logger.steady_tokens_per_s(),
                rollbacks=self.rollbacks,
            )
        except Exception as e:
            if self.dist.is_main:
                with contextlib.suppress(Exception):
                    self.logger.flush()  # the steps since the last row (superseded if they were not saved)
                    self.logger.event(
                        self.step, "error", f"{type(e).__name__}: {e}", tokens_total=self.tokens_seen
                    )
            raise
        finally:
            for sig, h in old_handlers.items():
                signal.signal(sig, h)
            self.logger.close()
            lock.release()

    def _start_warnings(self) -> list[str]:
        """Settings that make the run other than it looks: no validation although evaluation is on, a
        warmup that never reaches the peak learning rate."""
        tc, out = self.tc, []
        if tc.eval_every and self.val_data is None:
            out.append(f"no validation data, so training.eval_every has no effect: {self._no_val_reason}")
        if tc.warmup_steps > tc.max_steps:
            peak = lr_at(tc.max_steps - 1, **self._sched_kw())
            out.append(
                f"training.warmup_steps {tc.warmup_steps} > training.max_steps {tc.max_steps}: the learning "
                f"rate only warms up, to {peak:.3g} instead of training.lr {tc.lr:g}; lower warmup_steps"
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

    def _damaged_on_any_rank(self, mine: DataError | None, what: str) -> DataError | None:
        """The error every rank raises together when any rank's batch was damaged (one rank raising alone
        would leave the others waiting in the next collective), else None."""
        if not D.any_rank(mine is not None, self.dist):
            return None
        return mine or DataError(f"another rank's {what} is damaged (its log names the shard)")

    def _save_unsaved(self) -> bool:
        """Save the current step unless it is step 0 or saved already; True if it saved."""
        if self.step == 0 or self._last_saved == self.step:
            return False
        self.save_checkpoint()
        return True

    def _save_before_data_error(self) -> None:
        """A damaged batch stops the run (on every rank: `_damaged_on_any_rank`), but the steps done since
        the last checkpoint are good: save them, so that the run resumes here once the data is repaired."""
        if self._save_unsaved() and self.dist.is_main:
            self.logger.event(
                self.step,
                "save",
                f"saved step {self.step} before stopping on a damaged batch; repair the data and run the "
                "same command to resume from it",
                tokens_total=self.tokens_seen,
            )

    def _build_logger(self) -> TrainingLogger:
        tc = self.tc
        peak = peak_flops(self.device, tc.peak_tflops)
        flops = None
        try:
            from mamba3lite.model import model_flops_per_token

            flops = model_flops_per_token(self.cfg.model, tc.max_seq_len)["train"]
        except (ImportError, KeyError):
            pass
        return build_logger(
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
