"""Data-layer benchmark: the seed's PretrainDataset against ours, side by side in one run.

Both are read through torch.utils.data.DataLoader(batch_size=16, num_workers=0) at L = 2048, on corpora
this script writes to a temp dir:
  (a) 4 shards of 2M tokens      (b) 400 shards of 1,000 tokens (every window spans shards)
  (c) one file of 8M tokens
The seed reads its own format (torch.save'd int64 tensors: shard_*.bin, or one file); ours reads raw
uint16 shards plus manifest.json written by mamba3lite.data.shards. Before timing, the two are checked to
return identical windows. Printed: batches/s for each, the ratio ours/seed, and our batch-assembly
bandwidth (int64 bytes of x and y produced per second) next to this machine's memcpy bandwidth.

Rates are batches per CPU-second of this (single-threaded) process: on a shared machine wall time
measures the scheduler, CPU time the work; the wall-clock ratio is printed alongside. Each measurement
is the best of several alternating repeats; only ratios are worth quoting. Two reference columns:
"ceiling", the ratio a dataset doing no work at all gets through the same DataLoader (its loader and
default-collate cost bounds every dataset), and "get_batch", ours assembling the same batches without
the DataLoader, as a trainer feeding WindowSampler batches can.

Targets (issue 2): ratio >= 1.0 on (a) and (c), >= 30 on (b).

    python benchmarks/bench_data.py [--seconds 1.0] [--repeats 3]
"""

from __future__ import annotations

import argparse
import bisect
import os
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from mamba3lite.data import PretrainDataset
from mamba3lite.data.shards import Manifest, dtype_for_vocab, write_shard

L = 2048
BATCH = 16
VOCAB = 50_257
EOS = 50_256
TARGETS = {"a": 1.0, "b": 30.0, "c": 1.0}


class SeedPretrainDataset(Dataset):
    """The seed's training/pretrain.py:PretrainDataset, re-implemented from the seed document (dataset
    section) as the baseline: single layout fully loaded into RAM, sharded layout torch.load(mmap=True)
    with Python-list stitching of spanning windows. Its dummy fallback is left out (never benchmarked)."""

    def __init__(self, data_path: str, max_seq_len: int, vocab_size: int):
        self.max_seq_len = max_seq_len
        self.vocab_size = vocab_size
        if os.path.isdir(data_path):
            self._init_sharded(data_path)
        else:
            self._init_single(data_path)

    def _init_single(self, data_path: str) -> None:
        self.layout = "single"
        self.data = torch.load(data_path, weights_only=True)
        self._n_samples = (len(self.data) - 1) // self.max_seq_len

    def _init_sharded(self, data_dir: str) -> None:
        shard_paths = sorted(Path(data_dir).glob("shard_*.bin"))
        if not shard_paths:
            raise FileNotFoundError(f"No `shard_*.bin` files in {data_dir}")
        self.layout = "sharded"
        self.shards = [torch.load(p, weights_only=True, mmap=True) for p in shard_paths]
        self.shard_sizes = [s.numel() for s in self.shards]
        self.shard_offsets = [0] + [sum(self.shard_sizes[: i + 1]) for i in range(len(self.shard_sizes) - 1)]
        self._total_tokens = sum(self.shard_sizes)
        self._n_samples = (self._total_tokens - 1) // self.max_seq_len

    def _get_window_single(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = idx * self.max_seq_len
        chunk = self.data[start : start + self.max_seq_len + 1]
        return chunk[:-1], chunk[1:]

    def _locate(self, global_idx: int) -> tuple[int, int]:
        lo = bisect.bisect_right(self.shard_offsets, global_idx) - 1
        return lo, global_idx - self.shard_offsets[lo]

    def _get_window_sharded(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = idx * self.max_seq_len
        shard_idx, offset_in_shard = self._locate(start)
        if offset_in_shard + (self.max_seq_len + 1) <= self.shard_sizes[shard_idx]:
            chunk = self.shards[shard_idx][offset_in_shard : offset_in_shard + self.max_seq_len + 1]
            return chunk[:-1], chunk[1:]
        needed = self.max_seq_len + 1
        collected: list[int] = []
        cursor = start
        while len(collected) < needed:
            s_idx, off = self._locate(cursor)
            take = min(needed - len(collected), self.shard_sizes[s_idx] - off)
            collected.extend(self.shards[s_idx][off : off + take].tolist())
            cursor += take
        chunk = torch.tensor(collected[:needed], dtype=torch.long)
        return chunk[:-1], chunk[1:]

    def __len__(self) -> int:
        return self._n_samples

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.layout == "single":
            return self._get_window_single(idx)
        return self._get_window_sharded(idx)


class LoaderFloor(Dataset):
    """No data work at all: __getitems__ returns precomputed samples. Through the same DataLoader this
    measures the loader + default-collate cost that any dataset pays, i.e. the best ratio possible."""

    def __init__(self, n_windows: int):
        self.n_windows = n_windows
        t = torch.zeros(BATCH, L + 1, dtype=torch.long)
        self.samples = list(zip(t[:, :-1].unbind(0), t[:, 1:].unbind(0)))

    def __len__(self) -> int:
        return self.n_windows

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.samples[: len(indices)]


def write_corpus(
    root: Path, name: str, shard_tokens: list[int], single: bool, rng: np.random.Generator
) -> tuple:
    """Write one corpus twice: the seed's torch.save'd int64 format and ours (uint16 + manifest)."""
    seed_path, ours_path = root / f"{name}_seed", root / f"{name}_ours"
    seed_path.mkdir()
    dtype = dtype_for_vocab(VOCAB)
    infos = []
    for k, n in enumerate(shard_tokens):
        toks = rng.integers(0, VOCAB, n, dtype=np.int64)
        if single:
            seed_file = seed_path / "tokens.pt"
        else:
            seed_file = seed_path / f"shard_{k:04d}.bin"
        torch.save(torch.from_numpy(toks), seed_file)
        infos.append(
            write_shard(ours_path, f"train/shard_{k:05d}.bin", toks, split="train", n_docs=0, dtype=dtype)
        )
    Manifest(
        vocab_size=VOCAB,
        eos_id=EOS,
        dtype=dtype.name,
        tokenizer={"name": "gpt2", "vocab_hash": "bench"},
        shards=infos,
    ).save(ours_path)
    return (seed_path / "tokens.pt" if single else seed_path), ours_path


def batches_per_second(ds: Dataset, seconds: float) -> tuple[float, float]:
    """(batches per CPU-second, batches per wall-second) over about `seconds` of CPU time."""
    loader = DataLoader(ds, batch_size=BATCH, num_workers=0, drop_last=True)
    n, c0, w0 = 0, time.process_time(), time.perf_counter()
    while True:
        for xb, yb in loader:
            assert xb.shape == yb.shape == (BATCH, L)
            n += 1
            cpu = time.process_time() - c0
            if cpu >= seconds:
                return n / cpu, n / (time.perf_counter() - w0)


def get_batch_per_second(ds: PretrainDataset, seconds: float) -> tuple[float, float]:
    """Like batches_per_second, but through ds.get_batch (the same batches, no DataLoader/collate):
    what a trainer that feeds sampler batches straight in gets."""
    batches = [list(range(b * BATCH, (b + 1) * BATCH)) for b in range(len(ds) // BATCH)]
    n, c0, w0 = 0, time.process_time(), time.perf_counter()
    while True:
        for indices in batches:
            x_BT, y_BT = ds.get_batch(indices)
            assert x_BT.shape == y_BT.shape == (BATCH, L)
            n += 1
            cpu = time.process_time() - c0
            if cpu >= seconds:
                return n / cpu, n / (time.perf_counter() - w0)


def best_of(fn: Callable[[], float], repeats: int) -> float:
    return max(fn() for _ in range(repeats))


def memcpy_gbps(n_bytes: int = 256 << 20, repeats: int = 5) -> float:
    """This machine's single-thread memcpy bandwidth (GB/s, best of `repeats`, CPU time)."""
    src = np.ones(n_bytes // 8, dtype=np.int64)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in first
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        np.copyto(dst, src)
        best = min(best, time.process_time() - t0)
    return n_bytes / best / 1e9


def check_same_windows(seed_ds: Dataset, ours: PretrainDataset) -> None:
    assert len(seed_ds) == len(ours), (len(seed_ds), len(ours))
    picks = np.unique(np.linspace(0, len(ours) - 1, 25).astype(int))
    for i in picks:
        sx, sy = seed_ds[int(i)]
        ox, oy = ours[int(i)]
        assert torch.equal(sx.long(), ox) and torch.equal(sy.long(), oy), f"window {i} differs"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=1.0, help="CPU seconds per measurement")
    parser.add_argument("--repeats", type=int, default=3, help="alternating repeats per measurement (best)")
    args = parser.parse_args()
    # One thread: with num_workers=0 the loader runs in the training process's main thread, and CPU time
    # then counts exactly the work done. On a shared machine CPU time is stable where wall time is not.
    torch.set_num_threads(1)

    cases = [
        ("a", "4 shards x 2M tokens", [2_000_000] * 4, False),
        ("b", "400 shards x 1,000 tokens", [1_000] * 400, False),
        ("c", "1 file x 8M tokens", [8_000_000], True),
    ]
    mem_gbps = memcpy_gbps()
    batch_bytes = 2 * BATCH * L * 8  # x and y, int64
    rows = []
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_data_") as tmp:
        rng = np.random.default_rng(0)
        for key, desc, sizes, single in cases:
            seed_path, ours_path = write_corpus(Path(tmp), key, sizes, single, rng)
            t0 = time.perf_counter()
            seed_ds = SeedPretrainDataset(str(seed_path), L, VOCAB)
            seed_open = time.perf_counter() - t0
            t0 = time.perf_counter()
            ours = PretrainDataset(ours_path, L, VOCAB)
            ours_open = time.perf_counter() - t0
            check_same_windows(seed_ds, ours)
            contenders = (
                ("seed", batches_per_second, seed_ds),
                ("ours", batches_per_second, ours),
                ("floor", batches_per_second, LoaderFloor(len(ours))),
                ("get_batch", get_batch_per_second, ours),
            )
            best = {name: (0.0, 0.0) for name, _, _ in contenders}
            for _ in range(args.repeats):  # alternate so that noise hits all alike
                for name, measure, ds in contenders:
                    cpu, wall = measure(ds, args.seconds)
                    best[name] = (max(best[name][0], cpu), max(best[name][1], wall))
            rows.append((key, desc, len(ours), best, seed_open, ours_open))
            del seed_ds, ours, contenders, ds

    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}")
    print(f"torch {torch.__version__} (1 thread), numpy {np.__version__}, python {platform.python_version()}")
    print(
        f"DataLoader(batch_size={BATCH}, num_workers=0), L={L}; batches per CPU-second, best of "
        f"{args.repeats} alternating runs of {args.seconds} CPU-s; wall-clock ratio alongside"
    )
    print(f"memcpy bandwidth (np.copyto, 256 MiB, 1 thread): {mem_gbps:.2f} GB/s")
    print()
    header = (
        f"{'case':<30} {'windows':>7} {'seed b/s':>9} {'ours b/s':>9} {'ours/seed':>9} {'target':>7} "
        f"{'wall ratio':>10} {'ceiling':>8} {'ours GB/s':>9} {'of memcpy':>9} {'get_batch':>10} "
        f"{'open s seed/ours':>17}"
    )
    print(header)
    print("-" * len(header))
    for key, desc, n_win, best, seed_open, ours_open in rows:
        (seed_bps, seed_wall), (ours_bps, ours_wall) = best["seed"], best["ours"]
        ratio = ours_bps / seed_bps
        ours_gbps = ours_bps * batch_bytes / 1e9
        miss = "" if ratio >= TARGETS[key] else "  MISS"
        print(
            f"({key}) {desc:<26} {n_win:>7} {seed_bps:>9.1f} {ours_bps:>9.1f} {ratio:>8.1f}x "
            f"{'>=' + str(TARGETS[key]):>7} {ours_wall / seed_wall:>9.1f}x "
            f"{best['floor'][0] / seed_bps:>7.1f}x {ours_gbps:>9.2f} {ours_gbps / mem_gbps:>9.0%} "
            f"{best['get_batch'][0] / seed_bps:>9.1f}x "
            f"{seed_open:>8.3f}/{ours_open:<8.3f}{miss}"
        )
    print("\nceiling: the ratio a dataset doing no work at all would get (DataLoader + default collate only)")
    print("get_batch: ours/seed when the same batches come from ds.get_batch (no DataLoader, no collate)")
    print("ours GB/s: int64 bytes of x and y delivered per CPU-second through the DataLoader")
    print(f"total {time.perf_counter() - t_start:.0f}s")


if __name__ == "__main__":
    main()
