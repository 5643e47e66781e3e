"""`mamba3lite export`: a run's checkpoint -> the official mamba_ssm format, or a Hugging Face directory.

    mamba3lite export runs/tiny --out exported/tiny                  # mamba_ssm (default); or --step N
    # python: MambaLMHeadModel.from_pretrained("exported/tiny")
    mamba3lite export runs/tiny --format hf --out exported/tiny-hf   # transformers, trust_remote_code
    # python: AutoModelForCausalLM.from_pretrained("exported/tiny-hf", trust_remote_code=True)
    mamba3lite export runs/tiny --format hf --out exported/tiny-hf --push-to-hub me/tiny

mamba_ssm: config.json, pytorch_model.bin, model.safetensors, tokenizer.json, a README.md model card.
hf: config.json, the modeling and configuration files, model.safetensors (sharded above
--max-shard-size), generation_config.json, tokenizer.json, tokenizer_config.json, a README.md card.
"""

from __future__ import annotations

import argparse
import re

HELP = "write a run's checkpoint in the mamba_ssm format or as a Hugging Face (transformers) directory"
FORMATS = ("mamba_ssm", "hf")
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def shard_size(text: str) -> int:
    """'5GB', '500MB', '10KiB' or a byte count -> bytes (argparse type)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS or float(m.group(1)) * _UNITS[m.group(2).upper()] < 1:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB, 500MB, 1000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory of a training (or import) run")
    parser.add_argument(
        "--step", type=int, default=None, metavar="N", help="checkpoint step (default: newest verified)"
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="the directory to create (new or empty)")
    parser.add_argument(
        "--format",
        default="mamba_ssm",
        choices=FORMATS,
        help="mamba_ssm: the official Mamba-3 format (needs mamba_ssm's CUDA kernels to run); hf: a "
        "transformers directory (trust_remote_code, pure PyTorch) (default mamba_ssm)",
    )
    parser.add_argument(
        "--max-shard-size",
        type=shard_size,
        default="5GB",
        metavar="SIZE",
        help="hf: weights larger than this are split into shards with an index (default 5GB)",
    )
    parser.add_argument(
        "--push-to-hub",
        default=None,
        metavar="OWNER/NAME",
        help="then upload the directory to this Hugging Face model repository (needs huggingface_hub)",
    )
    parser.add_argument("--private", action="store_true", help="with --push-to-hub: create it private")


def run(args: argparse.Namespace) -> int:
    if args.format == "hf":
        from mamba3lite.interop.hf_export import export_hf

        result = export_hf(args.run_dir, args.out, step=args.step, max_shard_bytes=args.max_shard_size)
        written = ", ".join(result.files)
    else:
        from mamba3lite.interop.export import export_run

        result = export_run(args.run_dir, args.out, step=args.step)
        written = "config.json, pytorch_model.bin, model.safetensors, tokenizer.json, README.md"
    for note in result.notes:
        print(f"note: {note}")
    print(
        f"exported step {result.step} of {args.run_dir} ({result.n_params:,} parameters) to {result.out} "
        f"({args.format}): {written}"
    )
    if args.push_to_hub:
        from mamba3lite.interop.hub_push import push_to_hub

        print(f"uploaded to {push_to_hub(result.out, args.push_to_hub, private=args.private)}")
    return 0
