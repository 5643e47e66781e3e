"""Start-up: how long a command takes before it does its work, side by side with `import torch`.

    python benchmarks/startup.py [--repeat 7] [--run DIR] [--threads N]

Each row is a fresh process, timed from its start to its exit (wall-clock, and the CPU seconds of the
process, user + system), the median of --repeat rounds; the rounds alternate the commands, so a busy
spell of a shared machine falls on all of them alike. The commands:

    python -c "import torch"                               the floor: every command that computes pays it
    mamba3lite --help                                      no torch at all
    mamba3lite generate --max-new-tokens 1, GPT-2 run      a tiny model trained on GPT-2 tokens
    mamba3lite generate --max-new-tokens 1, own-BPE run    the same with a 4,096-id tokenizer.json of its
                                                           own, as the quickstart's runs have
    (--run DIR: also generate on that run)

The runs are made here (random weights: loading and one token do not depend on them). A warm-up round
runs first and is not counted; Python's bytecode caches are on, as for an installed package (a
PYTHONDONTWRITEBYTECODE of this shell is dropped for the commands). Targets (issue 41), on the
wall-clock: generate within 1.3x of `import torch`, --help under 0.5 s. The CPU column counts every
thread: after the model's first operations torch's second OpenMP thread spins idle for a while, CPU time
that a 2-core machine's other core absorbs without a later wall-clock. A shared machine slows every row
(the rounds alternate, so alike): quote the ratios, with the load average printed. There, torch's
two-thread operations also wait for a descheduled second thread at every parallel region, which a quiet
machine does not do: `--threads 1` (OMP_NUM_THREADS=1 for every command) shows the commands without it.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from mamba3lite.checkpoint import CheckpointManager, RunState
from mamba3lite.config import load_config
from mamba3lite.data_identity import vocab_hash_of
from mamba3lite.model import Mamba3Transformer
from mamba3lite.rundir import TOKENIZER_NAME
from mamba3lite.tokenizer import load_tokenizer
from mamba3lite.tokenizer_train import train_bpe

TARGET_GENERATE = 1.3  # x the time of `import torch`
TARGET_HELP_S = 0.5


def make_run(run: Path, tokenizer: str) -> Path:
    """A run directory with one verified checkpoint of the tiny preset's shape: "gpt2" tokens, or "bpe":
    a tokenizer.json of the quickstart's 4,096 ids fit to the package's Python files, copied into
    the run and recorded by that name (what `train` does for data with its own tokenizer)."""
    cfg = load_config("tiny")
    if tokenizer == "gpt2":
        tok = load_tokenizer("gpt2")
        data = {"tokenizer": "gpt2", "vocab_hash": tok.vocab_hash, "vocab_size": tok.vocab_size}
    else:
        # The package's own sources: every checkout has them (the repository root may also hold a .venv).
        src = Path(__file__).resolve().parents[1] / "src" / "mamba3lite"
        texts = [p.read_text(encoding="utf-8") for p in sorted(src.rglob("*.py"))]
        raw = train_bpe(texts, 4096)
        run.mkdir(parents=True)
        (run / TOKENIZER_NAME).write_bytes(raw)
        tok = load_tokenizer(str(run / TOKENIZER_NAME))
        data = {"tokenizer": TOKENIZER_NAME, "vocab_hash": vocab_hash_of(raw), "vocab_size": tok.vocab_size}
    data["eos_id"] = tok.eos_id
    cfg = cfg.replace("model", vocab_size=tok.vocab_size, eos_id=tok.eos_id)
    torch.manual_seed(0)
    model = Mamba3Transformer(cfg.model)
    state = RunState(step=1, config=cfg.to_dict(), tokens_seen=512, data=data)
    CheckpointManager(run).save(1, model, None, state)
    return run


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one process running `argv` to its end (exit 0 required)."""
    before = os.times()
    t = time.perf_counter()
    proc = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t
    after = os.times()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed (rc {proc.returncode}):\n{proc.stderr}")
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=7, help="rounds, alternating the commands (default 7)")
    ap.add_argument("--run", type=Path, default=None, help="also generate on this run directory")
    ap.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for every command")
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error(f"--repeat must be >= 1, got {args.repeat}")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    if args.threads is not None:
        if args.threads < 1:
            ap.error(f"--threads must be >= 1, got {args.threads}")
        env["OMP_NUM_THREADS"] = str(args.threads)
    py, cli = [sys.executable], [sys.executable, "-m", "mamba3lite"]
    with tempfile.TemporaryDirectory(prefix="startup-") as tmp:
        runs = {"GPT-2": make_run(Path(tmp) / "gpt2", "gpt2"), "own BPE": make_run(Path(tmp) / "bpe", "bpe")}
        if args.run is not None:
            runs[str(args.run)] = args.run
        generate = [*cli, "generate", "--max-new-tokens", "1", "--prompt", "x", "--checkpoint-dir"]
        cases = {
            'python -c "import torch"': [*py, "-c", "import torch"],
            "mamba3lite --help": [*cli, "--help"],
        }
        for name, run in runs.items():
            cases[f"generate --max-new-tokens 1 ({name})"] = [*generate, str(run)]
        for argv in cases.values():  # warm-up: bytecode caches written, files in the page cache
            timed(argv, env)
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
        for _ in range(args.repeat):
            for name, argv in cases.items():
                times[name].append(timed(argv, env))
    wall = {n: statistics.median(w for w, _ in ts) for n, ts in times.items()}
    cpu = {n: statistics.median(c for _, c in ts) for n, ts in times.items()}
    floor = 'python -c "import torch"'
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}")
    print(f"load average at the end: {os.getloadavg()[0]:.1f} (a shared machine: quote the ratios)")
    rounds = f"median of {args.repeat} alternating rounds after a warm-up; bytecode caches on; "
    rounds += f"OMP_NUM_THREADS={env.get('OMP_NUM_THREADS', 'unset')}"
    print(f"torch {torch.__version__}, python {platform.python_version()}; {rounds}")
    print()
    head = f"{'command':46} {'wall s':>7} {'cpu s':>7} {'wall/torch':>10} {'cpu/torch':>10}  target"
    print(head)
    print("-" * (len(head) + 12))
    for name in cases:
        rw, rc = wall[name] / wall[floor], cpu[name] / cpu[floor]
        if name == "mamba3lite --help":
            target = f"< {TARGET_HELP_S} s " + ("ok" if wall[name] < TARGET_HELP_S else "MISS")
        elif name.startswith("generate"):
            target = f"<= {TARGET_GENERATE}x " + ("ok" if rw <= TARGET_GENERATE else "MISS")
        else:
            target = ""
        print(f"{name:46} {wall[name]:7.2f} {cpu[name]:7.2f} {rw:9.2f}x {rc:9.2f}x  {target}")


if __name__ == "__main__":
    main()
