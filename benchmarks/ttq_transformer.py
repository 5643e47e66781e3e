"""The time-to-quality benchmark's Transformer row: the baseline Transformer (baseline_transformer.py)
trained by a finished Mamba-3 quickstart run's own recipe, for that run's training time, and evaluated
as the quickstart evaluates.

    python benchmarks/ttq_transformer.py RUN [--threads N] [--budget-s S]

RUN is the quickstart's run directory (WORKDIR/run...). The trainer builds only Mamba-3 models, so this
is a small loop, made of the library's pieces so that it is the same recipe:

    config     RUN/config.yaml, the run's resolved config: data, window length, batch, optimizer, lr,
               min_lr, grad clip, dtype, seed, and the shape the quickstart chose
    model      BaselineTransformer of the run's d_model, n_layers, SwiGLU width and vocabulary, heads of
               64 (`transformer_config`), seeded with training.seed as the trainer seeds its model
    data       the run's train split through `build_train_data` (the trainer's PretrainDataset) and a
               `WindowSampler` with the trainer's arguments: the same windows in the same order
    optimizer  `build_optimizer(model, cfg.training)`: under `optimizer: muon` the attention's and the
               MLP's matrices are Muon's, the embedding (= tied head) and the norms AdamW's
    schedule   by the clock, as the quickstart's trainer: `lr_at_progress` (train/schedule.py) of the
               share of the budget spent, with the run's lr, min_lr, lr_schedule and warmup_fraction
    step       forward under bf16 autocast when training.dtype is bf16, backward, the trainer's clip
               (training.grad_clip), the optimizer; glibc keeps freed memory, as the trainer sets on CPU
    budget     the run's training time: the sum of its train rows' window_seconds (RUN/metrics.jsonl:
               step time only; the trainer leaves evaluations and checkpoint writes out of its windows);
               --budget-s S trains S seconds instead (a check of the loop on a short run)
    end        when the budget is spent (the seconds of the steps): the steps are an outcome
    threads    --threads (the quickstart's choice, from its log), else torch's default
    evaluation the quickstart's `Evaluator` (quickstart/dataset.py): every window of the val split, the
               run's window length, batch and dtype, so bits/byte means the same as in the Mamba-3 row

Prints one JSON line: steps, budget_s, train_s, tokens_per_s (the median of windows of
the run's log_every steps, the first left out, as the Mamba-3 row's), bpb, loss, shape, params.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from baseline_transformer import BaselineTransformer
from mamba3lite.config import load_config
from mamba3lite.data import WindowSampler
from mamba3lite.errors import ConfigError
from mamba3lite.malloc import keep_freed_memory
from mamba3lite.model import ModelConfig
from mamba3lite.model.precision import resolve_precision
from mamba3lite.quickstart.dataset import evaluator
from mamba3lite.rundir import CONFIG_NAME
from mamba3lite.train.data import build_train_data
from mamba3lite.train.metrics import read_metrics
from mamba3lite.train.optim import build_optimizer, set_lr
from mamba3lite.train.schedule import lr_at_progress

HEAD_DIM = 64


def transformer_config(model: ModelConfig) -> ModelConfig:
    """The Transformer's shape for a Mamba-3 run's: the same width, depth, SwiGLU width, vocabulary, EOS,
    norms and init; heads of HEAD_DIM (the Mamba-3 model's headdim field is its SSM head dimension)."""
    if model.d_model % HEAD_DIM:
        raise ConfigError(f"model.d_model {model.d_model} is not a multiple of the heads' {HEAD_DIM}")
    return dataclasses.replace(model, headdim=HEAD_DIM)


def training_seconds(run: Path) -> float:
    """The run's training time: the sum of its train rows' window_seconds (see the module docstring)."""
    rows = read_metrics(run).train
    if not rows:
        raise ConfigError(f"{run} has no train rows in its metrics.jsonl: not a finished run")
    return sum(r["window_seconds"] for r in rows)


class Loop:
    """The Transformer, its optimizer and its data, stepped as the trainer steps (module docstring)."""

    def __init__(self, cfg, model_cfg: ModelConfig, train_data) -> None:
        self.tc = tc = cfg.training
        torch.manual_seed(tc.seed)  # as the trainer, before the model is built
        self.model = BaselineTransformer(model_cfg)
        self.optimizer = build_optimizer(self.model, tc)
        self.data = train_data
        self.sampler = WindowSampler(len(train_data), tc.global_windows, seed=tc.seed, shuffle=True)
        self.accum = tc.accumulation(1)
        self.autocast = resolve_precision(tc.dtype, "cpu").dtype  # the trainer's rule (model/precision.py)

    def step(self, lr: float) -> float:
        """One optimizer step at `lr`; its mean micro-batch loss."""
        set_lr(self.optimizer, lr)
        indices, mb, total = self.sampler.next_batch(), self.tc.micro_batch_size, 0.0
        for i in range(self.accum):
            x_BT, y_BT = self.data.get_batch(indices[i * mb : (i + 1) * mb])
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast is not None):
                loss = self.model(x_BT, y_BT)
            (loss / self.accum).backward()
            total += float(loss.detach()) / self.accum
        if self.tc.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.tc.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total


def train(cfg, model_cfg: ModelConfig, train_data, budget_s: float) -> dict:
    """Train for `budget_s` seconds of steps by the clock, as the module docstring says."""
    tc = cfg.training
    loop, step_s, losses = Loop(cfg, model_cfg, train_data), [], []
    while (spent := sum(step_s)) < budget_s:
        lr = lr_at_progress(spent / budget_s, lr=tc.lr, min_lr=tc.min_lr, warmup_fraction=tc.warmup_fraction,
                            schedule=tc.lr_schedule, decay_fraction=tc.decay_fraction)  # fmt: skip
        t0 = time.perf_counter()
        losses.append(loop.step(lr))
        step_s.append(time.perf_counter() - t0)
    # The Mamba-3 row's tokens/s: the median of its logged windows, the start-up window left out.
    window, tokens = max(1, tc.log_every), tc.tokens_per_step()
    starts = range(window, len(step_s) - window + 1, window)
    rates = [window * tokens / sum(step_s[a : a + window]) for a in starts] or [
        len(step_s) * tokens / sum(step_s)  # a run shorter than two windows: its mean
    ]
    return {
        "model": loop.model, "steps": len(step_s), "warmup_fraction": tc.warmup_fraction,
        "train_s": sum(step_s), "last_loss": losses[-1], "tokens_per_s": statistics.median(rates),
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", type=Path, help="a finished quickstart run directory")
    p.add_argument("--threads", type=int, default=None, help="torch threads (the quickstart's choice)")
    p.add_argument("--budget-s", type=float, default=None, help="train this long instead of the run's time")
    args = p.parse_args()
    if not (args.run / CONFIG_NAME).is_file():
        sys.exit(f"error: {args.run} has no {CONFIG_NAME}: not a run directory")
    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_memory()
    cfg = load_config(args.run / CONFIG_NAME)
    model_cfg = transformer_config(cfg.model)
    budget_s = args.budget_s or training_seconds(args.run)
    result = train(cfg, model_cfg, build_train_data(cfg), budget_s)
    model = result.pop("model")
    evaluate = evaluator(cfg, Path(cfg.data.train_data_path), lambda line: print(line, file=sys.stderr))
    final = evaluate(model)
    m, t = model_cfg, cfg.training
    print(json.dumps({
        **result, "budget_s": budget_s, "bpb": final["bits_per_byte"], "loss": final["loss"],
        "split": final["split"], "shape": f"{m.d_model}x{m.n_layers}", "heads": m.d_model // m.headdim,
        "params": sum(p.numel() for p in model.parameters()), "optimizer": t.optimizer, "dtype": t.dtype,
        "threads": torch.get_num_threads(), "vocab": f"{m.vocab_size:,}",
    }))  # fmt: skip


if __name__ == "__main__":
    main()
