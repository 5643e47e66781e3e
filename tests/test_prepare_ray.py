"""`prepare --ray`: the same bytes as the local pool on 1 and 3 nodes, and its faults (a node lost mid-run,
the driver killed, bad input, an unreachable cluster). One Ray cluster on this machine serves the whole
session (`ray_nodes` in conftest)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mamba3lite.data import plan as planning
from mamba3lite.data import prepare as P
from mamba3lite.data import staging, units
from mamba3lite.errors import DataError
from test_prepare_helpers import tree_hashes

UNIT_BYTES = 600  # a few documents a unit: dozens of units, spread over the nodes
OPTS = {"shard_tokens": 400, "val_fraction": 0.2, "min_chars": 1, "train_tokenizer": 300}


@pytest.fixture(scope="module")
def ray_cluster(ray_nodes):
    """The session's Ray cluster with this process as its driver, for this module's tests."""
    ray_nodes.connect()
    try:
        yield ray_nodes
    finally:
        ray_nodes.disconnect()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Three kinds of source (a directory of .txt/.md files, JSONL, Parquet) with duplicates inside and
    across them, in a mixture with a target that stops the sources before their end."""
    root = tmp_path_factory.mktemp("corpus")
    docs = root / "docs"
    docs.mkdir()
    for i in range(40):
        text = f"note {i}: the river runs by the mill " + "and the wheel turns " * (2 + i % 7)
        (docs / f"n{i:03d}.{'md' if i % 3 else 'txt'}").write_text(text if i % 9 else "note 0: a copy\n")
    lines = [f"record {i}: " + "alpha beta gamma " * (1 + i % 5) for i in range(120)]
    lines += lines[::15]  # duplicates within the source
    (root / "web.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    rows = [f"row {i}: " + "lorem ipsum dolor " * (1 + i % 4) for i in range(80)] + lines[:6]  # across
    pq.write_table(pa.table({"text": rows}), root / "books.parquet", row_group_size=10)
    mixture = root / "mix.yaml"
    mixture.write_text(
        "target_tokens: 9000\nsources:\n"
        "  - {source: docs, weight: 1}\n  - {source: web.jsonl, weight: 2}\n"
        "  - {source: books.parquet, weight: 1}\n"
    )
    return root


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """The local pool's dataset of the corpus (2 worker processes)."""
    out = tmp_path_factory.mktemp("ref") / "ds"
    with pytest.MonkeyPatch.context() as m:
        m.setattr(planning, "UNIT_BYTES", UNIT_BYTES)
        s = P.prepare((), out, mixture=corpus / "mix.yaml", workers=2, **OPTS)
    assert s.work.computed > 20 and s.stats["dropped"]["duplicate"] > 0
    print(s.table())
    return tree_hashes(out)


def _prepare_ray(corpus, out, address, monkeypatch, **kw):
    monkeypatch.setattr(planning, "UNIT_BYTES", UNIT_BYTES)
    return P.prepare((), out, mixture=corpus / "mix.yaml", ray=address, **OPTS, **kw)


def test_ray_on_one_and_three_nodes_writes_the_local_pools_bytes(
    ray_cluster, corpus, reference, tmp_path, monkeypatch
):
    ray_cluster.ensure(1)
    one = _prepare_ray(corpus, tmp_path / "one", ray_cluster.address, monkeypatch)
    assert tree_hashes(tmp_path / "one") == reference
    assert len(one.work.nodes) == 1 and one.work.reused == 0
    ray_cluster.ensure(3)
    # (with the dedup set partitioned by digest in 2 Ray tasks, too: the same bytes)
    three = _prepare_ray(corpus, tmp_path / "three", ray_cluster.address, monkeypatch, dedup_partitions=2)
    assert tree_hashes(tmp_path / "three") == reference
    assert three.work.dedup_partitions == 2 and three.work.dedup_candidates > 0
    assert len(three.work.nodes) >= 2, three.work.nodes  # the units were spread over the nodes
    assert "node" in three.table() and "Ray, 3 node(s)" in three.table()


def test_a_node_lost_mid_run_changes_nothing_and_recomputes_only_its_unfinished_unit(
    ray_cluster, corpus, reference, tmp_path, monkeypatch
):
    ray_cluster.ensure(3)
    monkeypatch.setenv(units.UNIT_SLEEP_ENV, "0.15")  # units still running when the node goes
    out = tmp_path / "ds"
    done = out / staging.STAGE_DIRNAME / units.UNITS_DIRNAME
    result: dict = {}

    def run() -> None:
        try:
            result["summary"] = _prepare_ray(corpus, out, ray_cluster.address, monkeypatch)
        except BaseException as e:  # re-raised below, on the test's thread
            result["error"] = e

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(list(done.glob("*.json"))) < 4 and t.is_alive():
        time.sleep(0.05)
    assert t.is_alive(), result
    ray_cluster.remove_one()
    t.join(120)
    assert "error" not in result, result.get("error")
    s = result["summary"]
    assert tree_hashes(out) == reference
    # Every unit came back once. A unit finished on the lost node before it went is not computed again
    # (its record is the driver's); the one it was running is computed again elsewhere, and would be
    # counted as reused had it completed its record before the node went.
    assert s.work.reused <= 1, s.work


def test_the_driver_killed_then_rerun_recomputes_no_recorded_unit(
    ray_cluster, corpus, reference, tmp_path, monkeypatch
):
    ray_cluster.ensure(3)
    out = tmp_path / "ds"
    driver = (
        "import sys; from mamba3lite.data import plan, prepare as P; plan.UNIT_BYTES = int(sys.argv[1]); "
        "P.prepare((), sys.argv[2], mixture=sys.argv[3], ray=sys.argv[4], **eval(sys.argv[5]))"
    )
    env = {**os.environ, units.UNIT_SLEEP_ENV: "0.15"}
    args = [str(UNIT_BYTES), str(out), str(corpus / "mix.yaml"), ray_cluster.address, repr(OPTS)]
    proc = subprocess.Popen([sys.executable, "-c", driver, *args], env=env, stderr=subprocess.PIPE)
    done = out / staging.STAGE_DIRNAME / units.UNITS_DIRNAME
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None and len(list(done.glob("*.json"))) < 6:
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read().decode()
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    recorded = {p.name: p.stat().st_mtime_ns for p in done.glob("*.json")}
    assert not (out / "manifest.json").exists() and len(recorded) >= 6
    seen: dict = {}
    finalize = staging.Stage.finalize

    def look_then_finalize(self, manifest):
        seen.update({p.name: p.stat().st_mtime_ns for p in (self.dir / units.UNITS_DIRNAME).glob("*.json")})
        finalize(self, manifest)

    monkeypatch.setattr(staging.Stage, "finalize", look_then_finalize)
    s = _prepare_ray(corpus, out, ray_cluster.address, monkeypatch)
    assert tree_hashes(out) == reference
    assert all(seen[name] == mtime for name, mtime in recorded.items()), "a recorded unit was computed again"
    assert s.work.reused + s.resumed_shards > 0 and f"{s.work.reused:,} reused" in s.table()


def test_a_malformed_parquet_file_is_one_error_naming_its_unit(ray_cluster, tmp_path):
    ray_cluster.ensure(3)
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1" + b"\x00not a parquet file" * 20)
    t0 = time.monotonic()
    with pytest.raises(DataError, match=r"unit 000-000000 \(.*bad\.parquet\): cannot read parquet file"):
        P.prepare([str(bad)], tmp_path / "ds", ray=ray_cluster.address, min_chars=1)
    assert time.monotonic() - t0 < 30  # not retried
    assert not (tmp_path / "ds").exists()  # bad input: the run's directory is removed


def test_an_unreachable_ray_address_is_one_error_line(cli, tmp_path):
    (tmp_path / "a.txt").write_text("enough text to be a document")
    r = cli(
        "prepare", "--source", str(tmp_path / "a.txt"), "--out", str(tmp_path / "ds"), "--ray", "127.0.0.1:9"
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert "--ray 127.0.0.1:9: cannot reach a Ray cluster there" in line and "ray start --head" in line
    assert not (tmp_path / "ds").exists()  # refused before anything was read or written


def test_without_ray_installed_the_error_says_how_to_install_it(tmp_path, monkeypatch):
    from mamba3lite.errors import ConfigError

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    (tmp_path / "a.txt").write_text("enough text to be a document")
    with pytest.raises(ConfigError, match=r"--ray needs Ray; fix: pip install 'mamba3lite\[ray\]'"):
        P.prepare([str(tmp_path / "a.txt")], tmp_path / "ds", ray="auto")
    assert not (tmp_path / "ds").exists()
