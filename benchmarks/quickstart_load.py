"""Does the quickstart keep its minutes when the machine is busy? A quiet quickstart and one with CPU-bound
processes running during its first seconds, side by side in one run.

    python benchmarks/quickstart_load.py [--minutes 5] [--load-seconds 30] [--load-procs 2] [--out DIR]
                                         [-- QUICKSTART-ARGS...]

The dataset is prepared once (a short quickstart in OUT/prepare), and both runs reuse a copy of it, so
neither pays for preparing it and both have the same minutes for the recipe, the calibration and the
training. Then, one after the other (never at once: they would share the cores):

    quiet    `mamba3lite quickstart --minutes M` in OUT/quiet
    loaded   the same in OUT/loaded, with --load-procs processes spinning on the CPU (`while True: pass`)
             from its start for --load-seconds seconds

The table gives, per run, the steps, the minutes trained and their share of the budget, whether the
schedule ended at the deadline, and the final bits per byte on the whole val split; then loaded / quiet
bits per byte. The target (issue 41): with two processes for the first 30 seconds of a 5-minute
quickstart, within 3% of the quiet run's bits per byte. Arguments after `--` go to both quickstarts
(e.g. `--max-docs 12 --vocab 300`). The machine is shared: quote the ratio, and say what else ran.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

PREPARE_MINUTES = 0.05  # the preparing run only needs its dataset


def quickstart(workdir: Path, minutes: float, extra: list[str], log: Path) -> str:
    """One `mamba3lite quickstart` in `workdir`; its output (also written to `log`)."""
    cmd = [sys.executable, "-m", "mamba3lite", "quickstart", "--minutes", str(minutes), "--workdir",
           str(workdir), *extra]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        sys.exit(f"error: the quickstart in {workdir} failed (exit {proc.returncode}): {last}; see {log}")
    return proc.stdout


@contextlib.contextmanager
def cpu_load(procs: int, seconds: float) -> Iterator[None]:
    """`procs` processes spinning on the CPU from now for `seconds` (ended early when the block ends)."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(procs)]

    def end() -> None:
        for p in spinners:
            if p.poll() is None:
                p.kill()
                p.wait()

    timer = threading.Timer(seconds, end)
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        end()


def numbers(out: str) -> dict:
    """The summary's numbers of one quickstart's output."""

    def find(pattern: str) -> re.Match:
        m = re.search(pattern, out, re.M)
        if m is None:
            sys.exit(f"error: no {pattern!r} in the quickstart's output")
        return m

    after = find(r"^after     step (\d+): val loss [\d.]+, ([\d.]+) bits/byte")
    trained = find(r"^training      ([\d.]+) min, (\d+)% of the ([\d.]+)-minute budget")
    schedule = find(r"^schedule      (.*)$").group(1)
    return {
        "steps": int(after.group(1)), "bpb": float(after.group(2)), "trained_min": float(trained.group(1)),
        "share": int(trained.group(2)) / 100,
        "schedule": "ended at the deadline" if schedule.startswith("done at") else schedule,
    }  # fmt: skip


def table(rows: dict[str, dict], load: str) -> str:
    lines = [
        "| run | load | steps | trained | budget share | schedule | bits/byte |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        what = load if name == "loaded" else "none"
        lines.append(
            f"| {name} | {what} | {r['steps']:,} | {r['trained_min']:.2f} min | {r['share']:.0%} | "
            f"{r['schedule']} | {r['bpb']:.3f} |"
        )
    q, ld = rows["quiet"]["bpb"], rows["loaded"]["bpb"]
    lines += ["", f"loaded / quiet bits/byte: {ld / q:.3f}x   (target: at most 1.03x)"]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=5.0, help="each quickstart's --minutes (default 5)")
    p.add_argument("--load-seconds", type=float, default=30.0, help="how long the load runs (default 30)")
    p.add_argument("--load-procs", type=int, default=2, help="CPU-bound processes of the load (default 2)")
    p.add_argument("--out", type=Path, default=Path("quickstart-load"), help="work directories and logs")
    p.add_argument("extra", nargs="*", help="after --: arguments for both quickstarts")
    args = p.parse_args()
    if not 0 < args.minutes <= 600 or args.load_seconds < 0 or args.load_procs < 1:
        sys.exit("error: --minutes must be in (0, 600], --load-seconds >= 0 and --load-procs >= 1")
    if args.out.exists() and any(args.out.iterdir()):
        sys.exit(f"error: --out {args.out} is not empty; choose a new directory (each run starts fresh)")
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"preparing the dataset once ({args.out / 'prepare'})", flush=True)
    quickstart(args.out / "prepare", PREPARE_MINUTES, args.extra, args.out / "prepare.log")
    rows = {}
    for name in ("quiet", "loaded"):
        work = args.out / name
        work.mkdir()
        shutil.copytree(args.out / "prepare" / "data", work / "data")  # reused: it verifies
        procs = args.load_procs if name == "loaded" else 0
        during = f", {procs} CPU-bound processes for its first {args.load_seconds:g} s" if procs else ""
        print(f"{name}: a {args.minutes:g}-minute quickstart{during}", flush=True)
        t0 = time.monotonic()
        with cpu_load(procs, args.load_seconds) if procs else contextlib.nullcontext():
            out = quickstart(work, args.minutes, args.extra, args.out / f"{name}.log")
        rows[name] = {**numbers(out), "wall_min": (time.monotonic() - t0) / 60}
    load = f"{args.load_procs} procs x {args.load_seconds:g} s"
    print()
    print(table(rows, load))


if __name__ == "__main__":
    main()
