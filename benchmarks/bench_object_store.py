"""`prepare` from a bucket of many small objects, to a local directory and to a bucket, side by side with
`prepare` from a local copy.

Starts moto's S3 server on 127.0.0.1 (a free port; `pip install 'moto[server]'`), writes N small text
objects (default 10,000: one document each, some duplicated) to a bucket and the same files to a local
directory, and prepares three ways:

    local -> local     prepare([local copy], DIR)
    s3:// -> local     prepare(["s3://corpus/c/"], DIR)
    s3:// -> s3://     prepare(["s3://corpus/c/"], "s3://datasets/ds/", stage_dir=...): built in a local
                       staging directory, uploaded with manifest.json last (data/url_out.py)

The uploaded dataset is read back with boto3 (not through mamba3lite's store) and checked: its shards are
byte-identical to the local run's, its manifest differs from the local run's only in the two fields that
record the source spec (`extra.prepare.sources[0].spec` and `extra.stats.sources[0].spec`) and is byte-
identical to the s3:// -> local manifest, and the prefix holds nothing else (no lock object, no staging
leftovers). The s3:// -> local dataset is checked against the local run's the same way. Then the times:

    python benchmarks/bench_object_store.py                 # 10,000 objects
    python benchmarks/bench_object_store.py --objects 200   # a quick run

The S3 server is moto's, in this process: its throughput is the emulator's, not S3's (one object read
costs a HEAD and a GET over loopback, one upload a PUT and a HEAD). What the numbers show is the cost per
object of listing once and reading each object through data/store.py, next to reading a local file, and
what staging and uploading the dataset add.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mamba3lite.data.prepare import prepare
from mamba3lite.data.shards import MANIFEST_NAME
from mamba3lite.data.store import Store

# Where a manifest may differ from the local run's: the source spec it records, in the arguments and in
# the per-source stats. Nothing else (not the shards' sha256, not the output location: none is recorded).
SOURCE_SPEC_FIELDS = ["extra.prepare.sources[0].spec", "extra.stats.sources[0].spec"]
_ABSENT = object()

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
    "nu",
    "xi",
    "omicron",
    "pi",
    "rho",
]


def document(i: int) -> bytes:
    """A small document; every 50th repeats an earlier one (exact duplicates for dedup)."""
    j = i - 7 if i % 50 == 49 else i
    words = [WORDS[(j * 7 + k * 3) % len(WORDS)] for k in range(40 + j % 60)]
    return (f"Document {j}.\n" + " ".join(words) + "\n").encode()


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """The paths (`extra.stats.sources[0].spec`) at which two parsed JSON documents differ, sorted by key."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [
            d
            for k in sorted(a.keys() | b.keys())
            for d in differences(a.get(k, _ABSENT), b.get(k, _ABSENT), f"{path}.{k}" if path else k)
        ]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    return [] if type(a) is type(b) and a == b else [path or "(the whole document)"]


def local_dataset(d: Path) -> dict[str, bytes]:
    """A prepared directory's files as an upload sees them (names starting with a dot are not data)."""
    return {
        p.relative_to(d).as_posix(): p.read_bytes()
        for p in sorted(d.rglob("*"))
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(d).parts)
    }


def bucket_dataset(client: Any, bucket: str, prefix: str) -> dict[str, bytes]:
    """Every object below `prefix`, read back with boto3 (independent of mamba3lite's store)."""
    keys = [
        o["Key"]
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        for o in page.get("Contents", [])
    ]
    with ThreadPoolExecutor(8) as pool:
        bodies = pool.map(lambda k: client.get_object(Bucket=bucket, Key=k)["Body"].read(), keys)
        return {k[len(prefix) :]: body for k, body in zip(keys, bodies)}


def shards_of(files: dict[str, bytes]) -> dict[str, bytes]:
    return {k: v for k, v in files.items() if k != MANIFEST_NAME}


def compare(reference: dict[str, bytes], got: dict[str, bytes]) -> tuple[bool, list[str]]:
    """(shards byte-identical, the manifest fields that differ from the reference's)."""
    fields = differences(json.loads(reference[MANIFEST_NAME]), json.loads(got[MANIFEST_NAME]))
    return shards_of(got) == shards_of(reference) and len(shards_of(got)) > 0, fields


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--objects", type=int, default=10_000, help="number of small objects (default 10,000)")
    ap.add_argument("--workers", type=int, default=0, help="prepare's tokenizer processes (0: in-process)")
    args = ap.parse_args(argv)

    try:
        import boto3
        from moto.server import ThreadedMotoServer
    except ImportError as e:
        sys.exit(f"bench_object_store needs moto's S3 server and boto3 ({e}): pip install 'moto[server]'")

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
    )
    try:
        client = boto3.client("s3", endpoint_url=endpoint)
        client.create_bucket(Bucket="corpus")
        client.create_bucket(Bucket="datasets")
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            local = root / "corpus"
            names = [f"d{i // 1000:03d}/doc_{i:06d}.txt" for i in range(args.objects)]
            t0 = time.perf_counter()
            for i, name in enumerate(names):
                (local / name).parent.mkdir(parents=True, exist_ok=True)
                (local / name).write_bytes(document(i))
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(lambda n: client.upload_file(str(local / n), "corpus", f"c/{n}"), names))
            upload_s = time.perf_counter() - t0
            url, out_url = "s3://corpus/c/", "s3://datasets/ds/"

            t0 = time.perf_counter()
            listed = Store(url).list()
            list_s = time.perf_counter() - t0
            assert len(listed) == args.objects

            opts = dict(workers=args.workers, val_fraction=0.05, min_chars=10)
            seconds = {}
            t0 = time.perf_counter()
            a = prepare([str(local)], root / "local_ds", **opts)
            seconds["local -> local"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            b = prepare([url], root / "s3_ds", **opts)
            seconds["s3:// -> local"] = time.perf_counter() - t0
            stage = root / "stage"
            t0 = time.perf_counter()
            c = prepare([url], out_url, **opts, stage_dir=str(stage))
            seconds["s3:// -> s3://"] = time.perf_counter() - t0

            t0 = time.perf_counter()
            uploaded = bucket_dataset(client, "datasets", "ds/")
            read_back_s = time.perf_counter() - t0
            reference, from_s3 = local_dataset(root / "local_ds"), local_dataset(root / "s3_ds")
            n_tokens = a.manifest.n_tokens()
            assert b.manifest.n_tokens() == c.manifest.n_tokens() == n_tokens and c.out == out_url
            checks = {
                "s3:// -> local": compare(reference, from_s3),
                "s3:// -> s3://": compare(reference, uploaded),
            }
            # the bucket holds exactly the dataset: no lock object, nothing staged but not named
            only_dataset = uploaded.keys() == from_s3.keys()
            same_as_s3_local = uploaded.get(MANIFEST_NAME) == from_s3[MANIFEST_NAME]
            stage_removed = not stage.exists()
    finally:
        server.stop()

    local_s = seconds["local -> local"]
    print(
        f"objects: {args.objects:,}  tokens: {n_tokens:,}  shards: {len(a.manifest.shards)}  (uploaded in "
        f"{upload_s:.1f} s; the s3:// -> s3:// dataset read back in {read_back_s:.2f} s; moto on loopback)"
    )
    print()
    print(f"{'case':<28}{'seconds':>10}{'objects/s':>12}{'x local':>10}")
    print(f"{'list once (s3)':<28}{list_s:>10.2f}{args.objects / list_s:>12,.0f}")
    for case, s in seconds.items():
        print(f"{'prepare ' + case:<28}{s:>10.2f}{args.objects / s:>12,.0f}{s / local_s:>9.2f}x")
    print()
    print(
        f"s3 -> local / local time = {seconds['s3:// -> local'] / local_s:.2f}x; "
        f"s3 -> s3 / local time = {seconds['s3:// -> s3://'] / local_s:.2f}x; "
        f"s3 -> s3 / s3 -> local time = {seconds['s3:// -> s3://'] / seconds['s3:// -> local']:.2f}x "
        "(staging and the upload)"
    )
    ok = True
    for case, (same_shards, fields) in checks.items():
        only_spec = fields == SOURCE_SPEC_FIELDS
        ok &= same_shards and only_spec
        print(
            f"{case}: shards byte-identical to local -> local's: {same_shards}; manifest differs only in the "
            f"source spec: {only_spec} ({', '.join(fields) or 'nothing'})"
        )
    print(
        f"s3:// -> s3://: manifest byte-identical to s3:// -> local's: {same_as_s3_local}; the prefix holds "
        f"the dataset only ({len(uploaded)} objects, no lock): {only_dataset}; "
        f"stage dir removed: {stage_removed}"
    )
    ok &= same_as_s3_local and only_dataset and stage_removed
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
