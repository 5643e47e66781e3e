"""`prepare --out s3://...` against a real S3 API (moto's server on 127.0.0.1, tests/s3_server.py): the
same objects as a local --out, manifest last; resume during the build (a URL source not listed again)
and during the upload (nothing computed again); the lock object; bad input as one error line."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from mamba3lite.data import prepare as P
from mamba3lite.data import staging, url_out
from mamba3lite.data.object_lock import LOCK_KEY, ObjectLock
from mamba3lite.data.shards import MANIFEST_NAME
from mamba3lite.data.store import Store
from mamba3lite.errors import ConfigError, DataError, StorageAccessError, StorageUnreachableError
from s3_server import unreachable_endpoint
from test_prepare_helpers import tree_hashes
from test_prepare_resume import KW, _Interrupt, _prepare_interrupted

# A few shards (each object is a PUT and a HEAD): for the tests that need no many-shard resume.
FEW = {**KW, "shard_tokens": 1500}
MID = {**KW, "shard_tokens": 300}


def _texts() -> dict[str, bytes]:
    a = [f"alpha {i}: " + "words " * (4 + i % 9) for i in range(120)]
    b = [f"beta {i}: " + "tokens " * (3 + i % 5) for i in range(80)] + a[::10]  # duplicates of alpha
    return {
        f"{name}.jsonl": "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()
        for name, texts in (("a", a), ("b", b))
    }


def _local_corpus(tmp_path) -> str:
    root = tmp_path / "corpus"
    root.mkdir()
    for name, data in _texts().items():
        (root / name).write_bytes(data)
    return str(root)


def _bucket_objects(s3, bucket: str, prefix: str) -> dict[str, str]:
    """key below `prefix` -> sha256 of its bytes, as `tree_hashes` gives a local dataset's files."""
    import hashlib

    out = {}
    for page in s3.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            body = s3.client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
            out[o["Key"][len(prefix) :]] = hashlib.sha256(body).hexdigest()
    return out


def test_prepare_to_a_bucket_equals_a_local_out(s3, tmp_path):
    src = _local_corpus(tmp_path)
    ref = P.prepare([src], tmp_path / "ref", **FEW)
    bucket = s3.bucket()
    url = f"s3://{bucket}/ds/"
    stage = tmp_path / "stage"
    summary = P.prepare([src], url, **FEW, stage_dir=str(stage))
    assert (
        summary.out == url and summary.n_tokens == ref.n_tokens > 0 and f"dataset   {url}" in summary.table()
    )
    # every shard and the manifest, byte for byte; no lock, no staging leftovers; the stage removed
    assert _bucket_objects(s3, bucket, "ds/") == tree_hashes(tmp_path / "ref")
    assert not stage.exists()
    # the same command again rebuilds the same dataset; other arguments are refused, bucket untouched
    P.prepare([src], url, **FEW, stage_dir=str(stage))
    with pytest.raises(ConfigError, match=rf"--out {url} holds a dataset prepared with different arguments"):
        P.prepare([src], url, **{**FEW, "val_fraction": 0.5}, stage_dir=str(stage))
    assert _bucket_objects(s3, bucket, "ds/") == tree_hashes(tmp_path / "ref")
    # --overwrite replaces it (the manifest last), and the replaced dataset's extra shards are removed
    wider = {**FEW, "val_fraction": 0.5, "shard_tokens": 3000}
    P.prepare([src], tmp_path / "ref_wider", **wider)
    P.prepare([src], url, **wider, stage_dir=str(stage), overwrite=True)
    assert _bucket_objects(s3, bucket, "ds/") == tree_hashes(tmp_path / "ref_wider")
    assert len(tree_hashes(tmp_path / "ref_wider")) < len(tree_hashes(tmp_path / "ref"))
    # with its own tokenizer (fit during the run): tokenizer.json goes up too; the same command again
    # passes the check before the fit (the vocabulary is not known yet) and the one after it
    P.prepare([src], tmp_path / "ref_bpe", **FEW, train_tokenizer=300)
    for _ in range(2):
        P.prepare([src], f"s3://{bucket}/bpe/", **FEW, train_tokenizer=300, stage_dir=str(stage))
        assert _bucket_objects(s3, bucket, "bpe/") == tree_hashes(tmp_path / "ref_bpe")
    assert "tokenizer.json" in tree_hashes(tmp_path / "ref_bpe")
    # a prefix holding the user's objects is never written into, --overwrite or not
    s3.put(bucket, "mine/notes.txt", b"my own file")
    with pytest.raises(ConfigError, match=r"holds objects that are not a mamba3lite dataset .*notes.txt"):
        P.prepare([src], f"s3://{bucket}/mine/", **FEW, stage_dir=str(stage), overwrite=True)
    assert _bucket_objects(s3, bucket, "mine/") == {
        "notes.txt": _bucket_objects(s3, bucket, "mine/")["notes.txt"]
    }


def test_a_bucket_of_small_objects_prepared_to_a_bucket_equals_a_local_prepare(s3, tmp_path):
    """Issue 50's object-storage identity in small (benchmarks/bench_object_store.py runs it on 10,000
    objects): a bucket of a few dozen objects, one document each, two exact duplicates and one too
    short, prepared to an s3:// --out in one run gives a local prepare's shards byte for byte, and a
    manifest that differs only in the two fields recording the source spec."""
    local, bucket = tmp_path / "corpus", s3.bucket()
    for i in range(36):
        j = i - 5 if i in (17, 29) else i  # 17 and 29 repeat 12 and 24
        data = b"x" if i == 8 else f"doc {j}: {'word ' * (3 + j % 11)}\n".encode()
        name = f"d{i % 3}/doc_{i:02d}.txt"
        (local / name).parent.mkdir(parents=True, exist_ok=True)
        (local / name).write_bytes(data)
        s3.put(bucket, f"c/{name}", data)
    opts = {**KW, "min_chars": 5}
    ref = P.prepare([str(local)], tmp_path / "ref", **opts)
    src, url = f"s3://{bucket}/c/", f"s3://{bucket}/ds/"
    P.prepare([src], url, **opts, stage_dir=str(tmp_path / "stage"))
    dropped = ref.manifest.extra["stats"]["dropped"]
    assert dropped["duplicate"] == 2 and dropped["too_short"] == 1
    # the prefix holds exactly the local dataset's files (no lock object), each shard byte for byte
    objects, expected = _bucket_objects(s3, bucket, "ds/"), tree_hashes(tmp_path / "ref")
    assert objects.keys() == expected.keys() and len(expected) >= 4
    assert {k: v for k, v in objects.items() if k != MANIFEST_NAME} == {
        k: v for k, v in expected.items() if k != MANIFEST_NAME
    }
    uploaded = json.loads(s3.client.get_object(Bucket=bucket, Key=f"ds/{MANIFEST_NAME}")["Body"].read())
    local_manifest = json.loads((tmp_path / "ref" / MANIFEST_NAME).read_text())
    for manifest, spec in ((uploaded, src), (local_manifest, str(local))):
        recorded = manifest["extra"]["prepare"]["sources"][0], manifest["extra"]["stats"]["sources"][0]
        assert [r["spec"] for r in recorded] == [spec, spec]
        for r in recorded:
            r["spec"] = "SOURCE"
    assert uploaded == local_manifest and not (tmp_path / "stage").exists()


def test_an_interrupted_upload_resumes_without_computing_again(s3, tmp_path, monkeypatch):
    src = _local_corpus(tmp_path)
    P.prepare([src], tmp_path / "ref", **MID)
    bucket = s3.bucket()
    url, stage = f"s3://{bucket}/ds/", tmp_path / "stage"
    calls = []
    put_file = Store.put_file

    def counted(self, key, path):
        calls.append(key)
        if len(calls) == 5 and interrupt:
            raise _Interrupt
        return put_file(self, key, path)

    monkeypatch.setattr(Store, "put_file", counted)
    interrupt = True
    with pytest.raises(_Interrupt):
        P.prepare([src], url, **MID, stage_dir=str(stage))
    assert not _bucket_objects(s3, bucket, "ds/").get(MANIFEST_NAME)  # unfinished: no manifest
    assert LOCK_KEY not in _bucket_objects(s3, bucket, "ds/")  # released on the way out
    n_files = len(tree_hashes(tmp_path / "ref")) - 1
    assert n_files >= 8
    interrupt, calls[:] = False, []
    built = []
    monkeypatch.setattr(P, "_prepare_local", lambda *a: built.append(a))
    resumed = P.prepare([src], url, **MID, stage_dir=str(stage))
    assert built == [] and resumed.work is None  # nothing computed again
    assert len(calls) == n_files - 4  # the 4 objects uploaded before the interruption are skipped
    assert _bucket_objects(s3, bucket, "ds/") == tree_hashes(tmp_path / "ref") and not stage.exists()


def test_a_resumed_prepare_from_a_url_source_does_not_list_it_again(s3, tmp_path, monkeypatch):
    bucket = s3.bucket()
    for name, data in _texts().items():
        s3.put(bucket, f"c/{name}", data)
    src = f"s3://{bucket}/c/"
    ref = P.prepare([_local_corpus(tmp_path)], tmp_path / "ref", **KW)
    listed = []
    original = Store.list

    def counting(self):
        listed.append(self.url)
        return original(self)

    monkeypatch.setattr(Store, "list", counting)
    url, stage = f"s3://{bucket}/ds/", tmp_path / "stage"
    _prepare_interrupted(monkeypatch, 3, [src], url, stage_dir=str(stage))
    assert listed.count(src) == 1
    listed.clear()
    written = len(json.loads((stage / staging.STAGE_DIRNAME / staging.STATE_NAME).read_text())["shards"])
    resumed = P.prepare([src], url, **KW, stage_dir=str(stage))
    assert listed.count(src) == 0, "a resume reads the plan's listing"
    assert resumed.resumed_shards == written > 0 and resumed.work.reused > 0
    got = _bucket_objects(s3, bucket, "ds/")
    shards = {k: v for k, v in tree_hashes(tmp_path / "ref").items() if k != MANIFEST_NAME}
    assert {k: v for k, v in got.items() if k != MANIFEST_NAME} == shards and len(shards) == len(
        ref.manifest.shards
    )


def test_two_runs_on_one_url_are_refused_and_a_dead_runs_lock_is_taken_over(s3, tmp_path, capsys):
    src = _local_corpus(tmp_path)
    bucket = s3.bucket()
    url, stage = f"s3://{bucket}/ds/", str(tmp_path / "stage")
    store = Store(url)
    held = ObjectLock(store, "another `mamba3lite prepare`", "wait").acquire()
    with pytest.raises(
        DataError, match=rf"{url} is in use by another `mamba3lite prepare` \(pid {os.getpid()}"
    ):
        P.prepare([src], url, **FEW, stage_dir=stage)
    assert set(_bucket_objects(s3, bucket, "ds/")) == {LOCK_KEY}  # nothing written by the refused run
    assert not ObjectLock(store, "x", "y").store.create(LOCK_KEY, b"")  # the conditional put refuses too
    held.release()
    # a lock left by a run on another machine: the error says how to remove it
    s3.put(bucket, f"ds/{LOCK_KEY}", json.dumps({"host": "elsewhere", "pid": 1, "since": "then"}).encode())
    with pytest.raises(DataError, match=rf"delete its lock {url}{LOCK_KEY} \(aws s3 rm"):
        P.prepare([src], url, **FEW, stage_dir=stage)
    # a lock left by a dead run on this machine (SIGKILL): taken over with a note
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    record = {"host": socket.gethostname(), "pid": int(dead.stdout), "since": "then"}
    s3.put(bucket, f"ds/{LOCK_KEY}", json.dumps(record).encode())
    P.prepare([src], url, **FEW, stage_dir=stage)
    assert "taking it over" in capsys.readouterr().err
    objects = _bucket_objects(s3, bucket, "ds/")
    assert MANIFEST_NAME in objects and LOCK_KEY not in objects


def test_bad_out_urls_are_one_line_and_leave_nothing(s3, tmp_path, monkeypatch, cli):

    src = _local_corpus(tmp_path)
    allowed, closed = s3.bucket("open"), s3.bucket("closed")
    env = s3.user_of_one_bucket(allowed, "writer")
    s3.enforce_auth(True)
    try:
        args = ("prepare", "--source", src, "--workers", "0", "--stage-dir", str(tmp_path / "st"))
        r = cli(*args, "--out", f"s3://{closed}/ds/", env=env)
        assert r.returncode != 0 and "Traceback" not in r.stderr
        (line,) = r.stderr.strip().splitlines()
        assert f"s3://{closed}/ds/.prepare.lock: access denied" in line and "AWS_ACCESS_KEY_ID" in line
    finally:
        s3.enforce_auth(False)
    assert _bucket_objects(s3, closed, "") == {} and not (tmp_path / "st").exists()
    # an endpoint nothing listens on: transient (exit 1), names the endpoint setting
    monkeypatch.setenv("AWS_ENDPOINT_URL", unreachable_endpoint())
    with pytest.raises(
        StorageUnreachableError, match=r"cannot reach the object store \(AWS_ENDPOINT_URL="
    ) as e:
        P.prepare([src], f"s3://{allowed}/ds/", **FEW, stage_dir=str(tmp_path / "st"))
    assert "\n" not in str(e.value) and not (tmp_path / "st").exists()
    # a store whose conditional write mamba3lite cannot vouch for: refused before anything is written
    with pytest.raises(
        ConfigError, match=r"memory://ds/.prepare.lock: mamba3lite knows no conditional write"
    ):
        P.prepare([src], "memory://ds/", **FEW, stage_dir=str(tmp_path / "st"))
    # --stage-dir without an --out URL
    with pytest.raises(ConfigError, match="--stage-dir applies only to an --out URL"):
        P.prepare([src], tmp_path / "local", **FEW, stage_dir=str(tmp_path / "st"))
    assert issubclass(StorageAccessError, Exception) and url_out.default_stage_dir("s3://b/x/") == (
        url_out.default_stage_dir("s3://b/x")
    )


def test_a_killed_run_is_resumed_by_the_same_command(s3, tmp_path):
    """SIGKILL mid-build (no clean-up: the lock object stays): the same command takes the dead run's lock
    over, resumes from its snapshot and uploads the same bytes as an uninterrupted run."""
    src = _local_corpus(tmp_path)
    P.prepare([src], tmp_path / "ref", **KW)
    bucket = s3.bucket()
    url, stage = f"s3://{bucket}/ds/", tmp_path / "stage"
    cmd = [
        sys.executable,
        "-m",
        "mamba3lite",
        "prepare",
        "--source",
        src,
        "--out",
        url,
        "--stage-dir",
        str(stage),
    ]
    cmd += ["--workers", "0", "--shard-tokens", "120", "--val-fraction", "0.25", "--min-chars", "1"]
    env = {**os.environ, P.SLEEP_ENV: "0.2", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    state = stage / staging.STAGE_DIRNAME / staging.STATE_NAME
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None and not state.is_file():
            time.sleep(0.05)
        assert proc.poll() is None, (
            "the run finished before it could be killed: " + proc.stderr.read().decode()
        )
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert set(_bucket_objects(s3, bucket, "ds/")) == {LOCK_KEY}  # a dead run's lock, nothing else
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "taking it over" in r.stderr and "resuming:" in r.stderr
    assert _bucket_objects(s3, bucket, "ds/") == tree_hashes(tmp_path / "ref") and not stage.exists()
