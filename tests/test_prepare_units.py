"""The plan / map / commit split of `prepare`: how the sources are cut into work units changes no byte of
the output, a recorded unit is never computed again, and the plan is read instead of listing again."""

from __future__ import annotations

import json
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mamba3lite.data import plan as planning
from mamba3lite.data import prepare as P
from mamba3lite.data import staging, units
from mamba3lite.errors import ConfigError, DataError
from test_prepare_helpers import tree_hashes
from test_prepare_resume import KW, _corpus, _prepare_interrupted


def _with_parquet(tmp_path) -> list:
    sources = _corpus(tmp_path)
    rows = [f"gamma {i}: " + "rows " * (2 + i % 6) for i in range(90)]
    pq.write_table(pa.table({"text": rows}), tmp_path / "c.parquet", row_group_size=7)
    return [*sources, P.SourceSpec(str(tmp_path / "c.parquet"), 1.0)]


def test_cutting_files_into_small_units_changes_no_byte(tmp_path, monkeypatch):
    sources = _with_parquet(tmp_path)
    whole = P.prepare(sources, tmp_path / "whole", **KW)
    assert whole.work.computed == 3  # one unit a file
    monkeypatch.setattr(planning, "UNIT_BYTES", 500)  # .jsonl cut by bytes, .parquet by row groups
    cut = P.prepare(sources, tmp_path / "cut", **{**KW, "workers": 2})
    assert cut.work.computed > 20
    assert tree_hashes(tmp_path / "cut") == tree_hashes(tmp_path / "whole")
    # --unit-mb, the user's form of the same knob: smaller still (a document or two a unit)
    tiny = P.prepare(sources, tmp_path / "tiny", **KW, unit_mb=200 / (1 << 20))
    assert tiny.work.computed > cut.work.computed
    assert tree_hashes(tmp_path / "tiny") == tree_hashes(tmp_path / "whole")
    with pytest.raises(ConfigError, match="--unit-mb must be in"):
        P.prepare(sources, tmp_path / "bad", **KW, unit_mb=0)


def test_a_large_corpus_gets_larger_units_up_to_a_cap():
    assert planning.default_unit_bytes(0) == planning.default_unit_bytes(8 << 30) == planning.UNIT_BYTES
    assert planning.default_unit_bytes(100 << 30) == (100 << 30) // planning.TARGET_UNITS  # 12.5 MiB
    assert planning.default_unit_bytes(10 << 40) == planning.MAX_UNIT_BYTES


def test_a_rerun_reads_the_plan_and_reuses_every_recorded_unit_that_verifies(tmp_path, monkeypatch, capsys):
    sources = _corpus(tmp_path)
    monkeypatch.setattr(planning, "UNIT_BYTES", 400)
    ref = P.prepare(sources, tmp_path / "ref", **KW)
    out = tmp_path / "ds"
    _prepare_interrupted(monkeypatch, 5, sources, out)
    stage = out / staging.STAGE_DIRNAME
    recorded = len(list((stage / units.UNITS_DIRNAME).glob("*.json")))
    assert 1 < recorded < ref.work.computed
    (stage / staging.STATE_NAME).unlink()  # as if the driver was killed before its first snapshot
    tok = sorted((stage / units.UNITS_DIRNAME).glob("*.tok"))[0]
    tok.write_bytes(tok.read_bytes()[:-2])  # fails its record's sha256: computed again
    listed = []
    monkeypatch.setattr(planning, "list_units", lambda *a: listed.append(a) or [])
    again = P.prepare(sources, out, **KW)
    assert listed == []  # the recorded plan was read, the sources not listed again
    err = capsys.readouterr().err
    assert "not resuming" in err and "left no snapshot" in err and "delete" not in err
    assert (again.work.reused, again.work.computed) == (recorded - 1, ref.work.computed - recorded + 1)
    assert f"{recorded - 1} reused" in again.table()
    assert tree_hashes(out) == tree_hashes(tmp_path / "ref")


def test_a_bad_line_in_a_cut_jsonl_file_is_located_by_its_byte_offset(tmp_path, monkeypatch):
    lines = [json.dumps({"text": f"line {i} " + "words " * 5}) for i in range(60)]
    lines[41] = "{not json"
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    offset = sum(len(x) + 1 for x in lines[:41])
    monkeypatch.setattr(planning, "UNIT_BYTES", 300)
    with pytest.raises(DataError, match=rf"d\.jsonl byte {offset}: malformed JSON"):
        P.prepare([str(tmp_path / "d.jsonl")], tmp_path / "ds", **KW)


def test_a_worker_that_cannot_see_a_source_or_the_stage_is_one_error_saying_so(tmp_path, monkeypatch):
    from mamba3lite.data import workers

    sources = _corpus(tmp_path)
    real_list = planning.list_units

    def list_then_lose(*a, **k):  # the file is listed here, and gone where the unit is computed
        listing = real_list(*a, **k)
        (tmp_path / "b.jsonl").rename(tmp_path / "b.moved")
        return listing

    with monkeypatch.context() as m:
        m.setattr(planning, "list_units", list_then_lose)
        with pytest.raises(DataError, match=r"cannot read .*b\.jsonl on .*every worker must see the sources"):
            P.prepare(sources, tmp_path / "ds", **KW)
    (tmp_path / "b.moved").rename(tmp_path / "b.jsonl")

    real_run = workers._run_unit

    def computed_elsewhere(job, unit, rows=None):  # its files written to a disk the driver does not see
        record = real_run(job, unit, rows)
        (units.units_dir(job.stage_dir) / f"{unit.key}.idx").unlink()
        return record

    monkeypatch.setattr(workers, "_run_unit", computed_elsewhere)
    with pytest.raises(
        DataError, match=r"unit 000-000000 was computed on .* --out must be on storage every node"
    ):
        P.prepare(sources, tmp_path / "ds", **KW)
    assert not (tmp_path / "ds").exists()


def test_a_dedup_partitioned_by_digest_writes_the_same_bytes_and_remembers_only_repeated_digests(
    tmp_path, monkeypatch
):
    sources = _with_parquet(tmp_path)
    rows = [f"gamma {i}: " + "rows " * (2 + i % 6) for i in range(90)] + ["alpha 3: " + "words " * 7]
    pq.write_table(pa.table({"text": rows}), tmp_path / "c.parquet", row_group_size=7)  # + a JSONL text
    monkeypatch.setattr(planning, "UNIT_BYTES", 500)
    ref = P.prepare(sources, tmp_path / "ref", **KW)
    s = P.prepare(sources, tmp_path / "ds", **{**KW, "workers": 2, "dedup_partitions": 3})
    assert tree_hashes(tmp_path / "ds") == tree_hashes(tmp_path / "ref")
    assert s.work.dedup_partitions == 3 and "partitioned by digest into 3 tasks" in s.table()
    # 12 texts of a.jsonl repeated in b.jsonl, 1 in c.parquet: all the driver had to remember
    assert s.work.dedup_candidates == ref.stats["dropped"]["duplicate"] == 13


def _fake_datasets(monkeypatch, n_rows: int, fail_after: int | None = None) -> None:
    import types

    def rows(name):
        for i in range(n_rows):
            if i == fail_after:
                raise ConnectionError("the network went away")
            yield {"text": f"streamed row {i} of {name}: " + "words " * (1 + i % 5)}

    module = types.ModuleType("datasets")
    module.load_dataset = lambda name, config=None, split=None, streaming=False: rows(name)
    monkeypatch.setitem(sys.modules, "datasets", module)


def test_an_hf_stream_is_cut_into_units_as_it_is_read_and_changes_no_byte(tmp_path, monkeypatch):
    from mamba3lite.errors import TransientError

    _fake_datasets(monkeypatch, 40)
    whole = P.prepare(["hf:org/data"], tmp_path / "whole", **KW)
    assert whole.work.computed == 1
    monkeypatch.setattr(planning, "STREAM_UNIT_ROWS", 3)
    cut = P.prepare(["hf:org/data"], tmp_path / "cut", **{**KW, "workers": 2})
    assert cut.work.computed == 14 and tree_hashes(tmp_path / "cut") == tree_hashes(tmp_path / "whole")
    # A network error mid-stream: the rows before it are consumed, the error names its row, the stage
    # is kept for the resume.
    _fake_datasets(monkeypatch, 40, fail_after=20)
    with pytest.raises(TransientError, match="reading row 21 failed"):
        P.prepare(["hf:org/data"], tmp_path / "ds", **{**KW, "workers": 2})
    assert (tmp_path / "ds" / staging.STAGE_DIRNAME).is_dir()
