"""Multiple-choice scoring through lm-eval: the standard path vs state reuse, side by side in one run.

    python benchmarks/bench_eval.py [--tasks hellaswag,piqa,arc_easy] [--items 40] [--preset tiny]
                                    [--batch-size 16] [--repeat 3] [--threads 1] [--device cpu]

On the same model (the preset's shape, random weights: speed does not depend on them) and the same
lm-eval requests (lm-eval builds them from the first --items items of each task, its own prompts; the
token columns are means per request), the
time of `Mamba3LiteLM.loglikelihood` with
  plain   lm-eval's standard causal-LM path: one row per (context, choice), padded batches, logits of
          every position (what lm-eval's HF model does)
  reuse   state reuse: each distinct context once (prefill), every choice continued from a copy of the
          recurrent state, the choices of several items in one batch
Best of --repeat alternating runs; items/s = task items (not requests) per CPU-second of this process
(1 thread by default; wall-clock seconds on CUDA). The last column is
the largest difference of the two paths' log-likelihoods (float32): the same numbers. Target (issue 18):
reuse >= 2x plain on HellaSwag. The machine is shared and noisy: quote ratios, not rates.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from mamba3lite.config import load_config
from mamba3lite.downstream.harness import Mamba3LiteLM
from mamba3lite.downstream.tasks import task_configs
from mamba3lite.model import Mamba3Transformer
from mamba3lite.tokenizer import load_tokenizer

TARGET = {"hellaswag": 2.0}


def requests_of(task_name: str, items: int) -> list:
    """lm-eval's loglikelihood requests of the first `items` items of `task_name`."""
    specs, manager = task_configs([task_name])
    task = manager.load(specs)["tasks"][task_name]
    task.build_all_requests(limit=items, rank=0, world_size=1)
    return [inst for inst in task.instances if inst.request_type == "loglikelihood"]


def timed(lm: Mamba3LiteLM, reqs: list, reuse: bool) -> tuple[float, list]:
    """(seconds, answers) of one pass: CPU seconds of this process on the CPU (other jobs on a shared
    machine do not count), wall seconds with a synchronize on CUDA."""
    lm.state_reuse = reuse
    cuda = lm.device.type == "cuda"
    clock = time.perf_counter if cuda else time.process_time
    t = clock()
    out = lm.loglikelihood(reqs, disable_tqdm=True)
    if cuda:
        torch.cuda.synchronize()
    return clock() - t, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default="hellaswag,piqa,arc_easy")
    ap.add_argument("--items", type=int, default=40)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = load_config(args.preset)
    device = torch.device(args.device)
    model = Mamba3Transformer(cfg.model).to(device).eval()
    lm = Mamba3LiteLM(model, load_tokenizer("gpt2"), batch_size=args.batch_size, max_length=2048)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"machine: {platform.machine()}, {torch.get_num_threads()} thread(s), {platform.platform()}")
    print(
        f"torch {torch.__version__}, device {device}, preset {args.preset} ({n_params / 1e6:.2f}M parameters)"
    )
    print(f"batch {args.batch_size} rows, best of {args.repeat} alternating runs, fp32\n")
    header = (
        "| task | items | requests | context tokens | choice tokens | plain items/s | reuse items/s "
        "| reuse/plain | target | max abs diff of log-lik |"
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for name in [t.strip() for t in args.tasks.split(",") if t.strip()]:
        reqs = requests_of(name, args.items)
        n_items = len({r.doc_id for r in reqs})
        ctx_tok = sum(len(lm.tok_encode(r.args[0])) for r in reqs) / len(reqs)
        cont_tok = sum(len(lm.tok_encode(r.args[1])) for r in reqs) / len(reqs)
        timed(lm, reqs[: args.batch_size], True)  # warm-up both paths
        timed(lm, reqs[: args.batch_size], False)
        best = {True: float("inf"), False: float("inf")}
        outs = {}
        for _ in range(args.repeat):
            for reuse in (False, True):
                dt, outs[reuse] = timed(lm, reqs, reuse)
                best[reuse] = min(best[reuse], dt)
        diff = max(abs(a[0] - b[0]) for a, b in zip(outs[False], outs[True]))
        plain, reuse = n_items / best[False], n_items / best[True]
        target = TARGET.get(name)
        mark = "" if target is None else f">= {target:.1f}x" + ("" if reuse / plain >= target else " MISS")
        print(
            f"| {name} | {n_items} | {len(reqs)} | {ctx_tok:.1f} | {cont_tok:.1f} | {plain:.2f} "
            f"| {reuse:.2f} | {reuse / plain:.2f}x | {mark} | {diff:.2e} |"
        )


if __name__ == "__main__":
    main()
