"""`prepare`: round trip, EOS structure, packing, manifest, determinism, split stability, mixing."""

from __future__ import annotations

import json
import random
import unicodedata

import numpy as np
import pytest

from mamba3lite.data.clean import clean_text
from mamba3lite.data.mixture import SourceSpec, load_mixture
from mamba3lite.data.prepare import prepare
from mamba3lite.data.shards import Manifest, verify_dataset
from mamba3lite.errors import ConfigError
from mamba3lite.tokenizer import load_tokenizer
from test_prepare_helpers import shard_docs, tree_hashes

TOK = load_tokenizer("gpt2")


def _decode_all(dataset) -> dict[str, list[str]]:
    return {
        split: [TOK.decode(d.tolist()) for shard in shards for d in shard]
        for split, shards in shard_docs(dataset).items()
    }


def test_clean_text():
    assert clean_text("a\r\nb\rc") == ("a\nb\nc", 0)
    assert clean_text("nul\x00 bell\x07 del\x7f c1\x85 tab\tnl\n") == ("nul bell del c1 tab\tnl\n", 0)
    nfd = "cafe\u0301"
    assert clean_text(nfd) == (unicodedata.normalize("NFC", nfd), 0)
    assert clean_text("e\x01\u0301") == ("\u00e9", 0)  # NFC after the control character is gone
    assert clean_text("bad \udcff\udcfe") == ("bad \ufffd\ufffd", 2)
    assert clean_text("emoji 👍🏽 zwj 👩‍💻") == ("emoji 👍🏽 zwj 👩‍💻", 0)


@pytest.fixture
def messy_corpus(tmp_path):
    """A directory of text files exercising every cleaning rule, plus the cleaned texts we expect kept."""
    d = tmp_path / "corpus"
    d.mkdir()
    files = {
        "a.txt": b"Hello world, plain ASCII text.\nSecond line.\n",
        "b.md": "# Caf\u0065\u0301 crème brûlée\r\nwith CRLF\r\n".encode(),
        "c.py": b"def f():\n\treturn 1  # tab\x07bell\x0cformfeed\n",
        "d.txt": b"broken \xff\xfe utf-8 here, " + "ünïcode".encode() + b" and \xe2\x82 cut",
        "e.txt": b"Hello world, plain ASCII text.\nSecond line.\n",  # duplicate of a.txt
        "f.txt": b"tiny",  # too short
        "g.txt": b"  \n\t \n",  # empty after cleaning
        "h.bin": bytes(range(256)) * 8,  # binary
        "i.jsonl": (
            json.dumps({"text": "json doc \u00e9 one, long enough"})
            + "\n"
            + json.dumps({"text": "json doc with \x00 NUL and more"})
            + "\n"
        ).encode(),
        "j.txt": " ".join(f"word{i}" for i in range(300)).encode(),  # longer than a shard
    }
    for name, data in files.items():
        (d / name).write_bytes(data)
    expected = []
    for name in ["a.txt", "b.md", "c.py", "d.txt", "j.txt"]:
        expected.append(clean_text(files[name].decode("utf-8", "surrogateescape"))[0])
    expected += [
        clean_text("json doc \u00e9 one, long enough")[0],
        clean_text("json doc with \x00 NUL and more")[0],
    ]
    return d, expected


def test_round_trip_structure_and_counts(messy_corpus, tmp_path):
    corpus, expected = messy_corpus
    out = tmp_path / "ds"
    summary = prepare([str(corpus)], out, workers=0, shard_tokens=40, val_fraction=0.3, min_chars=8)
    assert verify_dataset(out) == []
    m = Manifest.load(out)
    assert m.dtype == "uint16" and m.vocab_size == 50_257 and m.eos_id == 50_256
    assert m.tokenizer == {"name": "gpt2", "vocab_hash": TOK.vocab_hash}
    decoded = _decode_all(out)
    # Round trip: each kept document decodes to its cleaned text; nothing else is in the dataset.
    assert sorted(decoded["train"] + decoded["val"]) == sorted(expected)
    assert decoded["val"], "val_fraction=0.3 over 7 documents should put at least one in val (fixed hash)"
    docs = shard_docs(out)
    for info, shard in zip(m.split_shards("train") + m.split_shards("val"), docs["train"] + docs["val"]):
        # EOS exactly after each document and nowhere inside one (shard_docs splits on EOS).
        assert all(TOK.eos_id not in d for d in shard)
        # Packing: a shard overflows shard_tokens only when it holds a single oversized document.
        assert info.n_tokens <= 40 or info.n_docs == 1
        assert info.n_bytes == sum(len(TOK.decode(d.tolist()).encode()) for d in shard)
    stats = m.extra["stats"]
    assert stats["dropped"] == {"too_short": 1, "duplicate": 1, "binary": 1, "empty": 1, "bad_lines": 0}
    assert stats["replaced_bytes"] == 4
    assert stats["documents_in"] == 11 and stats["kept"] == 7
    (src,) = stats["sources"]
    assert src["tokens"] == {s: m.n_tokens(s) for s in ("train", "val")}
    assert sum(src["documents"].values()) == 7
    assert m.extra["prepare"]["tokenizer"] == "gpt2"
    assert summary.n_tokens == m.n_tokens() and "too_short 1" in summary.table()
    # Tokenized in this run: what was written, and the duplicate of a.txt (its tokens and EOS) dropped after.
    dup_tokens = len(TOK.encode(expected[0])) + 1
    assert summary.work.n_tokens() == m.n_tokens() + dup_tokens
    assert f"{m.n_tokens() + dup_tokens:,} tokens tokenized in this run" in summary.table()
    assert "tokens/s written" in summary.table()
    # Nothing but the dataset is left behind.
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "train", "val"]


def test_byte_order_marks_and_upper_case_suffixes(tmp_path):
    """A UTF-8 BOM is not text (it was a token of a .txt and broke the first line of a .jsonl); UTF-16/32
    files with their BOM (what Windows tools write) are text, not binary; DATA.JSONL is JSON lines, not
    one text document of braces."""
    d = tmp_path / "c"
    d.mkdir()
    body = "Grüße aus Köln, a document long enough to keep. "
    files = {
        "bom.txt": b"\xef\xbb\xbf" + (body + "utf-8 bom").encode(),
        "bom.jsonl": b"\xef\xbb\xbf" + (json.dumps({"text": body + "jsonl bom"}) + "\n").encode(),
        "wide16.txt": (body + "utf-16").encode("utf-16"),  # BOM + little-endian on this machine
        "wide16be.txt": b"\xfe\xff" + (body + "utf-16 be").encode("utf-16-be"),
        "wide32.txt": (body + "utf-32").encode("utf-32"),
        "broken16.txt": b"\xff\xfe" + (body + "cut").encode("utf-16-le") + b"\x00\xd8",  # lone surrogate
        "UPPER.JSONL": (
            json.dumps({"text": body + "upper one"}) + "\n" + json.dumps({"text": body + "upper two"})
        ).encode(),
        # Random bytes behind a UTF-16 or UTF-32 mark are binary all the same (they decode to lone
        # surrogates and private-use characters).
        "blob16.bin": b"\xff\xfe" + random.Random(0).randbytes(4000),
        "blob32.bin": b"\xff\xfe\x00\x00" + random.Random(1).randbytes(4000),
    }
    for name, data in files.items():
        (d / name).write_bytes(data)
    out = tmp_path / "ds"
    prepare([str(d)], out, workers=0, val_fraction=0.0, min_chars=8)
    m = Manifest.load(out)
    got = sorted(_decode_all(out)["train"])
    want = sorted(
        body + tail
        for tail in (
            "utf-8 bom",
            "jsonl bom",
            "utf-16",
            "utf-16 be",
            "utf-32",
            "cut\ufffd",
            "upper one",
            "upper two",
        )
    )
    assert got == want
    stats = m.extra["stats"]
    assert stats["dropped"]["binary"] == 2 and stats["dropped"]["bad_lines"] == 0
    assert stats["replaced_bytes"] == 1


def test_documents_are_never_split_across_shards(tmp_path):
    d = tmp_path / "c"
    d.mkdir()
    texts = [f"document number {i}: " + "lorem ipsum " * (i % 7 + 1) for i in range(40)]
    (d / "x.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "ds"
    prepare([str(d)], out, workers=0, shard_tokens=25, val_fraction=0.0, min_chars=1)
    m = Manifest.load(out)
    assert len(m.shards) > 5 and not m.split_shards("val")
    # Every shard holds whole documents, in source order: concatenating them gives back the source.
    decoded = [TOK.decode(doc.tolist()) for shard in shard_docs(out)["train"] for doc in shard]
    assert decoded == texts


def _build(tmp_path, name, workers, sources=None, **kw):
    out = tmp_path / name
    prepare(
        sources or ["stdlib", SourceSpec(str(tmp_path / "extra.jsonl"), 2.0)],
        out,
        workers=workers,
        max_docs=40,
        shard_tokens=30_000,
        val_fraction=0.1,
        **kw,
    )
    return tree_hashes(out)


def test_same_input_gives_byte_identical_output_for_any_worker_count(tmp_path):
    (tmp_path / "extra.jsonl").write_text(
        "".join(json.dumps({"text": f"extra document {i} " * 20}) + "\n" for i in range(50))
    )
    ref = _build(tmp_path, "w0", 0)
    assert len(ref) > 6
    assert _build(tmp_path, "w1", 1) == ref
    assert _build(tmp_path, "w2", 2) == ref
    assert _build(tmp_path, "w0b", 0) == ref


def test_split_is_stable_when_a_source_grows(tmp_path):
    d = tmp_path / "c"
    d.mkdir()
    for i in range(60):
        (d / f"doc{i:03d}.txt").write_text(f"document {i} says something unique: {i * 7919}")
    prepare([str(d)], tmp_path / "small", workers=0, val_fraction=0.2, min_chars=1)
    small = _decode_all(tmp_path / "small")
    for i in range(60, 150):
        (d / f"doc{i:03d}.txt").write_text(f"document {i} says something unique: {i * 7919}")
    prepare([str(d)], tmp_path / "big", workers=0, val_fraction=0.2, min_chars=1)
    big = _decode_all(tmp_path / "big")
    assert small["val"] and small["train"]
    assert set(small["val"]) <= set(big["val"])
    assert set(small["train"]) <= set(big["train"])
    assert 0.1 < len(big["val"]) / 150 < 0.3


def _two_sources(tmp_path, n=200):
    for name in "AB":
        (tmp_path / f"{name}.jsonl").write_text(
            "".join(json.dumps({"text": f"{name}{i} " + "text " * (5 + i % 11)}) + "\n" for i in range(n))
        )
    return str(tmp_path / "A.jsonl"), str(tmp_path / "B.jsonl")


def test_weighted_mixture_with_target_interleaves_and_records_contributions(tmp_path):
    a, b = _two_sources(tmp_path)
    out = tmp_path / "mix"
    prepare(
        [(a, 3.0), (b, 1.0)],
        out,
        workers=0,
        target_tokens=2000,
        shard_tokens=200,
        val_fraction=0.0,
        min_chars=1,
    )
    m = Manifest.load(out)
    src_a, src_b = m.extra["stats"]["sources"]
    ta, tb = src_a["tokens"]["train"], src_b["tokens"]["train"]
    longest = 20  # tokens of the longest document (+ EOS), the most a budget can be overshot by
    assert 1500 <= ta <= 1500 + longest and 500 <= tb <= 500 + longest
    assert ta + tb == m.n_tokens()
    # Interleaved: every shard sees both sources.
    for shard in shard_docs(out)["train"]:
        firsts = {TOK.decode(d.tolist())[0] for d in shard}
        assert firsts == {"A", "B"}


def test_huge_weights_are_relative_and_keep_the_target(tmp_path):
    a, b = _two_sources(tmp_path)
    out = tmp_path / "mix"  # 1e308 + 1e308 overflowed to inf: every budget NaN, every document used
    prepare([(a, 1e308), (b, 1e308)], out, workers=0, target_tokens=400, val_fraction=0.0, min_chars=1)
    src_a, src_b = Manifest.load(out).extra["stats"]["sources"]
    assert 200 <= src_a["tokens"]["train"] <= 220 and 200 <= src_b["tokens"]["train"] <= 220


def test_without_target_every_document_is_used(tmp_path):
    a, b = _two_sources(tmp_path, n=30)
    out = tmp_path / "all"
    prepare([(a, 1.0), (b, 5.0)], out, workers=0, val_fraction=0.0, min_chars=1)
    stats = Manifest.load(out).extra["stats"]
    assert [s["documents"]["train"] for s in stats["sources"]] == [30, 30]


def test_dedup_can_be_disabled(tmp_path):
    d = tmp_path / "c"
    d.mkdir()
    for i in range(4):
        (d / f"{i}.txt").write_text("the very same text in every file")
    prepare([str(d)], tmp_path / "dd", workers=0, val_fraction=0.0, min_chars=1)
    prepare([str(d)], tmp_path / "nd", workers=0, val_fraction=0.0, min_chars=1, dedup=False)
    assert Manifest.load(tmp_path / "dd").extra["stats"]["dropped"]["duplicate"] == 3
    assert len(_decode_all(tmp_path / "nd")["train"]) == 4


def test_mixture_file(tmp_path):
    a, b = _two_sources(tmp_path)
    mix = tmp_path / "mix.yaml"
    mix.write_text(
        "target_tokens: 1000\nsources:\n  - source: A.jsonl\n    weight: 1\n"
        "  - {source: B.jsonl, weight: 1}\n"
    )
    specs, target = load_mixture(mix)
    assert specs == [SourceSpec(a, 1.0), SourceSpec(b, 1.0)] and target == 1000
    prepare([], tmp_path / "ds", mixture=mix, workers=0, val_fraction=0.0, min_chars=1)
    stats = Manifest.load(tmp_path / "ds").extra["stats"]
    assert all(450 < s["tokens"]["train"] < 550 for s in stats["sources"])
    mix.write_text("sources:\n  - source: A.jsonl\n    wieght: 1\n")
    with pytest.raises(ConfigError, match="did you mean 'weight'"):
        load_mixture(mix)
    mix.write_text("target_tokns: 5\nsources: [A.jsonl]\n")
    with pytest.raises(ConfigError, match="did you mean 'target_tokens'"):
        load_mixture(mix)


def test_hf_source_through_prepare(tmp_path, monkeypatch):
    import sys
    import types

    module = types.ModuleType("datasets")
    module.load_dataset = lambda name, config=None, split=None, streaming=False: iter(
        [{"text": f"streamed row {i} of {name}/{config}"} for i in range(5)]
    )
    monkeypatch.setitem(sys.modules, "datasets", module)
    prepare(["hf:org/data:cfg"], tmp_path / "hf", workers=0, val_fraction=0.0, min_chars=1)
    assert _decode_all(tmp_path / "hf")["train"] == [f"streamed row {i} of org/data/cfg" for i in range(5)]


def test_rerun_same_arguments_rebuilds_in_place(tmp_path):
    d = tmp_path / "c"
    d.mkdir()
    (d / "x.txt").write_text("some text that is long enough")
    out = tmp_path / "ds"
    prepare([str(d)], out, workers=0, val_fraction=0.0)
    before = tree_hashes(out)
    prepare([str(d)], out, workers=0, val_fraction=0.0)  # same arguments: no --overwrite needed
    assert tree_hashes(out) == before


def test_out_inside_the_corpus_directory_is_not_read_back_as_documents(tmp_path, capsys):
    d = tmp_path / "c"
    d.mkdir()
    (d / "x.txt").write_text("some text that is long enough")
    out = d / "tokens"  # the dataset lands inside the directory it is made from
    prepare([str(d)], out, workers=0, val_fraction=0.0)
    before = tree_hashes(out)
    prepare([str(d)], out, workers=0, val_fraction=0.0)  # the re-run sees out/manifest.json in the corpus
    assert "skipping" in capsys.readouterr().err
    assert tree_hashes(out) == before and Manifest.load(out).extra["stats"]["kept"] == 1


def test_cli_prepare_and_weight_pairing(cli, tmp_path):
    a, b = _two_sources(tmp_path, n=20)
    out = tmp_path / "ds"
    r = cli(
        "prepare",
        "--source",
        a,
        "--weight",
        "2",
        "--source",
        b,
        "--out",
        str(out),
        "--workers",
        "0",
        "--val-fraction",
        "0",
        "--min-chars",
        "1",
        "--shard-tokens",
        "1e3",
    )
    assert r.returncode == 0, r.stderr
    assert "documents read 40" in r.stdout and "A.jsonl" in r.stdout
    assert [s["weight"] for s in Manifest.load(out).extra["prepare"]["sources"]] == [2.0, 1.0]
    r = cli("prepare", "--weight", "2", "--source", a, "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and "--weight must follow" in r.stderr
    r = cli("prepare", "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and "no sources" in r.stderr and "Traceback" not in r.stderr


def test_eos_inside_text_never_becomes_eos(tmp_path):
    d = tmp_path / "c"
    d.mkdir()
    (d / "x.txt").write_text("a literal <|endoftext|> marker inside the text")
    prepare([str(d)], tmp_path / "ds", workers=0, val_fraction=0.0)
    (docs,) = shard_docs(tmp_path / "ds")["train"]
    assert len(docs) == 1 and np.all(docs[0] != TOK.eos_id)
    assert TOK.decode(docs[0].tolist()) == "a literal <|endoftext|> marker inside the text"


def test_hf_tokenizer_json_and_eos_inside_text_is_removed(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=200, special_tokens=["<|endoftext|>"])
    tok.train_from_iterator(["hello world, a tiny corpus for a tiny tokenizer"] * 5, trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    d = tmp_path / "c"
    d.mkdir()
    (d / "a.txt").write_text("hello world <|endoftext|> tiny corpus")
    (d / "b.txt").write_text("a tiny tokenizer for the world")
    s = prepare([str(d)], tmp_path / "ds", tokenizer=str(path), workers=0, val_fraction=0.0, min_chars=1)
    m = Manifest.load(tmp_path / "ds")
    assert m.tokenizer["name"] == str(path.resolve()) and m.dtype == "uint16" and m.eos_id == 0
    assert m.vocab_size == tok.get_vocab_size() and verify_dataset(tmp_path / "ds") == []
    assert s.stats["special_tokens_removed"] == 1
    (shard,) = shard_docs(tmp_path / "ds")["train"]
    assert len(shard) == 2 and all(np.all(doc != 0) for doc in shard)


def test_hf_tokenizer_with_gaps_in_its_ids_gets_the_largest_id_plus_one_as_vocab_size(tmp_path):
    """A pruned vocabulary: 5 tokens, ids up to 9. The token count (5) would put EOS outside the
    vocabulary and the manifest would be refused after all the work."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "foo": 3, "<|endoftext|>": 9}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tok.json"))
    (tmp_path / "a.txt").write_text("hello world foo hello world\n")
    prepare([str(tmp_path / "a.txt")], tmp_path / "ds", tokenizer=str(tmp_path / "tok.json"), workers=0,
            val_fraction=0.0, min_chars=1)  # fmt: skip
    m = Manifest.load(tmp_path / "ds")
    assert (m.vocab_size, m.eos_id) == (10, 9) and verify_dataset(tmp_path / "ds") == []


def test_progress_bars_do_not_change_the_output(tmp_path, capsys):
    a, b = _two_sources(tmp_path, n=40)
    prepare([a, b], tmp_path / "quiet", workers=0, shard_tokens=100, min_chars=1)
    prepare([a, b], tmp_path / "bars", workers=0, shard_tokens=100, min_chars=1, progress=True)
    assert "tokenize" in capsys.readouterr().err
    assert tree_hashes(tmp_path / "bars") == tree_hashes(tmp_path / "quiet")


def test_without_target_sources_are_spread_over_all_shards_by_size(tmp_path):
    for name, n in (("A", 300), ("B", 30)):
        (tmp_path / f"{name}.jsonl").write_text(
            "".join(json.dumps({"text": f"{name}{i} " + "text " * (5 + i % 11)}) + "\n" for i in range(n))
        )
    out = tmp_path / "ds"
    prepare(
        [str(tmp_path / "A.jsonl"), str(tmp_path / "B.jsonl")],
        out,
        workers=0,
        shard_tokens=200,
        val_fraction=0.0,
        min_chars=1,
    )
    shards = shard_docs(out)["train"]
    with_b = [any(TOK.decode(d.tolist()).startswith("B") for d in shard) for shard in shards]
    assert len(shards) > 10
    assert with_b[0] and with_b[-1] and sum(with_b) >= 0.8 * len(shards)
