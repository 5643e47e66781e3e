"""`prepare` from a bucket of many small objects, side by side with `prepare` from a local copy.

Starts moto's S3 server on 127.0.0.1 (a free port; `pip install 'moto[server]'`), writes N small text
objects (default 10,000: one document each, some duplicated) to a bucket and the same files to a local
directory, prepares both, checks that the shards are byte-identical and that the manifests differ only in
the source spec, and prints the times:

    python benchmarks/bench_object_store.py                 # 10,000 objects
    python benchmarks/bench_object_store.py --objects 200   # a quick run

The S3 server is moto's, in this process: its throughput is the emulator's, not S3's (one object read
costs a HEAD and a GET over loopback). What the numbers show is the cost per object of listing once and
reading each object through data/store.py, next to reading a local file.
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--objects", type=int, default=10_000, help="number of small objects (default 10,000)")
    ap.add_argument("--workers", type=int, default=0, help="prepare's tokenizer processes (0: in-process)")
    args = ap.parse_args(argv)

    import boto3
    from moto.server import ThreadedMotoServer

    from mamba3lite.data.prepare import prepare
    from mamba3lite.data.store import Store

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
            url = "s3://corpus/c/"

            t0 = time.perf_counter()
            listed = Store(url).list()
            list_s = time.perf_counter() - t0
            assert len(listed) == args.objects

            opts = dict(workers=args.workers, val_fraction=0.05, min_chars=10)
            t0 = time.perf_counter()
            a = prepare([str(local)], root / "local_ds", **opts)
            local_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            b = prepare([url], root / "s3_ds", **opts)
            s3_s = time.perf_counter() - t0

            def shards(d: Path) -> dict[str, bytes]:
                return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("shard_*.bin"))}

            same_shards = shards(root / "local_ds") == shards(root / "s3_ds")
            ma = (root / "local_ds" / "manifest.json").read_text()
            mb = (root / "s3_ds" / "manifest.json").read_text()
            same_manifest = mb.replace(json.dumps(url), json.dumps(str(local))) == ma
            n_tokens = a.manifest.n_tokens()
            assert b.manifest.n_tokens() == n_tokens
    finally:
        server.stop()

    print(
        f"objects: {args.objects:,}  tokens: {n_tokens:,}  (uploaded in {upload_s:.1f} s; moto on loopback)"
    )
    print()
    print(f"{'case':<28}{'seconds':>10}{'objects/s':>12}")
    print(f"{'list once (s3)':<28}{list_s:>10.2f}{args.objects / list_s:>12,.0f}")
    print(f"{'prepare from local copy':<28}{local_s:>10.2f}{args.objects / local_s:>12,.0f}")
    print(f"{'prepare from s3://':<28}{s3_s:>10.2f}{args.objects / s3_s:>12,.0f}")
    print()
    print(f"s3 / local time = {s3_s / local_s:.2f}x")
    print(
        f"shards byte-identical: {same_shards}; manifests identical but for the source spec: {same_manifest}"
    )
    return 0 if same_shards and same_manifest else 1


if __name__ == "__main__":
    sys.exit(main())
