"""Context parallelism (model/context_parallel.py) at one long window: what each rank keeps, how long a
step takes, and what the ranks exchange, for C = 1, 2, 4 gloo processes on the CPU.

    PYTHONPATH=src python benchmarks/bench_context_parallel.py [--seq-len 8192] [--cp 1 2 4]
        [--models mamba3 hybrid]

Models (`--models`): mamba3, the small pure shape below; hybrid, the same width with four layers, the last
one attention (one in four; 4 heads of 32, rotary on half of each head), whose attention layer
all-gathers keys and values over the group (model/context_parallel_attention.py) while its Mamba-3
layers pass the state. Each model's ratios are to its own C = 1.

Per model and C, measured on every rank (the table shows the largest):
  activation MiB    the distinct storages autograd saves for the backward of one training forward (the
                    loss included), counted with saved_tensors_hooks as model/memory.py does, less the
                    parameters' own storages; the ratio to C = 1 is the saving (targets: ≤ 0.6 at C = 2,
                    ≤ 0.35 at C = 4)
  step s            forward + backward of one piece (median of --steps); on a shared CPU the C processes
                    compete for cores, so this is an upper bound on what separate devices would take
  exch KiB/layer    bytes one rank moves per layer per step (averaged over a hybrid's kinds), counted
                    from the collectives it calls with the ring algorithms' volumes (all-gather
                    (C − 1)·in, all-reduce 2(C − 1)/C·in), forward and backward
  ring-attn KiB     what ring attention in a Transformer of the same width would move per layer per step
                    at the same length and dtype: each rank passes its K and V blocks (2·T/C·D values) to
                    the C − 1 others in the forward, and again with their gradients in the backward
                    (3·(C − 1)·2·(T/C)·D values)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mamba3lite.model.config import ModelConfig
from mamba3lite.model.context_parallel import cut_window
from mamba3lite.model.transformer import Mamba3Transformer

SHAPE = dict(
    vocab_size=256,
    d_model=128,
    n_layers=2,
    d_intermediate=256,
    d_state=32,
    headdim=32,
    chunk_size=64,
    eos_id=0,
)
MODELS = {
    "mamba3": SHAPE,
    "hybrid": {
        **SHAPE,
        "n_layers": 4,
        "attn_layer_idx": (3,),
        "attn_cfg": {"num_heads": 4, "rotary_emb_dim": 16},
    },
}


def activation_bytes(model: Mamba3Transformer, x_BT: torch.Tensor, y_BT: torch.Tensor) -> int:
    """Bytes of the distinct non-parameter storages saved for the backward of model(x, y)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            storages[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x_BT, y_BT)
    loss.backward()
    return sum(storages.values())


class CollectiveBytes:
    """Counts what this rank moves through all_gather / all_reduce while installed (ring volumes)."""

    def __init__(self) -> None:
        self.bytes = 0.0
        self._gather, self._reduce = dist.all_gather, dist.all_reduce

    def __enter__(self) -> CollectiveBytes:
        def all_gather(out, t, *a, **kw):
            self.bytes += (len(out) - 1) * t.numel() * t.element_size()
            return self._gather(out, t, *a, **kw)

        def all_reduce(t, *a, **kw):
            C = dist.get_world_size(kw.get("group"))
            self.bytes += 2 * (C - 1) / C * t.numel() * t.element_size()
            return self._reduce(t, *a, **kw)

        dist.all_gather, dist.all_reduce = all_gather, all_reduce
        return self

    def __exit__(self, *exc) -> None:
        dist.all_gather, dist.all_reduce = self._gather, self._reduce


def run(rank: int, C: int, args: argparse.Namespace, init_file: str, out_file: str, shape: dict) -> None:
    torch.set_num_threads(max(1, args.threads // C))
    if C > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=C)
    torch.manual_seed(0)
    cfg = ModelConfig(**shape, scan_impl="chunked", reset_at_eos=False)
    model = Mamba3Transformer(cfg).train()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len + 1), generator=g)
    x, y = cut_window(tokens[:, :-1], tokens[:, 1:], rank, C)
    if C > 1:
        model.set_context_parallel(dist.group.WORLD)
    act = activation_bytes(model, x, y)
    exch = 0.0
    if C > 1:
        with CollectiveBytes() as counter:
            model(x, y).backward()
        exch = counter.bytes / cfg.n_layers
    times = []
    for _ in range(args.steps):
        if C > 1:
            dist.barrier()
        t0 = time.perf_counter()
        model(x, y).backward()
        times.append(time.perf_counter() - t0)
    row = {"act": act, "exch": exch, "step": statistics.median(times)}
    rows = [row]
    if C > 1:
        rows = [None] * C
        dist.all_gather_object(rows, row)
        dist.destroy_process_group()
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(rows, f)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-len", type=int, default=8192, help="tokens per window T")
    ap.add_argument("--batch", type=int, default=1, help="windows per step")
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4], help="context-parallel sizes C")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per C (median)")
    ap.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="CPU threads shared by the ranks"
    )
    ap.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS), help="models")
    args = ap.parse_args(argv)
    print(f"T = {args.seq_len}, batch {args.batch}, fp32, chunked scan, {args.threads} threads")
    for name in args.models:
        print(f"{name}: {MODELS[name]}")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            for C in args.cp:
                out = os.path.join(tmp, f"{name}-cp{C}.json")
                init = os.path.join(tmp, f"init-{name}-{C}")
                if C == 1:
                    run(0, 1, args, init, out, MODELS[name])
                else:
                    mp.spawn(run, args=(C, args, init, out, MODELS[name]), nprocs=C, join=True)
                with open(out) as f:
                    rows = json.load(f)
                results[name, C] = {k: max(r[k] for r in rows) for k in rows[0]}
    print("| model | C | activation MiB | x C=1 | step s | exchanged KiB/layer | ring attention KiB/layer |")
    print("|---|---|---|---|---|---|---|")
    for (name, C), r in results.items():
        base = results.get((name, 1), r)
        ring = 3 * (C - 1) * 2 * (args.batch * args.seq_len // C) * MODELS[name]["d_model"] * 4
        print(
            f"| {name} | {C} | {r['act'] / 2**20:.1f} | {r['act'] / base['act']:.2f} | {r['step']:.2f} "
            f"| {r['exch'] / 1024:.1f} | {ring / 1024:.1f} |"
        )
    print("targets: activations <= 0.6x of C=1 at C=2, <= 0.35x at C=4 (each model)")


if __name__ == "__main__":
    sys.exit(main())
