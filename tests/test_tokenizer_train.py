"""`prepare --train-tokenizer N`: the BPE itself (exact size, EOS, pre-tokenizer, round trip,
determinism) and its place in `prepare` (train split only, saved in the dataset, resume, the move)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mamba3lite.data import prepare as P
from mamba3lite.data import staging
from mamba3lite.data.clean import split_of
from mamba3lite.data.shards import Manifest, verify_dataset
from mamba3lite.errors import DataError
from mamba3lite.tokenizer import load_tokenizer
from mamba3lite.tokenizer_train import EOS_TOKEN, empty_bpe, train_bpe
from test_prepare_helpers import shard_docs, tree_hashes

pytest.importorskip("tokenizers")


WORDS = [
    "value",
    "count",
    "total",
    "index",
    "item",
    "result",
    "buffer",
    "parser",
    "reader",
    "writer",
    "token",
    "stream",
    "window",
    "shard",
    "config",
    "record",
    "number",
    "string",
    "prefix",
    "suffix",
    "offset",
    "length",
    "header",
    "footer",
    "cursor",
    "layer",
    "weight",
]


def python_docs(n: int, tag: str = "f") -> list[str]:
    """Small Python functions, varied enough that a few hundred merges exist."""
    docs = []
    for i in range(n):
        a, b, c = (WORDS[(i * k + k) % len(WORDS)] for k in (1, 3, 7))
        docs.append(
            f"def {tag}_{a}_{b}({a}, {c}={i % 7}):\n"
            f'    """Return the {["sum", "product", "maximum"][i % 3]} of {a} and {c}."""\n'
            f"    if {a} > {i}:\n        return {a} + {c} * {i % 5}\n"
            f"    for {b} in range({c}):\n        {a} = {a} - {b}\n    return {a}\n"
        )
    return docs


@pytest.fixture(scope="module")
def trained():
    raw = train_bpe(python_docs(200), 400)
    return raw


@pytest.fixture(scope="module")
def trained_tok(trained, tmp_path_factory):
    return _tok(trained, tmp_path_factory.mktemp("tok"))


def test_exactly_n_ids_with_eos_special_and_every_byte(trained):
    d = json.loads(trained)
    vocab = d["model"]["vocab"]
    assert len(vocab) == 400 and sorted(vocab.values()) == list(range(400))
    assert vocab[EOS_TOKEN] == 0 and [t["content"] for t in d["added_tokens"]] == [EOS_TOKEN]
    assert d["added_tokens"][0]["special"] is True
    assert len(d["model"]["merges"]) == 400 - 257  # 256 byte symbols + EOS + the merges


def _tok(raw: bytes, tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_bytes(raw)
    return load_tokenizer(str(path))


def test_indentation_and_newline_runs_are_tokens_and_words_keep_their_space(trained, tmp_path):
    tok = _tok(trained, tmp_path)
    assert tok.vocab_size == 400 and tok.eos_id == 0
    assert len(tok.encode("        ")) == 1  # 8 spaces of indentation: one token, not eight
    pieces = [p for p, _ in empty_bpe().pre_tokenizer.pre_tokenize_str("def f(x):\n\n        return x_1")]
    # (ByteLevel shows a space as Ġ and a newline as Ċ)
    assert pieces == ["def", "Ġf", "(", "x", "):", "ĊĊ", "ĠĠĠĠĠĠĠĠ", "return", "Ġx_1"]
    ids = tok.encode("    return value\n")
    assert [tok.decode([i]) for i in ids] == ["    ", "return", " value", "\n"]


@settings(max_examples=150, deadline=None)
@given(text=st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=80))
def test_every_string_round_trips(text, trained_tok):
    tok = trained_tok
    assert tok.decode(tok.encode(text)) == text


def test_tabs_crlf_and_unicode_round_trip(trained, tmp_path):
    tok = _tok(trained, tmp_path)
    for text in ["\tif x:\r\n\t\treturn 'héllo' 中文 👍🏽\r\n", "\x00\x7f\u2028 \u00a0 ", "   \n\n\n  \t "]:
        assert tok.decode(tok.encode(text)) == text


def test_training_is_deterministic_across_runs_threads_and_processes(trained):
    assert train_bpe(python_docs(200), 400) == trained
    code = (
        "import sys, hashlib; sys.path[:0] = [sys.argv[1], sys.argv[2]]\n"
        "from test_tokenizer_train import python_docs\n"
        "from mamba3lite.tokenizer_train import train_bpe\n"
        "print(hashlib.sha256(train_bpe(python_docs(200), 400)).hexdigest())"
    )
    here = os.path.dirname(__file__)
    src = os.path.join(os.path.dirname(here), "src")
    for env in ({"TOKENIZERS_PARALLELISM": "false"}, {"RAYON_NUM_THREADS": "2"}):
        r = subprocess.run(
            [sys.executable, "-c", code, src, here], env={**os.environ, **env}, capture_output=True, text=True
        )
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == hashlib.sha256(trained).hexdigest()


def test_more_ids_than_the_text_can_form_is_refused_with_the_number_it_can(tmp_path):
    fix = r"can form only (\d+) ids .*; pass --train-tokenizer \1 or less"
    with pytest.raises(DataError, match=fix) as e:
        train_bpe(["abcabc abcabc"] * 3, 5000)
    n = int(str(e.value).split("only ")[1].split(" ")[0])
    assert 258 <= n < 5000
    assert len(json.loads(train_bpe(["abcabc abcabc"] * 3, n))["model"]["vocab"]) == n


# ---------------------------------------------------------------------------------------------- prepare


def _write_corpus(tmp_path, docs: list[str]) -> str:
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    return str(path)


KW = {"workers": 0, "val_fraction": 0.2, "min_chars": 1, "train_tokenizer": 300}


def test_two_prepares_give_byte_identical_datasets_and_tokenizers(tmp_path):
    src = _write_corpus(tmp_path, python_docs(120))
    a = P.prepare([src], tmp_path / "a", **KW)
    b = P.prepare([src], tmp_path / "b", **{**KW, "workers": 2})
    assert tree_hashes(tmp_path / "a") == tree_hashes(tmp_path / "b")
    raw = (tmp_path / "a" / "tokenizer.json").read_bytes()
    assert a.manifest.tokenizer == {"name": "tokenizer.json", "vocab_hash": hashlib.sha256(raw).hexdigest()}
    assert a.manifest.vocab_size == 300 and a.manifest.eos_id == 0 and a.manifest.dtype == "uint16"
    assert b.manifest.extra["prepare"]["train_tokenizer"] == 300
    assert f"its own BPE, {tmp_path / 'a' / 'tokenizer.json'}, vocab 300, eos id 0" in a.table()
    assert verify_dataset(tmp_path / "a") == []


def test_the_shards_hold_the_trained_tokenizers_ids_and_the_directory_can_move(tmp_path):
    docs = python_docs(60)
    src = _write_corpus(tmp_path, docs)
    P.prepare([src], tmp_path / "ds", **KW)
    os.rename(tmp_path / "ds", tmp_path / "moved")
    m = Manifest.load(tmp_path / "moved")
    assert m.tokenizer["name"] == str((tmp_path / "moved" / "tokenizer.json").resolve())
    tok = load_tokenizer(m.tokenizer["name"])
    texts = sorted(
        tok.decode(list(d)) for split in shard_docs(tmp_path / "moved").values() for s in split for d in s
    )
    assert texts == sorted(docs)


def test_the_tokenizer_never_sees_a_val_document(tmp_path):
    """A word that occurs only in val documents, hundreds of times: had the trainer seen them, its
    pairs would be the most frequent of all and merged first."""
    docs = python_docs(80)
    secret = [f"{i} " + "zqxvbk " * 60 for i in range(400)]
    split = {d: split_of(hashlib.sha256(d.encode()).digest(), 0, 0.2) for d in secret}
    in_val = [d for d in secret if split[d] == "val"][:10]
    in_train = [d for d in secret if split[d] == "train"][:10]
    s = P.prepare([_write_corpus(tmp_path, docs + in_val)], tmp_path / "ds", **KW)
    assert sum(i.n_docs for i in s.manifest.split_shards("val")) >= 10
    vocab = json.loads((tmp_path / "ds" / "tokenizer.json").read_text())["model"]["vocab"]
    assert not [t for t in vocab if any(pair in t for pair in ("zq", "qx", "xv", "vb", "bk"))]
    # ...whereas the same text in train is merged at once
    P.prepare([_write_corpus(tmp_path, docs + in_train)], tmp_path / "t", **KW)
    vocab_t = json.loads((tmp_path / "t" / "tokenizer.json").read_text())["model"]["vocab"]
    assert any("zqxvbk" in t for t in vocab_t)


class _Interrupt(BaseException):
    pass


def test_a_resumed_prepare_fits_the_same_tokenizer_and_equals_an_uninterrupted_one(tmp_path, monkeypatch):
    src = _write_corpus(tmp_path, python_docs(150))
    kw = {**KW, "shard_tokens": 300}
    P.prepare([src], tmp_path / "ref", **kw)
    monkeypatch.setattr(P, "SNAPSHOT_MIN_INTERVAL_S", 0.0)
    original, count = P._Run._snapshot, [0]

    def snapshot(self):
        original(self)
        count[0] += 1
        if count[0] == 3:
            raise _Interrupt

    with monkeypatch.context() as m:
        m.setattr(P._Run, "_snapshot", snapshot)
        with pytest.raises(_Interrupt):
            P.prepare([src], tmp_path / "ds", **kw)
    assert (tmp_path / "ds" / staging.STAGE_DIRNAME / "tokenizer.json").is_file()
    written = len(
        json.loads((tmp_path / "ds" / staging.STAGE_DIRNAME / staging.STATE_NAME).read_text())["shards"]
    )
    resumed = P.prepare([src], tmp_path / "ds", **kw)
    assert resumed.resumed_shards == written > 0
    assert tree_hashes(tmp_path / "ds") == tree_hashes(tmp_path / "ref")


@pytest.mark.parametrize("moves_done", [0, 1, 3])
def test_an_interrupted_final_move_carries_the_tokenizer(tmp_path, monkeypatch, moves_done):
    src = _write_corpus(tmp_path, python_docs(60))
    P.prepare([src], tmp_path / "ref", **KW)
    out, real_replace, commit, calls = tmp_path / "ds", os.replace, staging.commit, [0]

    def replace(a, b):  # the move's renames: tokenizer.json, train/, val/, then manifest.json
        if calls[0] == moves_done:
            raise _Interrupt
        calls[0] += 1
        real_replace(a, b)

    def interrupted_commit(stage, out_dir, manifest):
        with monkeypatch.context() as m:
            m.setattr(staging.os, "replace", replace)
            commit(stage, out_dir, manifest)

    with monkeypatch.context() as m:
        m.setattr(staging, "commit", interrupted_commit)
        with pytest.raises(_Interrupt):
            P.prepare([src], out, **KW)
    assert not (out / "manifest.json").exists()
    assert (out / "tokenizer.json").exists() == (moves_done > 0)
    again = P.prepare([src], out, **KW)
    assert again.resumed_shards == len(again.manifest.shards)  # the move was completed, nothing redone
    assert tree_hashes(out) == tree_hashes(tmp_path / "ref")


def test_a_gpt2_dataset_prepared_over_a_trained_one_drops_its_tokenizer(tmp_path):
    src = _write_corpus(tmp_path, python_docs(40))
    P.prepare([src], tmp_path / "ds", **KW)
    P.prepare([src], tmp_path / "ds", workers=0, val_fraction=0.2, min_chars=1, overwrite=True)
    assert not (tmp_path / "ds" / "tokenizer.json").exists()
    assert Manifest.load(tmp_path / "ds").tokenizer["name"] == "gpt2"


# ------------------------------------------------------------------------- the tiktoken twin (fast path)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=60)
    | st.lists(st.sampled_from(["    ", " ", "\n", "\t", "def", " x", "é", "<|endoftext|>", "'s", "1"])).map(
        "".join
    )
)
def test_the_tiktoken_twin_encodes_exactly_as_tokenizers_does(text, trained_tok):
    assert trained_tok._fast is not None  # a BPE train_bpe made has one
    assert trained_tok.encode(text) == trained_tok._tok.encode(text, add_special_tokens=False).ids
    assert trained_tok.encode_batch([text, "x"]) == trained_tok._reference_batch([text, "x"])


def test_the_twin_agrees_on_a_corpus_and_text_spelling_eos_is_left_to_tokenizers(trained_tok):
    docs = [*python_docs(300, tag="other"), "x = 1<|endoftext|>y", "naïve café 中文 👍🏽\r\n\t"]
    assert trained_tok.encode_batch(docs) == trained_tok._reference_batch(docs)
    assert trained_tok.encode("a<|endoftext|>b")[1] == trained_tok.eos_id  # as tokenizers parses it


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d["pre_tokenizer"]["pretokenizers"][0]["pattern"].update(Regex=r"\s+|\S+"),
        lambda d: d["model"].update(dropout=0.1),
        lambda d: d["model"].update(ignore_merges=True),
        lambda d: d["model"]["merges"].reverse(),  # ids no longer in merge order
        lambda d: d.update(normalizer={"type": "NFC"}),
    ],
    ids=["other-pattern", "dropout", "ignore-merges", "merge-order", "normalizer"],
)
def test_a_tokenizer_the_twin_cannot_copy_has_none(trained, tmp_path, change):
    d = json.loads(trained)
    change(d)
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(d))
    assert load_tokenizer(str(path))._fast is None  # encoded by `tokenizers` itself


@pytest.mark.slow
def test_the_twin_agrees_on_the_stdlib_corpus(tmp_path):
    from mamba3lite.data.fit_tokenizer import train_sample
    from mamba3lite.data.sources import Source

    texts = train_sample([Source("stdlib")], P.PrepareOptions(val_fraction=0.02), 3_000_000)
    tok = _tok(train_bpe(texts, 4096), tmp_path)
    assert tok._fast is not None and tok.encode_batch(texts) == tok._reference_batch(texts)
