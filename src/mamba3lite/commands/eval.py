"""`mamba3lite eval`: loss, perplexity and bits per byte of a checkpoint on a dataset.

    mamba3lite eval --checkpoint-dir mamba3lite-quickstart/run --data-path mamba3lite-quickstart/data/stdlib
    mamba3lite eval --checkpoint-dir runs/x --step 4000 --data-path data/other --max-batches 50 --json

Evaluates the dataset's val split when it has one (else train; `--split` chooses) in windows of the
run's max_seq_len, batches of its micro_batch_size, in its compute dtype: the numbers match the
trainer's validation rows for the same windows. Refuses a dataset made with another tokenizer.
`--json` prints one JSON object (and nothing else) on stdout.

    mamba3lite eval --checkpoint-dir RUN --tasks piqa,arc_easy,lambada --limit 200 [--num-fewshot K]

With `--tasks` it scores downstream benchmarks instead, through lm-evaluation-harness (the `eval` extra),
offline over the local copies of the standard tasks (`mamba3lite.downstream`): a table per task (metric,
value, stderr, items), or with `--json` one object whose "tasks" maps each task to its metrics and "n".
"""

from __future__ import annotations

import argparse
import json
import sys

from mamba3lite.commands.options import add_checkpoint_options
from mamba3lite.config import TOKEN_DTYPES

HELP = "loss, perplexity and bits per byte on a dataset, or benchmark accuracy (--tasks)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_checkpoint_options(parser)
    parser.add_argument(
        "--data-path",
        default=None,
        metavar="P",
        help="a prepared dataset directory (or a seed-format token file); required without --tasks",
    )
    parser.add_argument(
        "--tasks",
        default=None,
        metavar="T1,T2",
        help="benchmarks through lm-evaluation-harness instead, e.g. "
        "piqa,arc_easy,arc_challenge,hellaswag,winogrande,openbookqa,lambada (offline)",
    )
    parser.add_argument(
        "--limit", type=int, default=None, metavar="N", help="with --tasks: the first N items of each task"
    )
    parser.add_argument(
        "--num-fewshot", type=int, default=None, metavar="K", help="with --tasks: K examples in each prompt"
    )
    parser.add_argument(
        "--no-state-reuse",
        action="store_true",
        help="with --tasks: score every choice from scratch (lm-eval's standard path; same numbers, slower)",
    )
    parser.add_argument(
        "--split", choices=("train", "val"), default=None, help="which split (default: val when present)"
    )
    parser.add_argument(
        "--max-batches",
        type=int,
        default=None,
        metavar="N",
        help="at most N batches, spread evenly over the split (default: all windows)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        metavar="B",
        help="windows per batch; with --tasks, rows per forward pass (default: the run's micro_batch_size)",
    )
    parser.add_argument(
        "--token-dtype",
        choices=TOKEN_DTYPES,
        default=None,
        help="dtype of raw token files without a manifest (default: the run's data.token_dtype)",
    )
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")


def run(args: argparse.Namespace) -> int:
    from mamba3lite.errors import ConfigError
    from mamba3lite.evaluate import evaluate_model
    from mamba3lite.pretrained import load_pretrained, resolve_device

    if args.tasks is not None:
        if args.data_path is not None:
            raise ConfigError("--tasks and --data-path are two evaluations; pass one of them")
        return _run_tasks(args)
    if args.data_path is None:
        raise ConfigError("eval needs --data-path P (loss on a dataset) or --tasks T1,T2 (benchmarks)")
    task_only = {
        "--limit": args.limit,
        "--num-fewshot": args.num_fewshot,
        "--no-state-reuse": args.no_state_reuse,
    }
    for flag, value in task_only.items():
        if value is not None and value is not False:  # (`0 in (None, False)` is true: not `in`)
            raise ConfigError(f"{flag} applies to --tasks only")
    loaded = load_pretrained(args.checkpoint_dir, args.step, device=resolve_device(args.device))
    for note in loaded.notes:
        print(f"note: {note}", file=sys.stderr)
    tc = loaded.config.training
    result = evaluate_model(
        loaded.model,
        args.data_path,
        max_seq_len=tc.max_seq_len,
        batch_size=tc.micro_batch_size if args.batch_size is None else args.batch_size,
        max_batches=args.max_batches,
        split=args.split,
        dtype=tc.dtype,
        vocab_hash=loaded.vocab_hash,
        tokenizer_name=loaded.tokenizer_name,
        token_dtype=args.token_dtype or loaded.config.data.token_dtype,
    )
    if args.json:
        out = {"checkpoint_dir": str(loaded.run_dir), "step": loaded.step, **result.to_dict()}
        print(json.dumps(out))
        return 0
    bpb = f"{result.bits_per_byte:.4f}" if result.bits_per_byte is not None else "n/a (no byte counts)"
    print(
        f"checkpoint  {loaded.run_dir} step {loaded.step} ({loaded.tokens_seen:,} tokens seen)\n"
        f"data        {result.data_path} [{result.split}], "
        f"{result.windows:,} windows of {result.max_seq_len} tokens\n"
        f"loss        {result.loss:.4f} nats/token\n"
        f"perplexity  {result.perplexity:,.2f}\n"
        f"bits/byte   {bpb}\n"
        f"tokens      {result.tokens:,}"
    )
    return 0


def _run_tasks(args: argparse.Namespace) -> int:
    """`eval --tasks`: lm-eval's metrics of the checkpoint on each task, as a table or one JSON object."""
    from mamba3lite.downstream.tasks import LOCAL_TASKS, parse_tasks, require_lm_eval
    from mamba3lite.errors import ConfigError

    names = parse_tasks(args.tasks)
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit must be >= 1 (items per task), got {args.limit}")
    if args.batch_size is not None and args.batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {args.batch_size}")
    require_lm_eval()  # before the checkpoint is loaded: a missing extra is the first thing to say
    from mamba3lite.downstream.harness import Mamba3LiteLM, run_tasks
    from mamba3lite.downstream.tasks import task_configs

    task_configs(names)  # unknown names and missing data, before the model is loaded
    lm = Mamba3LiteLM.from_run(
        args.checkpoint_dir,
        step=args.step,
        device=args.device,
        batch_size=args.batch_size,
        state_reuse=not args.no_state_reuse,
    )
    for note in lm.loaded.notes:
        print(f"note: {note}", file=sys.stderr)
    results = run_tasks(lm, names, limit=args.limit, num_fewshot=args.num_fewshot)
    step = lm.loaded.step
    # The split each task was scored on: the local copies' (see mamba3lite.downstream.tasks), else lm-eval's.
    splits = {n: LOCAL_TASKS[n].split if n in LOCAL_TASKS else "lm-eval's default" for n in names}
    if args.json:
        out = {"checkpoint_dir": str(lm.loaded.run_dir), "step": step, "limit": args.limit,
               "num_fewshot": args.num_fewshot or 0, "splits": splits, "tasks": results}  # fmt: skip
        print(json.dumps(out))
        return 0
    print(f"checkpoint  {lm.loaded.run_dir} step {step} ({lm.loaded.tokens_seen:,} tokens seen)")
    for name, metrics in results.items():
        print(f"\n{name} ({splits[name]} split, {metrics['n']:,} items, {args.num_fewshot or 0}-shot)")
        print(f"  {'metric':<12} {'value':>12} {'stderr':>10} {'items':>7}")
        for key, value in metrics.items():
            if key == "n" or key.endswith("_stderr"):
                continue
            err = metrics.get(f"{key}_stderr")
            print(f"  {key:<12} {_num(value):>12} {_num(err):>10} {metrics['n']:>7,}")
    return 0


def _num(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:.4f}" if abs(value) < 1e4 else f"{value:.4g}"
