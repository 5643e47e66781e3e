"""Resuming a run: which step it continues from, what to tidy first, and whether the checkpoint fits.

`plan_resume` reads the run directory once (on rank 0) and returns a `ResumePlan`: the step to load
(-1: a fresh start), or the refusal to raise, and the newer steps that an older resume abandons.
`resume="latest"` picks the newest VERIFIED checkpoint; an explicit step N loads exactly N (never a
newer one in its place); newer checkpoints are then moved to DIR/superseded/<UTC time>-from-step-N/
(one folder per abandoned timeline, never overwritten) so that a later crash cannot resume the
abandoned timeline, and saves cut short before their meta (never checkpoints) are deleted. If no
checkpoint in DIR verifies, `resume="latest"` is refused, not a fresh start over them.

`resume_warnings` compares a checkpoint's meta with the run that loads it: a pure function. The global
batch (windows per optimizer step, all processes together) is part of the run's contract: a resume
keeps it at any world size, and a checkpoint recorded with another one is refused unless the run sets
`training.global_batch_size` explicitly (then the change is reported).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from mamba3lite.checkpoint.manager import CheckpointManager
from mamba3lite.data_identity import DataIdentity
from mamba3lite.errors import CheckpointError
from mamba3lite.rundir import finished_save


@dataclass
class ResumePlan:
    """What a starting run does with its directory."""

    target: int = -1  # the step to load; -1: a fresh start
    refusal: str | None = None  # why the run must not start (raised as CheckpointError)
    torn: list[int] = field(default_factory=list)  # newer saves without a meta: deleted
    newer: list[int] = field(default_factory=list)  # newer checkpoints: moved aside

    def tidy(self, ckpt: CheckpointManager) -> str:
        """Delete the torn saves and move the newer checkpoints aside (rank 0, once the target loaded);
        the clause that says what was done, or ""."""
        note = ""
        if self.torn:
            for s in self.torn:
                ckpt.delete(s)
            note = f"; unfinished save(s) of step(s) {self.torn} (no meta) deleted"
        if self.newer:
            where = ckpt.move_aside(self.newer, from_step=self.target)
            note += f"; newer checkpoints {self.newer} moved to {where}"
        return note


def plan_resume(ckpt: CheckpointManager, resume: str | int) -> ResumePlan:
    """The plan for `resume` ("latest", "none" or a step) over the checkpoints of `ckpt`."""
    if resume not in ("none", "latest"):
        plan = _plan_exact(ckpt, int(resume))
    elif not (steps := ckpt.list_steps()):
        return ResumePlan()
    elif resume == "none":
        return ResumePlan(
            refusal=f"{ckpt.dir} already holds checkpoints (steps {steps}); use --resume latest to "
            "continue, or another --checkpoint-dir for a fresh run"
        )
    elif (latest := ckpt.latest_step()) is not None:
        plan = ResumePlan(target=latest)
    else:
        return ResumePlan(refusal=_none_verifies(ckpt, steps))
    if plan.refusal is None:
        newer = [s for s in ckpt.list_steps() if s > plan.target]
        # A save cut short before its meta (kill -9, disk full) was never a checkpoint: its files are
        # deleted, not kept aside, or every preemption would leave them for good.
        plan.torn = [s for s in newer if not finished_save(ckpt.dir, s)]
        plan.newer = [s for s in newer if s not in plan.torn]
    return plan


def _plan_exact(ckpt: CheckpointManager, step: int) -> ResumePlan:
    # Refused before the run's records are opened: a typo'd step must not log an error into a healthy
    # run's metrics.
    if (st := ckpt.status(step)).loadable:
        return ResumePlan(target=step)
    if step not in ckpt.list_steps():
        why = f"there is no checkpoint of step {step} in {ckpt.dir}"
    else:
        why = f"checkpoint step {step} in {ckpt.dir} cannot be loaded: {'; '.join(st.problems)}"
    return ResumePlan(target=step, refusal=f"{why}. Loadable steps: {ckpt.verified_steps() or 'none'}")


def _none_verifies(ckpt: CheckpointManager, steps: list[int]) -> str | None:
    """The refusal when no step verifies, if some save finished (its meta, written last, is there):
    starting afresh would overwrite those, and retention would delete them. (Steps without a meta are
    saves killed mid-way, never a checkpoint: a fresh start is right for those.)"""
    damaged = [s for s in steps if finished_save(ckpt.dir, s)]
    if not damaged:
        return None
    problems = "; ".join(f"step {s}: {', '.join(ckpt.status(s).problems)}" for s in damaged)
    return (
        f"none of the checkpoints in {ckpt.dir} verifies ({problems}); nothing was changed: restore "
        "them from a copy, or move them away to start this run afresh"
    )


def resume_warnings(meta: dict, run: dict) -> list[str]:
    """What makes checkpoint `meta` unfit for the run described by `run`, or its continuation inexact.

    `run`: {"model": the run's model config dict, "data": its data identity dict or None, "data_path",
    "max_seq_len", "run_dir"}, and optionally "global_batch_windows" (the run's global batch) with
    "global_batch_explicit" (training.global_batch_size was set, not derived). Raises CheckpointError for
    another model config, another tokenizer, or another global batch that the run did not set
    explicitly; returns warnings for changed data, a changed max_seq_len and an explicitly changed
    global batch (all allowed).
    """
    step, out = meta.get("step"), []
    saved_cfg = meta.get("config") or {}
    if "model" in saved_cfg:
        from mamba3lite.model.config import EXECUTION_FIELDS

        mine, saved_model = _with_later_fields(run["model"]), _with_later_fields(saved_cfg["model"])
        diff = sorted(
            k for k in (set(mine) | set(saved_model)) - EXECUTION_FIELDS if mine.get(k) != saved_model.get(k)
        )
        if diff:
            raise CheckpointError(
                f"checkpoint step {step} in {run['run_dir']} was trained with another model config "
                f"(differs in model.{', model.'.join(diff)}); use its config or another --checkpoint-dir"
            )
    # The records as written (names not resolved: both say "tokenizer.json" for a run's copy).
    where = f"the meta of checkpoint step {step}"
    none = DataIdentity("", None, None, None)
    saved = DataIdentity.from_dict(meta.get("data"), None, where=where, error=CheckpointError) or none
    mine = DataIdentity.from_dict(run["data"], None) or none
    if saved.vocab_hash and mine.vocab_hash and saved.vocab_hash != mine.vocab_hash:
        raise CheckpointError(
            f"checkpoint step {step} was trained on tokenizer {saved.tokenizer} (vocab hash "
            f"{saved.vocab_hash[:12]}), the data at {run['data_path']} uses "
            f"{mine.tokenizer} ({mine.vocab_hash[:12]})"
        )
    saved_sha, mine_sha = saved.manifest_sha256, mine.manifest_sha256
    if saved_sha and mine_sha and saved_sha != mine_sha:
        # Same tokenizer, other data (re-prepared, grown): allowed, but the resume is no longer exact.
        out.append(
            f"the training data at {run['data_path']} changed since checkpoint step {step} (its manifest "
            "differs): training goes on over the new data from the saved position, no longer an exact "
            "continuation of the run"
        )
    out += _global_batch_change(meta, run)
    saved_len = (saved_cfg.get("training") or {}).get("max_seq_len")
    if saved_len not in (None, run["max_seq_len"]):
        # The sampler's position counts windows of the old length in the old permutation.
        out.append(
            f"training.max_seq_len changed from {saved_len} (checkpoint step {step}) to "
            f"{run['max_seq_len']}: the windows and their order differ, so the data from here is not a "
            "continuation of the run's (some text comes again, some is skipped this epoch)"
        )
    return out


def _with_later_fields(saved_model: dict) -> dict:
    """A model config as recorded, with the fields added since it was written (a hybrid's attn_layer_idx
    and attn_cfg) at their defaults, which is what that run trained with; tuples as the record's lists."""
    from mamba3lite.model.config import ModelConfig

    defaults = {
        f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
        for f in dataclasses.fields(ModelConfig)
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
    }
    return json.loads(json.dumps({**defaults, **saved_model}))


def _global_batch_change(meta: dict, run: dict) -> list[str]:
    """[] when checkpoint `meta` and `run` train with the same global batch (or the meta predates the
    record: nothing to compare); the warning for a change that the run set explicitly; CheckpointError
    for a change that only follows from other settings (micro batch x accumulation), which would
    silently change the optimisation: the fix names both ways on."""
    saved, mine = meta.get("global_batch_windows"), run.get("global_batch_windows")
    if saved is None or mine is None or int(saved) == int(mine):
        return []
    step = meta.get("step")
    if not run.get("global_batch_explicit"):
        raise CheckpointError(
            f"checkpoint step {step} in {run['run_dir']} was trained with a global batch of {saved} windows "
            f"per optimizer step, this run's is {mine} (micro_batch_size x gradient_accumulation_steps; "
            f"training.global_batch_size is not set): to continue as recorded, --set "
            f"training.global_batch_size={saved}; to change the global batch, set it explicitly "
            f"(--set training.global_batch_size={mine})"
        )
    return [
        f"training.global_batch_size changed from {saved} (checkpoint step {step}) to {mine} windows per "
        "optimizer step, as the config sets it: the run goes on from the saved data position and schedule "
        "step with the new batch"
    ]
