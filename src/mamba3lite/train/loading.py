"""The trainer's loading path, what is decided before a checkpoint is loaded into it: the resume plan
every rank agrees on, and the facts of this run a checkpoint is compared with (checkpoint/resume.py's
`resume_warnings`: another model or tokenizer is refused, other data or windows are warned about).
"""

from __future__ import annotations

from pathlib import Path

from mamba3lite.checkpoint.resume import ResumePlan, plan_resume
from mamba3lite.errors import CheckpointError
from mamba3lite.train.parallel import process_group as D
from mamba3lite.train.run_record import run_records_problem


def agreed_resume_plan(ckpt, resume: str | int, run_dir: Path, dist: D.DistInfo) -> ResumePlan:
    """The resume plan, made on rank 0 (`plan_resume`, then the run records' own check), its target
    broadcast. A refusal is raised on every rank (rank 0 raising alone would leave the others waiting
    in the broadcast)."""
    plan = plan_resume(ckpt, resume) if dist.is_main else ResumePlan()
    if dist.is_main and plan.refusal is None:  # before the logger or the resume changes them
        plan.refusal = run_records_problem(run_dir)
    if D.any_rank(plan.refusal is not None, dist):
        raise CheckpointError(plan.refusal or "rank 0 refused to resume (its output says why)")
    plan.target = D.broadcast_int(plan.target, dist)
    return plan


def resume_facts(cfg, data: dict | None, run_dir: Path) -> dict:
    """What `resume_warnings` compares a checkpoint with: this run's model, data identity (`data`) and
    path, window length and global batch."""
    tc = cfg.training
    return {
        "model": cfg.to_dict()["model"],
        "data": data,
        "data_path": cfg.data.train_data_path,
        "max_seq_len": tc.max_seq_len,
        "run_dir": run_dir,
        "global_batch_windows": tc.global_windows,
        "global_batch_explicit": tc.global_batch_size > 0,
    }
