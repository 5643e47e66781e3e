"""`mamba3lite export`: a run's checkpoint -> a directory in the official mamba_ssm format.

    mamba3lite export runs/tiny --out exported/tiny          # newest verified checkpoint; or --step N
    # python: MambaLMHeadModel.from_pretrained("exported/tiny")

Writes config.json, pytorch_model.bin, model.safetensors, tokenizer.json and a README.md model card.
"""

from __future__ import annotations

import argparse

HELP = "write a run's checkpoint in the official mamba_ssm format (config.json, weights, tokenizer, card)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory of a training (or import) run")
    parser.add_argument(
        "--step", type=int, default=None, metavar="N", help="checkpoint step (default: newest verified)"
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="the directory to create (new or empty)")


def run(args: argparse.Namespace) -> int:
    from mamba3lite.interop.export import export_run

    result = export_run(args.run_dir, args.out, step=args.step)
    for note in result.notes:
        print(f"note: {note}")
    print(
        f"exported step {result.step} of {args.run_dir} ({result.n_params:,} parameters) to {result.out}: "
        "config.json, pytorch_model.bin, model.safetensors, tokenizer.json, README.md"
    )
    return 0
