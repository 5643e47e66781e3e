"""The quickstart's recipe: vocabulary, shape, learning rate and batch for a time budget, chosen on the
machine that runs it.

    vocabulary  a byte-level BPE of VOCAB ids fit to the train split (`prepare --train-tokenizer`): on
                Python source it reads ~1.5x the bytes per token of GPT-2's 50,257 ids, and its LM head
                is 12x smaller, so the minutes go to the Mamba-3 layers instead of a 50,257-way softmax
    shape       the largest of SHAPES that still reads TOKENS_PER_PARAM tokens per (non-embedding)
                parameter in the training time left, at the tokens/s measured for it here: a bigger
                model learns more per token, a smaller one reads more tokens, and which wins depends on
                how fast this machine is
    optimizer   Muon for the hidden matrices, AdamW for the rest, at LR (training.optimizer: muon)
    batch       MICRO_BATCH windows of SEQ_LEN tokens per step: many small steps

The constants are measured (benchmarks/time_to_quality.py; benchmarks/RESULTS.md, "The five-minute
model"). `choose_shape` is a pure function of the measurements, so the rule is tested without timing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

VOCAB = 4096
LR = 4e-3
MICRO_BATCH = 8
SEQ_LEN = 128
OPTIMIZER = "muon"
# The shape rule: the largest shape that reads at least this many tokens per non-embedding parameter in
# the training time the budget leaves (at the tokens/s measured before training). Fit on five-minute runs
# with the shape pinned, two CPUs (benchmarks/RESULTS.md): the larger shape lost to the smaller at 0.2-0.5
# tokens per parameter (by 5-10%, fp32 and bf16, two corpora) and won, narrowly, at 1.2.
TOKENS_PER_PARAM = 1.0
PROBE_STEPS = 2  # timed steps per shape (after one untimed warm-up step)


@dataclass(frozen=True)
class Shape:
    """A model shape of the family the quickstart chooses from: d_model D, n_layers, SwiGLU width 2D,
    d_state 32, head dimension 64 (d_inner 2D)."""

    d_model: int
    n_layers: int

    def overrides(self) -> list[str]:
        """The `--set model.*` items of this shape."""
        D = self.d_model
        return [f"model.d_model={D}", f"model.n_layers={self.n_layers}", f"model.d_intermediate={2 * D}",
                "model.d_state=32", "model.headdim=64"]  # fmt: skip

    def __str__(self) -> str:
        return f"{self.d_model}x{self.n_layers}"


SHAPES = (Shape(128, 2), Shape(192, 3), Shape(256, 4), Shape(320, 5), Shape(384, 6), Shape(512, 8))


@dataclass(frozen=True)
class Measured:
    """One shape as measured here: its non-embedding parameters and training tokens per second."""

    shape: Shape
    params: int
    tokens_per_s: float

    def tokens_per_param(self, train_s: float) -> float:
        return self.tokens_per_s * train_s / max(self.params, 1)


def choose_shape(measured: list[Measured], train_s: float) -> tuple[Shape, str]:
    """(the largest measured shape that reads >= TOKENS_PER_PARAM tokens per parameter in `train_s`
    seconds, else the smallest; why, in one line). `measured` in increasing size."""
    assert measured, "no shape measured"
    fits = [m for m in measured if m.tokens_per_param(train_s) >= TOKENS_PER_PARAM]
    pick = fits[-1] if fits else measured[0]
    rows = ", ".join(
        f"{m.shape} {m.tokens_per_s:,.0f} tok/s ({m.tokens_per_param(train_s):.2f} tok/param)"
        for m in measured
    )
    why = (
        f"{rows}: {pick.shape} is the largest that reads >= {TOKENS_PER_PARAM:.1f} tokens per parameter in "
        f"{train_s / 60:.1f} min"
        if fits
        else f"{rows}: none reads {TOKENS_PER_PARAM:.1f} tokens per parameter in {train_s / 60:.1f} min; the "
        "smallest"
    )
    return pick.shape, why


def non_embedding_parameters(model_cfg) -> int:
    """Parameters outside the (tied) embedding: what the shape rule counts."""
    from mamba3lite.model import count_parameters

    return count_parameters(model_cfg) - model_cfg.vocab_size * model_cfg.d_model


def training_step(cfg, compile: bool = False):
    """One training step of a fresh model of `cfg` on fixed random token ids, as a call: forward,
    backward and optimizer step under the config's dtype resolved for the CPU, the model wrapped as the
    trainer wraps it in one process (`Local.wrap`: compiled when `compile`). What the quickstart times
    (`time_shape`, compile_choice.measure_compile) and the CPU benchmarks run."""
    import torch

    from mamba3lite.model import Mamba3Transformer
    from mamba3lite.model.precision import resolve_precision
    from mamba3lite.train.optim import build_optimizer
    from mamba3lite.train.parallel.strategies import Local

    tc, mc = cfg.training, cfg.model
    torch.manual_seed(0)
    raw = Mamba3Transformer(mc)
    model = Local().wrap(raw, compile)
    optimizer = build_optimizer(raw, tc)
    compute = resolve_precision(tc.dtype, "cpu").dtype
    ids = torch.randint(0, mc.vocab_size, (tc.micro_batch_size, tc.max_seq_len + 1))

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=compute is not None):
            loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def time_shape(cfg, steps: int = PROBE_STEPS) -> float:
    """Training tokens per second of `cfg`'s model and optimizer on this machine (`training_step`):
    the median of `steps` timed steps after one untimed one."""
    import statistics

    step = training_step(cfg)
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    tc = cfg.training
    return tc.micro_batch_size * tc.max_seq_len / statistics.median(times[1:])


def measure_shapes(cfg, train_s: float) -> list[Measured]:
    """`time_shape` for SHAPES in increasing size, on `cfg` with each shape's overrides, until one reads
    fewer than TOKENS_PER_PARAM tokens per parameter in `train_s` (a larger one would read fewer)."""
    out = []
    for shape in SHAPES:
        shaped = cfg.with_overrides(shape.overrides())
        m = Measured(shape, non_embedding_parameters(shaped.model), time_shape(shaped))
        out.append(m)
        if m.tokens_per_param(train_s) < TOKENS_PER_PARAM:
            break
    return out


def recipe_overrides() -> list[str]:
    """The `--set` items of the recipe's optimizer, learning rate and batch (the vocabulary is the
    dataset's, the shape `choose_shape`'s)."""
    return [
        f"training.optimizer={OPTIMIZER}",
        f"training.lr={LR}",
        f"training.min_lr={LR / 10}",
        f"training.micro_batch_size={MICRO_BATCH}",
        f"training.max_seq_len={SEQ_LEN}",
        f"training.global_batch_size={MICRO_BATCH}",  # one micro batch per step, whatever the preset's
    ]
