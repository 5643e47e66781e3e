"""TrainingConfig: the `training:` section of a run's config (optimisation, schedule, cadence,
checkpoints, scale-out). Its fields document themselves (`doc`); values are checked on creation, and the
batch has one source of truth (`global_batch_size`, or the micro batch times the accumulation).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from mamba3lite.errors import ConfigError
from mamba3lite.optimizers import KINDS
from mamba3lite.sections.fault_tolerance import FaultToleranceConfig
from mamba3lite.sections.fields import check_choices, check_positive, doc

DTYPES = ("auto", "bf16", "fp32")  # resolved per device by model/precision.py
OPTIMIZERS = KINDS  # the registry itself (optimizers.py): an optimizer registered there is a choice here
# Micro batches per optimizer step of a run that states neither its global batch nor its accumulation
# (the seed's default).
DEFAULT_ACCUMULATION = 2
LR_SCHEDULES = ("cosine", "linear", "wsd")
PARALLELISMS = ("auto", "ddp", "fsdp", "hsdp")
MAX_BUDGET_MINUTES = 1e6  # ~2 years: any real budget, and far from float overflow
# The fields that must be > 0, and those that may also be 0 (0 = off or none, as each field says).
_POSITIVE = (
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
)
_NON_NEGATIVE = (
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
)


@dataclass
class TrainingConfig:
    """Optimisation, schedule, cadence and checkpointing. Defaults are the seed's 440M recipe."""

    max_seq_len: int = doc(2048, "window length L in tokens: each sample is L inputs + L shifted targets")
    micro_batch_size: int = doc(16, "windows per forward/backward pass on each process")
    gradient_accumulation_steps: int | None = doc(
        None,
        "for a run that does not state global_batch_size (0): micro-batches per optimizer step of ONE "
        "process, so that the global batch is micro_batch_size x this (default 2); with more data-parallel "
        "processes the accumulation is derived from that global batch, which stays the same. null where "
        "global_batch_size is set: the global batch decides the accumulation, and stating both is an error",
    )
    global_batch_size: int = doc(
        0,
        "windows per optimizer step, all data-parallel processes together: the run's contract, the same "
        "at any world size (accumulation = global_batch_size / (micro_batch_size x data-parallel size), "
        "which must divide). 0 = micro_batch_size x gradient_accumulation_steps",
    )
    max_steps: int = doc(256_000, "optimizer steps of the run; also the end of the learning-rate schedule")
    lr: float = doc(1.5e-3, "peak learning rate (after warmup)")
    min_lr: float = doc(1e-5, "learning rate at the end of the decay (reached at max_steps)")
    warmup_steps: int = doc(2000, "optimizer steps of linear warmup from 0 to lr")
    lr_schedule: str = doc(
        "cosine",
        "the decay from lr to min_lr after warmup: cosine (over all the steps after warmup), linear (a "
        "straight line over them), wsd (warmup-stable-decay: lr held, then a straight line over the last "
        "decay_fraction of max_steps)",
        choices=LR_SCHEDULES,
    )
    decay_fraction: float = doc(
        0.2, "lr_schedule wsd: the share of max_steps, at the end, over which lr decays to min_lr; in (0, 1]"
    )
    time_budget_minutes: float = doc(
        0.0,
        "train for this many minutes by the clock; 0 = off (the run is max_steps steps). Warmup and decay "
        "then follow the share of this time spent (warmup_fraction, then lr_schedule over the rest, min_lr "
        "when it is spent), training ends when it is spent, and max_steps only caps the steps. Training "
        "time includes the periodic evaluations and checkpoints, not start-up or loading; a resumed run "
        "continues from the share its checkpoint recorded",
    )
    warmup_fraction: float = doc(
        0.02,
        "with time_budget_minutes: the share of the time budget over which lr warms up linearly, in [0, 1) "
        "(warmup_steps is for runs of steps)",
    )
    weight_decay: float = doc(
        0.1,
        "decoupled weight decay on matrices (not norms, biases, embeddings, dt_bias, D): AdamW's, and with "
        "optimizer: muon also Muon's",
    )
    ema_decay: float = doc(
        0.0,
        "weight averaging: after every optimizer step avg = ema_decay x avg + (1 - ema_decay) x weights "
        "(the first step copies), in [0, 1); 0 = off. Checkpoints keep the average beside the raw weights "
        "(training resumes from the raw ones); eval, generate, serve, export and the quickstart's final "
        "evaluation use the average. e.g. 0.99: an average over the last ~100 steps. Not with fsdp/hsdp",
    )
    betas: tuple[float, float] = doc((0.9, 0.95), "AdamW (beta1, beta2)")
    eps: float = doc(1e-8, "AdamW epsilon")
    optimizer: str = doc(
        "adamw", ". ".join(f"{k.name}: {k.help}" for k in OPTIMIZERS.values()), choices=OPTIMIZERS
    )
    muon_lr: float | None = doc(
        None,
        "peak learning rate of the Muon matrices (optimizer: muon), following the same warmup and decay "
        "(its floor is min_lr x muon_lr / lr); null = lr. Muon's update is scaled per matrix to AdamW's "
        "RMS (torch's adjust_lr_fn=match_rms_adamw: 0.2 x sqrt(max(rows, cols))), so one lr serves both "
        "optimizers; set this to tune Muon apart",
    )
    muon_momentum: float = doc(0.95, "Muon's Nesterov momentum (optimizer: muon), in [0, 1)")
    grad_clip: float = doc(1.0, "clip the global gradient L2 norm to this; 0 disables clipping")
    dtype: str = doc(
        "auto",
        "compute dtype: bf16 (autocast, weights stay fp32), fp32, or auto: bf16 where the device computes it "
        "natively (CUDA compute capability >= 8.0; a CPU with AVX-512 or Arm BF16), else fp32 (an AVX2 "
        "CPU emulates bf16 ~10x slower). Muon's Newton-Schulz runs in the same dtype",
        choices=DTYPES,
    )
    device: str = doc("auto", "auto (cuda if available, else cpu), cpu, cuda or cuda:N")
    cpu_threads_watch: bool = doc(
        False,
        "CPU runs of one process with more than one torch thread (on in the tiny preset, the quickstart's; "
        "off by default, where a fixed thread count keeps CPU results bit-exact across a resume): when a "
        "logged window's steps take over "
        "twice the best seen (another job got the CPUs), try 1 thread for a window and keep it if faster, "
        "and the run's own count again once the load average leaves room (an event each time; a switch "
        "changes the low bits of the results). Off when OMP_NUM_THREADS or MKL_NUM_THREADS is set",
    )
    compile: bool = doc(False, "torch.compile the model (slow start; H200: ~1.55x eager speed, ~1.4x memory)")
    grad_checkpointing: bool = doc(False, "recompute block activations in backward to save memory")
    seed: int = doc(1337, "seed of the model init, the data order and every RNG")
    log_every: int = doc(50, "optimizer steps per logged window (loss is the window mean)")
    eval_every: int = doc(1000, "optimizer steps between validation evaluations; 0 disables")
    eval_batches: int = doc(20, "micro-batches (of micro_batch_size windows) per validation evaluation")
    eval_tasks: list[str] = doc(  # noqa: RUF009 (doc gives a list default its default_factory)
        [],
        "downstream benchmarks scored during training through lm-evaluation-harness (the eval extra), e.g. "
        "[piqa, arc_easy, lambada]; rows of kind eval in metrics.jsonl",
    )
    eval_tasks_every: int = doc(0, "optimizer steps between downstream evaluations (eval_tasks); 0 disables")
    eval_tasks_limit: int = doc(200, "items per task in each downstream evaluation (the first N); 0 = all")
    save_every: int = doc(4000, "optimizer steps between checkpoints (one is also written at the end)")
    keep_last_n: int = doc(3, "verified checkpoints kept; older ones are deleted; 0 keeps all")
    checkpoint_dir: str = doc("runs/run", "run directory: checkpoints, config.yaml, metrics.jsonl")
    init_from: str | None = doc(
        None,
        "weights to start a new run from (`--init-from`): a run directory, an official mamba_ssm "
        "directory or hf:NAME; fresh optimizer and schedule, step 0, the source's model config. Recorded "
        "in config.yaml; a run resuming from its own checkpoint ignores it",
    )
    nan_guard_max_consecutive: int = doc(
        5, "consecutive non-finite micro-steps (each skipped) before rolling back to the last checkpoint"
    )
    max_rollbacks: int = doc(3, "NaN rollbacks allowed without saving a newer checkpoint before giving up")
    peak_tflops: float = doc(0.0, "one accelerator's peak TFLOP/s for MFU; 0 = look up the GPU (none on CPU)")
    progress: bool = doc(True, "show a progress bar when stderr is an interactive terminal")
    parallelism: str = doc(
        "auto",
        "how the model is spread over the data-parallel processes of a torchrun job: ddp (replicated, "
        "gradients all-reduced during the backward), fsdp (parameters, gradients and optimizer state "
        "sharded over all processes: FSDP2), hsdp (sharded within dp_shard groups, replicated across "
        "dp_replicate of them), auto (fsdp when the memory estimate of a replicated model does not fit "
        "the device, else ddp). One process needs none of them",
        choices=PARALLELISMS,
    )
    dp_replicate: int = doc(
        1,
        "hsdp: replicas of the sharded model (e.g. nodes); the shard group is the data-parallel size / "
        "this, which must divide",
    )
    reshard_after_forward: bool = doc(
        True,
        "fsdp/hsdp: free each block's gathered parameters after its forward and gather them again in the "
        "backward (less memory, one more all-gather per block)",
    )
    context_parallel: int = doc(
        1,
        "processes that share each training window, each scanning T / this contiguous tokens and passing "
        "the recurrent state along (a hybrid's attention layers all-gather keys and values; a dimension of "
        "the device mesh: world size = data-parallel size x this); 1 = off",
    )
    dist_timeout_s: float = doc(
        1800.0, "seconds a collective may wait for the other processes before the job fails (torchrun jobs)"
    )
    dist_init_timeout_s: float = doc(
        600.0,
        "torchrun jobs: seconds the processes of a generation (the first, or one torchrun restarted) may "
        "take to meet at the rendezvous store, form their process group and pass its first barrier; past "
        "it a rank stops with an error naming what it waited for, and torchrun restarts the job if "
        "restarts remain",
    )
    watchdog_s: float = doc(
        1200.0,
        "torchrun jobs: seconds a rank may go without progress (the build and resume before the first step, "
        "then each training step, evaluation and checkpoint save) before it prints the Python stack of each "
        "of its threads and exits non-zero, so a stuck job becomes a torchrun restart instead of a stall; "
        "0 = off",
    )
    fault_tolerance: FaultToleranceConfig = field(
        default_factory=FaultToleranceConfig,
        metadata={"help": "live fault tolerance over torchft replica groups (off by default): its keys are "
                  "`training.fault_tolerance.*`, below"},
    )  # fmt: skip
    prefetch_batches: int = doc(
        2,
        "optimizer steps of input prepared ahead on a background thread (pinned memory, non-blocking "
        "copies); 0 = read each batch on the training thread",
    )
    async_checkpoint: bool = doc(
        True,
        "sharded runs (fsdp/hsdp) write checkpoints with torch.distributed.checkpoint's async save: training "
        "goes on while the files are written, and the meta file (the commit marker) follows when they are",
    )

    def __post_init__(self) -> None:
        s = "training"
        check_choices(s, self)  # optimizer, lr_schedule, dtype, parallelism: their `choices=`
        check_positive(s, self, _POSITIVE)
        check_positive(s, self, _NON_NEGATIVE, allow_zero=True)
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
        self._check_eval_tasks()
        self.betas = (float(self.betas[0]), float(self.betas[1]))

    def _check_eval_tasks(self) -> None:
        """Distinct task names (stripped), and some when a cadence asks for them."""
        names = [str(t).strip() for t in self.eval_tasks]
        if not all(names) or len(set(names)) != len(names):
            raise ConfigError(f"training.eval_tasks must be distinct task names, got {list(self.eval_tasks)}")
        self.eval_tasks = names
        if self.eval_tasks_every and not self.eval_tasks:
            raise ConfigError(
                f"training.eval_tasks_every is {self.eval_tasks_every} but training.eval_tasks is empty; "
                "name the tasks, e.g. --set 'training.eval_tasks=[piqa,arc_easy]'"
            )

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
            check_positive("training", self, ("gradient_accumulation_steps",))

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
            check_positive("training", self, ("muon_lr",))
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
