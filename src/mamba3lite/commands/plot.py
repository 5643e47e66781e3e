"""`mamba3lite plot RUN_DIR [-o FILE.png]`."""

from __future__ import annotations

import argparse

HELP = "plot metrics.jsonl of a run directory to a PNG"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run (checkpoint) directory holding metrics.jsonl")
    p.add_argument(
        "-o",
        "--output",
        metavar="FILE.png",
        default=None,
        help="where to write the PNG (default: RUN_DIR/metrics.png)",
    )


def run(args: argparse.Namespace) -> int:
    from mamba3lite.report.plot import plot_run

    out = plot_run(args.run_dir, args.output)
    print(f"wrote {out}")
    return 0
