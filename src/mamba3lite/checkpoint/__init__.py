"""Checkpoints: three files per step (or a shard directory and a meta), written atomically and verified
on load.

    DIR/model_step_N.safetensors   weights; tied tensors stored ONCE (aliases listed in meta and in the
                                   safetensors header), re-tied on load                 weights.py
    DIR/optim_step_N.pt            optimizer state keyed by PARAMETER NAME (torch.save, weights_only
                                   load)                                                optim_state.py
    DIR/meta_step_N.json           written LAST: step, config, counters, scheduler/sampler/RNG states
                                   (rng.py), dataset identity, last metrics, W&B run id, and the size
                                   and sha256 of the other two files and of itself      meta.py

A run that averages its weights (training.ema_decay > 0, train/averaging.py) writes a fourth file per
step, before the meta:

    DIR/average_step_N.safetensors the averaged weights, in the model file's form (the model's
                                   state_dict keys, tied tensors once, the same aliases)

recorded in the meta's `files` as "average" (size and sha256, verified with the others by every reader)
and the average's counters in its `average` field ({"decay", "updates"}). The contract: model_step_N
stays the weights the optimizer trains (a resume loads them, and the average back into the averager,
`read_average`); the users of a trained model (load_pretrained: eval, generate, serve, the quickstart;
export) load with `load(..., averaged=True)`, which takes the average when the meta records one and the
model file otherwise, so checkpoints without an average (older ones, runs that do not average) load as
before. Sharded runs (fsdp/hsdp) do not average (a ConfigError), so the sharded format has no average.

A run whose parameters are sharded (FSDP2/HSDP DTensors) writes instead DIR/dcp_step_N/, every rank's
own shards through torch.distributed.checkpoint (async by default), and the same meta, written last by
rank 0 with the size and sha256 of every shard file (sharded.py). Either format loads into a plain, DDP
or sharded model at any world size (state.py: torch's state_dict API, one code path for all three).

The file names and the one pattern that matches them are in mamba3lite/rundir.py, with every other
name under a run directory (`checkpoint_files`, `steps_in`, `finished_save`). The modules, read in
this order:

    run_state.py    RunState: what a meta records of the run, one field per meta key (its schema)
    manager.py      CheckpointManager: the one face of saving, verifying, finding, loading and
                    pruning a run's steps; each concept is a module of its own, below it:
    writer.py       writing a step's files (weights, optimizer state, the meta last), atomically
    verify.py       CheckpointStatus: a step's files against its meta, each file hashed once
    reader.py       a verified step's weights and optimizer state into a model and an optimizer
    retention.py    which steps are kept; deleting, pruning, moving aside, stale temp files
    sharded_save.py every rank's shards, the meta by rank 0 once they are written (async)
    collective.py   the save's collectives (rank, barrier, gather), no-ops in one process
    lazy.py         the sharded format's modules, imported where first needed (start-up)
    state.py        model/optimizer state of plain, DDP and FSDP2 models: local shards or whole tensors
                    (torch.distributed.checkpoint: imported by the manager for sharded models only)
    sharded.py      the sharded step format: DCP write (sync or async), read, checks against the meta
    resume.py       plan_resume: which step a starting run continues from, and what to tidy first;
                    compatibility of a checkpoint with the run that loads it
    run_dir.py      RunDir: the one reader of a run directory for every command (is it a run, its
                    newest verified step, "step or latest", a step's RunState, the resume decision,
                    `load`: a step as a model, verified once)
    loaded.py       LoadedStep: what `RunDir.load` returns (meta, config, model, notes)
    dtensor.py      whether a model is sharded, asked without importing DTensor (start-up)
    seed_format.py  the seed system's checkpoints (no hashes, index-keyed optimizer), accepted
                    as "unverified"
    lock.py         RunLock, the run directory's lock

Every file is written atomically (mamba3lite/atomicfile.py: temp file, fsync, rename, directory
fsync): the meta through `atomic_write_json`, the two big files streamed through `HashingAtomicFile`
(sha256 read back during the fsync, no in-memory copy of the state).

The package's names are imported lazily, so that importing one of them costs only its own module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names, for type checkers and editors (at run time: `__getattr__` below)
    from mamba3lite.checkpoint.dtensor import is_sharded
    from mamba3lite.checkpoint.lock import RunLock
    from mamba3lite.checkpoint.manager import CheckpointManager
    from mamba3lite.checkpoint.meta import META_FORMAT
    from mamba3lite.checkpoint.meta import meta_digest as _meta_digest
    from mamba3lite.checkpoint.optim_state import (
        OPTIM_FORMAT,
        load_optimizer_state_by_name,
        optimizer_state_by_name,
        param_names,
    )
    from mamba3lite.checkpoint.resume import ResumePlan, plan_resume, resume_warnings
    from mamba3lite.checkpoint.rng import capture_rng_state, restore_rng_state
    from mamba3lite.checkpoint.run_dir import RunDir, StepPick
    from mamba3lite.checkpoint.run_state import RngState, RunState
    from mamba3lite.checkpoint.state import (
        full_model_state,
        full_optimizer_state,
        set_full_model_state,
        set_full_optimizer_state,
    )
    from mamba3lite.checkpoint.verify import CheckpointStatus
    from mamba3lite.checkpoint.weights import load_model_file, split_tied, write_safetensors
    from mamba3lite.checkpoint.writer import SLOW_SAVE_ENV

_WHERE = {
    "CheckpointManager": "mamba3lite.checkpoint.manager",
    "CheckpointStatus": "mamba3lite.checkpoint.verify",
    "META_FORMAT": "mamba3lite.checkpoint.meta",
    "OPTIM_FORMAT": "mamba3lite.checkpoint.optim_state",
    "ResumePlan": "mamba3lite.checkpoint.resume",
    "RunDir": "mamba3lite.checkpoint.run_dir",
    "RunLock": "mamba3lite.checkpoint.lock",
    "SLOW_SAVE_ENV": "mamba3lite.checkpoint.writer",
    "StepPick": "mamba3lite.checkpoint.run_dir",
    "capture_rng_state": "mamba3lite.checkpoint.rng",
    "full_model_state": "mamba3lite.checkpoint.state",
    "full_optimizer_state": "mamba3lite.checkpoint.state",
    "is_sharded": "mamba3lite.checkpoint.dtensor",
    "set_full_model_state": "mamba3lite.checkpoint.state",
    "set_full_optimizer_state": "mamba3lite.checkpoint.state",
    "RngState": "mamba3lite.checkpoint.run_state",
    "RunState": "mamba3lite.checkpoint.run_state",
    "load_model_file": "mamba3lite.checkpoint.weights",
    "load_optimizer_state_by_name": "mamba3lite.checkpoint.optim_state",
    "optimizer_state_by_name": "mamba3lite.checkpoint.optim_state",
    "param_names": "mamba3lite.checkpoint.optim_state",
    "plan_resume": "mamba3lite.checkpoint.resume",
    "restore_rng_state": "mamba3lite.checkpoint.rng",
    "resume_warnings": "mamba3lite.checkpoint.resume",
    "split_tied": "mamba3lite.checkpoint.weights",
    "write_safetensors": "mamba3lite.checkpoint.weights",
    "_meta_digest": "mamba3lite.checkpoint.meta",
}
_RENAMED = {"_meta_digest": "meta_digest"}

__all__ = [
    "META_FORMAT",
    "OPTIM_FORMAT",
    "SLOW_SAVE_ENV",
    "CheckpointManager",
    "CheckpointStatus",
    "ResumePlan",
    "RngState",
    "RunDir",
    "RunLock",
    "RunState",
    "StepPick",
    "_meta_digest",
    "capture_rng_state",
    "full_model_state",
    "full_optimizer_state",
    "is_sharded",
    "load_model_file",
    "load_optimizer_state_by_name",
    "optimizer_state_by_name",
    "param_names",
    "plan_resume",
    "restore_rng_state",
    "resume_warnings",
    "set_full_model_state",
    "set_full_optimizer_state",
    "split_tied",
    "write_safetensors",
]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), _RENAMED.get(name, name))
    raise AttributeError(f"module 'mamba3lite.checkpoint' has no attribute {name!r}")
