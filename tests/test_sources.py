"""Text sources: resolution, order, formats, binary detection, decoding, and the hf stand-in."""

from __future__ import annotations

import gzip
import json
import signal
import sys
import types

import pytest

from mamba3lite.data import sources as S
from mamba3lite.errors import ConfigError, DataError, DataNotFoundError


def _texts(src: S.Source, start: int = 0) -> list:
    return [(S.format_location(loc), kind, payload) for loc, kind, payload in src.units(start)]


def test_directory_is_walked_in_sorted_order_skipping_hidden(tmp_path):
    for rel in ["b.txt", "a/z.md", "a/b.py", ".hidden.txt", ".git/x.txt", "__pycache__/c.txt"]:
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(rel)
    units = _texts(S.Source(str(tmp_path)))
    assert [payload.decode() for _, _, payload in units] == ["a/b.py", "a/z.md", "b.txt"]
    assert all(kind == S.KIND_TEXT_BYTES for _, kind, _ in units)


def test_glob_and_single_file(tmp_path):
    for name in ["x1.md", "x2.md", "y.txt"]:
        (tmp_path / name).write_text(name)
    got = [p.decode() for _, _, p in _texts(S.Source(str(tmp_path / "*.md")))]
    assert got == ["x1.md", "x2.md"]
    assert [p for _, _, p in _texts(S.Source(str(tmp_path / "y.txt")))] == [b"y.txt"]


def test_recursive_glob_takes_each_file_once(tmp_path):
    for rel in ["d/a.txt", "d/sub/b.txt"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(rel)
    got = [p.decode() for _, _, p in _texts(S.Source(str(tmp_path / "d" / "**")))]
    assert got == ["d/a.txt", "d/sub/b.txt"]


def test_recursive_globs_over_symlink_cycles_end_and_match_as_glob_does(tmp_path):
    """glob.glob follows a link to "." round and round: one such link listed every file 41 times, two
    never finished. `**` now walks each real directory once; what it matches is unchanged."""
    d = tmp_path / "d"
    for rel in ["a.md", "x.txt", "sub/b.md", "sub/deep/c.md", "other/sub/e.txt", ".hidden/h.md"]:
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text(rel)
    (d / "self").symlink_to(".")
    (d / "sub" / "up").symlink_to("..")

    def rel(spec):
        def hung(*_):
            raise TimeoutError(f"Source({spec!r}) did not finish in 30 s")

        old = signal.signal(signal.SIGALRM, hung)  # a regression would hang CI; fail the test instead
        signal.alarm(30)
        try:
            return [p.relative_to(d).as_posix() for p in S.Source(spec).files]
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)

    assert rel(f"{d}/**/*.md") == ["a.md", "sub/b.md", "sub/deep/c.md"]
    assert rel(f"{d}/**") == ["a.md", "other/sub/e.txt", "sub/b.md", "sub/deep/c.md", "x.txt"]
    assert rel(f"{d}/**/sub") == ["other/sub/e.txt", "sub/b.md", "sub/deep/c.md"]  # directories: walked
    assert rel(f"{d}/**/deep/*.md") == ["sub/deep/c.md"]
    assert rel(f"{d}/su*/**/*.md") == ["sub/b.md", "sub/deep/c.md", "sub/up/a.md"]  # up -> d, once
    assert rel(f"{d}/s*/**/*.md") == ["self/a.md", "self/sub/b.md", "self/sub/deep/c.md"]  # each file once
    assert rel(f"{d}/*.md") == ["a.md"]


def test_missing_path_and_empty_glob(tmp_path):
    with pytest.raises(DataNotFoundError, match="source not found"):
        S.Source(str(tmp_path / "nope"))
    with pytest.raises(DataNotFoundError, match="matches no files"):
        S.Source(str(tmp_path / "*.nothing"))


def test_symlinked_directories_are_followed_once(tmp_path):
    """A linked directory is read like a real one (a `**` glob follows it too); a link back up (a cycle) or a
    second link to a directory already read adds nothing, and the real directory's name is used."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "o.txt").write_text("outside")
    root = tmp_path / "corpus"
    (root / "real").mkdir(parents=True)
    (root / "real" / "r.txt").write_text("real")
    (root / "a_link_to_real").symlink_to(root / "real")
    (root / "linked").symlink_to(outside)
    (root / "real" / "loop").symlink_to(root)
    files = S.Source(str(root)).files
    assert [p.relative_to(root).as_posix() for p in files] == ["linked/o.txt", "real/r.txt"]


@pytest.mark.parametrize("spec", ["", "  ", "\t"])
def test_an_empty_source_is_refused_not_the_current_directory(spec, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.txt").write_text("would be read as the current directory")
    with pytest.raises(ConfigError, match=r"is empty .*unset shell variable"):
        S.Source(spec)


def test_jsonl_lines_are_units_with_locations_and_blank_lines_skipped(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_bytes(b'{"text": "one"}\n\n{"text": "two"}\n')
    units = _texts(S.Source(str(p)))
    assert [(loc, kind) for loc, kind, _ in units] == [(f"{p}:1", S.KIND_JSONL), (f"{p}:3", S.KIND_JSONL)]
    gz = tmp_path / "e.jsonl.gz"
    with gzip.open(gz, "wb") as f:
        f.write(b'{"text": "zipped"}\n')
    assert [S.parse_jsonl_line(p, "text") for _, _, p in _texts(S.Source(str(gz)))] == [("zipped", None)]


def test_parse_jsonl_line_problems():
    assert S.parse_jsonl_line(b'{"text": "a\\u00e9"}', "text") == ("a\u00e9", None)
    assert S.parse_jsonl_line(b'{"text": null}', "text") == ("", None)
    text, problem = S.parse_jsonl_line(b'{"text": "a"', "text")
    assert text is None and "malformed JSON" in problem
    text, problem = S.parse_jsonl_line(b'{"body": "a"}', "text")
    assert text is None and "no field 'text'" in problem and "body" in problem and "--text-field" in problem
    assert "not a string" in S.parse_jsonl_line(b'{"text": 3}', "text")[1]
    assert "JSON object" in S.parse_jsonl_line(b"[1, 2]", "text")[1]


def test_start_and_max_docs_give_the_same_units_as_slicing(tmp_path):
    for i in range(5):
        (tmp_path / f"f{i}.txt").write_text(f"file {i}")
    (tmp_path / "g.jsonl").write_text("".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(4)))
    full = _texts(S.Source(str(tmp_path)))
    assert len(full) == 9
    for start in range(10):
        assert _texts(S.Source(str(tmp_path)), start) == full[start:]
    assert _texts(S.Source(str(tmp_path), max_docs=7), 3) == full[3:7]


def test_size_with_max_docs_counts_only_the_units_taken(tmp_path):
    """Without a target the mixer's rates are the sources' sizes; a --max-docs slice of one big JSONL or
    Parquet file counted as the whole file (here 100x too large), skewing the mix toward it."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    lines = [json.dumps({"text": f"line {i:04d} " + "x" * 40}) + "\n" for i in range(1000)]
    j = tmp_path / "big.jsonl"
    j.write_text("\n" + "".join(lines))  # a blank first line is not a unit
    assert S.Source(str(j)).size_bytes() == j.stat().st_size
    assert S.Source(str(j), max_docs=10).size_bytes() == 1 + sum(len(x) for x in lines[:10])
    assert S.Source(str(j), max_docs=5000).size_bytes() == j.stat().st_size
    z = tmp_path / "big.jsonl.gz"
    z.write_bytes(gzip.compress("".join(lines).encode()))
    assert 0 < S.Source(str(z), max_docs=10).size_bytes() <= z.stat().st_size
    p = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": [f"row {i}" for i in range(1000)]}), p)
    assert S.Source(str(p), max_docs=100).size_bytes() == int(p.stat().st_size * 0.1)
    d = tmp_path / "d"
    d.mkdir()
    for name in ("a.txt", "b.txt"):
        (d / name).write_text("0123456789")
    (d / "c.jsonl").write_text("".join(lines[:3]))
    assert S.Source(str(d), max_docs=1).size_bytes() == 10
    assert S.Source(str(d), max_docs=4).size_bytes() == 20 + len(lines[0]) + len(lines[1])


def test_binary_detection():
    assert S.looks_binary(b"abc\x00def")
    assert S.looks_binary(bytes(range(1, 32)) * 10)
    assert not S.looks_binary("plain text, ünïcode, tabs\tand\nnewlines\r\n".encode())
    assert not S.looks_binary(b"")
    assert not S.looks_binary("日本語のテキスト".encode() * 100)


def test_undecodable_bytes_become_counted_replacements():
    text = S.decode_bytes(b"ok \xff\xfe end \xe2\x82")
    fixed, n = S.replace_surrogates(text)
    assert n == 4
    assert fixed == "ok \ufffd\ufffd end \ufffd\ufffd"
    assert S.replace_surrogates("clean ünïcode") == ("clean ünïcode", 0)


def test_parquet_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    p = tmp_path / "t.parquet"
    pq.write_table(pa.table({"content": ["alpha", None, "gamma"], "id": [1, 2, 3]}), p)
    units = _texts(S.Source(str(p), text_field="content"))
    assert [(loc, kind, payload) for loc, kind, payload in units] == [
        (f"{p}:1", S.KIND_STR, "alpha"),
        (f"{p}:2", S.KIND_STR, None),
        (f"{p}:3", S.KIND_STR, "gamma"),
    ]
    with pytest.raises(DataError, match=r"no column 'text'.*content"):
        list(S.Source(str(p)).units())


def test_stdlib_corpus_is_sorted_and_excludes_tests():
    files = S.stdlib_files()
    root = S.stdlib_dir()
    rels = [f.relative_to(root).as_posix() for f in files]
    assert len(rels) > 100 and rels == sorted(rels)
    assert "os.py" in rels
    assert not any(part in S.STDLIB_EXCLUDED_PARTS for r in rels for part in r.split("/")[:-1])


@pytest.fixture
def fake_datasets(monkeypatch):
    """A local stand-in for the `datasets` package: load_dataset streams dicts; records its arguments."""
    calls = []
    module = types.ModuleType("datasets")

    def load_dataset(name, config=None, split=None, streaming=False):
        calls.append((name, config, split, streaming))
        if name == "missing/ds":
            raise FileNotFoundError("Dataset 'missing/ds' doesn't exist on the Hub")
        return iter([{"text": f"row {i} of {name}", "meta": i} for i in range(3)])

    module.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", module)
    return calls


def test_hf_source_streams_train_split(fake_datasets):
    src = S.Source("hf:org/corpus:en")
    units = _texts(src)
    assert fake_datasets == [("org/corpus", "en", "train", True)]
    assert units == [(f"hf:org/corpus:en:{i + 1}", S.KIND_STR, f"row {i} of org/corpus") for i in range(3)]
    assert [u[2] for u in _texts(S.Source("hf:org/corpus"), 2)] == [u[2] for u in units[2:]]
    assert fake_datasets[-1][1] is None


def test_hf_source_errors(fake_datasets, monkeypatch):
    with pytest.raises(DataError, match=r"no field 'body'.*meta"):
        list(S.Source("hf:org/corpus", text_field="body").units())
    with pytest.raises(DataError, match="cannot load Hugging Face dataset 'hf:missing/ds'"):
        list(S.Source("hf:missing/ds").units())
    with pytest.raises(ConfigError, match="hf:NAME"):
        S.Source("hf:")
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails -> an install hint
    with pytest.raises(ConfigError, match="pip install"):
        S.Source("hf:org/corpus")


def test_damaged_inputs_are_one_data_error_each(tmp_path):
    """Damage that used to end in a traceback: a .gz whose compressed data is corrupt (zlib.error is not
    an OSError), and JSON lines Python's parser refuses with ValueError or RecursionError."""
    good = gzip.compress(b"".join(json.dumps({"text": "x" * i}).encode() + b"\n" for i in range(2000)))
    damaged = bytearray(good)
    damaged[len(good) // 2 : len(good) // 2 + 60] = bytes(
        b ^ 0xFF for b in good[len(good) // 2 : len(good) // 2 + 60]
    )
    (tmp_path / "d.jsonl.gz").write_bytes(bytes(damaged))
    with pytest.raises(DataError, match=r"cannot read .*d\.jsonl\.gz"):
        list(S.Source(str(tmp_path / "d.jsonl.gz")).units())
    assert "malformed JSON" in S.parse_jsonl_line(b'{"n": ' + b"9" * 5000 + b', "text": "a"}', "text")[1]
    assert "malformed JSON" in S.parse_jsonl_line(b"[" * 100_000 + b"]" * 100_000, "text")[1]
    assert "--text-field" in S.parse_jsonl_line(b'{"text": [1]}', "text")[1]


def test_parquet_text_column_types(tmp_path, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    p = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": [1, 2], "raw": pa.array([b"caf\xc3\xa9", None], pa.binary())}), p)
    with pytest.raises(DataError, match=r"column 'text' holds int64, not text; fix: --text-field"):
        list(S.Source(str(p)).units())
    # Text stored as BYTE_ARRAY without the UTF8 mark (some writers do): read as UTF-8
    assert [u[2] for u in S.Source(str(p), text_field="raw").units()] == ["caf\u00e9", None]

    def damaged_pages(self, *a, **k):
        yield pa.record_batch([pa.array([b"ok"], pa.binary())], names=["raw"])
        raise pa.ArrowInvalid("Index not in dictionary bounds")

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", damaged_pages)
    with pytest.raises(DataError, match=r"cannot read parquet file .*t\.parquet: Index not in"):
        list(S.Source(str(p), text_field="raw").units())


def test_unreadable_directories_and_files_fail_before_any_work(tmp_path, monkeypatch):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "sub" / "b.txt").write_text("b")
    scandir = S.os.scandir

    def no_permission(path="."):
        if str(path).endswith("sub"):
            raise PermissionError(13, "Permission denied", str(path))
        return scandir(path)

    with monkeypatch.context() as m:  # as for a chmod 000 directory (the tests may run as root)
        m.setattr(S.os, "scandir", no_permission)
        with pytest.raises(DataError, match=r"cannot read directory .*sub: Permission denied"):
            S.Source(str(tmp_path))
    access = S.os.access
    monkeypatch.setattr(S.os, "access", lambda p, mode: not str(p).endswith("b.txt") and access(p, mode))
    with pytest.raises(DataError, match=r"cannot read .*b\.txt: permission denied"):
        S.Source(str(tmp_path))


def test_an_existing_name_with_glob_characters_is_that_file(tmp_path):
    (tmp_path / "notes [draft].txt").write_text("draft")
    (tmp_path / "notes d.txt").write_text("the glob would match this one")
    units = _texts(S.Source(str(tmp_path / "notes [draft].txt")))
    assert [u[2] for u in units] == [b"draft"]


def test_max_docs_stops_before_reading_the_next_unit(tmp_path, monkeypatch):
    for name in ("a", "b", "c"):
        (tmp_path / f"{name}.txt").write_text(name)
    read = []
    read_bytes = S.intake.read_bytes_capped  # the one reader every text file goes through
    monkeypatch.setattr(
        S.intake, "read_bytes_capped", lambda path, kind: read.append(path.name) or read_bytes(path, kind)
    )
    assert len(_texts(S.Source(str(tmp_path), max_docs=2))) == 2
    assert read == ["a.txt", "b.txt"]


def test_hf_rows_that_fail_or_hold_no_text(monkeypatch):
    module = types.ModuleType("datasets")
    mode = {}

    def rows():
        yield {"text": "fine"}
        if mode["kind"] == "list":
            yield {"text": ["a", "paragraph"]}
        raise (
            mode["kind"]("connection reset") if mode["kind"] is ConnectionError else RuntimeError("bad shard")
        )

    module.load_dataset = lambda *a, **k: rows()
    monkeypatch.setitem(sys.modules, "datasets", module)
    mode["kind"] = "list"
    with pytest.raises(DataError, match=r"row 2: field 'text' is a list, not a string"):
        list(S.Source("hf:org/x").units())
    mode["kind"] = ConnectionError  # the network: resumable, not bad input
    with pytest.raises(S.TransientError, match=r"hf:org/x: reading row 2 failed .*re-run the same command"):
        list(S.Source("hf:org/x").units())
    mode["kind"] = RuntimeError
    with pytest.raises(DataError, match=r"hf:org/x: cannot read row 2: RuntimeError: bad shard"):
        list(S.Source("hf:org/x").units())


def test_a_prepared_dataset_below_a_source_directory_is_not_read_as_text(tmp_path):
    """`prepare --source corpus --out corpus/data`, then another prepare of corpus: the dataset's shards
    and manifest are output, not documents (a walk, a `**` glob and a plain glob skip it); a
    manifest.json of another program is text like any file; the dataset itself as the source is refused."""
    from userside_helpers import make_dataset

    corpus = tmp_path / "corpus"
    for rel in ["a.txt", "ext/manifest.json", "ext/b.js"]:
        (corpus / rel).parent.mkdir(parents=True, exist_ok=True)
        (corpus / rel).write_text(rel)
    (corpus / "ext" / "manifest.json").write_text('{"manifest_version": 3, "name": "x"}')
    make_dataset(corpus / "data")
    assert (corpus / "data" / "manifest.json").is_file()
    want = ["a.txt", "ext/b.js", "ext/manifest.json"]
    for spec in (str(corpus), f"{corpus}/**", f"{corpus}/*"):
        src = S.Source(spec)
        assert sorted(p.relative_to(corpus).as_posix() for p in src.files) == want, spec
        assert src.skipped_datasets == [corpus / "data"], spec  # prepare names them in a note
    with pytest.raises(DataError, match="is a dataset `prepare` wrote"):
        S.Source(str(corpus / "data"))
