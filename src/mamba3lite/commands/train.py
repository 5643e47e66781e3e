"""`mamba3lite train`: pretrain from a YAML config (a thin layer over `Pretrainer`).

    mamba3lite train --config tiny --data-path data/stdlib
    torchrun --nproc_per_node 8 -m mamba3lite train --config configs/440m.yaml --data-path ...

Flags override the config file; `--set section.key=value` overrides anything, typed. The run directory
(`--checkpoint-dir`, default `training.checkpoint_dir`) holds config.yaml, run.json, metrics.jsonl and
the checkpoints. `--resume latest` (default) continues from the newest verified checkpoint there;
`--resume N` from exactly step N; `--resume none` starts fresh (and refuses a directory with
checkpoints). `--init-from SRC` starts a new run (step 0, fresh optimizer and schedule) from the weights
of a run directory or an official mamba_ssm directory, with that model's config (`--set model.*` may
change what does not change a parameter's shape); data tokenized with another tokenizer is refused;
once the new run has a checkpoint, a resume takes the weights from it and never reads SRC again.
`--dry-run` trains 2 steps end to end, evaluates, and writes a checkpoint (the seed's smoke test),
always as a fresh run in a directory without checkpoints. SIGTERM / Ctrl-C: the current step
finishes, a checkpoint is written, exit code 0.
"""

from __future__ import annotations

import argparse
import signal
from pathlib import Path

from mamba3lite import intake
from mamba3lite.commands.options import add_override_option
from mamba3lite.errors import CheckpointError, ConfigError, TrainingError
from mamba3lite.outdir import check_run_dir

HELP = "pretrain a Mamba-3 language model from a YAML config"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        default="tiny",
        metavar="FILE|PRESET",
        help="YAML config file, or a packaged preset name (tiny, ...); default: tiny",
    )
    parser.add_argument("--data-path", metavar="P", help="training data (overrides data.train_data_path)")
    parser.add_argument("--val-data-path", metavar="P", help="validation data (overrides data.val_data_path)")
    parser.add_argument(
        "--checkpoint-dir", metavar="D", help="run directory (overrides training.checkpoint_dir)"
    )
    parser.add_argument(
        "--resume",
        default="latest",
        metavar="latest|none|N",
        help="latest verified checkpoint (default), none (fresh run), or exactly step N",
    )
    parser.add_argument("--max-steps", type=int, metavar="N", help="overrides training.max_steps")
    parser.add_argument(
        "--init-from",
        metavar="RUN_DIR|OFFICIAL_DIR",
        help="start a new run from these weights (a run directory, an official mamba_ssm directory, or "
        "hf:NAME); the model config is theirs (overrides training.init_from)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="2 optimizer steps end to end (train, evaluate, checkpoint): a smoke test",
    )
    parser.add_argument(
        "--dummy",
        action="store_true",
        help="random tokens instead of data (plumbing tests only; never a fallback)",
    )
    add_override_option(parser)
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")


def parse_resume(text: str) -> str | int:
    text = text.strip().lower()
    if text in ("latest", "none"):
        return text
    try:
        step = int(text)
    except ValueError:
        raise ConfigError(f"--resume must be latest, none or a step number, got {text!r}") from None
    if step < 0:
        raise ConfigError(f"--resume step must be >= 0, got {step}")
    return step


def build_config(args: argparse.Namespace):
    """The resolved Config: file, then --set overrides, then the dedicated flags."""
    from mamba3lite.config import load_config

    if args.dummy and args.data_path is not None:
        raise ConfigError("--dummy trains on random tokens, --data-path on a dataset: pass one of them")
    cfg = load_config(args.config, args.overrides)
    if args.checkpoint_dir is not None:
        cfg = cfg.replace("training", checkpoint_dir=args.checkpoint_dir)
    _check_config_file_is_not_the_runs_record(args.config, cfg.training.checkpoint_dir)
    if args.data_path is not None:  # an explicit data path means real data, even if the file said dummy
        cfg = cfg.replace("data", train_data_path=args.data_path, dummy=False)
    if args.val_data_path is not None:
        cfg = cfg.replace("data", val_data_path=args.val_data_path)
    if args.dummy:
        cfg = cfg.replace("data", dummy=True)
    if args.max_steps is not None:
        cfg = cfg.replace("training", max_steps=args.max_steps)
    if args.init_from is not None:
        cfg = cfg.replace("training", init_from=args.init_from)
    if args.dry_run:
        t = cfg.training
        cfg = cfg.replace(
            "training",
            max_steps=2,
            log_every=1,
            eval_every=2,
            save_every=2,
            eval_batches=min(t.eval_batches, 2),
            warmup_steps=min(t.warmup_steps, 1),
        )
    return cfg


def _check_config_file_is_not_the_runs_record(config: str, checkpoint_dir: str) -> None:
    """RUN/config.yaml is the trainer's record of the resolved config, rewritten at every start. Passing
    it back (`--config RUN/config.yaml`) is fine; a hand-written file of that name would be overwritten,
    comments and all: refuse before anything is written."""
    from mamba3lite.config import RESOLVED_CONFIG_NAME, RESOLVED_HEADER, resolve_preset

    path = resolve_preset(config)
    record = Path(checkpoint_dir) / RESOLVED_CONFIG_NAME
    mine = record.exists() and path.resolve() == record.resolve()
    header = RESOLVED_HEADER.encode("utf-8")
    if mine and intake.read_prefix(path, intake.CONFIG, len(header)) != header:
        raise ConfigError(
            f"--config {config} is the run's config.yaml, which `train` rewrites with the resolved "
            "config of every start: keep your config file outside the checkpoint directory"
        )


def _check_the_datas_tokenizer(cfg) -> None:
    """`generate` and `eval` refuse a run whose data's tokenizer they cannot load: refuse it before the
    run is trained, by their rule (`load_recorded_tokenizer`), when the manifest names a tokenizer this
    project knows (gpt2, a tokenizer.json path). A name it does not know is only a warning: token data
    may come from a tokenizer that lives elsewhere (pre-tokenized data, a test's byte vocabulary), and
    the training itself needs none."""
    import warnings

    from mamba3lite.data.shards import MANIFEST_NAME, Manifest, dataset_dir, has_manifest
    from mamba3lite.tokenizer import KNOWN_TOKENIZERS, is_tokenizer_file, load_recorded_tokenizer

    data = dataset_dir(cfg.data.train_data_path or "")
    if cfg.data.dummy or not has_manifest(data):
        return  # no manifest: nothing records a tokenizer (the dataset's own errors come later)
    recorded = Manifest.load(data).tokenizer or {}
    name = str(recorded.get("name", ""))
    if name in KNOWN_TOKENIZERS or is_tokenizer_file(name):
        load_recorded_tokenizer(
            name,
            recorded.get("vocab_hash"),
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


def out_of_memory_advice(exc: BaseException, cfg, building: bool = False) -> str | None:
    """The message for an allocation failure (CUDA or CPU), naming the knobs; None for other errors.
    A step that ran out of memory never reaches the optimizer or a checkpoint: the run directory holds
    what the last save wrote, and `train` resumes from it. `building`: it happened while the model and
    optimizer were built, before any step, where the batch knobs cannot help."""
    import torch

    text = str(exc)
    # torch's allocators raise RuntimeError subclasses; numpy's (a batch gathered on the host) MemoryError
    if not (isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or "can't allocate memory" in text):
        return None
    t = cfg.training
    where = "the accelerator" if isinstance(exc, torch.OutOfMemoryError) else "host memory"
    first = text.strip().splitlines()[0][:200] if text.strip() else type(exc).__name__
    if building:
        from mamba3lite.model import count_parameters

        n = count_parameters(cfg.model)
        return (
            f"out of memory on {where} while building the model ({first}): {n / 1e6:,.1f}M parameters "
            f"need ~{16 * n / 2**30:,.1f} GiB for fp32 weights, gradients and AdamW moments before any "
            "activation. Use a smaller model (e.g. --config tiny) or a device with more memory."
        )
    fix = (
        f"--set training.micro_batch_size={t.micro_batch_size // 2} "
        f"--set training.gradient_accumulation_steps={2 * t.gradient_accumulation_steps}"
        if t.micro_batch_size > 1
        else f"--set training.max_seq_len={max(1, t.max_seq_len // 2)}"
    )
    ckpt = ""
    if not t.grad_checkpointing:
        ckpt = ", or --set training.grad_checkpointing=true (recomputes each layer)"
    if t.compile:
        ckpt += ", or --set training.compile=false (the compiled model keeps ~1.4x the activations)"
    return (
        f"out of memory on {where} with micro_batch_size {t.micro_batch_size} x max_seq_len {t.max_seq_len} "
        f"({first}). Use less per micro-step and keep the batch: {fix}{ckpt}. "
        f"Checkpoints in {t.checkpoint_dir} are untouched; the run resumes from the newest one."
    )


def resolve_init_from(args: argparse.Namespace, cfg):
    """(cfg with the source's model config and the run's `--set model.*` on top, the model holding the
    source's weights); DataError when the training data was tokenized with another tokenizer."""
    from dataclasses import asdict

    from mamba3lite.data.shards import Manifest, has_manifest
    from mamba3lite.evaluate import check_compatible
    from mamba3lite.interop.init_from import load_init_source

    source = load_init_source(cfg.training.init_from)
    cfg = cfg.replace("model", **asdict(source.config))
    cfg = cfg.with_overrides([o for o in args.overrides if o.strip().startswith("model.")])
    data = Path(cfg.data.train_data_path)
    if not cfg.data.dummy and has_manifest(data):
        check_compatible(
            Manifest.load(data), cfg.model.vocab_size, cfg.model.eos_id, source.vocab_hash,
            source.tokenizer_name, where=f"the training data ({data})", reference="the --init-from model",
        )  # fmt: skip
    print(f"init-from {source.description}: its weights and model config; optimizer and schedule fresh")
    return cfg, source.build_model(cfg.model)


def resumed_checkpoint(cfg, resume: str | int) -> tuple[int, dict] | None:
    """(newest finished step, its recorded model config) when this command resumes the run (or the
    trainer will refuse its damaged checkpoints) rather than start it fresh; None for a fresh start or
    a `--resume N` of a step that was never saved. Decided as `plan_resume` decides, from which saves
    finished (their meta), without hashing the checkpoint that the trainer then verifies: `latest`
    starts fresh only where no save finished."""
    from mamba3lite.train.checkpoint import CheckpointManager, finished_save

    ckpt = CheckpointManager(cfg.training.checkpoint_dir)
    if resume == "none" or not ckpt.dir.is_dir():
        return None
    steps = [s for s in ckpt.list_steps() if finished_save(ckpt.dir, s)]
    if resume != "latest" and resume not in steps:
        return None  # the trainer refuses it; the source's config makes no difference
    for step in reversed([resume] if resume != "latest" else steps):
        try:
            model = ckpt.read_meta(step).get("config", {}).get("model")
        except CheckpointError:
            continue  # a damaged meta: an older step is what the trainer would fall back to
        if isinstance(model, dict):
            return step, model
    return None


def init_or_resume(args: argparse.Namespace, cfg):
    """(cfg, the model holding the init weights or None) for a run with `training.init_from`. A run
    that resumes from its own checkpoint takes the model config recorded there (with `--set model.*` on
    top) and leaves the source alone: the checkpoint holds the weights, so a resume neither reloads the
    source nor needs it to still exist."""
    resumed = resumed_checkpoint(cfg, parse_resume(args.resume))
    if resumed is None:
        return resolve_init_from(args, cfg)
    step, model = resumed
    cfg = cfg.replace("model", **model)
    cfg = cfg.with_overrides([o for o in args.overrides if o.strip().startswith("model.")])
    print(
        f"init-from {cfg.training.init_from}: not loaded; {cfg.training.checkpoint_dir} resumes from its "
        f"own checkpoints (newest: checkpoint step {step}), which hold the weights"
    )
    return cfg, None


def run(args: argparse.Namespace) -> int:
    resume = parse_resume(args.resume)
    cfg = build_config(args)
    init_model = None
    if cfg.training.init_from is not None:  # --init-from, or --set training.init_from=
        cfg, init_model = init_or_resume(args, cfg)
    if args.print_config:
        print(cfg.to_yaml(), end="")
        return 0
    check_run_dir(cfg.training.checkpoint_dir)  # before anything is written there
    _check_the_datas_tokenizer(cfg)
    if args.dry_run:
        from mamba3lite.train.checkpoint import CheckpointManager

        # A dry run is a fresh 2-step run: in a directory with checkpoints it would resume past step 2
        # and train nothing (or, forced fresh, mix its checkpoint into a real run's).
        steps = CheckpointManager(cfg.training.checkpoint_dir).list_steps()
        if steps:
            raise ConfigError(
                f"--dry-run trains a fresh 2-step run, but {cfg.training.checkpoint_dir} already holds "
                f"checkpoints (steps {steps[:5]}{'...' if len(steps) > 5 else ''}); point --checkpoint-dir "
                "at a new directory"
            )
        resume = "none"
    from mamba3lite.train import distributed as D
    from mamba3lite.train.stop import StopFlag

    info = D.init_distributed(cfg.training.device)
    # One stop flag for the whole command: a SIGTERM while the data and model are built, or while a
    # checkpoint is verified and restored, stops the run after its first step (with a checkpoint)
    # instead of killing the process; train() adds SIGINT for the loop. After the run, in the CLI's own
    # process, SIGTERM is ignored: the run is over and saved, and from here to the exit (slow, after
    # torch) a SIGTERM must not turn it into exit -15. An in-process caller gets its handler back.
    stop = StopFlag(announce=info.is_main)
    after = signal.SIG_IGN if getattr(args, "own_process", False) else None
    finished = False
    with stop.installed(signal.SIGTERM, on_exit=after):
        try:
            result = _train(cfg, resume, info, stop, init_model)
            if info.is_main:
                what = "stopped" if result.stopped else "done"
                tps = (
                    f", steady {result.steady_tokens_per_s:,.0f} tokens/s"
                    if result.steady_tokens_per_s
                    else ""
                )
                print(
                    f"{what}: step {result.step}, {result.tokens_seen:,} tokens{tps}; run directory "
                    f"{cfg.training.checkpoint_dir}",
                    flush=True,
                )
            finished = True
        finally:
            D.teardown(after_error=not finished)
    return 0


def _train(cfg, resume: str | int, info, stop, init_model=None):
    """Build the trainer and run it; errors a user can act on become TrainingError. `init_model`
    (--init-from) arrives holding the source's weights, or None where the run resumes from its own
    checkpoint (`init_or_resume`), so a re-run of the same command after a preemption continues the run."""
    from mamba3lite.train import distributed as D
    from mamba3lite.train.trainer import Pretrainer

    trainer = None
    try:
        trainer = Pretrainer(cfg, resume=resume, dist=info, model=init_model, stop=stop)
        return trainer.train()
    except (RuntimeError, MemoryError) as e:
        # e.g. rank 0 could not write a checkpoint: its error says why
        if isinstance(e, RuntimeError) and D.lost_a_peer(e, info):
            raise TrainingError(
                f"rank {info.rank} stops because another rank of this job stopped first; that rank's "
                "`error:` line says why (torchrun's summary, if it was killed)"
            ) from None
        advice = out_of_memory_advice(e, cfg, building=trainer is None)
        if advice is None:
            raise
        raise TrainingError(advice) from None
