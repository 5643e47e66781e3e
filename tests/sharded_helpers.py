"""Processes for the sharded-checkpoint tests: a tiny Mamba3Transformer wrapped with FSDP2 (fully_shard
on each block, then the root) over gloo on the CPU, trained two steps, saved or loaded through the
CheckpointManager. The tests run these workers with gloo_processes.spawn; every worker writes what the
test compares into files under the run's tmp directory.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from mamba3lite.checkpoint import CheckpointManager, RunState
from mamba3lite.checkpoint.rng import capture_rng_state
from mamba3lite.checkpoint.state import full_model_state, full_optimizer_state
from mamba3lite.config import TrainingConfig
from mamba3lite.model import Mamba3Transformer
from mamba3lite.model.config import ModelConfig
from mamba3lite.train.optim import build_optimizer
from tiny_shapes import TINY_MODEL_SHAPE

VOCAB = 64


def model_config(vocab: int = VOCAB) -> ModelConfig:
    return ModelConfig(vocab_size=vocab, eos_id=vocab - 1, **{**TINY_MODEL_SHAPE, "n_layers": 2})


def build(kind: str, optimizer: str = "adamw", vocab: int = VOCAB) -> tuple[torch.nn.Module, object]:
    """(model, optimizer): `kind` "fsdp" (fully_shard per block and root over the default group), "ddp"
    (the model inside DistributedDataParallel: the trainer's raw model) or "plain"; the same initial
    weights in every process (seed 0)."""
    torch.manual_seed(0)
    model = Mamba3Transformer(model_config(vocab))
    if kind == "fsdp":
        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
    elif kind == "ddp":
        DistributedDataParallel(model)  # wraps it; the checkpoint goes to and from the module inside
    tc = TrainingConfig(optimizer=optimizer, lr=1e-2, weight_decay=0.1)
    return model, build_optimizer(model, tc)


def train_steps(model: torch.nn.Module, opt, steps: int) -> None:
    """`steps` optimizer steps on fixed batches (the same on every rank)."""
    vocab = model.embed.weight.shape[0]
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randint(0, vocab, (2, 16), generator=g)
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab).float(), x.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def dump_full(model, opt, path: Path) -> None:
    """Whole model and optimizer state (a collective for FSDP), written by rank 0."""
    state = {"model": full_model_state(model), "optim": full_optimizer_state(model, opt)}
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(state, path)


def assert_same(a, b, where: str = "") -> None:
    """Nested dicts/lists of tensors and values: equal keys, equal values, tensors bit for bit."""
    if isinstance(a, dict):
        assert set(a) == set(b), (where, sorted(set(a) ^ set(b)))
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b, (where, a, b)


# ------------------------------------------------------------------------------------------ workers
def save_worker(
    rank: int, world: int, run_dir: str, step: int, kind: str, optimizer: str, config: dict | None
) -> None:
    """Train `step` steps as `kind`, save step `step` sharded and asynchronously through the manager
    (recording `config`: a run directory the commands can read), and dump the whole state as the
    reference, to RUN/../saved.pt."""
    vocab = config["model"]["vocab_size"] if config else VOCAB
    model, opt = build(kind, optimizer, vocab)
    train_steps(model, opt, step)
    torch.manual_seed(100 + rank)  # a distinct RNG per rank, to find in the meta
    state = RunState(step=step, config=config or {}, rng=capture_rng_state())
    ckpt = CheckpointManager(run_dir)
    ckpt.save(step, model, opt, state, sharded=True, async_save=True)
    ckpt.finish_pending()
    dump_full(model, opt, Path(run_dir).parent / "saved.pt")


def load_worker(rank: int, world: int, jobs: list[tuple[str, int, str, str]], vocab: int) -> None:
    """Each job (run_dir, step, kind, out): a fresh `kind` model (of `vocab`) and AdamW load the step, and
    the whole state is dumped to `out`; an FSDP model also saves it in the three-file format, to
    `out`.three/."""
    for run_dir, step, kind, out in jobs:
        model, opt = build(kind, "adamw", vocab)
        CheckpointManager(run_dir).load(step, model, opt)
        dump_full(model, opt, Path(out))
        if kind == "fsdp":  # and back to the three-file format: whole tensors gathered to rank 0
            CheckpointManager(out + ".three").save(step, model, opt, RunState(step=step), sharded=False)


def trainer_worker(rank: int, world: int, root: str) -> None:
    """The trainer with an FSDP2 model (one process; the sharded format is chosen from its DTensor
    parameters): 4 steps straight, and 2 + resume + 2 in another directory; both final states dumped."""
    from mamba3lite.config import Config
    from mamba3lite.train.trainer import Pretrainer

    def config(run_dir: Path) -> Config:
        cfg = Config().replace("model", **dataclasses.asdict(model_config()))
        cfg = cfg.replace(
            "training", max_seq_len=16, micro_batch_size=2, gradient_accumulation_steps=1, max_steps=4,
            warmup_steps=1, lr=1e-2, log_every=1, save_every=2, eval_every=0, dtype="fp32", device="cpu",
            checkpoint_dir=str(run_dir), keep_last_n=0, progress=False, async_checkpoint=True,
        )  # fmt: skip
        return cfg.replace("data", dummy=True)

    def trainer(run_dir: Path) -> Pretrainer:
        model, _ = build("fsdp")
        return Pretrainer(config(run_dir), model=model)

    straight, resumed = Path(root) / "straight", Path(root) / "resumed"
    t = trainer(straight)
    t.train()
    dump_full(t.raw_model, t.optimizer, Path(root) / "straight.pt")
    trainer(resumed).train(until_step=2)
    t = trainer(resumed)
    t.train()
    dump_full(t.raw_model, t.optimizer, Path(root) / "resumed.pt")
