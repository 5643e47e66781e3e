"""PretrainDataset (data/dataset.py): the seed's window math on every layout, its invariants, and every
bad input's error. The reference is the seed's semantics written as plainly as possible: concatenate all
tokens, window i = tokens[i·L : i·L + L + 1]."""

from __future__ import annotations

import hashlib
import json
import logging
import pickle
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from mamba3lite.atomicfile import atomic_write_json
from mamba3lite.data import PretrainDataset
from mamba3lite.data.dataset import n_windows, window_span
from mamba3lite.data.shards import MANIFEST_NAME, Manifest, dtype_for_vocab, write_shard
from mamba3lite.errors import ConfigError, DataError, DataNotFoundError

VOCAB = 70_000  # > 65,536 so uint32 manifests are exercised too; uint16 cases use a smaller vocab
LAYOUTS = ["manifest", "seed_torch_dir", "raw_dir", "single_torch", "single_raw"]


def write_manifest_dataset(root: Path, parts: list[np.ndarray], vocab: int, split: str = "train") -> Manifest:
    dtype = dtype_for_vocab(vocab)
    infos = [
        write_shard(
            root, f"{split}/shard_{k:05d}.bin", p, split=split, n_docs=0, n_bytes=4 * len(p), dtype=dtype
        )
        for k, p in enumerate(parts)
    ]
    m = Manifest(
        vocab_size=vocab, eos_id=0, dtype=dtype.name, tokenizer={"name": "t", "vocab_hash": ""}, shards=infos
    )
    m.save(root)
    return m


def build(layout: str, root: Path, parts: list[np.ndarray], L: int, vocab: int = VOCAB) -> PretrainDataset:
    """Write `parts` (the shards, in order) in `layout` under root and open it."""
    root.mkdir(parents=True, exist_ok=True)
    if layout == "manifest":
        write_manifest_dataset(root, parts, vocab)
        return PretrainDataset(root, L, vocab)
    if layout == "seed_torch_dir":  # as the seed's e2e test writes them: torch.save'd int64 tensors
        for k, p in enumerate(parts):
            torch.save(torch.from_numpy(p.astype(np.int64)), root / f"shard_{k:04d}.bin")
        return PretrainDataset(root, L, vocab)
    if layout == "raw_dir":  # the seed pipeline's raw uint32 files, no manifest
        for k, p in enumerate(parts):
            p.astype("<u4").tofile(root / f"shard_{k:04d}.bin")
        return PretrainDataset(root, L, vocab, dtype="uint32")
    allt = np.concatenate(parts)
    if layout == "single_torch":
        torch.save(torch.from_numpy(allt.astype(np.int64)), root / "tokens.pt")
        return PretrainDataset(root / "tokens.pt", L, vocab)
    assert layout == "single_raw"
    allt.astype("<u4").tofile(root / "tokens.bin")
    return PretrainDataset(root / "tokens.bin", L, vocab, dtype=np.uint32)


def reference_window(tokens: np.ndarray, i: int, L: int) -> tuple[np.ndarray, np.ndarray]:
    chunk = tokens[i * L : i * L + L + 1]
    return chunk[:-1], chunk[1:]


def assert_matches_reference(ds: PretrainDataset, tokens: np.ndarray, L: int) -> None:
    n = (len(tokens) - 1) // L
    assert len(ds) == n
    for i in range(n):
        x, y = ds[i]
        rx, ry = reference_window(tokens, i, L)
        assert x.dtype == torch.int64 and y.dtype == torch.int64
        np.testing.assert_array_equal(x.numpy(), rx)
        np.testing.assert_array_equal(y.numpy(), ry)


def split_parts(tokens: np.ndarray, cuts: list[int]) -> list[np.ndarray]:
    return np.split(tokens, sorted(c % (len(tokens) + 1) for c in cuts))


@pytest.mark.parametrize("layout", LAYOUTS)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n_tokens=st.integers(2, 300),
    L=st.integers(1, 40),
    cuts=st.lists(st.integers(0, 10_000), max_size=8),
    seed=st.integers(0, 2**16),
)
def test_windows_equal_seed_semantics(tmp_path_factory, layout, n_tokens, L, cuts, seed):
    tokens = np.random.default_rng(seed).integers(0, VOCAB, n_tokens)
    if (n_tokens - 1) // L < 1:
        L = n_tokens - 1
    root = tmp_path_factory.mktemp(layout)
    parts = split_parts(tokens, cuts) if layout not in ("single_torch", "single_raw") else [tokens]
    ds = build(layout, root, parts, L)
    assert ds.layout == ("single" if layout.startswith("single") else "sharded")
    assert ds.n_tokens == n_tokens
    assert_matches_reference(ds, tokens, L)


def assert_batched_equals_single(ds: PretrainDataset, indices: list[int]) -> None:
    """The batched paths (DataLoader's __getitems__, the trainer's get_batch) equal ds[i] one by one."""
    singles = [ds[i] for i in indices]
    for (bx, by), (sx, sy) in zip(ds.__getitems__(indices), singles, strict=True):
        assert bx.dtype == torch.int64 and torch.equal(bx, sx) and torch.equal(by, sy)
    x_BT, y_BT = ds.get_batch(indices)
    assert x_BT.shape == y_BT.shape == (len(indices), ds.max_seq_len) and x_BT.dtype == torch.int64
    if indices:
        assert torch.equal(x_BT, torch.stack([x for x, _ in singles]))
        assert torch.equal(y_BT, torch.stack([y for _, y in singles]))


@pytest.mark.parametrize("layout", LAYOUTS)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n_tokens=st.integers(2, 300),
    L=st.integers(1, 40),
    cuts=st.lists(st.integers(0, 10_000), max_size=8),
    data=st.data(),
)
def test_batched_gather_equals_per_window_reference(tmp_path_factory, layout, n_tokens, L, cuts, data):
    tokens = np.random.default_rng(n_tokens).integers(0, VOCAB, n_tokens)
    L = min(L, n_tokens - 1)
    parts = split_parts(tokens, cuts) if not layout.startswith("single") else [tokens]
    ds = build(layout, tmp_path_factory.mktemp(layout), parts, L)
    indices = data.draw(st.lists(st.integers(0, len(ds) - 1), max_size=12))
    assert_batched_equals_single(ds, indices)


def test_batched_gather_on_mixed_source_dtypes(tmp_path):
    # A manifest-less directory may mix torch.save'd int64 shards with raw ones: the cast path.
    tokens = np.random.default_rng(4).integers(0, 60_000, 500)
    torch.save(torch.from_numpy(tokens[:123]), tmp_path / "shard_0000.bin")
    tokens[123:300].astype("<u2").tofile(tmp_path / "shard_0001.bin")
    torch.save(torch.from_numpy(tokens[300:].astype(np.int32)), tmp_path / "shard_0002.bin")
    ds = PretrainDataset(tmp_path, 30, 60_000, dtype="uint16")
    assert ds._tokens.unit_dtype is None  # white-box: the mixed-dtype (np.concatenate) path
    assert_matches_reference(ds, tokens, 30)
    assert_batched_equals_single(ds, [*range(len(ds)), 3, 0])
    with pytest.raises(IndexError):
        ds.get_batch([0, len(ds)])
    with pytest.raises(IndexError):
        ds.__getitems__([-1])


def test_dummy_batched_equals_single():
    ds = PretrainDataset(None, 8, 100, dummy=True, seed=3, dummy_tokens=100)
    assert_batched_equals_single(ds, [0, 11, 5, 5])


@pytest.mark.parametrize("layout", ["manifest", "seed_torch_dir", "raw_dir"])
def test_window_starting_exactly_at_a_shard_start(tmp_path, layout):
    L = 8
    tokens = np.arange(1, 41)
    ds = build(layout, tmp_path, [tokens[:16], tokens[16:24], tokens[24:]], L)
    # window 2 starts at token 16 = first token of shard 1 and ends at the first token of shard 2
    x, y = ds[2]
    assert x.tolist() == list(range(17, 25)) and y.tolist() == list(range(18, 26))
    # window 1 ends exactly on shard 1's first token
    x, y = ds[1]
    assert x[0].item() == 9 and y[-1].item() == 17
    assert_matches_reference(ds, tokens, L)


@pytest.mark.parametrize("layout", ["manifest", "seed_torch_dir", "raw_dir"])
def test_windows_spanning_many_tiny_and_empty_shards(tmp_path, layout):
    rng = np.random.default_rng(1)
    sizes = rng.integers(0, 4, 120)  # shards of 0..3 tokens, many shorter than L
    tokens = rng.integers(0, VOCAB, int(sizes.sum()))
    parts = np.split(tokens, np.cumsum(sizes)[:-1])
    L = 64
    ds = build(layout, tmp_path, parts, L)
    assert len(ds) >= 2
    assert_matches_reference(ds, tokens, L)


def test_uint16_manifest_keeps_high_ids_and_reads_val_split(tmp_path):
    tokens = np.array([65_535, 0, 40_000, 65_534, 1, 2, 3, 4, 5])
    write_manifest_dataset(tmp_path, [tokens[:4], tokens[4:]], vocab=65_536, split="val")
    ds = PretrainDataset(tmp_path, 4, 65_536, split="val")
    assert ds.manifest is not None and ds.manifest.dtype == "uint16"
    assert_matches_reference(ds, tokens, 4)
    assert ds.bytes_per_token == pytest.approx(4.0)


def test_torch_saved_view_with_storage_offset(tmp_path):
    # torch.save of a slice saves the whole storage plus an offset; the reader must honour the offset.
    big = torch.arange(1000, dtype=torch.int64)
    torch.save(big[100:300], tmp_path / "t.pt")
    ds = PretrainDataset(tmp_path / "t.pt", 10, 5000)
    assert_matches_reference(ds, np.arange(100, 300), 10)
    assert_batched_equals_single(ds, [0, 18, 7])


def test_torch_saved_strided_tensor(tmp_path):
    # A non-contiguous saved view cannot be exported as bytes: the gather falls back to array slices.
    big = torch.arange(1000, dtype=torch.int64)
    torch.save(big[::3], tmp_path / "shard_0000.bin")
    torch.save(big[1::3], tmp_path / "shard_0001.bin")
    ds = PretrainDataset(tmp_path, 10, 5000)
    tokens = np.concatenate([np.arange(0, 1000, 3), np.arange(1, 1000, 3)])
    assert ds._tokens.unit_dtype is None  # white-box: this test exists to exercise the array-slice path
    assert_matches_reference(ds, tokens, 10)
    assert_batched_equals_single(ds, list(range(len(ds))))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_seed_invariants(tmp_path, layout):
    L, T = 16, 16 * 20 + 5
    tokens = np.random.default_rng(2).integers(0, VOCAB, T)
    parts = (
        [tokens]
        if layout.startswith("single")
        else [tokens[:37], tokens[37:38], tokens[38:200], tokens[200:]]
    )
    ds = build(layout, tmp_path, parts, L)
    n = len(ds)
    assert n == (T - 1) // L == n_windows(T, L)  # 3: len == (T-1)//L, numbering ignores shards
    assert window_span(n - 1, L)[1] <= T  # 1 and 5: the last window is complete
    assert ds.layout in ("single", "sharded", "dummy")  # 5
    for i in range(n):
        x, y = ds[i]
        assert x.shape == y.shape == (L,)  # 1: L + 1 tokens per window
        assert x.dtype == y.dtype == torch.int64 and x.device.type == "cpu"  # 6
        assert torch.equal(y[:-1], x[1:])  # 2: y[j] == x[j+1]
        if i + 1 < n:
            assert y[-1].item() == ds[i + 1][0][0].item()  # 4: consecutive windows share one token
    with pytest.raises(IndexError):
        ds[n]


def test_dataloader_batches(tmp_path):
    tokens = np.arange(1000) % 300
    ds = build("manifest", tmp_path, [tokens[:333], tokens[333:]], 32, vocab=300)
    xb, yb = next(iter(DataLoader(ds, batch_size=4, num_workers=0, drop_last=True)))
    assert xb.shape == yb.shape == (4, 32) and xb.dtype == torch.int64
    assert torch.equal(xb[:, 1:], yb[:, :-1])
    assert torch.equal(xb, torch.stack([ds[i][0] for i in range(4)]))
    # a shuffled loader goes through __getitems__ with arbitrary indices
    g = torch.Generator().manual_seed(0)
    for xb, yb in DataLoader(ds, batch_size=5, shuffle=True, generator=g):
        assert xb.shape[1] == 32 and torch.equal(xb[:, 1:], yb[:, :-1])


def test_pickles_small_and_reopens(tmp_path):
    tokens = np.random.default_rng(3).integers(0, VOCAB, 50_000)
    ds = build("manifest", tmp_path, [tokens[:20_000], tokens[20_000:]], 100)
    blob = pickle.dumps(ds)
    assert len(blob) < 5_000  # the file list, not the tokens
    ds2 = pickle.loads(blob)
    for i in (0, 199, 200, len(ds) - 1):
        assert torch.equal(ds2[i][0], ds[i][0]) and torch.equal(ds2[i][1], ds[i][1])


RESIDENT_SNIPPET = """
import re, sys
from pathlib import Path
from mamba3lite.data import PretrainDataset

def rss_anon_kib():
    return int(re.search(r"^RssAnon:\\s+(\\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1))

for path in sys.argv[1:]:
    before = rss_anon_kib()  # before opening: materialising the corpus would show up below
    ds = PretrainDataset(path, 2048, 50_000)
    total = 0
    for i in range(len(ds)):
        x, y = ds[i]
        total += int(x[0]) + int(y[-1])
    print(rss_anon_kib() - before, total)
    del ds
"""


def test_epoch_does_not_make_corpus_resident(tmp_path):
    """The seed's single layout loads the corpus into anonymous memory; ours maps it. File-backed pages
    of a mapping are reclaimable page cache, so we measure anonymous resident memory (RssAnon), in a
    fresh process that never held the corpus (so the allocator's free lists cannot hide a copy).
    Both a manifest dataset (2 uint16 shards) and a torch.save'd int64 single file, in one process."""
    if not Path("/proc/self/status").exists() or "RssAnon" not in Path("/proc/self/status").read_text():
        pytest.skip("needs Linux /proc/self/status RssAnon")
    T, L = 4_000_000, 2048
    tokens = (np.arange(T, dtype=np.int64) * 7919) % 50_000
    build("manifest", tmp_path / "m", [tokens[: T // 2], tokens[T // 2 :]], L, vocab=50_000)
    build("single_torch", tmp_path / "s", [tokens], L, vocab=50_000)
    paths = [str(tmp_path / "m"), str(tmp_path / "s" / "tokens.pt")]
    out = subprocess.run([sys.executable, "-c", RESIDENT_SNIPPET, *paths], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    corpus_kib = T * 8 // 1024  # 31 MiB as int64
    for line in out.stdout.splitlines():
        growth_kib, total = map(int, line.split())
        assert total > 0
        assert growth_kib < corpus_kib // 4, (growth_kib, corpus_kib)
    assert len(out.stdout.splitlines()) == 2


# ------------------------------------------------------------------------------------------------ dummy

DUMMY_SNIPPET = """
import hashlib, sys
from mamba3lite.data import PretrainDataset
ds = PretrainDataset(None, 32, 1000, dummy=True, seed=7)
x, y = ds[5]
print(hashlib.sha256(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest())
"""


def test_dummy_is_deterministic_across_processes():
    ds = PretrainDataset(None, 32, 1000, dummy=True, seed=7)
    x, y = ds[5]
    here = hashlib.sha256(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest()
    out = subprocess.run([sys.executable, "-c", DUMMY_SNIPPET], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == here


def test_dummy_windows_shift_vary_and_are_configurable(caplog):
    with caplog.at_level(logging.WARNING, logger="mamba3lite"):
        ds = PretrainDataset("/does/not/matter", 16, 500, dummy=True, seed=1, dummy_tokens=16 * 10 + 1)
    assert [r.getMessage() for r in caplog.records if "DUMMY DATA" in r.getMessage()] != []
    assert len(caplog.records) == 1
    assert ds.layout == "dummy" and len(ds) == 10
    x, y = ds[3]
    assert x.shape == (16,) and x.dtype == torch.int64
    assert torch.equal(y[:-1], x[1:])
    assert int(x.max()) < 500 and int(x.min()) >= 0
    assert torch.equal(ds[3][0], x)  # same index, same window
    assert not torch.equal(ds[4][0], x)
    assert not torch.equal(PretrainDataset(None, 16, 500, dummy=True, seed=2)[3][0], x)
    assert len(PretrainDataset(None, 16, 500, dummy=True)) == 1000  # the seed's default count


# ----------------------------------------------------------------------------------------------- errors


def test_missing_path_is_an_error_naming_path_and_the_fix(tmp_path):
    # (not random tokens, the seed's silent fallback; `train` adds how to ask for those: test_train_cli)
    missing = tmp_path / "no_such_data.bin"
    with pytest.raises(FileNotFoundError) as e:
        PretrainDataset(missing, 16, 100)
    msg = str(e.value)
    assert isinstance(e.value, DataNotFoundError)
    assert str(missing) in msg and "mamba3lite prepare" in msg and "fix the path" in msg


def test_empty_directory(tmp_path):
    with pytest.raises(DataError, match=re.escape(str(tmp_path))):
        PretrainDataset(tmp_path, 16, 100)


def test_unfinished_prepare_is_named(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "shard_00000.bin").write_bytes(b"\x00\x00" * 100)
    with pytest.raises(DataError, match="unfinished"):
        PretrainDataset(tmp_path, 16, 100)


def test_size_not_multiple_of_dtype(tmp_path):
    (tmp_path / "shard_0000.bin").write_bytes(b"\x01\x00\x00\x00" * 50 + b"\x01\x02")
    with pytest.raises(DataError, match=r"shard_0000\.bin.*not a multiple of 4"):
        PretrainDataset(tmp_path, 16, 100, dtype="uint32")
    (tmp_path / "one.bin").write_bytes(b"\x01" * 101)
    with pytest.raises(DataError, match=r"one\.bin.*not a multiple of 2"):
        PretrainDataset(tmp_path / "one.bin", 16, 100, dtype="uint16")


def test_raw_without_manifest_needs_dtype(tmp_path):
    np.arange(100, dtype="<u4").tofile(tmp_path / "tokens.bin")
    with pytest.raises(DataError, match=r"tokens\.bin.*data\.token_dtype"):
        PretrainDataset(tmp_path / "tokens.bin", 16, 200)


def test_manifest_disagreeing_with_files(tmp_path):
    tokens = np.arange(200) % 100
    write_manifest_dataset(tmp_path, [tokens[:100], tokens[100:]], vocab=100)
    shard = tmp_path / "train" / "shard_00001.bin"
    shard.write_bytes(shard.read_bytes()[:-2])  # one token short
    with pytest.raises(DataError, match=r"shard_00001\.bin.*198 bytes.*manifest\.json"):
        PretrainDataset(tmp_path, 16, 100)
    shard.unlink()
    with pytest.raises(DataError, match=r"shard_00001\.bin.*missing"):
        PretrainDataset(tmp_path, 16, 100)


def test_manifest_vocab_mismatch_names_both_values_and_file(tmp_path):
    write_manifest_dataset(tmp_path, [np.arange(100)], vocab=100)
    with pytest.raises(DataError) as e:
        PretrainDataset(tmp_path, 16, 50_257)
    msg = str(e.value)
    assert "100" in msg and "50257" in msg and str(tmp_path / MANIFEST_NAME) in msg


def test_manifest_without_the_split(tmp_path):
    write_manifest_dataset(tmp_path, [np.arange(100)], vocab=100)
    with pytest.raises(DataError, match=r"manifest\.json: no shards for split 'val' \(it has: train\)"):
        PretrainDataset(tmp_path, 16, 100, split="val")


def test_corrupt_manifest_is_named(tmp_path):
    write_manifest_dataset(tmp_path, [np.arange(100)], vocab=100)
    d = json.loads((tmp_path / MANIFEST_NAME).read_text())
    d["shards"][0]["max_token_id"] = 100
    atomic_write_json(tmp_path / MANIFEST_NAME, d)
    with pytest.raises(DataError, match=r"manifest\.json.*max_token_id 100 >= vocab_size 100"):
        PretrainDataset(tmp_path, 16, 100)


@pytest.mark.parametrize("layout", ["seed_torch_dir", "raw_dir", "single_torch", "single_raw"])
def test_ids_beyond_vocab_without_manifest_name_the_shard(tmp_path, layout):
    tokens = np.arange(300) % 100
    tokens[250] = 100
    parts = [tokens] if layout.startswith("single") else [tokens[:200], tokens[200:]]
    with pytest.raises(DataError, match=r"(shard_0001\.bin|tokens\.(pt|bin)): token id 100 is outside"):
        build(layout, tmp_path, parts, 16, vocab=100)


def test_negative_ids_in_torch_file(tmp_path):
    torch.save(torch.tensor([1, 2, -3, 4] * 10), tmp_path / "t.pt")
    with pytest.raises(DataError, match="token id -3"):
        PretrainDataset(tmp_path / "t.pt", 4, 100)


@pytest.mark.parametrize(
    "obj", [torch.ones(50), torch.ones(5, 10, dtype=torch.int64), {"tokens": torch.arange(50)}]
)
def test_torch_file_must_hold_a_1d_integer_tensor(tmp_path, obj):
    torch.save(obj, tmp_path / "shard_0000.bin")
    with pytest.raises(DataError, match=r"shard_0000\.bin.*1-D integer tensor"):
        PretrainDataset(tmp_path, 4, 100)


@pytest.mark.parametrize("obj", [np.arange(50), np.arange(6).reshape(2, 3)])
def test_torch_file_with_a_pickled_non_tensor_is_one_line_naming_the_fix(tmp_path, obj):
    torch.save(obj, tmp_path / "shard_0000.bin")
    with pytest.raises(DataError, match=r"shard_0000\.bin: holds a pickled object.*torch\.from_numpy") as e:
        PretrainDataset(tmp_path, 4, 100)
    assert "\n" not in str(e.value) and "weights_only" not in str(e.value)


def test_corpus_too_short_for_one_window(tmp_path):
    write_manifest_dataset(tmp_path, [np.arange(16)], vocab=100)
    with pytest.raises(DataError, match="no window"):
        PretrainDataset(tmp_path, 16, 100)  # 16 tokens < L + 1 = 17


def test_bad_arguments():
    with pytest.raises(ConfigError, match="max_seq_len"):
        PretrainDataset(None, 0, 100, dummy=True)
    with pytest.raises(ConfigError, match="vocab_size"):
        PretrainDataset(None, 8, 0, dummy=True)
    with pytest.raises(ConfigError, match="dummy"):
        PretrainDataset(None, 8, 100)
    with pytest.raises(ConfigError, match="dummy_tokens"):
        PretrainDataset(None, 8, 100, dummy=True, dummy_tokens=8)
    with pytest.raises(ConfigError, match="seed"):
        PretrainDataset(None, 8, 100, dummy=True, seed=-1)


def test_dtype_argument_must_match_manifest(tmp_path):
    write_manifest_dataset(tmp_path, [np.arange(100)], vocab=100)
    with pytest.raises(DataError, match="uint32"):
        PretrainDataset(tmp_path, 16, 100, dtype="uint32")
    assert len(PretrainDataset(tmp_path / MANIFEST_NAME, 16, 100, dtype="uint16")) == 6


def test_ids_beyond_vocab_written_after_prepare_are_refused_per_batch(tmp_path):
    # Manifest shards are trusted at construction (no full scan); bytes changed afterwards are caught
    # when their window is read, naming the shard, before they reach the embedding.
    tokens = np.arange(300) % 100
    write_manifest_dataset(tmp_path, [tokens[:150], tokens[150:]], vocab=100)
    shard = tmp_path / "train" / "shard_00001.bin"
    raw = bytearray(shard.read_bytes())
    raw[20:22] = (250).to_bytes(2, "little")  # token 10 of shard 1 = global token 160, in window 10
    shard.write_bytes(bytes(raw))
    ds = PretrainDataset(tmp_path, 16, 100)
    assert ds[0][0].shape == (16,)  # other windows still read
    for read in (lambda: ds[9], lambda: ds.get_batch([0, 9]), lambda: ds.__getitems__([9])):
        with pytest.raises(DataError, match=r"shard_00001\.bin: token id 250 at token 10 is outside"):
            read()
