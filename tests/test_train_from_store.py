"""Training from a dataset in object storage (data.train_data_path: s3://...) through the verified local
cache (data/remote_cache.py), against moto's S3 server on loopback (tests/s3_server.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mamba3lite.data import remote_cache
from mamba3lite.data.remote_cache import entry_dir, fetch_dataset
from mamba3lite.data.shards import MANIFEST_NAME, Manifest
from mamba3lite.data.store import upload_dataset
from mamba3lite.errors import ConfigError, DataError, DataNotFoundError
from mamba3lite.train.entry import run_training
from userside_helpers import make_dataset, tiny_config


def uploaded(s3, tmp_path: Path, name: str = "ds", repeats: int = 8, seed: int = 0) -> tuple[Path, str]:
    """A small GPT-2 dataset (train and val splits) written locally and uploaded: (local dir, URL)."""
    local = make_dataset(tmp_path / name, repeats=repeats, seed=seed)
    bucket = s3.bucket()
    url = f"s3://{bucket}/{name}/"
    upload_dataset(local, url)
    return local, url


def test_training_from_s3_equals_training_from_the_local_copy(s3, tmp_path):
    local, url = uploaded(s3, tmp_path)
    cache = tmp_path / "cache"
    losses = []
    for run, data in (("local", local), ("remote", url)):
        cfg = tiny_config(tmp_path / run, data, max_steps=20)
        cfg = cfg.replace("data", cache_dir=str(cache))
        result = run_training(cfg)
        assert result.step == 20
        losses.append([loss for _, loss in result.history])
    assert len(losses[0]) == 20 and losses[0] == losses[1]  # loss for loss, exactly
    # the cache holds the manifest and every shard, byte for byte
    entry = entry_dir(cache, url)
    for s in Manifest.load(local).shards:
        assert (entry / s.path).read_bytes() == (local / s.path).read_bytes()


def test_a_corrupt_or_missing_shard_object_is_one_clear_error(s3, tmp_path, cli):
    local, url = uploaded(s3, tmp_path)
    bucket, shard = url.split("/")[2], Manifest.load(local).shards[0]
    good = (local / shard.path).read_bytes()
    bad = bytearray(good)
    bad[10] ^= 0xFF  # the same size, one byte changed
    s3.put(bucket, f"ds/{shard.path}", bytes(bad))
    cache = tmp_path / "cache"
    with pytest.raises(DataError, match=rf"{url}{shard.path}: its sha256 is .* the manifest records"):
        fetch_dataset(url, cache, 1 << 30)
    entry = entry_dir(cache, url)
    assert not (entry / shard.path).exists() and not (entry / MANIFEST_NAME).exists()
    # the same through the CLI: one line, no traceback, a non-zero exit
    r = cli(
        "train", "--config", "tiny", "--data-path", url, "--checkpoint-dir", str(tmp_path / "run"),
        "--set", f"data.cache_dir={cache}", "--set", "training.max_steps=1", "--set", "training.device=cpu",
    )  # fmt: skip
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert f"{url}{shard.path}: its sha256 is" in r.stderr
    # a shard missing from the bucket: named, before anything is fetched
    s3.client.delete_object(Bucket=bucket, Key=f"ds/{shard.path}")
    with pytest.raises(DataNotFoundError, match=rf"{url}{shard.path}: no such object"):
        fetch_dataset(url, cache, 1 << 30)
    # a prefix without a manifest: an unfinished upload
    s3.client.delete_object(Bucket=bucket, Key="ds/manifest.json")
    with pytest.raises(DataNotFoundError, match="upload did not finish"):
        fetch_dataset(url, cache, 1 << 30)


def test_the_cache_evicts_what_no_process_holds_under_its_size_limit(s3, tmp_path, monkeypatch):
    a_local, a_url = uploaded(s3, tmp_path, "a", seed=1)
    b_local, b_url = uploaded(s3, tmp_path, "b", seed=2)
    size = {
        u: sum(s.n_tokens * 2 for s in Manifest.load(p).shards)
        for u, p in ((a_url, a_local), (b_url, b_local))
    }
    cache = tmp_path / "cache"
    limit = size[a_url] + size[b_url] - 1  # room for one dataset, not both
    a = fetch_dataset(a_url, cache, limit)
    assert a.fetched and not a.reused
    with pytest.raises(ConfigError, match=r"data.cache_max_gb"):  # a is held: it is not evicted
        fetch_dataset(b_url, cache, limit)
    assert (entry_dir(cache, a_url) / MANIFEST_NAME).exists()
    a.close()  # no process reads a any more
    b = fetch_dataset(b_url, cache, limit)
    assert not entry_dir(cache, a_url).exists() and (b.path / MANIFEST_NAME).exists()
    b.close()
    # a cached copy is verified again before use: a damaged one is fetched again, the others reused
    shard = Manifest.load(b_local).shards[0].path
    (b.path / shard).write_bytes(b"\0" * (b.path / shard).stat().st_size)
    again = fetch_dataset(b_url, cache, limit)
    assert again.fetched == [shard] and len(again.reused) == len(Manifest.load(b_local).shards) - 1
    assert (again.path / shard).read_bytes() == (b_local / shard).read_bytes()
    again.close()
    # files verified since they last changed are not hashed again (one hash per download, not per start)
    monkeypatch.setattr(remote_cache, "_sha256", lambda path: pytest.fail(f"{path} hashed again"))
    last = fetch_dataset(b_url, cache, limit)
    assert not last.fetched and len(last.reused) == len(Manifest.load(b_local).shards)
    last.close()


def test_the_cache_limit_is_a_positive_number_of_gb():
    from mamba3lite.config import Config

    assert Config().data.cache_max_gb > 0
    for bad in (0, -1.0, True):
        with pytest.raises(ConfigError, match=r"data\.cache_max_gb must be"):
            Config().replace("data", cache_max_gb=bad)


def test_a_dataset_with_its_own_tokenizer_is_fetched_with_it(s3, tmp_path):
    """`prepare --train-tokenizer` writes tokenizer.json into the dataset: the cache fetches it too,
    held to the manifest's vocab_hash (its sha256), so the cached copy loads as the local one does."""
    pytest.importorskip("tokenizers")
    from mamba3lite.data.prepare import prepare

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"{i}.txt").write_text(f"document {i}: " + "some words to fit merges on, " * (20 + i))
    prepare([str(corpus)], tmp_path / "ds", workers=0, val_fraction=0, train_tokenizer=270)
    url = f"s3://{s3.bucket()}/ds/"
    upload_dataset(tmp_path / "ds", url)
    held = fetch_dataset(url, tmp_path / "cache", 1 << 30)
    try:
        assert "tokenizer.json" in held.fetched
        assert (held.path / "tokenizer.json").read_bytes() == (
            tmp_path / "ds" / "tokenizer.json"
        ).read_bytes()
        assert (
            Manifest.load(held.path).identity.vocab_hash == Manifest.load(tmp_path / "ds").identity.vocab_hash
        )
    finally:
        held.close()


def test_ranks_on_one_node_share_one_fetch(s3, tmp_path):
    """Two fetchers of one URL at once (the ranks of a node): the cache lock lets one download while
    the other waits, then finds every shard verified; both get the same, complete copy."""
    from concurrent.futures import ThreadPoolExecutor

    local, url = uploaded(s3, tmp_path)
    n = len(Manifest.load(local).shards)
    with ThreadPoolExecutor(2) as pool:
        a, b = pool.map(lambda _: fetch_dataset(url, tmp_path / "cache", 1 << 30), range(2))
    try:
        assert a.path == b.path and sorted([len(a.fetched), len(b.fetched)]) == [0, n]
        assert sorted([len(a.reused), len(b.reused)]) == [0, n]
        assert Manifest.load(a.path).shards == Manifest.load(local).shards
    finally:
        a.close()
        b.close()
