"""State tracking: running parity of bit strings with a 1-layer model (docs/model.md §6, paper Table 5b).

Task: a sequence [BOS, b_1, ..., b_T] of random bits; at every bit position t the model predicts
parity(b_1..b_t). Trained only on lengths up to --train-len (default 40; a curriculum grows the length
from 3 over the first 30% of the steps; every position is supervised), evaluated at length 256, 6.4x
beyond anything seen. `--train-len 160` is the paper's protocol (docs/model.md §5: curriculum 3..40 -> 160,
evaluated at 256). A = −softplus(a), the paper's (docs/model.md §7; `--a-activation heavy_tail` for the
official HEAD's form, with which a decay near 1 needs a → −∞).

Why Mamba-3 can do it and Mamba-2 cannot: with data-dependent RoPE the state rotates by
θ = π·tanh(a^θ)·Δ per token, so "rotate by π on a 1, by 0 on a 0" keeps the parity as the phase of the
state, exactly and at any length. Without rotation the state is a sum of non-negatively decayed
writes (α = e^{ΔA} > 0), which cannot represent a sign flip per token, and accuracy stays near chance.

What makes it extrapolate from 40 tokens: the readout and the loss must keep asking for *exact* angles.
Short sequences only pin the angle to the precision the loss still feels: an error ε per bit moves the
phase by ≤ 40ε within training but by ~128ε at 256. The default readout is linear in the block's output
(no final RMSNorm) and the loss regresses the logit margin (logit_1 − logit_0) onto ±--margin (squared
error), so every position's margin must be the same, which only exact angles and a decay of 1 give; it
never saturates. Cross-entropy through a normalised readout (`--loss ce --final-norm`, this script's
first recipe) reaches a training loss of exactly 0 in fp32 and stops pulling: angle errors of
0.004-0.016π per bit remain, enough to be right at 40 and at chance by 256 (55-85% beyond 40;
benchmarks/RESULTS.md has both recipes, the sweeps and the seeds).

The model is built from the library pieces: embedding (3 tokens: 0, 1, BOS) -> one `Block`
(RMSNorm -> Mamba3 -> residual; its SwiGLU half only with --d-mlp > 0, off by default so the mixer
alone does the state tracking) -> [RMSNorm with --final-norm] -> 2-way linear head.
Paper shapes: 1 layer, N = 64, d_model in {32, 64}. Variants (one row each, same readout and loss):
    Mamba-3         trapezoid + RoPE (the default mixer)
    Mamba-3 no RoPE rope=False
    Mamba-2-style   trapezoid=False (λ ≡ 1, exponential-Euler) and rope=False

Printed: accuracy at the positions seen in training (t <= train-len) and beyond them, over all 256
positions and at the last one, the paper's "scaled accuracy" (acc − 0.5) / 0.5 beyond the training
length (chance = 0, perfect = 100); as a diagnostic, the accuracy beyond the training length of the same
weights with every angle rounded to a multiple of π and A at its floor ("exact"); and the learned
dynamics per 0-bit and per 1-bit of every head: the rotation in units of π (exact parity needs 0 and
±1) and the decay α = e^{AΔ} (needs 1). The paper trains 10^4 steps × batch 256 with an LR sweep; here
2000 steps × 64, about half a minute per variant on one CPU core.

    python benchmarks/parity.py [--train-len 40] [--steps 2000] [--variants mamba3,norope,mamba2]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import time

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mamba3lite.model import ModelConfig
from mamba3lite.model.config import A_ACTIVATIONS
from mamba3lite.model.mamba3 import RMSNorm
from mamba3lite.model.transformer import Block

BOS = 2
VOCAB = 3
VARIANTS = {
    "mamba3": ("Mamba-3 (trapezoid + RoPE)", {"trapezoid": True, "rope": True}),
    "norope": ("Mamba-3, no RoPE", {"trapezoid": True, "rope": False}),
    "mamba2": ("Mamba-2-style (Euler, no RoPE)", {"trapezoid": False, "rope": False}),
}


class ParityModel(nn.Module):
    """embed -> one Mamba-3 Block -> [RMSNorm] -> Linear(d_model, 2). forward(ids_BT) -> logits_BT2."""

    def __init__(self, cfg: ModelConfig, final_norm: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.block = Block(cfg)
        self.norm_f = RMSNorm(cfg.d_model, cfg.norm_eps) if final_norm else nn.Identity()
        self.head = nn.Linear(cfg.d_model, 2)

    def forward(self, ids_BT: Tensor) -> Tensor:
        return self.head(self.norm_f(self.block(self.embed(ids_BT))))


def parity_loss(logits_BT2: Tensor, targets_BT: Tensor, args: argparse.Namespace) -> Tensor:
    """`margin`: mean squared error of logit_1 − logit_0 against ±args.margin (the sign of the parity)
    over supervised positions; `ce`: cross-entropy (with args.smoothing)."""
    logits, targets = logits_BT2.flatten(0, 1), targets_BT.flatten()
    if args.loss == "ce":
        return F.cross_entropy(logits, targets, ignore_index=-100, label_smoothing=args.smoothing)
    keep = targets != -100
    want = (2.0 * targets[keep] - 1.0) * args.margin
    return (logits[keep, 1] - logits[keep, 0] - want).square().mean()


def make_batch(batch: int, length: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """ids (B, 1 + length) = [BOS, bits...]; targets (B, 1 + length): running parity, −100 at BOS."""
    bits_BT = torch.randint(0, 2, (batch, length), generator=gen)
    parity_BT = torch.cumsum(bits_BT, dim=1) % 2
    ids = torch.cat([torch.full((batch, 1), BOS), bits_BT], dim=1)
    targets = torch.cat([torch.full((batch, 1), -100), parity_BT], dim=1)
    return ids, targets


def model_config(
    d_model: int, d_state: int, headdim: int, d_mlp: int, switches: dict, a_activation: str = "softplus"
) -> ModelConfig:
    # Δ is initialised in [dt_min, dt_max]; a π rotation needs tanh(a^θ)·Δ ≈ 1, so Δ starts near 1 rather
    # than at the LM's [1e-3, 0.1] (a choice of init range, not of architecture; same for every variant).
    # A = −softplus(a) is the paper's (docs/model.md §7: the paper and the release used softplus; the official
    # HEAD's heavy tail 1/(1 − a) needs a → −∞ for a decay near 1, which parity needs on every token).
    return ModelConfig(
        vocab_size=VOCAB, d_model=d_model, n_layers=1, d_intermediate=d_mlp, mlp_multiple_of=16,
        d_state=d_state, headdim=headdim, chunk_size=64, dt_min=0.1, dt_max=1.0, eos_id=BOS,
        a_activation=a_activation, **switches,
    )  # fmt: skip


def train_variant(
    switches: dict, args: argparse.Namespace, seed: int
) -> tuple[dict[str, float], tuple[str, str], float, float]:
    """Train one variant; returns (eval accuracies, (rotation, decay) per bit, train loss (a 0.95 moving
    average over the last steps), seconds)."""
    torch.manual_seed(seed)
    cfg = model_config(args.d_model, args.d_state, args.headdim, args.d_mlp, switches, args.a_activation)
    model = ParityModel(cfg, final_norm=args.final_norm)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    gen = torch.Generator().manual_seed(seed)
    warmup = max(1, args.steps // 20)
    t0 = time.perf_counter()
    loss_ema = float("nan")
    for step in range(args.steps):
        # Curriculum: the length grows 3 -> train_len over the first `curriculum` fraction of the steps.
        # Every position is supervised, so a batch of length n also trains all lengths < n.
        ramp = min(1.0, step / max(1.0, args.curriculum * args.steps))
        length = 3 + round((args.train_len - 3) * ramp)
        ids, targets = make_batch(args.batch, length, gen)
        lr = args.lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        loss = parity_loss(model(ids), targets, args)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_ema = loss.item() if step == 0 else 0.95 * loss_ema + 0.05 * loss.item()
    seconds = time.perf_counter() - t0
    acc = evaluate(model, args.eval_len, args.train_len, args.eval_batch, seed + 1)
    with exact_dynamics(model):
        acc["exact"] = evaluate(model, args.eval_len, args.train_len, args.eval_batch, seed + 1)["beyond"]
    return acc, dynamics_per_bit(model), loss_ema, seconds


@torch.no_grad()
def dynamics_per_bit(model: ParityModel) -> tuple[str, str]:
    """What the mixer does to its state on a 0 bit and on a 1 bit, per head: (rotation, decay).

    rotation: the angle of the pair closest to exact parity (0 on a 0 bit, π on a 1 bit, mod 2π), in
    units of π ('-' without RoPE); decay: α = e^{AΔ}. Exact parity at every length needs 0/±1 and
    α = 1 on both bits: an angle error ε per token, or α < 1, costs nothing at the trained lengths and
    grows with the length (the phase drifts by ε per token; the BOS write fades as α^t)."""
    mixer = model.block.mixer
    u = model.block.norm(model.embed.weight[None, :2])  # (1, 2 tokens, D): bits 0 and 1
    *_, dt_BHT, A_BHT, _, dtheta_BHTS = mixer._project(u)
    alpha = torch.exp(A_BHT * dt_BHT)[0]  # (H, 2)
    decay = " ".join(f"{a0:.3f}/{a1:.3f}" for a0, a1 in alpha.tolist())
    if dtheta_BHTS is None:
        return "-", decay
    turns = dtheta_BHTS[0] / math.pi  # (H, 2, S)
    target = torch.tensor([0.0, 1.0])[None, :, None]
    err = ((turns - target + 1) % 2 - 1).abs().sum(1)  # (H, S): distance to (0, π) mod 2π
    best = err.argmin(-1)
    rot = " ".join(f"{turns[h, 0, s]:+.3f}/{turns[h, 1, s]:+.3f}" for h, s in enumerate(best.tolist()))
    return rot, decay


@contextlib.contextmanager
def exact_dynamics(model: ParityModel):
    """Evaluate the trained weights with every angle rounded to a multiple of π and A at its floor
    (α ≈ 1): a diagnostic of whether the model learned the parity algorithm and fails only on
    precision. Changes nothing outside the `with`."""
    mixer = model.block.mixer
    project = mixer._project

    def exact(u):
        z, x, Bp, Cp, dt, A, lam, dtheta = project(u)
        A = torch.full_like(A, -mixer.A_floor)
        if dtheta is not None:
            dtheta = torch.round(dtheta / math.pi) * math.pi
        return z, x, Bp, Cp, dt, A, lam, dtheta

    mixer._project = exact
    try:
        yield
    finally:
        del mixer._project


@torch.no_grad()
def evaluate(model: nn.Module, eval_len: int, train_len: int, n: int, seed: int) -> dict[str, float]:
    """Accuracy at length eval_len: all positions, positions beyond train_len, last position."""
    model.eval()
    ids, targets = make_batch(n, eval_len, torch.Generator().manual_seed(seed))
    correct_BT = (model(ids).argmax(-1) == targets)[:, 1:].float()  # drop the BOS column
    return {
        "all": correct_BT.mean().item(),
        "within": correct_BT[:, :train_len].mean().item(),
        "beyond": correct_BT[:, train_len:].mean().item(),
        "last": correct_BT[:, -1].mean().item(),
    }


def scaled(acc: float) -> float:
    return 100 * (acc - 0.5) / 0.5


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000, help="optimizer steps per variant")
    ap.add_argument("--batch", type=int, default=64, help="sequences per step")
    ap.add_argument("--lr", type=float, default=1e-2, help="peak AdamW learning rate (warmup, cosine)")
    ap.add_argument("--d-model", type=int, default=32)
    ap.add_argument("--d-state", type=int, default=64)
    ap.add_argument("--headdim", type=int, default=64, help="64 with d_model 32: one head")
    ap.add_argument("--d-mlp", type=int, default=0, help="SwiGLU width of the block (0 = mixer only)")
    ap.add_argument(
        "--train-len", type=int, default=40, help="longest training length (curriculum end); 160: the paper's"
    )
    ap.add_argument(
        "--curriculum", type=float, default=0.3, help="fraction of the steps over which the length grows"
    )
    ap.add_argument("--eval-len", type=int, default=256)
    ap.add_argument("--eval-batch", type=int, default=256, help="sequences in the evaluation set")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument(
        "--a-activation", choices=A_ACTIVATIONS, default="softplus",
        help="A = −f(a): softplus as in the paper (default), or heavy_tail as the official HEAD",
    )  # fmt: skip
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument(
        "--loss", choices=("margin", "ce"), default="margin",
        help="margin: squared error of logit_1 - logit_0 against +-margin (default); ce: cross-entropy",
    )  # fmt: skip
    ap.add_argument("--margin", type=float, default=4.0, help="the logit margin --loss margin regresses onto")
    ap.add_argument("--final-norm", action="store_true", help="RMSNorm before the head (the first recipe's)")
    ap.add_argument(
        "--label-smoothing", dest="smoothing", type=float, default=0.0,
        help="label smoothing of --loss ce",
    )  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: the model is tiny, more only adds overhead)"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")

    print(
        f"running parity: 1 layer, d_model {args.d_model}, N {args.d_state}, headdim {args.headdim}, "
        f"A = -{args.a_activation}(a); "
        f"readout {'RMSNorm -> ' if args.final_norm else ''}linear, loss "
        f"{'cross-entropy' if args.loss == 'ce' else f'margin MSE (+-{args.margin:g})'}; "
        f"train lengths 3..{args.train_len} (curriculum over {args.curriculum:.0%} of the steps), "
        f"{args.steps} steps x batch {args.batch}, "
        f"lr {args.lr:g}; eval {args.eval_batch} sequences of length {args.eval_len}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    rows = []
    for name in names:
        label, switches = VARIANTS[name]
        acc, dyn, loss, seconds = train_variant(switches, args, args.seed)
        rows.append((label, acc, dyn, loss, seconds))
        print(
            f"  trained {label}: train loss {loss:.4f} (moving average) in {seconds:.0f} s; accuracy "
            f"t<={args.train_len} {100 * acc['within']:.1f}%, t>{args.train_len} {100 * acc['beyond']:.1f}%",
            flush=True,
        )

    n, L = args.train_len, args.eval_len
    print()
    print(
        f"Accuracy on {args.eval_batch} sequences of length {L} (positions t <= {n} were seen in training, "
        f"t > {n} were not). exact t>{n}: the same weights with every angle rounded to a multiple of π and "
        "A at its floor (a diagnostic). rotation: learned θ per 0-bit / per 1-bit of the pair closest to "
        "0/π, in units of π; decay: α = e^{AΔ} per 0-bit / per 1-bit; one entry per head"
    )
    print(f"| model | acc t<={n} | acc t>{n} | acc all {L} | acc last | scaled t>{n} | exact t>{n} "
          "| train loss | rotation | decay | time |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for label, acc, (rot, decay), loss, seconds in rows:
        print(
            f"| {label} | {100 * acc['within']:.1f}% | {100 * acc['beyond']:.1f}% | {100 * acc['all']:.1f}% "
            f"| {100 * acc['last']:.1f}% | {scaled(acc['beyond']):.1f} | {100 * acc['exact']:.1f}% "
            f"| {loss:.4f} | {rot} | {decay} | {seconds:.0f} s |"
        )
    print(
        "(scaled = (acc - 0.5) / 0.5 x 100, as the paper's Table 5b: Mamba-3 100, no RoPE 2.3, Mamba-2 0.9)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
