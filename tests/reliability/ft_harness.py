"""Two-group fault-tolerant runs driven from outside, as a user launches them (tests and
benchmarks/bench_fault_tolerance.py): a lighthouse started here, each replica group its own `torchrun`
(`--max-restarts` restarts a killed worker), a SIGKILL at a step chosen by an event, and the oracle that
replays a run's recorded participation in one process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import chaos_harness as H
import torch
import yaml

from mamba3lite.checkpoint import CheckpointManager
from mamba3lite.config import Config
from mamba3lite.data import WindowSampler
from mamba3lite.model import Mamba3Transformer
from mamba3lite.train.faults import HOLD_ENV
from mamba3lite.train.optim import set_lr
from mamba3lite.train.trainer import Pretrainer

STEPS = 30
GLOBAL_WINDOWS = 8  # 2 groups x micro batch 2 x 2 micro-steps


def group_config(data: Path, work: Path, group: int, groups: int, lighthouse: str, **training) -> Path:
    """The chaos config as replica group `group` of `groups` (its own run directory `work/g{group}`)."""
    ft = {"enabled": True, "lighthouse": lighthouse, "replica_groups": groups, "replica_group_id": group,
          "timeout_s": 10, "connect_timeout_s": 5, **training.pop("fault_tolerance", {})}  # fmt: skip
    tc = {"max_steps": STEPS, "save_every": STEPS, "eval_every": 0, "gradient_accumulation_steps": None,
          "global_batch_size": GLOBAL_WINDOWS, "fault_tolerance": ft, **training}  # fmt: skip
    path = work / f"g{group}.yaml"
    path.write_text(yaml.safe_dump(H.config_dict(data, work / f"g{group}", **tc)), encoding="utf-8")
    return path


def start_group(
    config: Path, log: Path, *, hold: str | None = None, restarts: int = 1, ranks: int = 1
) -> subprocess.Popen:
    """`torchrun --standalone --nproc_per_node RANKS --max-restarts N -m mamba3lite train --config CONFIG`."""
    env = {**os.environ, **H.BASE_ENV}
    if hold:
        env[HOLD_ENV] = hold
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
    argv = [*torchrun, "--max-restarts", str(restarts), "-m", "mamba3lite", "train", "--config", str(config)]
    out = open(log, "w", encoding="utf-8")  # noqa: SIM115 (the child holds it; closed with the process)
    p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    p.log = log  # type: ignore[attr-defined]
    return p


def stop_group(torchrun: subprocess.Popen) -> None:
    """SIGKILL a group's torchrun and the workers it started; nothing if they have ended."""
    H.kill_tree(torchrun)


def worker_pids(torchrun: subprocess.Popen) -> list[int]:
    """The training processes torchrun's agent started (its children), in the order it started them."""
    return sorted(
        int(p) for p in Path(f"/proc/{torchrun.pid}/task/{torchrun.pid}/children").read_text().split()
    )


def kill_worker(torchrun: subprocess.Popen) -> float:
    """SIGKILL the group's last-started training process (its one process, or its highest rank); the time
    of the kill."""
    os.kill(worker_pids(torchrun)[-1], signal.SIGKILL)
    return time.time()


def rows(run_dir: Path, kind: str, event: str | None = None) -> list[dict]:
    """Live (not superseded) rows of one kind (and event name) of a run's metrics.jsonl."""
    return [r for r in H.metrics_rows(run_dir) if r.get("kind") == kind and not r.get("superseded")
            and (event is None or r.get("event") == event)]  # fmt: skip


def started_after(run_dir: Path, t: float) -> bool:
    return any(r["time"] > t for r in rows(run_dir, "event", "start"))


def participation_at(runs: list[list], step: int) -> list[int]:
    return next(g for first, last, g in runs if first <= step <= last)


def oracle_weights(config: Path, runs: list[list], steps: int = STEPS, ranks: int = 1) -> dict:
    """The weights one process reaches by replaying `runs` (the recorded participation): at each step
    the mean over the groups that took part of each group's gradient over its slot of the global batch
    (itself the mean over the group's `ranks` DDP processes of theirs), clipped, one optimizer step; the
    data position moves one global batch per step."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the groups run (H.BASE_ENV): Muon's matmuls round by the thread count
    try:
        return _replay(config, runs, steps, ranks)
    finally:
        torch.set_num_threads(threads)


def _replay(config: Path, runs: list[list], steps: int, ranks: int) -> dict:
    raw = yaml.safe_load(config.read_text())
    groups = raw["training"]["fault_tolerance"]["replica_groups"]
    raw["training"]["fault_tolerance"] = {}
    raw["training"]["checkpoint_dir"] = str(config.parent / "oracle")
    trainer = Pretrainer(Config.from_dict(raw), resume="none")
    tc, model, opt = trainer.tc, trainer.raw_model, trainer.optimizer
    world = groups * ranks  # sampler rank g * ranks + r: rank r of group g
    samplers = [WindowSampler(len(trainer.train_data), tc.global_windows, rank=i, world_size=world,
                              seed=tc.seed, shuffle=True) for i in range(world)]  # fmt: skip
    mb, accum = tc.micro_batch_size, tc.accumulation(world)
    params = [p for p in model.parameters() if p.requires_grad]
    for step in range(steps):
        set_lr(opt, trainer.schedule.lr(step))
        grads: dict[int, list[torch.Tensor]] = {}
        for i, sampler in enumerate(samplers):
            indices = sampler.next_batch()
            g = i // ranks
            if g not in participation_at(runs, step + 1):
                continue
            for j in range(accum):
                x, y = trainer.train_data.get_batch(indices[j * mb : (j + 1) * mb])
                (model(x, y) / accum).backward()
            # DDP inside the group: each rank's gradient / ranks, summed (a power of two: exact scaling)
            mine = [p.grad / ranks for p in params]
            grads[g] = mine if g not in grads else [a + b for a, b in zip(grads[g], mine, strict=True)]
            opt.zero_grad(set_to_none=True)
        mean = [sum(gs[k] for gs in grads.values()) / len(grads) for k in range(len(params))]
        for p, m in zip(params, mean, strict=True):
            p.grad = m
        torch.nn.utils.clip_grad_norm_(params, tc.grad_clip or float("inf"), foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
    trainer.prefetcher.close()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def checkpoint_weights(run_dir: Path, step: int, config: Path) -> dict:
    """A run's weights at `step` read in one process, whatever wrote them (three files or sharded DCP)."""
    raw = yaml.safe_load(config.read_text())
    model = Mamba3Transformer(Config.from_dict(raw).model)
    CheckpointManager(run_dir).load(step, model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
