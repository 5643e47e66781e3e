"""Where a five-minute model's gap to xz given the train text comes from, on one quickstart run.

    python benchmarks/ttq_gap.py DATASET RUN

The val documents are split in two: those half of whose lines (of more than 20 characters) also stand
in the train split (near-copies a match-finder finds in its history), and the rest. For each group: its
bytes, the model's bits per byte (each document scored alone, from EOS, in windows of the run's
max_seq_len tokens, as the evaluation windows are) and xz -9e's given the last 9 MB of the train text
(report/baselines.py's number, per group). Prints one table row per group.
"""

from __future__ import annotations

import argparse
import lzma
import math
from pathlib import Path

import numpy as np
import torch

from mamba3lite.data.shards import Manifest
from mamba3lite.pretrained import load_pretrained
from mamba3lite.report.baselines import HISTORY_BYTES, split_text
from mamba3lite.tokenizer import load_tokenizer

XZ = 9 | lzma.PRESET_EXTREME


def documents(data: Path, manifest, split: str) -> list[np.ndarray]:
    """The token ids of each document of `split` (EOS removed)."""
    out = []
    for shard in manifest.split_shards(split):
        ids = np.fromfile(data / shard.path, dtype=manifest.np_dtype)
        start = 0
        for cut in [*np.flatnonzero(ids == manifest.eos_id).tolist(), len(ids)]:
            if cut > start:
                out.append(ids[start:cut])
            start = cut + 1
    return out


@torch.no_grad()
def doc_nll(model, ids: np.ndarray, eos_id: int, window: int) -> float:
    """The model's summed loss (nats) over one document, from EOS, in windows of `window` tokens."""
    full = torch.as_tensor(np.concatenate([[eos_id], ids]).astype(np.int64))
    nll = 0.0
    for a in range(0, len(full) - 1, window):
        y = full[a + 1 : a + window + 1]
        x = full[a : a + len(y)]
        logits = model(x[None])[0].float()
        nll += torch.nn.functional.cross_entropy(logits, y, reduction="sum").item()
    return nll


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dataset", type=Path)
    p.add_argument("run", type=Path)
    args = p.parse_args()
    manifest = Manifest.load(args.dataset)
    tok = load_tokenizer(manifest.identity.tokenizer)
    train_text = split_text(args.dataset, "train")
    train_lines = {s for line in train_text.decode().split("\n") if len(s := line.strip()) > 20}
    loaded = load_pretrained(args.run)
    model, window = loaded.model.eval(), loaded.config.training.max_seq_len
    groups = {"copied": [0.0, 0, b""], "other": [0.0, 0, b""]}  # nll, bytes, text
    for ids in documents(args.dataset, manifest, "val"):
        text = tok.decode(ids.tolist())
        lines = [s for line in text.split("\n") if len(s := line.strip()) > 20]
        share = sum(line in train_lines for line in lines) / max(1, len(lines))
        g = groups["copied" if share >= 0.5 else "other"]
        g[0] += doc_nll(model, ids, manifest.eos_id, window)
        g[1] += len(text.encode())
        g[2] += text.encode() + b"\n"
    history = train_text[-HISTORY_BYTES:]
    base = len(lzma.compress(history, preset=XZ))
    total = sum(g[1] for g in groups.values())
    print("| val documents | bytes | share | model bits/byte | xz given train |\n|---|---|---|---|---|")
    for name, (nll, n_bytes, blob) in groups.items():
        if n_bytes:
            given = 8 * (len(lzma.compress(history + blob, preset=XZ)) - base) / len(blob)
            bpb = nll / math.log(2) / n_bytes
            print(f"| {name} | {n_bytes:,} | {n_bytes / total:.0%} | {bpb:.3f} | {given:.3f} |")


if __name__ == "__main__":
    main()
