"""Object storage against a real S3 API (moto's server on 127.0.0.1, tests/s3_server.py): the store's
listing, reads and errors, `prepare` from a bucket (the same shards as from a local copy), and the
manifest-last upload."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from mamba3lite.data.prepare import prepare
from mamba3lite.data.shards import MANIFEST_NAME, Manifest
from mamba3lite.data.store import Store, upload_dataset
from mamba3lite.errors import (
    DataError,
    DataNotFoundError,
    ObjectChangedError,
    StorageAccessError,
    StorageUnreachableError,
)
from s3_server import unreachable_endpoint


def make_corpus(root: Path) -> dict[str, bytes]:
    """A small corpus of mixed kinds (text, JSONL, gzipped JSONL, Parquet), with a duplicate document, a
    hidden file and a __pycache__ directory that a directory walk skips. Written under `root`; returns
    {relative name: bytes} for uploading the same files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    para = "The quick brown fox jumps over the lazy dog, and then writes a little more text. "
    files = {
        "a/one.txt": (para * 8).encode(),
        "a/two.md": ("# Title\n\n" + para * 5).encode(),
        "a/dup.txt": (para * 8).encode(),  # an exact duplicate of a/one.txt
        "b/lines.jsonl": b"".join(
            json.dumps({"text": f"line {i}: " + para * 3}).encode() + b"\n" for i in range(12)
        )
        + b"\n",
        "b/more.jsonl.gz": gzip.compress(
            b"".join(json.dumps({"text": f"gz {i}: " + para * 2}).encode() + b"\n" for i in range(6)),
            mtime=0,
        ),
        ".hidden.txt": b"never read",
        "c/__pycache__/x.txt": b"never read either",
        "z.py": b"def f(x):\n    return x + 1\n" * 10,
    }
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    table = pa.table({"text": [f"row {i}: " + para * 2 for i in range(9)]})
    pq.write_table(table, root / "c" / "rows.parquet")
    files["c/rows.parquet"] = (root / "c" / "rows.parquet").read_bytes()
    return files


def upload(s3, bucket: str, prefix: str, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        s3.put(bucket, f"{prefix}{name}", data)


def shard_bytes(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("shard_*.bin"))}


def test_list_and_read_a_prefix(s3, tmp_path):
    bucket = s3.bucket()
    upload(s3, bucket, "p/", {"b.txt": b"bee", "a/x.txt": b"hello world", "a/y.txt": b""})
    s3.put(bucket, "other/q.txt", b"not below the prefix")
    store = Store(f"s3://{bucket}/p/")
    objs = store.list()
    assert [o.key for o in objs] == ["a/x.txt", "a/y.txt", "b.txt"]
    assert [o.size for o in objs] == [11, 0, 3]
    assert all(o.etag for o in objs) and str(objs[0]) == f"s3://{bucket}/p/a/x.txt"
    assert store.read(objs[0]) == b"hello world"
    assert store.read(objs[0], 6, 9) == b"wor"  # a range
    assert store.read(objs[1]) == b""
    # one object named by its URL is a listing of one
    (single,) = Store(f"s3://{bucket}/p/b.txt").list()
    assert single.key == "" and single.size == 3
    # a file:// URL and a plain path list the same way
    (tmp_path / "d" / "s").mkdir(parents=True)
    (tmp_path / "d" / "s" / "k.txt").write_bytes(b"local")
    for root in (tmp_path / "d", f"file://{tmp_path / 'd'}"):
        (o,) = Store(root).list()
        assert o.key == "s/k.txt" and o.mtime is not None and Store(root).read(o) == b"local"
    # puts are atomic: on a file system a temp file and a rename (no temp file left), on S3 one PUT
    Store(tmp_path / "d").put("s/new.txt", b"written")
    assert sorted(p.name for p in (tmp_path / "d" / "s").iterdir()) == ["k.txt", "new.txt"]
    store.put("a/x.txt", b"replaced")
    assert Store(f"s3://{bucket}/p/a/x.txt").read(Store(f"s3://{bucket}/p/a/x.txt").list()[0]) == b"replaced"


def test_errors_are_one_line_and_name_the_url(s3, monkeypatch):
    bucket = s3.bucket()
    s3.put(bucket, "p/a.txt", b"version one")
    with pytest.raises(DataNotFoundError, match=r"s3://no-such-bucket-x/p/: no such object or bucket"):
        Store("s3://no-such-bucket-x/p/").list()
    with pytest.raises(DataNotFoundError, match=rf"s3://{bucket}/nothing/: no objects there"):
        Store(f"s3://{bucket}/nothing/").list()
    store = Store(f"s3://{bucket}/p/")
    (obj,) = store.list()
    # a listing recorded in a plan (JSON) reads back without listing again, held to the same etag
    recorded = Store(f"s3://{bucket}/p/").object_from_record(json.loads(json.dumps(obj.record())))
    assert recorded == obj and Store(f"s3://{bucket}/p/").read(recorded) == b"version one"
    s3.put(bucket, "p/a.txt", b"version two")  # the same size, another etag
    with pytest.raises(ObjectChangedError, match=rf"s3://{bucket}/p/a.txt changed"):
        store.read(obj)
    s3.put(bucket, "p/a.txt", b"v3")  # another size
    with pytest.raises(ObjectChangedError, match=rf"s3://{bucket}/p/a.txt changed"):
        Store(f"s3://{bucket}/p/").read(obj)
    # an endpoint nothing listens on (a port just closed): transient, names the endpoint setting
    monkeypatch.setenv("AWS_ENDPOINT_URL", unreachable_endpoint())
    with pytest.raises(
        StorageUnreachableError, match=r"cannot reach the object store \(AWS_ENDPOINT_URL="
    ) as e:
        Store(f"s3://{bucket}/p/").list()
    assert "\n" not in str(e.value) and e.value.exit_code == 1  # transient: the same command may work later


def test_bucket_without_permission(s3, monkeypatch):
    """moto enforces IAM when asked (its reset-auth switch): a user allowed one bucket is refused
    another, and unknown credentials are refused everywhere."""

    allowed, closed = s3.bucket("open"), s3.bucket("closed")
    s3.put(allowed, "p/a.txt", b"readable")
    s3.put(closed, "p/a.txt", b"secret")
    for name, value in s3.user_of_one_bucket(allowed, "reader").items():
        monkeypatch.setenv(name, value)
    s3.enforce_auth(True)
    try:
        (obj,) = Store(f"s3://{allowed}/p/").list()
        assert Store(f"s3://{allowed}/p/").read(obj) == b"readable"
        with pytest.raises(StorageAccessError, match=rf"s3://{closed}/p/: access denied .*AWS_ACCESS_KEY_ID"):
            Store(f"s3://{closed}/p/").list()
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAUNKNOWNUNKNOWN00")
        with pytest.raises(StorageAccessError, match="access denied"):
            Store(f"s3://{allowed}/p/").list()
    finally:
        s3.enforce_auth(False)


def test_a_url_source_gives_the_units_of_its_local_copy(s3, tmp_path):
    """The same units (kind and payload) in the same order, from any start (a resumed run's cursor),
    with the objects' URLs for locations; text objects are read ahead, handed out in order."""
    from mamba3lite.data.sources import Source

    local = tmp_path / "corpus"
    files = make_corpus(local)
    bucket = s3.bucket()
    upload(s3, bucket, "c/", files)
    url = f"s3://{bucket}/c/"

    def units(src: Source, start: int) -> list:
        out = []
        for loc, kind, payload in src.units(start):
            where = loc if isinstance(loc, str) else loc[0]
            out.append((where.replace(url, "").replace(f"{local}/", ""), kind, payload))
        return out

    remote, here = Source(url), Source(str(local))
    assert [o.key for o in remote.objects] == [p.relative_to(local).as_posix() for p in here.files]
    assert remote.fingerprint() != here.fingerprint() and remote.size_bytes() == here.size_bytes()
    for start in (0, 2, 5, 20):
        assert units(remote, start) == units(here, start), start
    assert len(units(remote, 0)) == 3 + 12 + 6 + 9 + 1


def test_prepare_from_a_bucket_equals_prepare_from_a_local_copy(s3, tmp_path):
    local = tmp_path / "corpus"
    files = make_corpus(local)
    bucket = s3.bucket()
    upload(s3, bucket, "corpus/", files)
    opts = dict(workers=0, val_fraction=0.2, shard_tokens=300, min_chars=10)
    a = prepare([str(local)], tmp_path / "local", **opts)
    b = prepare([f"s3://{bucket}/corpus/"], tmp_path / "remote", **opts)
    assert a.manifest.shards and shard_bytes(tmp_path / "local") == shard_bytes(tmp_path / "remote")
    # the manifests differ only in the source spec they record (the arguments and the per-source stats)
    url = f"s3://{bucket}/corpus/"
    local_manifest, remote_manifest = (
        (tmp_path / d / MANIFEST_NAME).read_text() for d in ("local", "remote")
    )
    assert remote_manifest.count(json.dumps(url)) == 2 and json.dumps(str(local)) not in remote_manifest
    assert remote_manifest.replace(json.dumps(url), json.dumps(str(local))) == local_manifest
    assert b.manifest.n_tokens("train") == a.manifest.n_tokens("train") > 0
    # a slice (--max-docs) and a mixture of a bucket and a local source aiming at a token total
    other = tmp_path / "other"
    (other / "o.txt").parent.mkdir()
    (other / "o.txt").write_text("Another source with its own text, long enough to be kept. " * 30)
    mix = dict(opts, max_docs=7, target_tokens=900)
    a = prepare([(str(local), 2.0), (str(other), 1.0)], tmp_path / "local_mix", **mix)
    b = prepare([(url, 2.0), (str(other), 1.0)], tmp_path / "remote_mix", **mix)
    assert shard_bytes(tmp_path / "local_mix") == shard_bytes(tmp_path / "remote_mix")
    assert a.manifest.n_tokens() == b.manifest.n_tokens() > 0


def test_prepare_refuses_an_object_changed_after_listing(s3, tmp_path, monkeypatch):
    """The listing is the plan: an object rewritten between the listing and its read stops the run
    with one error naming it, and nothing that looks like a finished dataset is left."""
    from mamba3lite.data import sources

    bucket = s3.bucket()
    upload(s3, bucket, "c/", {"a.txt": b"first document " * 20, "b.txt": b"second document " * 20})
    listed = sources._listed_objects

    def list_then_change(store, skipped):
        objects = listed(store, skipped)
        s3.put(bucket, "c/b.txt", b"rewritten document " * 20)
        return objects

    monkeypatch.setattr(sources, "_listed_objects", list_then_change)
    # the work unit that read it reports the error (a DataError naming the unit, then the object)
    with pytest.raises(DataError, match=rf"s3://{bucket}/c/b.txt changed after it was listed"):
        prepare([f"s3://{bucket}/c/"], tmp_path / "out", workers=0, val_fraction=0)
    assert not (tmp_path / "out" / MANIFEST_NAME).exists()


def test_cli_prepare_from_a_missing_bucket_is_one_line(s3, cli, tmp_path):
    r = cli("prepare", "--source", "s3://no-such-bucket-y/x/", "--out", str(tmp_path / "o"))
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "s3://no-such-bucket-y/x/: no such object or bucket" in r.stderr


def test_upload_dataset_writes_the_manifest_last(s3, tmp_path):
    corpus = tmp_path / "corpus"
    make_corpus(corpus)
    prepare([str(corpus)], tmp_path / "ds", workers=0, val_fraction=0.2, shard_tokens=300)
    bucket = s3.bucket()
    s3.put(bucket, "ds/manifest.json", b"{}")  # an older dataset's manifest: removed before any shard
    keys = upload_dataset(tmp_path / "ds", f"s3://{bucket}/ds/")
    assert keys[-1] == MANIFEST_NAME and len(keys) == len(Manifest.load(tmp_path / "ds").shards) + 1
    assert not any(k.startswith(".") for k in keys)
    store = Store(f"s3://{bucket}/ds/")
    got = {o.key: store.read(o) for o in store.list()}
    assert got[MANIFEST_NAME] == (tmp_path / "ds" / MANIFEST_NAME).read_bytes()
    assert {k: v for k, v in got.items() if k != MANIFEST_NAME} == shard_bytes(tmp_path / "ds")
    with pytest.raises(DataNotFoundError, match="not a finished dataset"):
        upload_dataset(corpus, f"s3://{bucket}/x/")
    with pytest.raises(DataError, match="is a dataset `prepare` wrote"):
        prepare([f"s3://{bucket}/ds/"], tmp_path / "again", workers=0)
