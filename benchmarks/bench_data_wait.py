"""Data wait: the fraction of step time the training thread waits for its input, without and with the
background prefetcher (training.prefetch_batches), side by side in one run.

The real trainer trains a small Mamba-3 on a prepared dataset this script writes to a temp dir, once per
case: prefetch_batches 0 (each step's batches read on the training thread) and N (read ahead on the
prefetcher's thread). The input's cost is the dataset's gather plus, with --read-delay-ms, a sleep per
micro-batch standing in for slow storage (a network file system, a cold page cache). Printed per read
delay: the data-wait fraction and tokens/s of each case over the steady windows (the start-up window is
left out) and the ratio of the waits, off / on. Only ratios are worth quoting on a shared machine.

    python benchmarks/bench_data_wait.py [--steps 30] [--prefetch 2] [--read-delay-ms 0,20]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from mamba3lite.config import Config
from mamba3lite.data.shards import write_dataset
from mamba3lite.train.trainer import Pretrainer

VOCAB = 512
SEQ = 128
MODEL = dict(d_model=64, n_layers=2, d_intermediate=128, d_state=16, headdim=16, chunk_size=32)


def write_data(root: Path, n_tokens: int = 400_000) -> Path:
    tokens = (np.arange(n_tokens) * 7 + np.random.default_rng(0).integers(0, 5, n_tokens)) % (VOCAB - 1) + 1
    tokens[::100] = 0
    write_dataset(root, [("train", tokens, n_tokens // 100, 3 * n_tokens)], vocab_size=VOCAB, eos_id=0,
                  tokenizer={"name": "bench", "vocab_hash": "ab" * 32})  # fmt: skip
    return root


def data_wait(data: Path, run_dir: Path, *, prefetch: int, steps: int, read_delay_s: float) -> dict:
    """Train `steps` steps with `prefetch` batches read ahead; the steady windows' data-wait fraction
    (waited seconds over wall seconds) and tokens/s."""
    cfg = Config().replace("model", vocab_size=VOCAB, eos_id=0, **MODEL)
    cfg = cfg.replace(
        "training", max_seq_len=SEQ, micro_batch_size=8, gradient_accumulation_steps=2, max_steps=steps,
        warmup_steps=2, log_every=5, save_every=10**6, eval_every=0, dtype="fp32", device="cpu",
        checkpoint_dir=str(run_dir), keep_last_n=0, progress=False, prefetch_batches=prefetch,
    ).replace("data", dummy=False, train_data_path=str(data), val_data_path=None)  # fmt: skip
    trainer = Pretrainer(cfg, resume="none")
    gather = trainer.input.batch
    if read_delay_s:
        trainer.input.batch = lambda indices: (time.sleep(read_delay_s), gather(indices))[1]
    trainer.train()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    steady = [r for r in train if not r.get("warmup_window")] or train  # a short run: all it has
    seconds = sum(r["window_seconds"] for r in steady)
    waited = sum(r["data_wait"] * r["window_seconds"] for r in steady)
    tokens = sum(r["tokens_per_s"] * r["window_seconds"] for r in steady)
    return {"data_wait": waited / seconds, "tokens_per_s": tokens / seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps per case (>= 10)")
    ap.add_argument("--prefetch", type=int, default=2, help="prefetch_batches of the 'on' case")
    ap.add_argument("--read-delay-ms", default="0,20", help="comma-separated sleeps per micro-batch read")
    args = ap.parse_args()
    delays = [float(d) for d in args.read_delay_ms.split(",")]
    steps = max(args.steps, 10)  # two windows of 5: one start-up, at least one steady
    print(f"data wait over {steps} steps, micro-batch 8 x {SEQ} tokens x 2, prefetch {args.prefetch}")
    print("| read delay (ms) | wait, off | wait, on | off / on | tokens/s off | tokens/s on |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        data = write_data(Path(tmp) / "data")
        for delay in delays:
            out = {}
            for case, prefetch in (("off", 0), ("on", args.prefetch)):
                run = Path(tmp) / f"run-{delay}-{case}"
                out[case] = data_wait(data, run, prefetch=prefetch, steps=steps, read_delay_s=delay / 1000)
            off, on = out["off"], out["on"]
            ratio = off["data_wait"] / max(on["data_wait"], 1e-6)
            waits = f"{100 * off['data_wait']:.2f}% | {100 * on['data_wait']:.2f}% | {ratio:.1f}x"
            print(f"| {delay:g} | {waits} | {off['tokens_per_s']:,.0f} | {on['tokens_per_s']:,.0f} |")


if __name__ == "__main__":
    main()
