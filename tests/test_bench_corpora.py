"""The JSONL corpus of `benchmarks/bench_prepare.py` (benchmarks/corpora.py): the same bytes for the same
seed, about the size asked for, valid JSON lines with a `text` field, unique documents of 1-8 KB apart
from the planted 1% of exact duplicates; and the benchmark's --help and its refusal of an unknown corpus.
(The benchmark's own smoke run is tests/test_benchmarks_smoke.py's, slow-marked.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mamba3lite.data.clean import clean_text

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"


@pytest.fixture
def corpora(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import corpora

    return corpora


def _documents(files: list[Path]) -> list[dict]:
    return [json.loads(line) for f in files for line in f.read_text(encoding="utf-8").splitlines()]


def test_the_jsonl_corpus_is_deterministic_sized_and_has_its_duplicate_fraction(corpora, tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for d in (a, b, c):
        d.mkdir()
    made = corpora.write_jsonl(a, 2.0, seed=3)
    again = corpora.write_jsonl(b, 2.0, seed=3)
    assert [f.read_bytes() for f in made.files] == [f.read_bytes() for f in again.files]
    other = corpora.write_jsonl(c, 2.0, seed=4)
    assert [f.read_bytes() for f in made.files] != [f.read_bytes() for f in other.files]

    assert len(made.files) >= corpora.MIN_FILES and all(f.stat().st_size > 0 for f in made.files)
    n_bytes = sum(f.stat().st_size for f in made.files)
    assert n_bytes == made.n_bytes and 2.0e6 <= n_bytes < 2.0e6 + 20_000  # stops at the first line past it

    docs = _documents(made.files)
    assert len(docs) == made.n_docs and [d["id"] for d in docs] == list(range(len(docs)))
    texts = [d["text"] for d in docs]
    assert all(isinstance(t, str) and t.strip() for t in texts)
    sizes = [len(t.encode("utf-8")) for t in texts]
    assert min(sizes) >= corpora.MIN_DOC_BYTES and max(sizes) <= corpora.MAX_DOC_BYTES
    # Every 100th document is a copy of an earlier one; all the others are distinct, also once cleaned
    # as `prepare` cleans them (its dedup key), so its dedup drops exactly the copies.
    assert made.n_duplicates == len(docs) // corpora.DUPLICATE_EVERY >= 3
    copies = [i for i in range(len(texts)) if (i + 1) % corpora.DUPLICATE_EVERY == 0]
    assert all(texts[i] in texts[:i] for i in copies)
    unique = [t for i, t in enumerate(texts) if (i + 1) % corpora.DUPLICATE_EVERY]
    assert len({clean_text(t)[0] for t in unique}) == len(unique) == len(set(texts))


def test_the_licences_corpus_copies_each_licence_file_once_in_order(corpora, tmp_path, monkeypatch):
    root = tmp_path / "root"
    (root / "pkg-1.0.dist-info").mkdir(parents=True)
    (root / "doc" / "zlib").mkdir(parents=True)
    (root / "pkg-1.0.dist-info" / "LICENSE.txt").write_text("MIT License\n")
    (root / "doc" / "zlib" / "copyright").write_text("zlib licence\n")
    (root / "doc" / "zlib" / "README").write_text("not a licence\n")
    (root / "doc" / "COPYING").symlink_to(root / "doc" / "zlib" / "copyright")  # a link: not followed
    (root / "NOTICE").write_bytes(b"")  # empty: left out
    monkeypatch.setattr(corpora, "LICENCE_ROOTS", (str(root), str(root / "doc")))  # the same file twice
    assert corpora.licence_files() == [
        root / "doc" / "zlib" / "copyright",
        root / "pkg-1.0.dist-info" / "LICENSE.txt",
    ]
    with corpora.open_corpus("licences") as corpus:
        copied = sorted(Path(corpus.spec).iterdir())
        assert [p.name for p in copied] == ["00000-copyright", "00001-LICENSE.txt"]
        assert [p.read_text() for p in copied] == ["zlib licence\n", "MIT License\n"]
        assert corpus.about == "2 licence and copyright files, 0.0 MB"
    assert not Path(corpus.spec).exists()
    monkeypatch.setattr(corpora, "LICENCE_ROOTS", (str(tmp_path / "none"),))
    with pytest.raises(SystemExit, match="no licence files found"), corpora.open_corpus("licences"):
        pass


def test_bench_prepare_help_names_its_corpora_and_refuses_an_unknown_one():
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, str(BENCH / "bench_prepare.py"), *args],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    out = run("--help")
    assert out.returncode == 0, out.stderr
    assert "--source CORPUS" in out.stdout and "jsonl:MB" in out.stdout and "licences" in out.stdout
    bad = run("--source", "stdlib,jsonl:x", "--repeats", "1")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "unknown corpus 'jsonl:x': expected stdlib, numpy, licences or jsonl:MB" in bad.stderr
