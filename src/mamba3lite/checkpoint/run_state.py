"""The run state: everything a checkpoint remembers of a run besides its tensors, as one record.

`RunState`'s fields ARE the schema of a step's meta file (meta_step_N.json): the trainer fills one at
every save from its stateful parts (the `state_dict()` of the sampler, the RNG and the non-finite
guard, the counters, the logger's last row and its W&B run id), `import` fills one for the step 0 of
an imported model, and every reader (the trainer's resume, `inspect`, `generate`, `export`) takes one
back with `RunState.from_meta`. The checkpoint manager adds its own file-integrity fields (format,
files, tied, has_optimizer, saved_at, meta_sha256) around `to_meta()`; meta.py checks a meta's shape
against `meta_schema()`, which is built from the fields below, so it never lists them again.

    state = RunState(step=7, config=cfg.to_dict(), tokens_seen=...)   # the trainer's _run_state()
    meta = state.to_meta()                                             # -> CheckpointManager.save
    state = RunState.from_meta(ckpt.load(7, model, optimizer))         # absent fields: their default

Adding a checkpoint field is one line here, `name: type = default` under a comment, plus the lines that
set and use it: nothing else changes (test_run_state round-trips every field). A field whose metadata
is ABSENT is left out of the file while it is None (a seed-format or imported step has no sampler);
the others are written always, None included, as `null`. Metas written before a field existed load with
the field's default.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mamba3lite.data_identity import DataIdentity
from mamba3lite.errors import CheckpointError

# The metadata of a field that is not written while it is None (its type in the file excludes None):
# `name: T | None = field(default=None, metadata=ABSENT)`.
ABSENT = {"absent_when_none": True}


@dataclass
class RunState:
    """One checkpoint's record of its run (see the module docstring)."""

    # optimizer steps completed
    step: int
    # the resolved Config.to_dict(): model, training, data
    config: dict = field(default_factory=dict)
    # training tokens consumed (all ranks), skipped steps included
    tokens_seen: int = 0
    # {"kind": "warmup_cosine" | "warmup_linear" | "warmup_wsd", "step", "lr"} (wsd: "decay_fraction"):
    # the lr is a pure function of the step and the config (a run by the clock: kind "..._by_time",
    # "progress": of `clock`)
    scheduler: dict | None = field(default=None, metadata=ABSENT)
    # a run with training.time_budget_minutes: train/clock.py's TrainClock.state_dict(), {"budget_s",
    # "spent_s", "progress"}: the share of the budget spent, which a resume continues
    clock: dict | None = field(default=None, metadata=ABSENT)
    # train/averaging.py's WeightAverage (training.ema_decay > 0): {"decay", "updates"}; its weights are
    # the step's average_step_N.safetensors
    average: dict | None = field(default=None, metadata=ABSENT)
    # WindowSampler.state_dict(): epoch and windows consumed
    sampler: dict | None = field(default=None, metadata=ABSENT)
    # RngState.state_dict(): the Python, numpy, torch (and CUDA) generators (rank 0's)
    rng: dict | None = field(default=None, metadata=ABSENT)
    # every rank's RngState.state_dict(), by rank (sharded saves gather them): see `rng_of`
    rank_rngs: list | None = field(default=None, metadata=ABSENT)
    # DataIdentity.to_dict() of the training data: tokenizer, vocab hash and size, eos id, manifest sha256
    data: dict | None = None
    # the last logged train row
    metrics: dict | None = None
    # {"step", "val_loss", ...} of the newest evaluation
    last_eval: dict | None = None
    # the W&B sink's run id, continued by a resumed run
    wandb_run_id: str | None = None
    # processes of the run that saved, and windows per optimizer step of all of them together
    world_size: int | None = field(default=None, metadata=ABSENT)
    global_batch_windows: int | None = field(default=None, metadata=ABSENT)
    # NonFiniteGuard.state_dict(): the run's non-finite rollbacks so far (a resume goes on counting)
    rollbacks: int | None = field(default=None, metadata=ABSENT)
    # run_record.code_version of the run that saved
    code_version: dict | None = None
    # `mamba3lite import`: the source, its format and official config
    imported_from: dict | None = field(default=None, metadata=ABSENT)
    # training.fault_tolerance: {"replica_groups", "participation": [[first_step, last_step, [group ids]],
    # ...]}: which replica groups took part in each committed step (train/parallel/replicas.py)
    replicas: dict | None = field(default=None, metadata=ABSENT)

    def to_meta(self) -> dict:
        """The meta file's fields of this state (JSON values; ABSENT fields left out while None)."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.metadata.get("absent_when_none"):
                continue
            out[f.name] = value
        return out

    def rng_of(self, rank: int) -> dict | None:
        """The RNG state rank `rank` resumes with: its own when the saving run recorded one, else rank 0's
        (`rng`): a resume on more processes than saved gives the new ranks rank 0's generators, which is
        harmless because the data order comes from the sampler's state (the same at any world size) and
        the model draws no random numbers in training."""
        if isinstance(self.rank_rngs, list) and rank < len(self.rank_rngs) and self.rank_rngs[rank]:
            return self.rank_rngs[rank]
        return self.rng

    @classmethod
    def from_meta(cls, meta: dict) -> RunState:
        """The state recorded in a meta (ours, an older one, a seed-format or imported one): fields it
        lacks take their defaults; the manager's own fields and unknown keys are not part of it."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in meta.items() if k in known})

    def data_identity(self, run_dir: str | Path) -> DataIdentity | None:
        """`data` as the typed record (data_identity.py), its tokenizer name resolved against `run_dir`;
        None for a run without one (dummy data, seed-format and old runs)."""
        return DataIdentity.from_dict(
            self.data, run_dir, where=f"a checkpoint in {run_dir}", error=CheckpointError
        )

    @classmethod
    def meta_schema(cls) -> dict[str, type | tuple[type, ...]]:
        """{field: the JSON type(s) its value may have in a meta file}, for meta.py's shape check."""
        hints = typing.get_type_hints(cls)
        schema = {}
        for f in dataclasses.fields(cls):
            kinds = _json_types(hints[f.name])
            if f.metadata.get("absent_when_none"):
                kinds = tuple(k for k in kinds if k is not type(None))
            schema[f.name] = kinds[0] if len(kinds) == 1 else kinds
        return schema


def _json_types(hint: Any) -> tuple[type, ...]:
    """`dict | None` -> (dict, NoneType); `int` -> (int,)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return tuple(typing.get_args(hint))
    return (hint,)


class RngState:
    """The process's random generators as a stateful component: `state_dict()` captures Python's,
    numpy's, torch's and CUDA's (checkpoint/rng.py), `load_state_dict` restores them."""

    def state_dict(self) -> dict:
        from mamba3lite.checkpoint.rng import capture_rng_state

        return capture_rng_state()

    def load_state_dict(self, state: dict) -> None:
        from mamba3lite.checkpoint.rng import restore_rng_state

        restore_rng_state(state)
