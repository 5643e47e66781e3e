"""Why a user would pick a hybrid: pure Mamba-3, a Mamba-3 + attention hybrid and a Transformer, side by
side on the same tokens at (nearly) the same parameter count.

    python benchmarks/hybrid_compare.py                      # MQAR + step time (synthetic, no data)
    python benchmarks/hybrid_compare.py --data DATASET_DIR   # + bits/byte and length extrapolation
    python benchmarks/hybrid_compare.py --quick              # a smoke run (seconds; numbers mean nothing)

Three sections, each printing a table with ratios:

1. **Multi-query associative recall** (MQAR; Arora et al., "Zoology", 2023, and the Based paper): a window
   opens with `n` key-value pairs `k1 v1 k2 v2 ...`; later, at random positions, each key appears again
   and the model must predict its value. Only those positions are scored. A fixed-size recurrent state
   must hold all `n` pairs at once, attention looks them up: accuracy at a growing `n` shows the gap.
   Every model trains on a mixture of the pair counts (same windows, same order, same steps) and is
   scored on fresh windows of each count. The table's last row is the accuracy without recall (knowing
   which values a window holds, guessing among those not asked yet): a model above it has learned to
   bind keys to values. The three models start their token embeddings at std `--mqar-init-std` (0.3,
   not the model's 0.02): at d_model 64 a layer's output at init is ~15x an embedding of std 0.02, so a
   layer after the first sees little of which token it is on, and an attention layer placed after a
   Mamba-3 layer stayed on the no-recall line for 12,000 steps; at 0.3 it binds in a few hundred.
   `--device cuda` trains there (the windows are built on the device); `--models
   X --json F` trains some of the models in one process, and `--merge F1 F2 ...` prints their table (one
   per `--seed`, then each model's mean and range across the seeds).
2. **Language modelling and length extrapolation** (with `--data`): each model trains on windows of
   `--window` tokens of a prepared dataset (same windows, same order), then is scored on the val split:
   bits/byte at the training window, and mean loss by position on windows of 8x the training window
   (positions [0, W), [W, 2W), [2W, 4W), [4W, 8W)).
3. **CPU step time** at T = 512: forward + backward of the hybrid with one attention layer in four,
   over the pure model of the same width and depth (alternating, median).

The hybrid's attention layer is mamba3lite's official-layout `MHA` (model/attention.py) at the index
`--attn-idx` (default: the third of four layers, as the field places a few attention layers inside the
stack rather than first); the Transformer is benchmarks/baseline_transformer.py.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from baseline_transformer import BaselineTransformer
from mamba3lite.model import ModelConfig
from mamba3lite.model.transformer import Mamba3Transformer

IGNORE = -100


# ---- MQAR data ----
@dataclass(frozen=True)
class MqarVocab:
    """Token ids of the task: 0 = filler, keys in [1, 1 + n_keys), values in [1 + n_keys, vocab)."""

    n_keys: int
    n_values: int

    @property
    def size(self) -> int:
        return 1 + self.n_keys + self.n_values


def mqar_batch(
    vocab: MqarVocab, batch: int, seq_len: int, n_pairs: int, gen: torch.Generator
) -> tuple[Tensor, Tensor]:
    """(x_BT, y_BT): `n_pairs` key-value pairs, then each key once more at a random even position of the
    rest of the window followed by its value; y is the value after each queried key, IGNORE elsewhere.
    Built on the generator's device, every row at once (random permutations as argsorts of uniforms)."""
    assert 4 * n_pairs <= seq_len, "the pairs and their queries must fit the window"
    dev = gen.device
    slots = (seq_len - 2 * n_pairs) // 2  # query slots: (key, value) at even offsets after the pairs

    def first_of_permutation(n: int, k: int) -> Tensor:  # (batch, k): k distinct of range(n) per row
        return torch.rand(batch, n, generator=gen, device=dev).argsort(-1)[:, :k]

    keys_BN = first_of_permutation(vocab.n_keys, n_pairs) + 1
    values_BN = torch.randint(0, vocab.n_values, (batch, n_pairs), generator=gen, device=dev)
    values_BN += 1 + vocab.n_keys
    pos_BN = 2 * n_pairs + 2 * first_of_permutation(slots, n_pairs)
    order_BN = first_of_permutation(n_pairs, n_pairs)
    x_BT = torch.zeros(batch, seq_len, dtype=torch.long, device=dev)
    y_BT = torch.full((batch, seq_len), IGNORE, dtype=torch.long, device=dev)
    x_BT[:, 0 : 2 * n_pairs : 2] = keys_BN
    x_BT[:, 1 : 2 * n_pairs : 2] = values_BN
    asked_BN, answer_BN = keys_BN.gather(1, order_BN), values_BN.gather(1, order_BN)
    x_BT.scatter_(1, pos_BN, asked_BN)
    x_BT.scatter_(1, pos_BN + 1, answer_BN)
    y_BT.scatter_(1, pos_BN, answer_BN)
    return x_BT, y_BT


# ---- the models ----
def base_config(args, vocab_size: int) -> dict:
    return dict(
        vocab_size=vocab_size,
        eos_id=vocab_size - 1,
        d_model=args.d_model,
        n_layers=args.n_layers,
        d_intermediate=2 * args.d_model,
        d_state=args.d_state,
        headdim=args.headdim,
        expand=args.expand,
        chunk_size=64,
    )


def build_models(args, vocab_size: int, **overrides) -> dict[str, torch.nn.Module]:
    """The three contenders with one seed each: pure, hybrid, Transformer; `overrides` are ModelConfig
    fields all three take (section 1's `init_std`), else the model's defaults."""
    base = base_config(args, vocab_size) | overrides
    heads = max(1, args.d_model // args.attn_head_dim)
    attn_cfg = {
        "num_heads": heads,
        "head_dim": args.attn_head_dim,
        "rotary_emb_dim": args.attn_head_dim,
        "d_conv": args.attn_d_conv,
        "qkv_proj_bias": False,
        "out_proj_bias": False,
    }
    models = {}
    torch.manual_seed(args.seed)
    models["mamba3"] = Mamba3Transformer(ModelConfig(**base))
    torch.manual_seed(args.seed)
    models["hybrid"] = Mamba3Transformer(
        ModelConfig(**base, attn_layer_idx=tuple(args.attn_idx), attn_cfg=attn_cfg)
    )
    torch.manual_seed(args.seed)
    models["transformer"] = BaselineTransformer(ModelConfig(**{**base, "headdim": args.attn_head_dim}))
    return models


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def logits(model: torch.nn.Module, x_BT: Tensor) -> Tensor:
    if isinstance(model, BaselineTransformer):
        return model._body(x_BT) @ model.embed.weight.T
    return model(x_BT)


def train(
    model, batches, steps: int, lr: float, budget_s: float = math.inf, log_every: int = 0, wd: float = 0.1
) -> tuple[float, int]:
    """AdamW, linear warmup (5%) then cosine to 10%, on `batches(step)`; stops early when `budget_s`
    seconds have passed (the schedule is not shortened: a cut run says so); the loss to stderr every
    `log_every` steps. Returns (seconds, steps)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=wd)
    warm = max(1, steps // 20)
    model.train()
    t0 = time.perf_counter()
    for step in range(steps):
        if time.perf_counter() - t0 > budget_s:
            return time.perf_counter() - t0, step
        frac = step / max(1, steps - 1)
        scale = (step + 1) / warm if step < warm else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))
        for g in opt.param_groups:
            g["lr"] = lr * scale
        x_BT, y_BT = batches(step)
        loss = model(x_BT, y_BT)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if log_every and step % log_every == 0:
            print(f"step {step} loss {loss.item():.4f} {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return time.perf_counter() - t0, steps


# ---- section 1: MQAR ----
def accuracy(model: torch.nn.Module, x_BT: Tensor, y_BT: Tensor) -> float:
    """The share of scored positions (y ≠ IGNORE) where the model's most likely next token is y."""
    model.eval()
    with torch.no_grad():
        pred_BT = logits(model, x_BT).argmax(-1)
    scored = y_BT != IGNORE
    return float((pred_BT[scored] == y_BT[scored]).float().mean())


def mqar(args) -> dict:
    vocab = MqarVocab(args.mqar_keys, args.mqar_values)
    pairs = args.pairs
    built = build_models(args, vocab.size, init_std=args.mqar_init_std)
    models = {n: m.to(args.device) for n, m in built.items() if n in args.models}
    train_gen_seed = args.seed + 1

    def batches_for(seed):
        gen = torch.Generator(device=args.device).manual_seed(seed)
        cache = {}

        def batches(step):
            if step not in cache:
                cache.clear()
                n = pairs[step % len(pairs)]
                cache[step] = mqar_batch(vocab, args.batch, args.mqar_len, n, gen)
            return cache[step]

        return batches

    rows: dict[str, dict] = {}
    for name, model in models.items():
        secs, done = train(
            model,
            batches_for(train_gen_seed),
            args.mqar_steps,
            args.lr,
            args.mqar_budget_s,
            args.log_every,
            args.weight_decay,
        )
        gen = torch.Generator(device=args.device).manual_seed(args.seed + 2)
        windows = {n: mqar_batch(vocab, args.eval_windows, args.mqar_len, n, gen) for n in pairs}
        acc = {n: accuracy(model, x_BT, y_BT) for n, (x_BT, y_BT) in windows.items()}
        rows[name] = {"parameters": n_params(model), "acc": acc, "steps": done, "train_s": secs}
    header = (
        f"\n## MQAR: window {args.mqar_len}, {args.mqar_steps} steps x {args.batch} windows (pair counts "
        f"{','.join(map(str, pairs))} in turn), {args.eval_windows} fresh windows per count, lr {args.lr}, "
        f"d_model {args.d_model}, {args.n_layers} layers (attention at {args.attn_idx}), d_state "
        f"{args.d_state}, expand {args.expand}, the hybrid's attention d_conv {args.attn_d_conv}, "
        f"embedding init std {args.mqar_init_std}, seed {args.seed}, on {args.device}"
    )
    if args.json:
        args.json.write_text(json.dumps({"header": header, "seed": args.seed, "pairs": pairs, "rows": rows}))
    return report_mqar(header, pairs, rows)


def merge_mqar(paths: list[Path]) -> tuple[dict[str, dict[int, float]], int]:
    """One table per seed from the JSON of runs that trained some of the models each (in parallel
    processes), and with several seeds one more: each model's mean and range across them. The runs must
    share every setting but the seed (their headers equal once the seed is taken out). Returns the
    accuracies (the mean over the seeds) and the number of seeds."""
    runs = [json.loads(p.read_text()) for p in paths]
    settings = {r["header"].replace(f", seed {r.get('seed', 0)}", "") for r in runs}
    assert len(settings) == 1, f"the runs' settings differ: {settings}"
    by_seed: dict[int, dict] = {}
    for r in runs:
        group = by_seed.setdefault(r.get("seed", 0), {"header": r["header"], "rows": {}})
        for name, row in r["rows"].items():
            group["rows"][name] = {**row, "acc": {int(n): a for n, a in row["acc"].items()}}
    pairs = runs[0]["pairs"]
    accs = {seed: report_mqar(g["header"], pairs, g["rows"]) for seed, g in sorted(by_seed.items())}
    means = next(iter(accs.values())) if len(accs) == 1 else report_across_seeds(pairs, accs)
    return means, len(accs)


def report_across_seeds(pairs: list[int], accs: dict[int, dict]) -> dict[str, dict[int, float]]:
    """Each model's mean (min-max) over the seeds at each count, and in how many seeds the target holds;
    returns the means."""
    names = list(next(iter(accs.values())))
    missing = {seed: sorted(set(names) ^ set(acc)) for seed, acc in accs.items() if set(acc) != set(names)}
    assert not missing, f"every seed needs the same models; these differ: {missing}"
    print(f"\n## Across seeds {', '.join(map(str, accs))}: mean (min-max)")
    print("| model | " + " | ".join(f"{n} pairs" for n in pairs) + " |")
    print("|---|" + "---|" * len(pairs))
    means = {}
    for name in names:
        per_count = {n: [acc[name][n] for acc in accs.values()] for n in pairs}
        means[name] = {n: statistics.fmean(a) for n, a in per_count.items()}
        cells = " | ".join(f"{means[name][n]:.3f} ({min(a):.3f}-{max(a):.3f})" for n, a in per_count.items())
        print(f"| {name} | {cells} |")
    if {"mamba3", "hybrid"} <= set(names):
        verdicts = {seed: recall_target(acc, pairs) for seed, acc in accs.items()}
        met = sum(ok for _, ok in verdicts.values())
        cells = ", ".join(
            f"seed {seed}: " + (f"{n} pairs, {'met' if ok else 'not met'}" if n else "pure >= 0.5 everywhere")
            for seed, (n, ok) in verdicts.items()
        )
        print(f"target met in {met} of {len(accs)} seeds ({cells})")
    return means


def recall_target(acc: dict[str, dict[int, float]], pairs: list[int]) -> tuple[int | None, bool]:
    """The target's count (the largest where pure Mamba-3 < 0.5; None if there is none) and whether the
    hybrid reaches 0.9 there."""
    below = [n for n in pairs if acc["mamba3"][n] < 0.5]
    if not below:
        return None, False
    return max(below), acc["hybrid"][max(below)] >= 0.9


def elimination_accuracy(n_pairs: int) -> float:
    """The accuracy of a model that knows which values the window holds but not which key each belongs
    to: the queries come in random order with their answers (teacher forcing), so the k-th query has
    n - k values left to guess among: mean over k of 1 / (n - k) = H(n) / n. Above it is recall."""
    return sum(1 / k for k in range(1, n_pairs + 1)) / n_pairs


def report_mqar(header: str, pairs: list[int], rows: dict[str, dict]) -> dict[str, dict[int, float]]:
    """The table as printed, and the target's line when both Mamba-3 models are in it."""
    print(header)
    print("| model | parameters | " + " | ".join(f"{n} pairs" for n in pairs) + " | steps | train s |")
    print("|---|---|" + "---|" * len(pairs) + "---|---|")
    for name, row in rows.items():
        cells = " | ".join(f"{row['acc'][n]:.3f}" for n in pairs)
        print(f"| {name} | {row['parameters']:,} | {cells} | {row['steps']} | {row['train_s']:.0f} |")
    cells = " | ".join(f"{elimination_accuracy(n):.3f}" for n in pairs)
    print(f"| (no recall: a guess among the values not yet asked) | - | {cells} | - | - |")
    acc = {name: row["acc"] for name, row in rows.items()}
    if not {"mamba3", "hybrid"} <= acc.keys():
        return acc
    n, met = recall_target(acc, pairs)
    if n:
        verdict = "met" if met else "not met"
        print(
            f"target: at {n} pairs (the largest count where pure Mamba-3 < 0.5: {acc['mamba3'][n]:.3f}) "
            f"the hybrid reads {acc['hybrid'][n]:.3f} (>= 0.9: {verdict})"
        )
    else:
        print("target: pure Mamba-3 stays >= 0.5 at every count measured: raise --pairs")
    return acc


# ---- section 2: language modelling and length extrapolation ----
def lm(args) -> dict:
    from mamba3lite.data import PretrainDataset
    from mamba3lite.data.shards import Manifest, dataset_dir

    W, long = args.window, 8 * args.window
    vocab = Manifest.load(dataset_dir(args.data) / "manifest.json").vocab_size
    train_ds = PretrainDataset(args.data, W, vocab, split="train")
    val_ds = PretrainDataset(args.data, W, vocab, split="val")
    long_ds = PretrainDataset(args.data, long, vocab, split="val")
    models = build_models(args, vocab)
    order = torch.randperm(len(train_ds), generator=torch.Generator().manual_seed(args.seed)).tolist()

    def batches(step):
        i = (step * args.batch) % max(1, len(order) - args.batch)
        return train_ds.get_batch(order[i : i + args.batch])

    buckets = [(0, W), (W, 2 * W), (2 * W, 4 * W), (4 * W, 8 * W)]
    out = {}
    for name, model in models.items():
        train(model, batches, args.lm_steps, args.lr)
        model.eval()
        with torch.no_grad():
            n_val = min(len(val_ds), args.eval_windows)
            picks = [k * len(val_ds) // n_val for k in range(n_val)]
            loss = statistics.fmean(float(model(*val_ds.get_batch([i]))) for i in picks)
            n_long = min(len(long_ds), max(1, args.eval_windows // 8))
            sums = torch.zeros(long)
            for k in range(n_long):
                x_BT, y_BT = long_ds.get_batch([k * len(long_ds) // n_long])
                lp = torch.log_softmax(logits(model, x_BT).float(), -1)
                sums += -lp.gather(-1, y_BT[..., None])[0, :, 0]
            per_pos = sums / n_long
        bpb = loss / math.log(2) / val_ds.bytes_per_token if val_ds.bytes_per_token else float("nan")
        out[name] = {"bpb": bpb, "buckets": [float(per_pos[a:b].mean()) for a, b in buckets]}
    print(
        f"\n## Language modelling: {args.data}, window {W}, {args.lm_steps} steps x {args.batch} windows; "
        f"loss (nats) by position on {long}-token val windows"
    )
    heads = " | ".join(f"[{a},{b})" for a, b in buckets)
    print(f"| model | val bits/byte | {heads} | 8x/1x |")
    print("|---|---|" + "---|" * len(buckets) + "---|")
    for name, r in out.items():
        b = r["buckets"]
        cells = " | ".join(f"{v:.3f}" for v in b)
        print(f"| {name} | {r['bpb']:.3f} | {cells} | {b[-1] / b[0]:.2f}x |")
    return out


# ---- section 3: CPU step time ----
def step_time(args) -> dict:
    base = base_config(args, 4096)
    base.update(d_model=args.step_d_model, d_intermediate=2 * args.step_d_model)
    heads = args.step_d_model // args.attn_head_dim
    attn_cfg = {"num_heads": heads, "head_dim": args.attn_head_dim, "rotary_emb_dim": args.attn_head_dim}
    idx = tuple(i for i in range(args.n_layers) if i % 4 == 2)
    cfgs = {
        "mamba3": ModelConfig(**base),
        "hybrid": ModelConfig(**base, attn_layer_idx=idx, attn_cfg=attn_cfg),
    }
    T = args.step_len
    x_BT = torch.randint(0, 4096, (args.step_batch, T))
    models = {k: Mamba3Transformer(c) for k, c in cfgs.items()}
    times: dict[str, list[float]] = {k: [] for k in models}
    for rep in range(args.step_reps + 2):
        for name, model in models.items():
            t0 = time.perf_counter()
            model(x_BT, x_BT).backward()
            if rep >= 2:
                times[name].append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"\n## CPU step time: T = {T}, batch {args.step_batch}, d_model {args.step_d_model}, "
        f"{args.n_layers} layers (attention at {list(idx)}), {torch.get_num_threads()} threads, "
        f"median of {args.step_reps}"
    )
    print("| model | parameters | fwd+bwd vs mamba3 |")
    print("|---|---|---|")
    for name, model in models.items():
        print(f"| {name} | {n_params(model):,} | {med[name] / med['mamba3']:.2f}x |")
    ratio = med["hybrid"] / med["mamba3"]
    print(f"target: hybrid / pure <= 1.2x: {ratio:.2f}x ({'met' if ratio <= 1.2 else 'not met'})")
    return {"ratio": ratio}


def plot(acc: dict | None, lm_out: dict | None, path: Path, recall_title: str = "Recall") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in (acc, lm_out) if p]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    if acc:
        ax = axes[0][0]
        pairs = sorted(next(iter(acc.values())))  # every model is scored at the same counts
        # Lines that coincide (two models at 1.0) stay visible: each a narrower line with its own marker.
        for k, (name, a) in enumerate(acc.items()):
            ax.plot(pairs, [a[p] for p in pairs], marker="os^D"[k % 4], linewidth=4 - 1.2 * k, label=name)
        no_recall = [elimination_accuracy(p) for p in pairs]
        ax.plot(pairs, no_recall, linestyle="--", color="grey", label="no recall (a guess among the unasked)")
        ax.set(xlabel="key-value pairs", ylabel="MQAR accuracy", title=recall_title, ylim=(0, 1.05))
        ax.legend()
    if lm_out:
        ax = axes[0][-1]
        for name, r in lm_out.items():
            ax.plot(["1x", "2x", "4x", "8x"], r["buckets"], marker="o", label=name)
        ax.set(xlabel="position (x the training window)", ylabel="loss (nats)", title="Length extrapolation")
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"\nplot: {path}")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run: tiny sizes, a few steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--n-layers", type=int, default=4)
    ap.add_argument("--d-state", type=int, default=16, help="Mamba-3 state size N (small: recall is hard)")
    ap.add_argument("--headdim", type=int, default=16, help="Mamba-3 head dim P")
    ap.add_argument(
        "--expand",
        type=int,
        default=2,
        help="Mamba-3 inner width over d_model (its state: expand * d_model * d_state)",
    )
    ap.add_argument("--attn-head-dim", type=int, default=32)
    ap.add_argument(
        "--attn-d-conv",
        type=int,
        default=4,
        help="the hybrid's short causal conv over q, k, v (the official MHA's d_conv; 0: none)",
    )
    ap.add_argument("--attn-idx", type=int, nargs="+", default=[2], help="the hybrid's attention layers")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1, help="AdamW's, on every parameter (MQAR)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--pairs", type=int, nargs="+", default=[4, 8, 16, 32, 48])
    ap.add_argument("--mqar-len", type=int, default=256)
    ap.add_argument("--mqar-keys", type=int, default=512)
    ap.add_argument("--mqar-values", type=int, default=512)
    ap.add_argument("--mqar-steps", type=int, default=1500)
    ap.add_argument("--mqar-budget-s", type=float, default=math.inf, help="cut each model's training here")
    ap.add_argument(
        "--mqar-init-std",
        type=float,
        default=0.3,
        help="section 1's token embedding init std (the model's default is 0.02, which at d_model 64 is "
        "~1/15 of a layer's output at init, so a layer after it hardly sees which token it is on)",
    )
    ap.add_argument("--device", default="cpu", help="where section 1 (MQAR) runs: cpu or cuda")
    ap.add_argument("--eval-windows", type=int, default=128)
    ap.add_argument("--log-every", type=int, default=0, help="the training loss to stderr every N steps")
    ap.add_argument("--json", type=Path, default=None, help="section 1's results, for --merge")
    ap.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        default=None,
        help="one MQAR table from runs' --json (and nothing else)",
    )
    models = ["mamba3", "hybrid", "transformer"]
    ap.add_argument("--models", nargs="+", choices=models, default=models, help="section 1's contenders")
    ap.add_argument("--data", type=Path, default=None, help="a prepared dataset directory (section 2)")
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--lm-steps", type=int, default=1000)
    ap.add_argument("--step-len", type=int, default=512)
    ap.add_argument("--step-batch", type=int, default=4)
    ap.add_argument("--step-d-model", type=int, default=256)
    ap.add_argument("--step-reps", type=int, default=10)
    ap.add_argument("--plot", type=Path, default=Path("docs/hybrid_compare.png"))
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--sections", default="mqar,lm,step", help="which to run, comma-separated")
    return ap


def main() -> None:
    args = parser().parse_args()
    if args.quick:
        args.pairs, args.mqar_len, args.mqar_steps, args.batch = [2, 4], 32, 4, 4
        args.eval_windows, args.lm_steps, args.window = 4, 3, 32
        args.step_len, args.step_reps, args.step_d_model = 64, 1, 64
        args.mqar_keys = args.mqar_values = 16
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.merge:  # the runs' table and plot only: nothing trains or is timed
        acc, seeds = merge_mqar(args.merge)
        if not args.no_plot:
            plot(acc, None, args.plot, "Recall" if seeds == 1 else f"Recall (mean of {seeds} seeds)")
        return
    sections = set(args.sections.split(","))
    acc = mqar(args) if "mqar" in sections else None
    lm_out = lm(args) if args.data is not None and "lm" in sections else None
    if "step" in sections:
        step_time(args)
    if not args.no_plot and (acc or lm_out):
        plot(acc, lm_out, args.plot)


if __name__ == "__main__":
    main()
