"""How long a sharded checkpoint save stalls training: synchronous vs async (torch.distributed.checkpoint).

    python benchmarks/bench_checkpoint_stall.py [--preset mamba3_180m] [--dir DIR] [--repeat 3]
                                                [--train-seconds 2]

The state saved is a preset's model and AdamW moments, through `CheckpointManager.save(..., sharded=True)`
in one process (the same code path each rank of an FSDP2 run takes for its own shards):
  sync   the caller is blocked until every shard file is written and fsynced, hashed, and the meta
         (the commit marker) written
  async  the caller is blocked while the state is copied to CPU memory (DCP's staging); the files, the
         hashes and the meta follow in the background. Then `--train-seconds` of "training" (the
         caller sleeps: on a shared CPU, busy work would slow the writer it is meant to overlap) and
         `finish_pending()`, which blocks only if the background save is not done yet
Blocked time = time in `save` + time in `finish_pending`. Printed: both, and the ratio async / sync
(target: <= 0.25). The machine is shared and noisy: quote ratios, not seconds.

`measure_stall(model, optimizer, directory, async_save=..., train_seconds=...)` is the one measurement,
callable from other benchmarks.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from mamba3lite.checkpoint import CheckpointManager, RunState
from mamba3lite.config import load_config
from mamba3lite.model import Mamba3Transformer
from mamba3lite.train.optim import build_optimizer


@dataclass
class Stall:
    """Seconds the caller was blocked in one save: in `save`, and in `finish_pending` after training."""

    in_save: float
    in_finish: float

    @property
    def blocked(self) -> float:
        return self.in_save + self.in_finish


def measure_stall(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    directory: Path,
    *,
    async_save: bool,
    train_seconds: float = 0.0,
    step: int = 1,
) -> Stall:
    """One sharded save of `model` and `optimizer` into `directory` (emptied first): how long the caller
    is blocked, with `train_seconds` of training between the save call and `finish_pending`."""
    shutil.rmtree(directory, ignore_errors=True)
    ckpt = CheckpointManager(directory)
    t = time.perf_counter()
    ckpt.save(step, model, optimizer, RunState(step=step), sharded=True, async_save=async_save)
    in_save = time.perf_counter() - t
    time.sleep(train_seconds)
    t = time.perf_counter()
    ckpt.finish_pending()
    in_finish = time.perf_counter() - t
    assert ckpt.status(step).verified, ckpt.status(step).problems
    return Stall(in_save, in_finish)


def fill_adam_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """AdamW's state as after a step, without a forward/backward of the model."""
    g = torch.Generator().manual_seed(0)
    for group in optimizer.param_groups:
        for p in group["params"]:
            optimizer.state[p] = {
                "step": torch.tensor(1.0),
                "exp_avg": torch.randn(p.shape, generator=g) * 1e-3,
                "exp_avg_sq": torch.rand(p.shape, generator=g) * 1e-6,
            }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="mamba3_180m")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    ap.add_argument("--repeat", type=int, default=3, help="best of N for each mode")
    ap.add_argument("--train-seconds", type=float, default=2.0, help="training between save and finish")
    args = ap.parse_args()

    cfg = load_config(args.preset)
    model = Mamba3Transformer(cfg.model)
    optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
    fill_adam_state(model, optimizer)
    n_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="stall-"))
    try:
        best = {}
        for mode in ("sync", "async"):
            kw = {"async_save": mode == "async", "train_seconds": args.train_seconds}
            runs = [measure_stall(model, optimizer, root / mode, **kw) for _ in range(args.repeat)]
            best[mode] = min(runs, key=lambda s: s.blocked)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    print(f"preset {args.preset}: {n_bytes / 2**20:.0f} MiB of state, best of {args.repeat}")
    print(f"{'mode':<8}{'in save (s)':>14}{'in finish (s)':>16}{'blocked (s)':>14}")
    for mode, s in best.items():
        print(f"{mode:<8}{s.in_save:>14.3f}{s.in_finish:>16.3f}{s.blocked:>14.3f}")
    print(f"async stall / sync stall = {best['async'].blocked / best['sync'].blocked:.3f} (target <= 0.25)")


if __name__ == "__main__":
    main()
