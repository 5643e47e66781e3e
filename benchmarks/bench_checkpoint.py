"""Checkpoint save/load of a 440M preset's full training state, side by side in one run.

    python benchmarks/bench_checkpoint.py [--preset mamba3_440m] [--dir DIR] [--repeat 2]

Compared, on the same state (model weights + AdamW moments) and the same directory:
  ours   CheckpointManager.save: 3 files, each atomic (temp, fsync, rename, dir fsync), sha256 of both
         data files computed by reading each back while it is fsynced, tied embedding once; load =
         verify hashes + load weights + name-keyed optimizer state
  plain  torch.save({"model", "optim"}) to one file + fsync; load = torch.load(weights_only) + load
  raw    dd-like: the same number of bytes written sequentially in 64 MiB blocks + fsync; read back
The target (issue 5): ours' save bandwidth >= 0.7 of raw. Reads are served from the page cache
(dropping it would disturb other users of the machine), so load times measure deserialisation and
hashing, not the disk. The machine is shared and noisy: quote ratios, not seconds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from mamba3lite.checkpoint import CheckpointManager, RunState
from mamba3lite.config import load_config
from mamba3lite.model import Mamba3Transformer
from mamba3lite.train.optim import build_optimizer


def fake_adam_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """Fill AdamW's state as after a step (no forward/backward of a 440M model on CPU needed)."""
    g = torch.Generator().manual_seed(0)
    for group in opt.param_groups:
        for p in group["params"]:
            opt.state[p] = {
                "step": torch.tensor(1.0),
                "exp_avg": torch.randn(p.shape, generator=g) * 1e-3,
                "exp_avg_sq": torch.rand(p.shape, generator=g) * 1e-6,
            }


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_write(path: Path, n_bytes: int) -> float:
    block = os.urandom(1 << 20) * 64  # 64 MiB of incompressible bytes
    t = time.perf_counter()
    with open(path, "wb") as f:
        left = n_bytes
        while left > 0:
            n = min(left, len(block))
            f.write(memoryview(block)[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t


def raw_read(path: Path) -> float:
    buf = bytearray(64 << 20)
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="mamba3_440m")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    ap.add_argument("--repeat", type=int, default=2, help="best of N for each measurement")
    args = ap.parse_args()

    cfg = load_config(args.preset)
    torch.manual_seed(0)
    model = Mamba3Transformer(cfg.model)
    n_params = sum(p.numel() for p in model.parameters())
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
    fake_adam_state(model, opt)
    root = Path(tempfile.mkdtemp(prefix="bench_ckpt_", dir=args.dir))
    names = ("ours (3 atomic files + sha256)", "plain torch.save + fsync", "raw sequential write/read")
    times: dict[str, dict[str, list[float]]] = {n: {"save": [], "load": []} for n in names}
    sizes: dict[str, int] = {}
    try:
        # Rounds interleave the three methods, so that the machine's load drifts over all of them alike.
        for i in range(args.repeat):
            d = root / f"ours{i}"
            t = time.perf_counter()
            CheckpointManager(d).save(1, model, opt, RunState(step=1))
            times[names[0]]["save"].append(time.perf_counter() - t)
            sizes[names[0]] = sum(p.stat().st_size for p in d.iterdir() if p.is_file())
            t = time.perf_counter()
            CheckpointManager(d).load(1, model, opt)  # a fresh manager: verifies the hashes from disk
            times[names[0]]["load"].append(time.perf_counter() - t)
            shutil.rmtree(d)

            p = root / f"plain{i}.pt"
            t = time.perf_counter()
            torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, p)
            fsync_file(p)
            times[names[1]]["save"].append(time.perf_counter() - t)
            sizes[names[1]] = p.stat().st_size
            t = time.perf_counter()
            obj = torch.load(p, weights_only=True)
            model.load_state_dict(obj["model"])
            opt.load_state_dict(obj["optim"])
            times[names[1]]["load"].append(time.perf_counter() - t)
            del obj
            p.unlink()

            p = root / f"raw{i}.bin"
            times[names[2]]["save"].append(raw_write(p, sizes[names[0]]))
            times[names[2]]["load"].append(raw_read(p))
            sizes[names[2]] = sizes[names[0]]
            p.unlink()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results = {
        n: {"save": min(times[n]["save"]), "load": min(times[n]["load"]), "bytes": sizes[n]} for n in names
    }

    raw = results["raw sequential write/read"]
    raw_bw = raw["bytes"] / raw["save"]
    print(
        f"preset {args.preset}: {n_params / 1e6:.1f}M parameters, model + AdamW state; best of {args.repeat}"
    )
    print(f"{'method':34s} {'MB':>8s} {'save s':>8s} {'save MB/s':>10s} {'vs raw':>7s} {'load s':>8s}")
    for name, r in results.items():
        bw = r["bytes"] / r["save"]
        print(
            f"{name:34s} {r['bytes'] / 1e6:8.0f} {r['save']:8.2f} {bw / 1e6:10.0f} {bw / raw_bw:7.2f} "
            f"{r['load']:8.2f}"
        )
    ours = results["ours (3 atomic files + sha256)"]
    print(
        f"ours save bandwidth / raw = {ours['bytes'] / ours['save'] / raw_bw:.2f} (target >= 0.70); "
        f"ours bytes / plain bytes = {ours['bytes'] / results['plain torch.save + fsync']['bytes']:.3f}"
    )


if __name__ == "__main__":
    main()
