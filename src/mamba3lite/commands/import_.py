"""`mamba3lite import`: an official mamba_ssm Mamba-3 model, or an `export --format hf` directory
(recognised by its config.json's model_type "mamba3lite"), -> a run directory.

    mamba3lite import path/to/official-dir --out runs/mamba3-187m
    mamba3lite import exported/tiny-hf --out runs/tiny-again
    mamba3lite import hf:state-spaces/mamba3-siso-187m --out runs/mamba3-187m   # needs huggingface_hub
    mamba3lite generate --checkpoint-dir runs/mamba3-187m --prompt "The"

The run directory works with generate, eval, inspect and `train --init-from` like a trained run's.
"""

from __future__ import annotations

import argparse

HELP = "turn an official mamba_ssm Mamba-3 model or an HF export (a directory, hf:NAME) into a run directory"
# As mamba3lite.model.config.A_ACTIVATIONS and interop.import_.DEFAULT_A_ACTIVATION (not imported here:
# they would bring torch into `mamba3lite --help`; a test checks they agree).
A_ACTIVATIONS = ("heavy_tail", "softplus")
DEFAULT_A_ACTIVATION = "heavy_tail"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "source", metavar="SRC", help="official model directory (config.json + weights) or hf:NAME"
    )
    parser.add_argument(
        "--out", required=True, metavar="RUN_DIR", help="the run directory to create (new or empty)"
    )
    parser.add_argument(
        "--a-activation",
        default=DEFAULT_A_ACTIVATION,
        choices=A_ACTIVATIONS,
        help="the A activation the model was trained with, which the official format does not record "
        f"(default {DEFAULT_A_ACTIVATION}: the official code's current one; softplus: before mid-2026)",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH|gpt2",
        help="the model's tokenizer.json (default: SRC/tokenizer.json), or gpt2",
    )


def run(args: argparse.Namespace) -> int:
    from mamba3lite.interop.hf_import import import_hf, is_hf_export, local_root
    from mamba3lite.interop.import_ import import_official

    if is_hf_export(local_root(args.source)):
        result = import_hf(args.source, args.out, tokenizer=args.tokenizer)
    else:
        result = import_official(
            args.source, args.out, a_activation=args.a_activation, tokenizer=args.tokenizer
        )
    c = result.config
    kind = f"MIMO rank {c.mimo_rank}" if c.is_mimo else "SISO"
    print(
        f"imported {args.source}: {c.n_layers} layers, d_model {c.d_model}, {kind}, vocab {c.vocab_size:,}, "
        f"tokenizer {result.tokenizer}"
    )
    for note in result.notes:
        print(f"note: {note}")
    print(f"run directory {result.out} (step 0); try: mamba3lite generate --checkpoint-dir {result.out}")
    return 0
