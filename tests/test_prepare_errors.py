"""`prepare` on bad input: a clear error, a non-zero exit where fatal, and nothing on disk damaged."""

from __future__ import annotations

import gzip
import json
import os

import pytest

from mamba3lite.cli import main
from mamba3lite.data.prepare import prepare
from mamba3lite.data.shards import Manifest, verify_dataset
from mamba3lite.errors import ConfigError, DataError, DataNotFoundError
from test_prepare_helpers import tree_hashes


def _jsonl(path, texts, bad_at=None, bad=b"{not json\n"):
    lines = [json.dumps({"text": t}).encode() + b"\n" for t in texts]
    if bad_at is not None:
        lines.insert(bad_at, bad)
    path.write_bytes(b"".join(lines))
    return str(path)


def _docs(n, tag="doc"):
    return [f"{tag} {i}: " + "some words " * (3 + i % 5) for i in range(n)]


@pytest.fixture
def existing(tmp_path):
    """A finished dataset in tmp_path/ds, and the hashes of everything under it."""
    src = _jsonl(tmp_path / "old.jsonl", _docs(30, "old"))
    out = tmp_path / "ds"
    prepare([src], out, workers=0, shard_tokens=100, val_fraction=0.2, min_chars=1)
    return out, tree_hashes(out)


def test_missing_path_cli(cli, tmp_path):
    r = cli("prepare", "--source", str(tmp_path / "nope"), "--out", str(tmp_path / "ds"))
    assert r.returncode == 2
    assert "error: source not found" in r.stderr and str(tmp_path / "nope") in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "ds").exists()


@pytest.mark.parametrize("value", ["inf", "1e400", "nan", "2.5", "many"])
def test_counts_that_are_not_whole_finite_numbers_are_usage_errors(cli, tmp_path, value):
    (tmp_path / "a.txt").write_text("text long enough to keep")
    r = cli(
        "prepare", "--source", str(tmp_path / "a.txt"), "--out", str(tmp_path / "ds"), "--max-docs", value
    )
    assert r.returncode == 2 and "--max-docs" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "ds").exists()


def test_unknown_tokenizer(cli, tmp_path):
    (tmp_path / "a.txt").write_text("text long enough to keep")
    with pytest.raises(ConfigError, match="unknown tokenizer 'gpt3'"):
        prepare([str(tmp_path / "a.txt")], tmp_path / "ds", tokenizer="gpt3", workers=0)
    r = cli(
        "prepare", "--source", str(tmp_path / "a.txt"), "--out", str(tmp_path / "ds"), "--tokenizer", "gpt3"
    )
    assert r.returncode == 2 and "unknown tokenizer" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "ds").exists()


def test_empty_corpus_after_filtering(tmp_path):
    d = tmp_path / "c"
    d.mkdir()
    (d / "a.txt").write_text("short")
    (d / "b.txt").write_text("\n\n")
    (d / "c.bin").write_bytes(b"\x00\x01\x02" * 100)
    with pytest.raises(DataError, match=r"empty corpus: 3 documents read.*too_short 1.*binary 1.*empty 1"):
        prepare([str(d)], tmp_path / "ds", workers=0)
    assert not (tmp_path / "ds").exists()


def test_malformed_jsonl_line_names_file_and_line(cli, tmp_path):
    src = _jsonl(tmp_path / "d.jsonl", _docs(5), bad_at=3)
    with pytest.raises(DataError, match=rf"{src}:4: malformed JSON"):
        prepare([src], tmp_path / "ds", workers=0, min_chars=1)
    assert not (tmp_path / "ds").exists()
    r = cli("prepare", "--source", src, "--out", str(tmp_path / "ds"), "--workers", "0")
    assert r.returncode == 2 and f"{src}:4: malformed JSON" in r.stderr and "--skip-bad-lines" not in r.stdout
    s = prepare([src], tmp_path / "ds", workers=0, min_chars=1, skip_bad_lines=True, val_fraction=0.0)
    assert s.stats["dropped"]["bad_lines"] == 1 and s.stats["kept"] == 5


def test_jsonl_without_the_text_field(tmp_path):
    src = tmp_path / "d.jsonl"
    src.write_text("".join(json.dumps({"content": t}) + "\n" for t in _docs(3)))
    with pytest.raises(DataError, match=r"d.jsonl:1: no field 'text' \(fields: content\); fix: --text-field"):
        prepare([str(src)], tmp_path / "ds", workers=0)
    s = prepare([str(src)], tmp_path / "ds", workers=0, text_field="content", val_fraction=0.0, min_chars=1)
    assert s.stats["kept"] == 3


def test_bad_arguments(tmp_path):
    (tmp_path / "a.txt").write_text("text long enough to keep")
    src = str(tmp_path / "a.txt")
    for kw, msg in [
        ({"val_fraction": 1.0}, "--val-fraction"),
        ({"shard_tokens": 0}, "--shard-tokens"),
        ({"min_chars": -1}, "--min-chars"),
        ({"target_tokens": 0}, "--target-tokens"),
        ({"sources": [(src, 0.0)]}, "weight must be a positive"),
    ]:
        with pytest.raises(ConfigError, match=msg):
            prepare(**{"sources": [src], "out": tmp_path / "ds", "workers": 0, **kw})
    with pytest.raises(ConfigError, match="no sources"):
        prepare([], tmp_path / "ds")
    assert not (tmp_path / "ds").exists()


def test_an_empty_source_is_a_usage_error(tmp_path, monkeypatch, capsys):
    """`prepare --source "$UNSET"`: one error line, exit 2, and neither the current directory tokenized nor
    --out created."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.txt").write_text("text long enough to keep, in the current directory")
    assert main(["prepare", "--source", "", "--out", str(tmp_path / "ds"), "--workers", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: source '' is empty") and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "ds").exists()


def test_out_holding_a_different_dataset_is_refused_unless_overwrite(existing, tmp_path):
    out, before = existing
    new = _jsonl(tmp_path / "new.jsonl", _docs(10, "new"))
    with pytest.raises(ConfigError, match=r"holds a dataset prepared with different arguments.*--overwrite"):
        prepare([new], out, workers=0, min_chars=1)
    assert tree_hashes(out) == before
    prepare([new], out, workers=0, min_chars=1, val_fraction=0.0, overwrite=True)
    assert verify_dataset(out) == []
    assert Manifest.load(out).extra["stats"]["kept"] == 10
    assert not (out / "val").exists()  # the old dataset's val split went with it


def test_out_that_is_not_a_dataset_is_refused(tmp_path):
    out = tmp_path / "ds"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (tmp_path / "a.txt").write_text("text long enough to keep")
    with pytest.raises(ConfigError, match=r"is not empty \(notes.txt\) and is not a mamba3lite dataset"):
        prepare([str(tmp_path / "a.txt")], out, workers=0)
    assert list(tree_hashes(out)) == ["notes.txt"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        prepare([str(tmp_path / "a.txt")], tmp_path / "file", workers=0)


def test_failure_mid_run_leaves_the_previous_dataset_intact(existing, tmp_path):
    """Many shards are written (to the staging area) before the bad line is reached."""
    out, before = existing
    src = _jsonl(tmp_path / "new.jsonl", _docs(200, "new"), bad_at=150)
    with pytest.raises(DataError, match=r"new.jsonl:151: malformed JSON"):
        prepare([src], out, workers=0, min_chars=1, shard_tokens=50, overwrite=True)
    assert tree_hashes(out) == before
    assert verify_dataset(out) == []


def test_a_manifest_that_cannot_be_written_leaves_the_previous_dataset_intact(
    existing, tmp_path, monkeypatch
):
    """The last step (disk full, or a manifest that fails validation) fails before the old dataset's
    manifest and splits are replaced."""
    out, before = existing
    src = _jsonl(tmp_path / "new.jsonl", _docs(40, "new"))

    def disk_full(self, dataset_dir):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Manifest, "save", disk_full)
    with pytest.raises(OSError, match="No space"):
        prepare([src], out, workers=0, min_chars=1, overwrite=True)
    after = tree_hashes(out)
    assert {k: v for k, v in after.items() if not k.startswith(".prepare")} == before
    monkeypatch.undo()
    assert verify_dataset(out) == []
    prepare([src], out, workers=0, min_chars=1, overwrite=True)  # and the same command then succeeds
    assert verify_dataset(out) == [] and Manifest.load(out).extra["stats"]["kept"] == 40


def test_failure_in_a_workers_run_is_reported_cleanly(cli, existing, tmp_path):
    out, before = existing
    src = _jsonl(tmp_path / "new.jsonl", _docs(100, "new"), bad_at=60, bad=b'{"body": "no text"}\n')
    r = cli(
        "prepare", "--source", src, "--out", str(out), "--workers", "2", "--overwrite", "--shard-tokens", "50"
    )
    assert r.returncode == 2 and "new.jsonl:61: no field 'text'" in r.stderr and "Traceback" not in r.stderr
    assert tree_hashes(out) == before


def test_missing_path_among_good_sources_fails_before_any_work(existing, tmp_path):
    out, before = existing
    good = _jsonl(tmp_path / "new.jsonl", _docs(10))
    with pytest.raises(DataNotFoundError, match="source not found"):
        prepare([good, str(tmp_path / "missing_dir")], out, workers=0, overwrite=True)
    assert tree_hashes(out) == before


def _die(items):  # runs in a forked worker in place of clean.process_batch
    import os

    os._exit(1)


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="the patched worker is inherited by fork")
def test_a_dying_worker_is_an_error_not_a_hang(tmp_path, monkeypatch):
    from mamba3lite.data import clean
    from mamba3lite.errors import Mamba3LiteError

    src = _jsonl(tmp_path / "d.jsonl", _docs(20))
    monkeypatch.setattr(clean, "process_batch", _die)
    with pytest.raises(Mamba3LiteError, match=r"worker process died.*re-run the same command to resume"):
        prepare([src], tmp_path / "ds", workers=2, min_chars=1)
    assert (tmp_path / "ds" / ".prepare").is_dir()  # kept for the resume
    monkeypatch.undo()
    s = prepare([src], tmp_path / "ds", workers=2, min_chars=1, val_fraction=0.0)
    assert s.stats["kept"] == 20


def test_a_second_prepare_into_the_same_out_is_refused_while_the_first_runs(
    cli, existing, tmp_path, monkeypatch
):
    # Two prepares into one --out would share (and resume from) one staging directory. The first holds
    # a lock for its whole run; the second fails at once, touching nothing, and the first completes.
    import threading

    from mamba3lite.data import prepare as prep

    out, before = existing
    src = _jsonl(tmp_path / "more.jsonl", _docs(20, "more"))
    inside, go_on = threading.Event(), threading.Event()
    real_run = prep._Run.run

    def run_slowly(self, pool, depth):
        inside.set()
        assert go_on.wait(60)
        return real_run(self, pool, depth)

    monkeypatch.setattr(prep._Run, "run", run_slowly)
    first: dict = {}
    worker = threading.Thread(
        target=lambda: first.update(summary=prepare([src], out, workers=0, min_chars=1, overwrite=True))
    )
    worker.start()
    try:
        assert inside.wait(60)
        staged = tree_hashes(out)  # the old dataset, the lock and the first run's staging directory
        with pytest.raises(DataError, match=rf"{out} is in use by another `mamba3lite prepare` \(pid"):
            prepare([src], out, workers=0, min_chars=1, overwrite=True)
        r = cli("prepare", "--source", src, "--out", str(out), "--overwrite", "--workers", "0")
        assert r.returncode == 2 and "in use by another `mamba3lite prepare`" in r.stderr
        assert "Traceback" not in r.stderr
        assert tree_hashes(out) == staged
    finally:
        go_on.set()
        worker.join(60)
    assert first["summary"].stats["kept"] == 20 and verify_dataset(out) == []
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []  # no lock, no staging left
    assert tree_hashes(out) != before


def test_a_read_error_beyond_the_target_fails_no_run_whatever_the_workers(tmp_path):
    """Sources are read ahead of the pipeline, deeper with more --workers: a truncated archive whose
    damage lies past the point where --target-tokens is reached failed with --workers 2 and succeeded
    with --workers 0. Both now succeed, with the same dataset; without a target both fail."""
    lines = "".join(json.dumps({"text": t}) + "\n" for t in _docs(4000)).encode()
    data = gzip.compress(lines)
    src = tmp_path / "trunc.jsonl.gz"
    src.write_bytes(data[: len(data) // 2])
    kw = {"target_tokens": 2000, "val_fraction": 0.0, "min_chars": 1}
    prepare([str(src)], tmp_path / "w0", workers=0, **kw)
    prepare([str(src)], tmp_path / "w2", workers=2, **kw)
    assert tree_hashes(tmp_path / "w0") == tree_hashes(tmp_path / "w2")
    for workers in (0, 2):
        with pytest.raises(DataError, match=r"trunc\.jsonl\.gz"):
            prepare([str(src)], tmp_path / f"all{workers}", workers=workers, val_fraction=0.0, min_chars=1)
        assert not (tmp_path / f"all{workers}").exists()


def test_a_source_that_fails_while_the_run_is_set_up_leaves_no_out_behind(tmp_path):
    # --max-docs reads the head of a JSONL source to size it, before anything is written
    data = gzip.compress(b"".join(json.dumps({"text": t}).encode() + b"\n" for t in _docs(3000)))
    src = tmp_path / "trunc.jsonl.gz"
    src.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"trunc\.jsonl\.gz"):
        prepare([str(src)], tmp_path / "ds", workers=0, max_docs=5000)
    assert not (tmp_path / "ds").exists()


def test_mixture_files_that_are_not_usable_yaml_are_one_line_errors(cli, tmp_path):
    (tmp_path / "a.txt").write_text("text long enough to keep")
    bad_utf8 = tmp_path / "bad.yaml"
    bad_utf8.write_bytes(b"sources:\n  - source: a.txt\n\xff\xfe bad\n")
    negative = tmp_path / "neg.yaml"
    negative.write_text("sources: [a.txt]\ntarget_tokens: -5\n")
    cases = [
        (bad_utf8, f"{bad_utf8} is not a UTF-8 text file"),
        (tmp_path, f"{tmp_path} is a directory; a mixture file must be a regular file"),
        (negative, f"{negative}: target_tokens must be an integer >= 1, got -5"),
    ]
    for mixture, message in cases:
        r = cli("prepare", "--mixture", str(mixture), "--out", str(tmp_path / "ds"))
        assert r.returncode == 2 and message in r.stderr, r.stderr
        assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
        assert not (tmp_path / "ds").exists()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs a named pipe")
def test_a_source_that_is_a_pipe_is_not_reported_missing(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(DataError, match="is not a regular file or a directory; write it to a file first"):
        prepare([str(fifo)], tmp_path / "ds", workers=0)
    assert not (tmp_path / "ds").exists()


def test_worker_counts_beyond_the_machine_and_huge_mixture_weights_are_usage_errors(tmp_path):
    (tmp_path / "a.txt").write_text("text long enough to keep")
    with pytest.raises(ConfigError, match="more than 4 per CPU"):
        prepare([str(tmp_path / "a.txt")], tmp_path / "ds", workers=10**12)
    mixture = tmp_path / "mix.yaml"
    mixture.write_text("sources:\n  - source: a.txt\n    weight: 1" + "0" * 400 + "\n")
    with pytest.raises(ConfigError, match=r"sources\[0\]\.weight is too large"):
        prepare((), tmp_path / "ds", mixture=str(mixture))
    assert not (tmp_path / "ds").exists()


def test_a_staged_state_that_is_not_an_object_starts_afresh(tmp_path):
    (tmp_path / "a.txt").write_text("text long enough to keep, and some more words")
    stage = tmp_path / "ds" / ".prepare"
    stage.mkdir(parents=True)
    (stage / "state.json").write_text("[]")
    (stage / "commit.json").write_text("null")
    prepare([str(tmp_path / "a.txt")], tmp_path / "ds", workers=0, val_fraction=0.0, min_chars=1)
    assert verify_dataset(tmp_path / "ds") == []
