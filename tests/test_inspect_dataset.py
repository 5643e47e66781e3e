"""`mamba3lite inspect DATASET_DIR [--verify]`: the description, and verification naming the bad shard."""

from __future__ import annotations

import json

import pytest

from mamba3lite.cli import main
from mamba3lite.data.prepare import prepare
from mamba3lite.data.shards import Manifest


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("inspect")
    (tmp / "a.jsonl").write_text(
        "".join(json.dumps({"text": f"doc {i} " + "x y " * 30}) + "\n" for i in range(40))
    )
    (tmp / "b.txt").write_text("tiny")
    prepare(
        [str(tmp / "a.jsonl"), str(tmp / "b.txt")], tmp / "ds", workers=0, shard_tokens=200, val_fraction=0.2
    )
    return tmp / "ds"


def _copy(dataset, tmp_path):
    import shutil

    return shutil.copytree(dataset, tmp_path / "copy")


def test_describe(dataset, capsys):
    assert main(["inspect", str(dataset)]) == 0
    out = capsys.readouterr().out
    m = Manifest.load(dataset)
    assert "gpt2" in out and "50,257" in out and "uint16" in out
    for split in ("train", "val"):
        line = next(ln for ln in out.splitlines() if ln.startswith(split))
        assert f"{m.n_tokens(split):,}" in line and f"{len(m.split_shards(split)):,}" in line
    assert "a.jsonl" in out and "b.txt" in out
    assert "too_short 1" in out and "read 41" in out


def test_verify_ok(dataset, capsys):
    assert main(["inspect", str(dataset), "--verify"]) == 0
    assert f"verified: {len(Manifest.load(dataset).shards)} shards" in capsys.readouterr().out


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_verify_names_the_first_bad_shard(dataset, tmp_path, damage, capsys):
    ds = _copy(dataset, tmp_path)
    m = Manifest.load(ds)
    bad = m.split_shards("train")[2]
    path = ds / bad.path
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[3] ^= 0x01
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(bytes(data[:-2]))
    else:
        path.unlink()
    also = ds / m.split_shards("val")[0].path  # a second bad shard, later in the manifest
    also.write_bytes(also.read_bytes()[:-2])
    code = main(["inspect", str(ds), "--verify"])
    err = capsys.readouterr().err
    assert code != 0
    assert f"error: verification failed: {bad.path}" in err and "and 1 more" in err
    assert {"flip": "sha256", "truncate": "size", "delete": "missing"}[damage] in err.splitlines()[-1]


def test_verify_cli_exit_code(cli, dataset, tmp_path):
    ds = _copy(dataset, tmp_path)
    r = cli("inspect", str(ds), "--verify")
    assert r.returncode == 0 and "verified" in r.stdout
    (ds / "manifest.json").write_text("{broken")
    r = cli("inspect", str(ds), "--verify")
    assert r.returncode != 0 and "manifest.json" in r.stderr and "Traceback" not in r.stderr


def test_other_kinds_dispatch_to_their_modes(dataset, tmp_path, capsys):
    # The shard-file and checkpoint modes themselves are tested in test_inspect_run.py.
    shard = dataset / Manifest.load(dataset).shards[0].path
    assert main(["inspect", str(shard)]) == 0
    assert "tokens" in capsys.readouterr().out
    ckpt = tmp_path / "run"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"")
    assert main(["inspect", str(ckpt)]) == 2
    assert "holds no checkpoint files" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "nothing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["inspect", str(empty)]) == 2
    assert "without manifest.json" in capsys.readouterr().err
