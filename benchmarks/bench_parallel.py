"""What the parallelism seam (src/mamba3lite/train/parallel/) buys, on CPU processes over gloo.

    python benchmarks/bench_parallel.py [--steps 8] [--nproc 2] [--mem-nproc 4] [--d-model 64] [--layers 4]

Sections (each a function in SECTIONS, printing one markdown table; add yours there):

    step time   one optimizer step at `--nproc` processes: the former hand-written reduction (every
                micro-step under no_sync, a host read of the loss and an all-reduce of its finiteness per
                micro-step, then a bucketed all-reduce of all gradients after the backward: kept HERE
                ONLY, for comparison) vs DDP's reducer through the seam (overlapped with the last
                backward, one read per step) vs FSDP2 through the seam
    memory      per-rank bytes of parameters + gradients + optimizer state (AdamW), summed from the
                tensors themselves (a DTensor counts its local shard) at `--mem-nproc` processes: ddp
                vs fsdp (target: fsdp <= 0.3x ddp at 4 processes)

Times are medians over the steps after the first two, the slowest rank's; they are this machine's, not a
property of the code. On a 2-core host shared with other work, the overlap DDP gains on a GPU mostly
shows as the missing per-micro-step syncs.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from mamba3lite.model import Mamba3Transformer
from mamba3lite.model.config import ModelConfig
from mamba3lite.train.optim import build_optimizer
from mamba3lite.train.parallel import DistInfo, Layout, Parallelism

MODES = ("hand_reduce", "ddp", "fsdp")


# ------------------------------------------------------------------ the former approach (reference)
def hand_all_reduce_grads(params: list[torch.nn.Parameter], world_size: int) -> None:
    """The reduction the trainer used before the seam: gradients averaged in place, in flat buckets of
    ~32 MB, after the whole accumulation."""
    grads = [p.grad for p in params if p.grad is not None]
    bucket: list[torch.Tensor] = []
    size, limit = 0, 32 * 2**20

    def flush() -> None:
        nonlocal bucket, size
        if not bucket:
            return
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat /= world_size
        offset = 0
        for g in bucket:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        bucket, size = [], 0

    for g in grads:
        if bucket and (g.dtype != bucket[0].dtype or size + g.numel() * g.element_size() > limit):
            flush()
        bucket.append(g)
        size += g.numel() * g.element_size()
    flush()


def hand_step(model, ddp, params, optimizer, batches, world_size: int) -> float:
    loss_sum = 0.0
    for x, y in batches:
        with ddp.no_sync():
            loss = ddp(x, y)
            ok = torch.isfinite(loss.detach()).to(torch.float32).reshape(1)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            if bool(ok.item() > 0):  # a host read per micro-step
                (loss / len(batches)).backward()
                loss_sum += float(loss.detach())  # and another
    hand_all_reduce_grads(params, world_size)
    norm = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


# ----------------------------------------------------------------------------- the seam's steps
def seam_step(par: Parallelism, model, params, optimizer, batches) -> float:
    tally, accum = par.tally(), len(batches)
    for i, (x, y) in enumerate(batches):
        with par.micro_step(last=i == accum - 1):
            (tally.admit(model(x, y)) / accum).backward()
    norm = par.reduce_and_clip(params, tally, 1.0, accum)
    outcome = tally.settle(norm, stop=False, damaged=False)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return outcome.grad_norm


def model_config(args) -> ModelConfig:
    return ModelConfig(
        vocab_size=512, d_model=args.d_model, n_layers=args.layers, d_intermediate=2 * args.d_model,
        d_state=16, headdim=16, chunk_size=16, eos_id=0,
    )  # fmt: skip


def local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def state_bytes(model: torch.nn.Module, optimizer) -> dict[str, int]:
    params = list(model.parameters())
    opt_tensors = [
        v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0
    ]
    return {
        "params": local_bytes(params),
        "grads": local_bytes(p.grad for p in params if p.grad is not None),
        "optimizer": local_bytes(opt_tensors),
    }


def worker(rank: int, world: int, port: int, mode: str, args, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        raw = Mamba3Transformer(model_config(args))
        raw.set_scan_impl("chunked", torch.device("cpu"))
        info = DistInfo(rank=rank, world_size=world)
        layout = Layout("ddp", dp_replicate=world) if mode != "fsdp" else Layout("fsdp", dp_shard=world)
        par = Parallelism(layout, info)
        model = par.wrap(raw)
        params = [p for p in raw.parameters() if p.requires_grad]
        optimizer = build_optimizer(raw, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
        gen = torch.Generator().manual_seed(rank)
        batches = [
            tuple(torch.randint(0, 512, (args.micro, args.seq_len), generator=gen) for _ in range(2))
            for _ in range(args.accum)
        ]
        times = []
        for _ in range(args.steps):
            dist.barrier()
            t0 = time.perf_counter()
            if mode == "hand_reduce":
                hand_step(raw, model, params, optimizer, batches, world)
            else:
                seam_step(par, model, params, optimizer, batches)
            times.append(time.perf_counter() - t0)
        # one more accumulation without the step, so the gradients exist for the memory count
        for i, (x, y) in enumerate(batches):
            with par.micro_step(last=i == len(batches) - 1):
                model(x, y).backward()
        sizes = state_bytes(raw, optimizer)
        steady = times[2:] or times
        row = [statistics.median(steady), sizes["params"], sizes["grads"], sizes["optimizer"]]
        t = torch.tensor(row, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's time; the largest rank's bytes
        if rank == 0:
            Path(out_dir, f"{mode}_{world}.txt").write_text(" ".join(str(v) for v in t.tolist()))
    finally:
        dist.barrier()
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The rows measured so far in this run, {(mode, processes): row}: see `measure`.
_MEASURED: dict[tuple[str, int], list[float]] = {}


def measure(mode: str, world: int, args) -> list[float]:
    """[median step s, parameter bytes, gradient bytes, optimizer bytes] of `mode` at `world` processes
    (the slowest rank's time, the largest rank's bytes). Each (mode, world) is spawned once per run: a
    row holds both the time and the bytes, so with --mem-nproc equal to --nproc the memory section
    reads the step-time section's ddp and fsdp runs (at the defaults, 2 and 4, nothing is shared)."""
    if (mode, world) not in _MEASURED:
        with tempfile.TemporaryDirectory() as out:
            mp.spawn(worker, args=(world, free_port(), mode, args, out), nprocs=world, join=True)
            row = [float(v) for v in Path(out, f"{mode}_{world}.txt").read_text().split()]
        _MEASURED[(mode, world)] = row
    return _MEASURED[(mode, world)]


# ----------------------------------------------------------------------------------- sections
def step_time_section(args) -> None:
    rows = {mode: measure(mode, args.nproc, args) for mode in MODES}
    base = rows["hand_reduce"][0]
    print(f"\n### Step time, {args.nproc} processes (gloo, CPU), accumulation {args.accum}\n")
    print("| reduction | ms / step | vs hand-written |")
    print("|---|---|---|")
    for mode in MODES:
        ms = rows[mode][0] * 1e3
        print(f"| {mode} | {ms:.1f} | {rows[mode][0] / base:.2f}x |")


def memory_section(args) -> None:
    rows = {mode: measure(mode, args.mem_nproc, args) for mode in ("ddp", "fsdp")}
    print(f"\n### Per-rank training state, {args.mem_nproc} processes (bytes from the tensors)\n")
    print("| | ddp | fsdp | fsdp / ddp |")
    print("|---|---|---|---|")
    names = ("params", "grads", "optimizer")
    for i, name in enumerate(names, start=1):
        d, f = rows["ddp"][i], rows["fsdp"][i]
        print(f"| {name} | {d / 2**20:.2f} MiB | {f / 2**20:.2f} MiB | {f / d:.2f}x |")
    d_total, f_total = sum(rows["ddp"][1:]), sum(rows["fsdp"][1:])
    print(f"| total | {d_total / 2**20:.2f} MiB | {f_total / 2**20:.2f} MiB | {f_total / d_total:.2f}x |")


# One entry per section, in print order: others add theirs (e.g. a checkpoint save stall, the data
# loader's wait) as functions of `args` here.
SECTIONS = {"step time": step_time_section, "memory": memory_section}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--mem-nproc", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--accum", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"of {', '.join(SECTIONS)}")
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}; model d_model {args.d_model}, {args.layers} layers, vocab 512")
    for name in args.sections.split(","):
        SECTIONS[name.strip()](args)


if __name__ == "__main__":
    main()
