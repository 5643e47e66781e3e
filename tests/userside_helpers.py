"""Shared by the user-side tests (generate, eval, inspect, quickstart): a tiny GPT-2-vocabulary model
and a small real dataset, written exactly as `prepare` and the trainer write them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import yaml

from mamba3lite.checkpoint import CheckpointManager, RunState
from mamba3lite.config import Config
from mamba3lite.data.shards import write_dataset
from mamba3lite.model import Mamba3Transformer
from mamba3lite.tokenizer import load_tokenizer
from tiny_shapes import TINY_MODEL_SHAPE

TINY_MODEL = dict(vocab_size=50257, **TINY_MODEL_SHAPE)
TINY_TRAINING = dict(
    max_seq_len=16,
    micro_batch_size=2,
    gradient_accumulation_steps=1,
    dtype="fp32",
    device="cpu",
    lr=3e-3,
    warmup_steps=1,
    log_every=1,
    eval_every=0,
    eval_batches=2,
    progress=False,
    keep_last_n=0,
)

PYTHON_DOCS = [
    "def add(a, b):\n    return a + b\n",
    "import os\n\n\ndef main():\n    print(os.getcwd())\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i)\n",
]


def tiny_config(run_dir: Path | str, data_path: Path | str | None = None, **training) -> Config:
    cfg = Config().replace("model", **TINY_MODEL)
    cfg = cfg.replace("training", **{**TINY_TRAINING, "checkpoint_dir": str(run_dir), **training})
    if data_path is None:
        return cfg.replace("data", dummy=True)
    return cfg.replace("data", train_data_path=str(data_path))


def tiny_config_yaml(path: Path, **training) -> str:
    """The tiny config as a YAML file (for the CLI's --config)."""
    cfg = {"model": TINY_MODEL, "training": {**TINY_TRAINING, **training}}
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def make_dataset(root: Path, repeats: int = 30, vocab_hash: str | None = None, seed: int = 0) -> Path:
    """A dataset of real GPT-2 tokens of small Python documents, train and val splits, with byte counts."""
    tok = load_tokenizer("gpt2")
    rng = np.random.default_rng(seed)
    parts = []
    for split, n_docs in (("train", repeats * len(PYTHON_DOCS)), ("val", 2 * len(PYTHON_DOCS))):
        docs = [PYTHON_DOCS[i] for i in rng.integers(0, len(PYTHON_DOCS), n_docs)]
        ids: list[int] = []
        for d in docs:
            ids += [*tok.encode(d), tok.eos_id]
        parts.append((split, np.asarray(ids), n_docs, sum(len(d.encode()) for d in docs)))
    write_dataset(
        root,
        parts,
        vocab_size=tok.vocab_size,
        eos_id=tok.eos_id,
        tokenizer={"name": "gpt2", "vocab_hash": vocab_hash or tok.vocab_hash},
    )
    return root


def save_tiny_checkpoint(
    run_dir: Path, step: int = 5, model: torch.nn.Module | None = None, **training
) -> Path:
    """A verified checkpoint of a (randomly initialised unless given) tiny model, with the meta the
    trainer writes (config, tokens seen, data identity)."""
    cfg = tiny_config(run_dir, "data/x", **training)
    if model is None:
        torch.manual_seed(0)
        model = Mamba3Transformer(cfg.model)
    tok = load_tokenizer("gpt2")
    state = RunState(
        step=step,
        config=cfg.to_dict(),
        tokens_seen=step * 32,
        data={"tokenizer": "gpt2", "vocab_hash": tok.vocab_hash, "vocab_size": 50257, "eos_id": 50256},
        metrics={"kind": "train", "step": step, "loss": 7.5, "lr": 1e-3, "tokens_per_s": 1000.0},
        last_eval={"step": step, "val_loss": 7.75, "val_bpb": 3.25},
    )
    CheckpointManager(run_dir).save(step, model, None, state)
    return run_dir


def eos_model() -> torch.nn.Module:
    """A tiny model whose next token is EOS with near certainty after any input: residual branches
    zeroed (the hidden state is the token's embedding), every embedding row has a positive first
    feature, and EOS's row has a huge one, so the tied head's EOS logit dominates."""
    cfg = tiny_config("unused").model
    model = Mamba3Transformer(cfg)
    with torch.no_grad():
        for block in model.layers:
            block.mixer.out_proj.weight.zero_()
            block.mlp.fc2.weight.zero_()
        model.embed.weight.normal_(0, 0.01)
        model.embed.weight[:, 0] = 1.0
        model.embed.weight[cfg.eos_id, 0] = 100.0
    return model
