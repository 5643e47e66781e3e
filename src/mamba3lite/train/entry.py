"""The one training entry: a resolved config and `TrainOptions` -> every check -> the distributed set-up
-> a `Pretrainer`. `mamba3lite train`, `train --init-from` and the quickstart all go through it, so a
check added here reaches every command that trains.

    with training_session(cfg, opts) as trainer:    # checks, init_distributed, SIGTERM, build
        result = trainer.train(until_step)          # errors a user can act on become TrainingError
    run_training(cfg, opts)                         # the same in one call
    prepared = prepare_run(cfg, opts)               # points 1-4 once: a `PreparedRun`, which both take
                                                    # in place of (cfg, opts) (the quickstart's runs)

What happens, in order, before anything is written:
    0. a dataset given as a URL (s3://...) is fetched into the verified local cache and read from there
    1. `--init-from` (training.init_from): the source's model config and weights, or, once the run has
       checkpoints of its own, their recorded model config and no source at all (`resolve_init`)
    2. a dry run is a fresh 2-step run: a directory with checkpoints is refused
    3. the run directory is new, empty or a run directory (outdir.check_run_dir), and no other trainer
       holds its lock
    4. the data's tokenizer loads here and fits the model (`check_data_tokenizer`), by the rule
       `generate` and `eval` apply later; the sinks of `logging.sinks` can be built
    5. init_distributed (a store namespace per torchrun generation, group creation bounded by
       training.dist_init_timeout_s, collectives by dist_timeout_s) and a rank's watchdog
       (training.watchdog_s: no progress -> its stacks, a non-zero exit); the parallelism seam is
       built once, in the trainer (train/parallel/: the layout is checked before the model is built);
       SIGTERM sets the run's
       stop flag from here on (the run stops after a step, with a checkpoint); the model is refused
       before it is built when it cannot fit the device (model.memory.check_model_fits, in the
       trainer's build)
    6. out of memory (CUDA or host) is one line naming the knobs; a rank that stops because another
       one did says so
"""

from __future__ import annotations

import contextlib
import copy
import os
import signal
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from mamba3lite.errors import ConfigError, TrainingError
from mamba3lite.outdir import check_run_dir


@dataclass(frozen=True)
class TrainOptions:
    """How to run a resolved config (what `mamba3lite train`'s flags add to it).

    resume: "latest" (newest verified checkpoint, or a fresh start), "none" (fresh; a directory with
        checkpoints is refused) or a step number.
    dry_run: the config is a 2-step smoke test (see commands/train.py); only a fresh directory.
    model_overrides: the `--set model.*` items, re-applied over an --init-from source's model config.
    own_process: the caller is the CLI's own process: after the run SIGTERM is ignored (the run is
        saved; a signal on the way out must not turn it into exit -15).
    """

    resume: str | int = "latest"
    dry_run: bool = False
    model_overrides: tuple[str, ...] = ()
    own_process: bool = False

    def __post_init__(self) -> None:
        ok = self.resume in ("latest", "none") or (isinstance(self.resume, int) and self.resume >= 0)
        if not ok or isinstance(self.resume, bool):
            raise ConfigError(f"resume must be 'latest', 'none' or a step number >= 0, got {self.resume!r}")


def resolve_init(cfg, opts: TrainOptions):
    """(cfg, the model holding the init weights or None). Without training.init_from: (cfg, None). With
    it, a run that resumes from its own checkpoint takes the model config recorded there (with the model
    overrides on top) and leaves the source alone: the checkpoint holds the weights, so a resume neither
    reloads the source nor needs it to still exist."""
    if cfg.training.init_from is None:
        return cfg, None
    resumed = resumed_checkpoint(cfg, opts.resume)
    if resumed is None:
        return init_from_source(cfg, opts)
    step, model = resumed
    cfg = cfg.replace("model", **model).with_overrides(list(opts.model_overrides))
    print(
        f"init-from {cfg.training.init_from}: not loaded; {cfg.training.checkpoint_dir} resumes from its "
        f"own checkpoints (newest: checkpoint step {step}), which hold the weights"
    )
    return cfg, None


def init_from_source(cfg, opts: TrainOptions):
    """(cfg with the source's model config and the model overrides on top, the model holding the
    source's weights); DataError when the training data was tokenized with another tokenizer."""
    from mamba3lite.data.shards import Manifest, has_manifest
    from mamba3lite.data_identity import DataIdentity
    from mamba3lite.interop.init_from import load_init_source

    source = load_init_source(cfg.training.init_from)
    cfg = cfg.replace("model", **asdict(source.config)).with_overrides(list(opts.model_overrides))
    data = Path(cfg.data.train_data_path)
    if not cfg.data.dummy and has_manifest(data):
        model = DataIdentity(source.tokenizer_name, source.vocab_hash, cfg.model.vocab_size, cfg.model.eos_id)
        Manifest.load(data).identity.compatible_with(
            model, where=f"the training data ({data})", reference="the --init-from model"
        )
    print(f"init-from {source.description}: its weights and model config; optimizer and schedule fresh")
    return cfg, source.build_model(cfg.model)


def resumed_checkpoint(cfg, resume: str | int) -> tuple[int, dict] | None:
    """(the step the run resumes from, its recorded model config), or None for a fresh start. The step
    is `plan_resume`'s (through `RunDir.resume_step`), the one the trainer then loads; a resume the
    trainer would refuse (a step never saved, checkpoints that do not verify) is refused here, with the
    trainer's message, before the --init-from source is loaded for nothing. Costs a verification of the
    newest checkpoint, which the trainer repeats (only runs with --init-from and the quickstart ask)."""
    from mamba3lite.checkpoint.run_dir import RunDir

    run = RunDir(cfg.training.checkpoint_dir)
    step = run.resume_step(resume)
    if step is None:
        return None
    model = run.run_state(step).config.get("model")
    if not isinstance(model, dict):  # a seed-format step records no config
        return None
    return step, model


def check_run_directory(cfg, opts: TrainOptions) -> None:
    """The run directory may be written (new, empty or a run directory), is not busy (another trainer
    holds its lock), and for a dry run holds no checkpoints."""
    from mamba3lite.checkpoint import RunLock
    from mamba3lite.checkpoint.run_dir import RunDir

    run_dir = Path(cfg.training.checkpoint_dir)
    check_run_dir(run_dir)  # before anything is written there
    if opts.dry_run and (steps := RunDir(run_dir).steps()):
        # in a directory with checkpoints a dry run would resume past step 2 and train nothing (or,
        # forced fresh, mix its checkpoint into a real run's)
        raise ConfigError(
            f"--dry-run trains a fresh 2-step run, but {run_dir} already holds checkpoints (steps "
            f"{steps[:5]}{'...' if len(steps) > 5 else ''}); point --checkpoint-dir at a new directory"
        )
    # Refused now, not after the data and model were built. Rank 0 alone: under torchrun every rank
    # runs this at once, and a rank would find rank 0's brief check holding the lock.
    if run_dir.is_dir() and os.environ.get("RANK", "0") == "0":
        with RunLock(run_dir):
            pass


def check_data_tokenizer(cfg) -> None:
    """`generate` and `eval` refuse a run whose data's tokenizer they cannot load: refuse it before the
    run is trained, by their rule (`load_recorded_tokenizer`), when the manifest names a tokenizer this
    project knows (gpt2, a tokenizer.json path). A name it does not know is only a warning: token data
    may come from a tokenizer that lives elsewhere (pre-tokenized data, a test's byte vocabulary), and
    the training itself needs none."""
    from mamba3lite.data.shards import MANIFEST_NAME, Manifest, dataset_dir, has_manifest
    from mamba3lite.tokenizer import KNOWN_TOKENIZERS, is_tokenizer_file, load_recorded_tokenizer

    data = dataset_dir(cfg.data.train_data_path or "")
    if cfg.data.dummy or not has_manifest(data):
        return  # no manifest: nothing records a tokenizer (the dataset's own errors come later)
    recorded = Manifest.load(data).identity
    name = recorded.tokenizer
    if name in KNOWN_TOKENIZERS or is_tokenizer_file(name):
        load_recorded_tokenizer(
            name,
            recorded.vocab_hash,
            cfg.model.vocab_size,
            subject=f"the data at {data} (its {MANIFEST_NAME}) was prepared with",
        )
        return
    warnings.warn(
        f"the tokenizer recorded in {data / MANIFEST_NAME}, {name!r}, is not one mamba3lite knows "
        f"({', '.join(KNOWN_TOKENIZERS)} or a tokenizer.json path); the run will train, but `generate` and "
        "`eval` need that tokenizer to read its output",
        stacklevel=2,
    )


def out_of_memory_advice(exc: BaseException, cfg, building: bool = False, world_size: int = 1) -> str | None:
    """The message for an allocation failure (CUDA or CPU), naming the knobs; None for other errors.
    A step that ran out of memory never reaches the optimizer or a checkpoint: the run directory holds
    what the last save wrote, and `train` resumes from it. `building`: it happened while the model and
    optimizer were built, before any step, where the batch knobs cannot help. `world_size`: processes of
    the job; a replicated model over several names fsdp, which divides the model state among them."""
    import torch

    text = str(exc)
    # torch's allocators raise RuntimeError subclasses; numpy's (a batch gathered on the host) MemoryError
    if not (isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or "can't allocate memory" in text):
        return None
    t = cfg.training
    where = "the accelerator" if isinstance(exc, torch.OutOfMemoryError) else "host memory"
    first = text.strip().splitlines()[0][:200] if text.strip() else type(exc).__name__
    replicated = world_size > 1 and t.parallelism in ("ddp", "auto")
    shard = (
        "--set training.parallelism=fsdp (the weights, gradients and optimizer state divided over the "
        f"{world_size} processes)"
    )
    if building:
        from mamba3lite.model import count_parameters

        n = count_parameters(cfg.model)
        how = (
            f"Shard it: {shard}; or use a smaller model"
            if replicated
            else "Use a smaller model (e.g. --config tiny), shard it over several processes (torchrun "
            "--nproc_per_node N ... --set training.parallelism=fsdp)"
        )
        return (
            f"out of memory on {where} while building the model ({first}): {n / 1e6:,.1f}M parameters "
            f"need ~{16 * n / 2**30:,.1f} GiB for fp32 weights, gradients and AdamW moments before any "
            f"activation. {how}, or a device with more memory."
        )
    if t.micro_batch_size > 1:
        # The global batch is the run's contract: with it stated, a smaller micro batch only means more
        # accumulation; derived (micro x accumulation), it is pinned so that halving keeps it.
        fix = f"--set training.micro_batch_size={t.micro_batch_size // 2}"
        if not t.global_batch_size:
            fix += f" --set training.global_batch_size={t.global_windows}"
    else:
        fix = f"--set training.max_seq_len={max(1, t.max_seq_len // 2)}"
    more = f", or {shard}" if replicated else ""
    if not t.grad_checkpointing:
        more += ", or --set training.grad_checkpointing=true (recomputes each layer)"
    if t.compile:
        more += ", or --set training.compile=false (the compiled model keeps ~1.4x the activations)"
    return (
        f"out of memory on {where} with micro_batch_size {t.micro_batch_size} x max_seq_len {t.max_seq_len} "
        f"({first}). Use less per micro-step and keep the batch: {fix}{more}. "
        f"Checkpoints in {t.checkpoint_dir} are untouched; the run resumes from the newest one."
    )


# The training fields a caller may change on a prepared run: the length and cadence of its schedule, its
# progress bar and whether the model is compiled. No check of `prepare_run` reads them (the run
# directory, the data's tokenizer, the sinks and --init-from do not depend on them), so changing them
# keeps the run checked.
ADJUSTABLE_TRAINING_FIELDS = (
    "max_steps", "time_budget_minutes", "warmup_steps", "eval_every", "eval_batches", "save_every",
    "log_every", "progress", "compile",
)  # fmt: skip


@dataclass(frozen=True, eq=False)
class PreparedRun:
    """A run after every check that needs no process group (points 1-4 above): its config as resolved
    (an --init-from source's model config in it), its options, and the model holding the init weights
    (None without --init-from, or once the run resumes from its own checkpoints). `training_session` and
    `run_training` take one in place of (cfg, opts): a caller that trains the same run several times
    (the quickstart: a calibration, then the run) prepares it once and changes only what the
    checks do not read, through the methods below. The runs made with `with_training` share the init
    model: the first one trains it, and the next ones resume from the checkpoint it wrote."""

    cfg: Any
    opts: TrainOptions
    init_model: Any = None
    # datasets given as URLs, fetched into the local cache and held there for the run (train/data.py)
    data_leases: tuple = ()

    def with_training(self, **fields: Any) -> PreparedRun:
        """The same run with some of ADJUSTABLE_TRAINING_FIELDS changed (validated as --set values are)."""
        assert set(fields) <= set(ADJUSTABLE_TRAINING_FIELDS), f"not adjustable: {sorted(fields)}"
        return replace(self, cfg=self.cfg.replace("training", **fields))

    def with_model(self, **fields: Any) -> PreparedRun:
        """The same run with model fields changed (a shape the caller chose, a resumed run's recorded
        model config), the data's tokenizer checked again against it: the one check that reads the
        model. Not for a run with init weights, whose model they fix."""
        assert self.init_model is None, "the init weights fix the model"
        cfg = self.cfg.replace("model", **fields)
        check_data_tokenizer(cfg)
        return replace(self, cfg=cfg)

    def in_scratch_dir(self, path: str | Path) -> PreparedRun:
        """The same run, fresh, in `path`: a new, empty directory the caller made for a throw-away
        trainer (nothing of the checked run directory is read or written). It trains a copy of the init
        weights, so that its steps do not move the real run's starting point."""
        fresh = replace(self.opts, resume="none")
        cfg = self.cfg.replace("training", checkpoint_dir=str(path))
        return replace(self, cfg=cfg, opts=fresh, init_model=copy.deepcopy(self.init_model))


def prepare_run(cfg, opts: TrainOptions = TrainOptions()) -> PreparedRun:
    """`cfg` run with `opts` after every check that needs no process group (points 1-4 above)."""
    from mamba3lite.train.data import localize_data
    from mamba3lite.train.metrics import resolve_sinks

    cfg, leases = localize_data(cfg)  # a dataset URL becomes its verified local copy, before any check
    cfg, init_model = resolve_init(cfg, opts)
    check_run_directory(cfg, opts)
    check_data_tokenizer(cfg)
    resolve_sinks(cfg.logging)  # a named sink whose package is missing: refused now, not at the start
    return PreparedRun(cfg, opts, init_model, leases)


@contextlib.contextmanager
def training_session(cfg, opts: TrainOptions = TrainOptions(), stop: Any = None) -> Iterator[Any]:
    """A built `Pretrainer` for `cfg` after every check, inside the distributed set-up and the SIGTERM
    handling (see the module docstring). `cfg` may be a `PreparedRun` (checked already; its options are
    its own, so `opts` is left at the default). `stop`: the run's `StopFlag` (default a new one), e.g.
    one that a caller's timer sets. Allocation failures and a lost peer, in the build or in the block,
    become one-line TrainingErrors."""
    from mamba3lite.train.parallel import process_group as D
    from mamba3lite.train.stop import StopFlag
    from mamba3lite.train.trainer import Pretrainer
    from mamba3lite.train.watchdog import watchdog_for

    if isinstance(cfg, PreparedRun):
        assert opts == TrainOptions(), "a PreparedRun carries its own options"
        prepared = cfg
    else:
        prepared = prepare_run(cfg, opts)
    cfg, opts, init_model = prepared.cfg, prepared.opts, prepared.init_model
    tc = cfg.training
    info = D.init_distributed(tc.device, tc.dist_timeout_s, tc.dist_init_timeout_s)
    watchdog = watchdog_for(tc.watchdog_s, info.rank, info.distributed)
    stop = stop or StopFlag(announce=info.is_main)
    after = signal.SIG_IGN if opts.own_process else None
    resume = "none" if opts.dry_run else opts.resume
    trainer, finished = None, False
    with stop.installed(signal.SIGTERM, on_exit=after):
        try:
            trainer = Pretrainer(
                cfg, resume=resume, dist=info, model=init_model, stop=stop, watchdog=watchdog
            )
            yield trainer
            finished = True
        except (RuntimeError, MemoryError) as e:
            if (actionable := _actionable(e, cfg, info, building=trainer is None)) is e:
                raise
            raise actionable from None
        finally:
            D.teardown(after_error=not finished)
            watchdog.stop()


def _actionable(e: BaseException, cfg, info, building: bool) -> BaseException:
    """The TrainingError a user can act on for `e` (a lost peer, out of memory), else `e` itself."""
    from mamba3lite.train.parallel import process_group as D

    if isinstance(e, RuntimeError) and D.lost_a_peer(e, info):
        return TrainingError(
            f"rank {info.rank} stops because another rank of this job stopped first; that rank's "
            "`error:` line says why (torchrun's summary, if it was killed)"
        )
    advice = out_of_memory_advice(e, cfg, building=building, world_size=info.world_size)
    return e if advice is None else TrainingError(advice)


def run_training(cfg, opts: TrainOptions = TrainOptions(), stop: Any = None, until_step: int | None = None):
    """Check, set up, build and train `cfg` (a config, or a `PreparedRun`) to training.max_steps, or to
    `until_step` then save: the `TrainResult`."""
    with training_session(cfg, opts, stop) as trainer:
        return trainer.train(until_step=until_step)
