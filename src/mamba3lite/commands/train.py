"""`mamba3lite train`: pretrain from a YAML config (flags -> config + `TrainOptions` -> the one training
entry, train/entry.py, which every command that trains goes through).

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
always as a fresh run in a directory without checkpoints, and prints the plan first. `--plan` prints
each rank's memory estimate for the run's strategy on `--nproc N` processes (default: torchrun's
WORLD_SIZE, else 1) without building anything (train/plan.py), then exits. SIGTERM / Ctrl-C: the
current step finishes, a checkpoint is written, exit code 0.
"""

from __future__ import annotations

import argparse
import os

from mamba3lite.commands.options import add_override_option
from mamba3lite.errors import ConfigError

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
    parser.add_argument(
        "--plan",
        action="store_true",
        help="print each rank's memory estimate (weights, gradients, optimizer state, activations) for the "
        "strategy and world size, and whether it fits the device; nothing is built; then exit",
    )
    parser.add_argument(
        "--nproc",
        type=int,
        metavar="N",
        help="processes the plan is for (default: torchrun's WORLD_SIZE, else 1)",
    )
    parser.add_argument(
        "--device-memory-gib",
        type=float,
        metavar="G",
        help="plan for a device of G GiB (default: the memory of the run's device on this machine)",
    )


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
    from mamba3lite.checkpoint.run_dir import RunDir
    from mamba3lite.config import resolve_preset
    from mamba3lite.rundir import CONFIG_NAME

    path = resolve_preset(config)
    run = RunDir(checkpoint_dir)
    record = run.path / CONFIG_NAME
    mine = record.exists() and path.resolve() == record.resolve()
    if mine and not run.has_resolved_config():  # the rule `RunDir.is_run` reads a run by
        raise ConfigError(
            f"--config {config} is the run's config.yaml, which `train` rewrites with the resolved "
            "config of every start: keep your config file outside the checkpoint directory"
        )


def train_options(args: argparse.Namespace):
    """The `TrainOptions` of these flags."""
    from mamba3lite.train.entry import TrainOptions

    return TrainOptions(
        resume=parse_resume(args.resume),
        dry_run=args.dry_run,
        model_overrides=tuple(o for o in args.overrides if o.strip().startswith("model.")),
        own_process=getattr(args, "own_process", False),
    )


def plan_world_size(args: argparse.Namespace) -> int:
    """--nproc, else torchrun's WORLD_SIZE, else 1."""
    if args.nproc is not None:
        if args.nproc < 1:
            raise ConfigError(f"--nproc must be >= 1, got {args.nproc}")
        return args.nproc
    text = os.environ.get("WORLD_SIZE", "1")
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"WORLD_SIZE must be a number >= 1, got {text!r}")
    return int(text)


def run(args: argparse.Namespace) -> int:
    from mamba3lite.train.entry import resolve_init, training_session
    from mamba3lite.train.plan import memory_plan

    opts = train_options(args)
    cfg = build_config(args)
    if args.print_config:
        print(resolve_init(cfg, opts)[0].to_yaml(), end="")
        return 0
    gib = args.device_memory_gib
    if gib is not None and not gib > 0:
        raise ConfigError(f"--device-memory-gib must be > 0, got {gib}")
    plan = {"device_bytes": None if gib is None else gib * 2**30}
    if args.plan:
        print(memory_plan(cfg, plan_world_size(args), **plan), flush=True)
        return 0
    if args.dry_run and cfg.training.init_from is None and os.environ.get("RANK", "0") == "0":
        print(memory_plan(cfg, plan_world_size(args), **plan), flush=True)
    # The one training entry (train/entry.py): every check, the distributed set-up, SIGTERM, the build.
    with training_session(cfg, opts) as trainer:
        result = trainer.train()
        if trainer.dist.is_main:
            what = "stopped" if result.stopped else "done"
            tps = f", steady {result.steady_tokens_per_s:,.0f} tokens/s" if result.steady_tokens_per_s else ""
            print(
                f"{what}: step {result.step}, {result.tokens_seen:,} tokens{tps}; run directory "
                f"{trainer.cfg.training.checkpoint_dir}",
                flush=True,
            )
    return 0
