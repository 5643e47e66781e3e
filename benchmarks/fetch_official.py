"""Fetch the official Mamba-3 kernels for a GPU machine that has no network: run it here, where PyPI is
reachable, then carry the directory to the GPU machine with the run (it is git-ignored).

    python benchmarks/fetch_official.py [--out benchmarks/.official]

It stores two files, each checked against the sha256 the package index publishes:

    mamba_ssm-<VERSION>.tar.gz   the source release (its Mamba-3 kernels are Triton: nothing to compile)
    einops-<VERSION>.whl         the one pure-Python module the Mamba-3 layer imports besides torch/triton

`benchmarks/gpu_check.sh` unpacks both into its scratch directory when they are there (no pip, no
index: `gpu_model.py --official` imports the layer from the unpacked source, without the package's
compiled extensions), and otherwise tries `pip install mamba-ssm` as before. Nothing of them becomes
part of this project: they are the benchmark's anchor, read only on the GPU machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import urllib.request
from pathlib import Path

INDEX = "https://pypi.org/simple/{name}/"
MAMBA_SSM = "2.3.2.post1"  # the release with mamba_ssm/ops/triton/mamba3 (SISO) that gpu_model.py loads
EINOPS = "0.8.2"


def index_files(name: str) -> list[dict]:
    """The project's files from the index's JSON simple API (PEP 691): filename, url, hashes."""
    accept = {"Accept": "application/vnd.pypi.simple.v1+json"}
    req = urllib.request.Request(INDEX.format(name=name), headers=accept)
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)["files"]


def fetch(entry: dict, out: Path) -> Path:
    """Download one index file into `out` (kept if already there with the right hash); sha256 checked."""
    path = out / entry["filename"]
    want = entry["hashes"]["sha256"]
    if path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == want:
        return path
    with urllib.request.urlopen(entry["url"], timeout=120) as r:
        data = r.read()
    got = hashlib.sha256(data).hexdigest()
    if got != want:
        raise SystemExit(f"error: {entry['filename']}: sha256 {got}, the index says {want}")
    tmp = path.with_suffix(path.suffix + ".part")
    tmp.write_bytes(data)
    tmp.replace(path)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name(".official"))
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    sdist = [f for f in index_files("mamba-ssm") if f["filename"] == f"mamba_ssm-{MAMBA_SSM}.tar.gz"]
    wheel = [f for f in index_files("einops") if f["filename"] == f"einops-{EINOPS}-py3-none-any.whl"]
    if not sdist or not wheel:
        missing = f"mamba_ssm-{MAMBA_SSM}.tar.gz or the einops {EINOPS} wheel"
        print(f"error: the index has no {missing}", file=sys.stderr)
        return 1
    for entry in (sdist[0], wheel[0]):
        path = fetch(entry, args.out)
        print(f"{path} ({path.stat().st_size:,} bytes, sha256 checked)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
