"""Activation memory per layer, side by side: what autograd keeps for the backward of one layer, per token.

    python benchmarks/activation_memory.py [--presets mamba3_180m,mamba3_440m] [--seq-len 2048]
                                           [--check-seq-lens 512,2048]

A CPU measurement of the term that dominates a training step's peak memory (issue 16's target: peak
memory of the Triton path <= 1.25x the same-shape Transformer's). One layer's forward runs on the CPU
under bf16 autocast, as the trainer runs on a GPU, with a saved-tensors hook that adds up the distinct
storages saved for the backward, at --seq-len and half of it: the growth per token is the activations
(weights and their copies drop out). It is `mamba3lite.model.memory`'s own measure. Rows:
  mamba3 chunked   the pure-PyTorch scan (its (L, L) blocks and chunk states are kept)
  mamba3 triton    the Triton scan, fused with the bias + rotation prologue (TRITON_INTERPRET=1: the
                   kernels run in the interpreter, but the op saves exactly the tensors, dtypes and shapes
                   it saves on a GPU: it gets its operands in bf16 and keeps no kernel output)
  transformer      the benchmarks' same-shape Transformer block (baseline_transformer.py): RoPE
                   attention through SDPA and the same MLP. On the CPU SDPA's flash kernel saves q, k,
                   v, the output and the log-sum-exp, as the CUDA flash kernel does.
  hybrid           a preset with attention layers (e.g. mamba3_180m_hybrid): memory.py's estimate, the
                   mean over its layers by kind (the Mamba-3 ones with the chunked scan), at --seq-len
The "model GiB" column is activations of every layer at --batch x --seq-len plus 16 bytes per parameter
(fp32 weights, gradients, AdamW's two moments); the embedding and head activations (the same for
both models) are left out. Ratios are against the Transformer of the same preset.

A second table checks the estimate `train --plan` prints (memory.py `activation_bytes`, micro batch 1,
one process) against what the whole model keeps, measured: the distinct non-parameter storages saved for
the backward of a training forward with the loss (`model_saved_bytes`), for 2 windows less 1 (the
weights' autocast copies drop out), for each preset at each of --check-seq-lens, without and with packed
documents (reset_at_eos: attention then keeps its T × T mask). Target (issue 39): within 10%. The
estimate leaves out the embedding, final norm and loss.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are first built

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import baseline_transformer
from mamba3lite.config import load_config
from mamba3lite.model.flops import count_parameters
from mamba3lite.model.memory import (
    activation_bytes,
    activation_bytes_per_token,
    model_saved_bytes,
    saved_bytes_per_token,
)
from mamba3lite.model.transformer import Block, Mamba3Transformer


def transformer_parameters(cfg) -> int:
    with torch.device("meta"):
        model = baseline_transformer.BaselineTransformer(cfg)
    return sum(p.numel() for p in model.parameters())


def measured_activations(cfg, seq_len: int) -> int:
    """What the whole model keeps for one window of seq_len tokens (module docstring, second table)."""
    torch.manual_seed(0)
    model = Mamba3Transformer(cfg).train()
    ids = torch.randint(1, cfg.vocab_size, (2, seq_len + 1), generator=torch.Generator().manual_seed(1))
    ids[:, seq_len // 3] = cfg.eos_id  # a second document (used when packed)
    saved = [model_saved_bytes(model, ids[:b, :-1], ids[:b, 1:]) for b in (1, 2)]
    return saved[1] - saved[0]


def check_table(presets: list[str], seq_lens: list[int]) -> None:
    print("\n| preset | T | packed | estimate MiB | measured MiB | estimate / measured |")
    print("|---|---|---|---|---|---|")
    for preset in presets:
        base = dataclasses.replace(load_config(preset).model, scan_impl="chunked")
        for T in seq_lens:
            for packed in (False, True):
                cfg = dataclasses.replace(base, reset_at_eos=packed)
                est, got = activation_bytes(cfg, 1, T), measured_activations(cfg, T)
                mark = "" if 0.9 <= est / got <= 1.1 else " MISS"
                packed_cell = "yes" if packed else "no"
                print(f"| {preset} | {T} | {packed_cell} | {est / 2**20:.1f} | {got / 2**20:.1f} | "
                      f"{est / got:.3f}{mark} |", flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="mamba3_180m,mamba3_440m")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=16, help="micro batch of the model GiB column")
    ap.add_argument("--check-seq-lens", default="", help="lengths of the second table (default: --seq-len)")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, bf16 autocast on the CPU, T={args.seq_len}; per layer, per token")
    header = "| preset | layer | KiB/token/layer | vs Transformer | model GiB at {} x {} | vs Transformer |"
    print(header.format(args.batch, args.seq_len))
    print("|---|---|---|---|---|---|")
    tokens = args.batch * args.seq_len
    for preset in args.presets.split(","):
        cfg = load_config(preset).model
        torch.manual_seed(0)
        twin = baseline_transformer.TransformerBlock(cfg)
        rows = {
            "transformer": (
                saved_bytes_per_token(twin, cfg.d_model, args.seq_len),
                transformer_parameters(cfg),
            )
        }
        for scan in ("chunked", "triton"):
            block = Block(dataclasses.replace(cfg, scan_impl=scan))
            rows[f"mamba3 {scan}"] = (
                saved_bytes_per_token(block, cfg.d_model, args.seq_len),
                count_parameters(cfg),
            )
        if cfg.attn_layer_idx:
            hybrid = dataclasses.replace(cfg, scan_impl="chunked")
            rows[f"hybrid, mean of {cfg.n_layers} layers"] = (
                activation_bytes_per_token(hybrid, args.seq_len),
                count_parameters(cfg),
            )
        ref_layer, ref_params = rows["transformer"]
        ref_gib = (cfg.n_layers * ref_layer * tokens + 16 * ref_params) / 2**30
        for name, (per_layer, params) in rows.items():
            gib = (cfg.n_layers * per_layer * tokens + 16 * params) / 2**30
            print(
                f"| {preset} | {name} | {per_layer / 1024:.1f} | {per_layer / ref_layer:.2f}x | {gib:.1f} | "
                f"{gib / ref_gib:.2f}x |",
                flush=True,
            )
    lens = [int(t) for t in (args.check_seq_lens or str(args.seq_len)).split(",")]
    check_table(args.presets.split(","), lens)


if __name__ == "__main__":
    main()
