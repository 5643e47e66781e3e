"""The run configuration: typed, documented, validated dataclasses, loaded from YAML, overridable.

A config file has three sections, in the seed's layout, and a fourth of its own:

    model:     ModelConfig (mamba3lite.model): the architecture
    training:  TrainingConfig: optimisation, schedule, cadence, checkpoints
    data:      DataConfig: where the token shards are (`train_data_path`, as in the seed)
    logging:   LoggingConfig: where the metrics rows go (train/metrics/: one sink each)

Every field carries `metadata={"help": ...}` (meaning and unit); `mamba3lite.report.config_reference`
renders them for the docs. Values are validated on creation (`__post_init__`) with a `ConfigError` that
names the field ("training.lr must be > 0, got -1"). Unknown keys, in YAML or in `--set section.key=value`
overrides, are errors with a did-you-mean suggestion. A preset is named by path or by bare name
("tiny" -> the packaged `mamba3lite/configs/tiny.yaml`).

The seed kept `data_path` in its TrainingConfig; here it is `data.train_data_path` (the key its YAML
already used), next to `val_data_path` and `dummy`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mamba3lite.errors import ConfigError, did_you_mean_hint
from mamba3lite.optimizers import KINDS

if TYPE_CHECKING:
    from mamba3lite.model import ModelConfig

PRESET_DIR = Path(__file__).resolve().parent / "configs"
SECTIONS = ("model", "training", "data", "logging")
DTYPES = ("auto", "bf16", "fp32")  # resolved per device by model/precision.py
OPTIMIZERS = KINDS  # the registry itself (optimizers.py): an optimizer registered there is a choice here
# Micro batches per optimizer step of a run that states neither its global batch nor its accumulation
# (the seed's default).
DEFAULT_ACCUMULATION = 2
LR_SCHEDULES = ("cosine", "linear", "wsd")
PARALLELISMS = ("auto", "ddp", "fsdp", "hsdp")
MAX_BUDGET_MINUTES = 1e6  # ~2 years: any real budget, and far from float overflow


def _f(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field with its documentation (meaning, unit) in metadata."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


def _check_choices(section: str, obj: Any) -> None:
    """Every field declared with `choices=` holds one of them: one ConfigError with a did-you-mean."""
    for f in dataclasses.fields(obj):
        choices, value = f.metadata.get("choices"), getattr(obj, f.name)
        if choices is not None and value not in choices:
            hint = did_you_mean_hint(value, choices)
            raise ConfigError(f"{section}.{f.name} must be one of {', '.join(choices)}, got {value!r}{hint}")


def _positive(section: str, obj: Any, names: tuple[str, ...], *, allow_zero: bool = False) -> None:
    for name in names:
        value = getattr(obj, name)
        if value != value or value in (float("inf"), float("-inf")):  # NaN/inf pass every comparison below
            raise ConfigError(f"{section}.{name} must be a finite number, got {value}")
        if value < 0 or (value == 0 and not allow_zero):
            bound = ">= 0" if allow_zero else "> 0"
            raise ConfigError(f"{section}.{name} must be {bound}, got {value}")


@dataclass
class TrainingConfig:
    """Optimisation, schedule, cadence and checkpointing. Defaults are the seed's 440M recipe."""

    max_seq_len: int = _f(2048, "window length L in tokens: each sample is L inputs + L shifted targets")
    micro_batch_size: int = _f(16, "windows per forward/backward pass on each process")
    gradient_accumulation_steps: int | None = _f(
        None,
        "for a run that does not state global_batch_size (0): micro-batches per optimizer step of ONE "
        "process, so that the global batch is micro_batch_size x this (default 2); with more data-parallel "
        "processes the accumulation is derived from that global batch, which stays the same. null where "
        "global_batch_size is set: the global batch decides the accumulation, and stating both is an error",
    )
    global_batch_size: int = _f(
        0,
        "windows per optimizer step, all data-parallel processes together: the run's contract, the same "
        "at any world size (accumulation = global_batch_size / (micro_batch_size x data-parallel size), "
        "which must divide). 0 = micro_batch_size x gradient_accumulation_steps",
    )
    max_steps: int = _f(256_000, "optimizer steps of the run; also the end of the learning-rate schedule")
    lr: float = _f(1.5e-3, "peak learning rate (after warmup)")
    min_lr: float = _f(1e-5, "learning rate at the end of the decay (reached at max_steps)")
    warmup_steps: int = _f(2000, "optimizer steps of linear warmup from 0 to lr")
    lr_schedule: str = _f(
        "cosine",
        "the decay from lr to min_lr after warmup: cosine (over all the steps after warmup), linear (a "
        "straight line over them), wsd (warmup-stable-decay: lr held, then a straight line over the last "
        "decay_fraction of max_steps)",
        choices=LR_SCHEDULES,
    )
    decay_fraction: float = _f(
        0.2, "lr_schedule wsd: the share of max_steps, at the end, over which lr decays to min_lr; in (0, 1]"
    )
    time_budget_minutes: float = _f(
        0.0,
        "train for this many minutes by the clock; 0 = off (the run is max_steps steps). Warmup and decay "
        "then follow the share of this time spent (warmup_fraction, then lr_schedule over the rest, min_lr "
        "when it is spent), training ends when it is spent, and max_steps only caps the steps. Training "
        "time includes the periodic evaluations and checkpoints, not start-up or loading; a resumed run "
        "continues from the share its checkpoint recorded",
    )
    warmup_fraction: float = _f(
        0.02,
        "with time_budget_minutes: the share of the time budget over which lr warms up linearly, in [0, 1) "
        "(warmup_steps is for runs of steps)",
    )
    weight_decay: float = _f(
        0.1,
        "decoupled weight decay on matrices (not norms, biases, embeddings, dt_bias, D): AdamW's, and with "
        "optimizer: muon also Muon's",
    )
    ema_decay: float = _f(
        0.0,
        "weight averaging: after every optimizer step avg = ema_decay x avg + (1 - ema_decay) x weights "
        "(the first step copies), in [0, 1); 0 = off. Checkpoints keep the average beside the raw weights "
        "(training resumes from the raw ones); eval, generate, serve, export and the quickstart's final "
        "evaluation use the average. e.g. 0.99: an average over the last ~100 steps. Not with fsdp/hsdp",
    )
    betas: tuple[float, float] = _f((0.9, 0.95), "AdamW (beta1, beta2)")
    eps: float = _f(1e-8, "AdamW epsilon")
    optimizer: str = _f(
        "adamw", ". ".join(f"{k.name}: {k.help}" for k in OPTIMIZERS.values()), choices=OPTIMIZERS
    )
    muon_lr: float | None = _f(
        None,
        "peak learning rate of the Muon matrices (optimizer: muon), following the same warmup and decay "
        "(its floor is min_lr x muon_lr / lr); null = lr. Muon's update is scaled per matrix to AdamW's "
        "RMS (torch's adjust_lr_fn=match_rms_adamw: 0.2 x sqrt(max(rows, cols))), so one lr serves both "
        "optimizers; set this to tune Muon apart",
    )
    muon_momentum: float = _f(0.95, "Muon's Nesterov momentum (optimizer: muon), in [0, 1)")
    grad_clip: float = _f(1.0, "clip the global gradient L2 norm to this; 0 disables clipping")
    dtype: str = _f(
        "auto",
        "compute dtype: bf16 (autocast, weights stay fp32), fp32, or auto: bf16 where the device computes it "
        "natively (CUDA compute capability >= 8.0; a CPU with AVX-512 or Arm BF16), else fp32 (an AVX2 "
        "CPU emulates bf16 ~10x slower). Muon's Newton-Schulz runs in the same dtype",
        choices=DTYPES,
    )
    device: str = _f("auto", "auto (cuda if available, else cpu), cpu, cuda or cuda:N")
    cpu_threads_watch: bool = _f(
        False,
        "CPU runs of one process with more than one torch thread (on in the tiny preset, the quickstart's; "
        "off by default, where a fixed thread count keeps CPU results bit-exact across a resume): when a "
        "logged window's steps take over "
        "twice the best seen (another job got the CPUs), try 1 thread for a window and keep it if faster, "
        "and the run's own count again once the load average leaves room (an event each time; a switch "
        "changes the low bits of the results). Off when OMP_NUM_THREADS or MKL_NUM_THREADS is set",
    )
    compile: bool = _f(False, "torch.compile the model (slow start; H200: ~1.55x eager speed, ~1.4x memory)")
    grad_checkpointing: bool = _f(False, "recompute block activations in backward to save memory")
    seed: int = _f(1337, "seed of the model init, the data order and every RNG")
    log_every: int = _f(50, "optimizer steps per logged window (loss is the window mean)")
    eval_every: int = _f(1000, "optimizer steps between validation evaluations; 0 disables")
    eval_batches: int = _f(20, "micro-batches (of micro_batch_size windows) per validation evaluation")
    eval_tasks: list[str] = _f(  # noqa: RUF009 (_f gives a list default its default_factory)
        [],
        "downstream benchmarks scored during training through lm-evaluation-harness (the eval extra), e.g. "
        "[piqa, arc_easy, lambada]; rows of kind eval in metrics.jsonl",
    )
    eval_tasks_every: int = _f(0, "optimizer steps between downstream evaluations (eval_tasks); 0 disables")
    eval_tasks_limit: int = _f(200, "items per task in each downstream evaluation (the first N); 0 = all")
    save_every: int = _f(4000, "optimizer steps between checkpoints (one is also written at the end)")
    keep_last_n: int = _f(3, "verified checkpoints kept; older ones are deleted; 0 keeps all")
    checkpoint_dir: str = _f("runs/run", "run directory: checkpoints, config.yaml, metrics.jsonl")
    init_from: str | None = _f(
        None,
        "weights to start a new run from (`--init-from`): a run directory, an official mamba_ssm "
        "directory or hf:NAME; fresh optimizer and schedule, step 0, the source's model config. Recorded "
        "in config.yaml; a run resuming from its own checkpoint ignores it",
    )
    nan_guard_max_consecutive: int = _f(
        5, "consecutive non-finite micro-steps (each skipped) before rolling back to the last checkpoint"
    )
    max_rollbacks: int = _f(3, "NaN rollbacks allowed without saving a newer checkpoint before giving up")
    peak_tflops: float = _f(0.0, "one accelerator's peak TFLOP/s for MFU; 0 = look up the GPU (none on CPU)")
    progress: bool = _f(True, "show a progress bar when stderr is an interactive terminal")
    parallelism: str = _f(
        "auto",
        "how the model is spread over the data-parallel processes of a torchrun job: ddp (replicated, "
        "gradients all-reduced during the backward), fsdp (parameters, gradients and optimizer state "
        "sharded over all processes: FSDP2), hsdp (sharded within dp_shard groups, replicated across "
        "dp_replicate of them), auto (fsdp when the memory estimate of a replicated model does not fit "
        "the device, else ddp). One process needs none of them",
        choices=PARALLELISMS,
    )
    dp_replicate: int = _f(
        1,
        "hsdp: replicas of the sharded model (e.g. nodes); the shard group is the data-parallel size / "
        "this, which must divide",
    )
    reshard_after_forward: bool = _f(
        True,
        "fsdp/hsdp: free each block's gathered parameters after its forward and gather them again in the "
        "backward (less memory, one more all-gather per block)",
    )
    context_parallel: int = _f(
        1,
        "processes that share each training window, each scanning T / this contiguous tokens and passing "
        "the recurrent state along (a hybrid's attention layers all-gather keys and values; a dimension of "
        "the device mesh: world size = data-parallel size x this); 1 = off",
    )
    dist_timeout_s: float = _f(
        1800.0, "seconds a collective may wait for the other processes before the job fails (torchrun jobs)"
    )
    dist_init_timeout_s: float = _f(
        600.0,
        "torchrun jobs: seconds the processes of a generation (the first, or one torchrun restarted) may "
        "take to meet at the rendezvous store, form their process group and pass its first barrier; past "
        "it a rank stops with an error naming what it waited for, and torchrun restarts the job if "
        "restarts remain",
    )
    watchdog_s: float = _f(
        1200.0,
        "torchrun jobs: seconds a rank may go without progress (the build and resume before the first step, "
        "then each training step, evaluation and checkpoint save) before it prints the Python stack of each "
        "of its threads and exits non-zero, so a stuck job becomes a torchrun restart instead of a stall; "
        "0 = off",
    )
    prefetch_batches: int = _f(
        2,
        "optimizer steps of input prepared ahead on a background thread (pinned memory, non-blocking "
        "copies); 0 = read each batch on the training thread",
    )
    async_checkpoint: bool = _f(
        True,
        "sharded runs (fsdp/hsdp) write checkpoints with torch.distributed.checkpoint's async save: training "
        "goes on while the files are written, and the meta file (the commit marker) follows when they are",
    )

    def __post_init__(self) -> None:
        s = "training"
        _check_choices(s, self)  # optimizer, lr_schedule, dtype, parallelism: their `choices=`
        _positive(
            s,
            self,
            (
                "max_seq_len",
                "micro_batch_size",
                "max_steps",
                "lr",
                "log_every",
                "save_every",
                "eval_batches",
                "nan_guard_max_consecutive",
                "eps",
                "dp_replicate",
                "context_parallel",
                "dist_timeout_s",
                "dist_init_timeout_s",
            ),
        )
        _positive(
            s,
            self,
            (
                "min_lr",
                "warmup_steps",
                "weight_decay",
                "grad_clip",
                "eval_every",
                "eval_tasks_every",
                "eval_tasks_limit",
                "keep_last_n",
                "max_rollbacks",
                "peak_tflops",
                "global_batch_size",
                "prefetch_batches",
                "watchdog_s",
            ),
            allow_zero=True,
        )
        if self.min_lr > self.lr:
            raise ConfigError(f"training.min_lr ({self.min_lr}) must be <= training.lr ({self.lr})")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"training.betas must be two numbers in [0, 1), got {list(self.betas)}")
        self._check_optimizer()
        self._check_schedule()
        self._resolve_batch()
        self._check_scale_out()
        if not (self.device in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", self.device)):
            raise ConfigError(f"training.device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if not 0 <= self.seed < 2**63:
            raise ConfigError(f"training.seed must be in [0, 2**63), got {self.seed}")
        if not self.checkpoint_dir:
            raise ConfigError("training.checkpoint_dir must not be empty")
        names = [str(t).strip() for t in self.eval_tasks]
        if not all(names) or len(set(names)) != len(names):
            raise ConfigError(f"training.eval_tasks must be distinct task names, got {list(self.eval_tasks)}")
        self.eval_tasks = names
        if self.eval_tasks_every and not self.eval_tasks:
            raise ConfigError(
                f"training.eval_tasks_every is {self.eval_tasks_every} but training.eval_tasks is empty; "
                "name the tasks, e.g. --set 'training.eval_tasks=[piqa,arc_easy]'"
            )
        self.betas = (float(self.betas[0]), float(self.betas[1]))

    def _resolve_batch(self) -> None:
        """One source of truth for the batch: global_batch_size when it is set (gradient_accumulation_steps
        then null: the run derives it, so a value there would be ignored: refused), else
        micro_batch_size x gradient_accumulation_steps (default DEFAULT_ACCUMULATION)."""
        if self.global_batch_size and self.gradient_accumulation_steps is not None:
            per_step = self.micro_batch_size * self.gradient_accumulation_steps
            raise ConfigError(
                f"training.gradient_accumulation_steps is {self.gradient_accumulation_steps} but "
                f"training.global_batch_size is {self.global_batch_size}, which decides the accumulation "
                "(global batch / (micro batch x data-parallel processes)); state one: "
                f"--set training.global_batch_size={per_step} for {self.gradient_accumulation_steps} micro "
                "batches per step on one process, or remove gradient_accumulation_steps"
            )
        if not self.global_batch_size and self.gradient_accumulation_steps is None:
            self.gradient_accumulation_steps = DEFAULT_ACCUMULATION
        if self.gradient_accumulation_steps is not None:
            _positive("training", self, ("gradient_accumulation_steps",))

    def _check_scale_out(self) -> None:
        """Replicas go with hsdp, and the global batch is made of whole micro batches. (What needs the
        world size is checked where the mesh is planned: train/parallel/layout.py, and `accumulation`.)"""
        if self.dp_replicate > 1 and self.parallelism not in ("hsdp", "auto"):
            raise ConfigError(
                f"training.dp_replicate is {self.dp_replicate} but training.parallelism is "
                f"{self.parallelism}: replicas of a sharded model are hsdp; set training.parallelism=hsdp"
            )
        if self.global_batch_size and self.global_batch_size % self.micro_batch_size:
            raise ConfigError(
                f"training.global_batch_size {self.global_batch_size} is not a multiple of "
                f"training.micro_batch_size {self.micro_batch_size}; choose a global batch that whole micro "
                "batches make up"
            )

    def _check_optimizer(self) -> None:
        """Muon's settings are sane. (Whether the model has a matrix for Muon is checked where the
        optimizer is built: train/optim.py.)"""
        if self.muon_lr is not None:
            _positive("training", self, ("muon_lr",))
        if not 0.0 <= self.muon_momentum < 1.0:
            raise ConfigError(f"training.muon_momentum must be in [0, 1), got {self.muon_momentum}")

    def _check_schedule(self) -> None:
        """decay_fraction and warmup_fraction are shares, time_budget_minutes a time; ema_decay is a decay
        (and not beside sharding: train/averaging.py)."""
        if not 0.0 < self.decay_fraction <= 1.0:  # NaN fails this too
            raise ConfigError(f"training.decay_fraction must be in (0, 1], got {self.decay_fraction}")
        if not 0.0 <= self.warmup_fraction < 1.0:  # NaN fails this too
            raise ConfigError(f"training.warmup_fraction must be in [0, 1), got {self.warmup_fraction}")
        if not 0.0 <= self.time_budget_minutes <= MAX_BUDGET_MINUTES:  # NaN fails this too
            raise ConfigError(
                f"training.time_budget_minutes must be in [0, {MAX_BUDGET_MINUTES:,.0f}] (0 = off: train "
                f"max_steps steps), got {self.time_budget_minutes}"
            )
        if not 0.0 <= self.ema_decay < 1.0:
            raise ConfigError(f"training.ema_decay must be in [0, 1) (0 = off), got {self.ema_decay}")
        if self.ema_decay and self.parallelism in ("fsdp", "hsdp"):
            raise ConfigError(
                f"training.ema_decay is {self.ema_decay} but training.parallelism is {self.parallelism}: "
                "weight averaging keeps a whole copy of the weights on each process and is not supported "
                "for sharded models; use ddp, or --set training.ema_decay=0"
            )

    @property
    def global_windows(self) -> int:
        """The global batch in windows per optimizer step (all data-parallel processes together)."""
        if self.global_batch_size:
            return self.global_batch_size
        assert self.gradient_accumulation_steps is not None, "resolved in __post_init__"
        return self.micro_batch_size * self.gradient_accumulation_steps

    def accumulation(self, dp_size: int = 1) -> int:
        """Micro-batches per optimizer step on each of `dp_size` data-parallel processes, so that they
        make up the global batch together; ConfigError when they cannot."""
        assert dp_size >= 1
        per_pass = self.micro_batch_size * dp_size
        if self.global_windows % per_pass:
            raise ConfigError(
                f"the global batch of {self.global_windows} windows does not split into micro batches of "
                f"{self.micro_batch_size} over {dp_size} data-parallel processes ({per_pass} windows per "
                f"pass); choose training.global_batch_size as a multiple of {per_pass}, or another "
                "micro_batch_size or process count"
            )
        return self.global_windows // per_pass

    def windows_per_step(self) -> int:
        """Global batch in windows per optimizer step (the same at any world size)."""
        return self.global_windows

    def tokens_per_step(self) -> int:
        """Input tokens trained on per optimizer step (all processes together)."""
        return self.global_windows * self.max_seq_len


TOKEN_DTYPES = ("uint16", "uint32", "int32", "int64")


@dataclass
class DataConfig:
    """Where the tokens come from. Paths are dataset directories (manifest.json) or seed-format files."""

    train_data_path: str = _f(
        "data/pretrain_data.bin", "training tokens: a prepared dataset directory or a seed-format token file"
    )
    val_data_path: str | None = _f(
        None,
        "validation tokens; default: the val split of train_data_path "
        "when its manifest has one, else no evaluation",
    )
    dummy: bool = _f(False, "train on seeded random tokens instead of data (plumbing tests only)")
    token_dtype: str | None = _f(
        None,
        "dtype of raw token files without a manifest (uint32 for the seed pipeline's shards); "
        "a prepared dataset's manifest records its own",
    )

    def __post_init__(self) -> None:
        if not self.dummy and not self.train_data_path:
            raise ConfigError("data.train_data_path must be set (or data.dummy: true for random tokens)")
        if self.token_dtype is not None and self.token_dtype not in TOKEN_DTYPES:
            raise ConfigError(
                f"data.token_dtype must be one of {', '.join(TOKEN_DTYPES)} (or unset), "
                f"got {self.token_dtype!r}"
            )


LOGGING_SINKS = ("console", "tensorboard", "wandb", "progress", "jsonl")  # the order rows reach them


@dataclass
class LoggingConfig:
    """Where the metrics rows go (how often: training.log_every); `auto` is every sink that is available."""

    sinks: list[str] = _f(  # noqa: RUF009 (_f gives a list default its default_factory)
        ["auto"],
        "metrics sinks: console, jsonl (RUN/metrics.jsonl; required), tensorboard (RUN/tb), wandb, progress "
        "(a bar when stderr is a terminal and training.progress is on); auto = console, jsonl, progress, "
        "tensorboard when it is installed and wandb when a project is set, plus any named beside it. A "
        "named sink whose package is missing is an error",
    )
    wandb_project: str | None = _f(
        None,
        "Weights & Biases project of the wandb sink; unset: the WANDB_PROJECT environment variable (if "
        "that is unset too, auto has no wandb)",
    )
    wandb_run_name: str | None = _f(
        None, "display name of the W&B run; unset: the WANDB_RUN_NAME environment variable, else W&B's own"
    )

    def __post_init__(self) -> None:
        # The environment is read here, where the config is resolved (and recorded in config.yaml), not
        # by the logger's builder.
        self.wandb_project = self.wandb_project or os.environ.get("WANDB_PROJECT") or None
        self.wandb_run_name = self.wandb_run_name or os.environ.get("WANDB_RUN_NAME") or None
        names = [str(s).strip() for s in self.sinks]
        for name in names:
            if name not in (*LOGGING_SINKS, "auto"):
                known = ("auto", *LOGGING_SINKS)
                hint = did_you_mean_hint(name, known, otherwise=f"; known: {', '.join(known)}")
                raise ConfigError(f"logging.sinks: unknown sink `{name}`{hint}")
        if len(set(names)) != len(names) or not names:
            raise ConfigError(f"logging.sinks must name distinct sinks, got {list(self.sinks)}")
        if "auto" not in names and "jsonl" not in names:
            raise ConfigError(
                f"logging.sinks must include jsonl (or auto), got {names}: RUN/metrics.jsonl is the "
                "record that plot, inspect and resume read"
            )
        if "wandb" in names and not self.wandb_project:
            raise ConfigError(
                "logging.sinks names wandb but no project is set: set logging.wandb_project (or the "
                "WANDB_PROJECT environment variable)"
            )
        self.sinks = names


def _model_config_cls() -> type:
    from mamba3lite.model import ModelConfig

    return ModelConfig


def _default_model() -> ModelConfig:
    return _model_config_cls()()


@dataclass
class Config:
    """A whole run: the four sections. Build with `load_config`, `Config.from_dict` or directly."""

    model: ModelConfig = field(default_factory=_default_model)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @classmethod
    def section_classes(cls) -> dict[str, type]:
        return {
            "model": _model_config_cls(),
            "training": TrainingConfig,
            "data": DataConfig,
            "logging": LoggingConfig,
        }

    @classmethod
    def from_dict(cls, raw: dict | None, *, source: str = "config", record: bool = True) -> Config:
        """Build from a nested mapping (YAML, a checkpoint's meta). Missing keys take defaults.

        record: `raw` is what a run recorded (a checkpoint's meta, a run's config.yaml). Runs recorded
        every field, so records made before the batch had one source of truth state
        gradient_accumulation_steps beside a set global_batch_size, which those runs ignored: it is
        dropped, and the record reads as the run trained. False (a file someone wrote): stating both is
        the ConfigError of `TrainingConfig._resolve_batch`."""
        raw = {} if raw is None else raw
        if not isinstance(raw, dict):
            raise ConfigError(
                f"{source}: the top level must be a mapping with sections {', '.join(SECTIONS)}"
            )
        _reject_unknown(raw.keys(), SECTIONS, where=f"{source}: unknown section")
        sections = {}
        for name, section_cls in cls.section_classes().items():
            values = raw.get(name) or {}
            if not isinstance(values, dict):
                raise ConfigError(f"{source}: section `{name}:` must be a mapping of key: value")
            if record and name == "training" and values.get("global_batch_size"):
                values = {k: v for k, v in values.items() if k != "gradient_accumulation_steps"}
            sections[name] = build_section(section_cls, values, name)
        return cls(**sections)

    def to_dict(self) -> dict:
        """Plain nested dict (tuples become lists): JSON and YAML safe."""
        return {name: _plain(dataclasses.asdict(getattr(self, name))) for name in SECTIONS}

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def with_overrides(self, overrides: list[str] | tuple[str, ...]) -> Config:
        """A copy with `section.key=value` overrides applied (values typed by the field). All the overrides
        of a section are applied together and validated once, so `model.vocab_size=296 model.eos_id=0`
        works in either order (one at a time, the first would be checked against the other's old value);
        a key given twice: the last wins. A mapping field takes a whole mapping (`model.attn_cfg={num_heads:
        8}`) or one of its keys (`model.attn_cfg.num_heads=8`, merged into the current mapping)."""
        per_section: dict[str, dict[str, Any]] = {}
        for item in overrides:
            key, sep, text = item.partition("=")
            if not sep:
                raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. training.lr=3e-4")
            section, dot, name = key.strip().partition(".")
            if not dot:
                raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. training.lr=3e-4")
            _reject_unknown([section], SECTIONS, where="--set: unknown section")
            values = per_section.setdefault(section, {})
            name, dot, sub = name.partition(".")
            if not dot:
                values[name] = _parse_text(text.strip())
                continue
            current = values.get(name, getattr(getattr(self, section), name, None))
            if not isinstance(current, dict):
                _reject_unknown(
                    [name],
                    dataclasses.asdict(getattr(self, section)),
                    where=f"--set: unknown key in section `{section}:`",
                )
                raise ConfigError(
                    f"--set {item!r}: {section}.{name} is not a mapping; set it whole: {section}.{name}=value"
                )
            values[name] = {**current, sub: _parse_text(text.strip())}
        cfg = self
        for section, values in per_section.items():
            cfg = cfg.replace(section, **values)
        return cfg

    def replace(self, section: str, **values: Any) -> Config:
        """A copy with fields of one section replaced (coerced and validated like YAML values)."""
        section_cls = self.section_classes()[section]
        current = dataclasses.asdict(getattr(self, section))
        _reject_unknown(values.keys(), current.keys(), where=f"unknown key in section `{section}:`")
        if (
            section == "training"
            and "global_batch_size" in values
            and "gradient_accumulation_steps" not in values
        ):
            # A global batch set over one derived from the accumulation replaces it: one source of truth.
            current["gradient_accumulation_steps"] = None
        merged = {**current, **values}
        return dataclasses.replace(self, **{section: build_section(section_cls, merged, section)})


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _parse_text(text: str) -> Any:
    """A --set value: YAML scalar syntax (3e-4 stays a string for YAML 1.1; coercion handles it)."""
    import yaml

    try:
        return yaml.safe_load(text) if text else ""
    except (yaml.YAMLError, ValueError, RecursionError):
        # Not YAML, an integer past Python's int-string limit, or nesting past the recursion limit:
        # the field's coercion then says what it expected, naming the field.
        return text


def _reject_unknown(keys: Any, known: Any, *, where: str) -> None:
    known = list(known)
    for key in keys:
        if key not in known:
            hint = did_you_mean_hint(key, known, otherwise=f"; known: {', '.join(map(str, known))}")
            raise ConfigError(f"{where} `{key}`{hint}")


def build_section(section_cls: type, values: dict, section: str) -> Any:
    """Instantiate one section dataclass from a mapping, coercing each value to its field's type."""
    fields = {f.name: f for f in dataclasses.fields(section_cls) if f.init}
    _reject_unknown(values.keys(), fields.keys(), where=f"unknown key in section `{section}:`")
    hints = typing.get_type_hints(section_cls)
    kwargs = {name: _coerce(value, hints[name], f"{section}.{name}") for name, value in values.items()}
    try:
        return section_cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:  # a section class validating with plain exceptions
        raise ConfigError(f"section `{section}:`: {e}") from e


def _coerce(value: Any, type_: Any, where: str) -> Any:
    """Check/convert one value against a field's type hint; errors name the field."""
    origin = typing.get_origin(type_)
    args = typing.get_args(type_)
    if origin in (typing.Union, types.UnionType):
        return _coerce_union(value, args, where)
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{where} must be one of {', '.join(map(repr, args))}, got {value!r}")
        return value
    if origin in (tuple, list):
        return _coerce_sequence(value, origin, args, where)
    scalar = _SCALARS.get(type_)
    return value if scalar is None else scalar(value, where)  # Any (and unknown hints): as given


def _coerce_union(value: Any, args: tuple, where: str) -> Any:
    """`X | None` and other unions: None (or its YAML spellings) where allowed, else the first member
    type the value converts to; the first member's error otherwise."""
    is_none = value is None or (isinstance(value, str) and value.lower() in ("none", "null", "~"))
    if is_none and type(None) in args:
        return None
    errors = []
    for arg in args:
        if arg is type(None):
            continue
        try:
            return _coerce(value, arg, where)
        except ConfigError as e:
            errors.append(str(e))
    raise ConfigError(errors[0] if errors else f"{where}: cannot be {value!r}")


def _coerce_sequence(value: Any, origin: type, args: tuple, where: str) -> Any:
    """A list or tuple field: a YAML sequence, or a comma-separated string (`--set x=a,b`)."""
    if isinstance(value, str):
        value = [v.strip() for v in value.strip("()[]").split(",") if v.strip()]
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{where} must be a list, got {value!r}")
    if origin is tuple and args and args[-1] is not Ellipsis:
        if len(value) != len(args):
            raise ConfigError(f"{where} must have {len(args)} items, got {len(value)}: {list(value)}")
        return tuple(_coerce(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    inner = args[0] if args else Any
    items = [_coerce(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
    return tuple(items) if origin is tuple else items


def _coerce_bool(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):  # `--set training.progress=1`: YAML reads an int
        return bool(value)
    if isinstance(value, str) and value.lower() in ("true", "yes", "on", "1", "false", "no", "off", "0"):
        return value.lower() in ("true", "yes", "on", "1")
    raise ConfigError(f"{where} must be true or false, got {value!r}")


def _coerce_int(value: Any, where: str) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{where} must be an integer, got {value!r}")
    number = None
    if isinstance(value, int):
        number = value
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    elif isinstance(value, str):
        try:
            f = float(value.replace("_", ""))
        except (ValueError, OverflowError):
            f = None
        if f is not None and f.is_integer():
            number = int(f)
    if number is None:
        raise ConfigError(f"{where} must be an integer, got {_short(value)}")
    if abs(number) >= 2**64:  # beyond any int64 size or counter (fields check their own ranges)
        raise ConfigError(f"{where} is impossibly large, got {_short(value)}")
    return number


def _coerce_float(value: Any, where: str) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"{where} must be a number, got {value!r}")
    try:
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            return float(value)
    except ValueError:
        pass
    except OverflowError:  # an integer of hundreds of digits
        raise ConfigError(f"{where} is too large for a number, got {_short(value)}") from None
    raise ConfigError(f"{where} must be a number, got {_short(value)}")


def _coerce_str(value: Any, where: str) -> str:
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(f"{where} must be a string, got {value!r}")


_SCALARS = {bool: _coerce_bool, int: _coerce_int, float: _coerce_float, str: _coerce_str}


def _short(value: Any) -> str:
    """repr of a value for a message, cut to 40 characters (a pasted 400-digit number)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def resolve_preset(name_or_path: str | Path) -> Path:
    """A config file path, or a packaged preset's bare name ("tiny" -> configs/tiny.yaml)."""
    p = Path(name_or_path)
    if p.is_file() or (p.exists() and not p.is_dir()):  # a pipe or device: intake's error names it
        return p
    if p.suffix in ("", ".yaml", ".yml") and len(p.parts) == 1:
        packaged = PRESET_DIR / (p.name if p.suffix else f"{p.name}.yaml")
        if packaged.is_file():
            return packaged
    presets = available_presets()
    hint = did_you_mean_hint(p.stem, presets)
    raise ConfigError(
        f"config not found: {name_or_path} (not a file, not a packaged preset){hint} "
        f"Presets: {', '.join(presets) or '(none)'}"
    )


def available_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def load_config(name_or_path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load a preset/YAML file, then apply `section.key=value` overrides in order."""
    from mamba3lite import intake

    path = resolve_preset(name_or_path)
    raw = intake.read_yaml(path, intake.CONFIG)
    if raw is None:  # an empty file (or only comments) would silently be every default
        raise ConfigError(
            f"{path} is empty; a config holds model:, training: and/or data: sections (or use a preset "
            f"name: {', '.join(available_presets())})"
        )
    header = RESOLVED_HEADER.encode("utf-8")
    record = intake.read_prefix(path, intake.CONFIG, len(header)) == header  # a run's config.yaml
    return Config.from_dict(raw, source=str(path), record=record).with_overrides(list(overrides))


# The first line of a run directory's record of its resolved config (rundir.CONFIG_NAME: written at every
# start of `train`, and by `import`): how outdir tells a run's config.yaml from a hand-written one.
RESOLVED_HEADER = "# Resolved config of this run (every field; written by `mamba3lite train`).\n"


def write_resolved_config(cfg: Config, path: str | Path) -> None:
    """Write the fully resolved config (every field, defaults included) as YAML, atomically."""
    from mamba3lite.atomicfile import atomic_write_bytes

    atomic_write_bytes(Path(path), (RESOLVED_HEADER + cfg.to_yaml()).encode("utf-8"))
