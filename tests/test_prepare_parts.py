"""The pieces `prepare` is built from, each on its own: the mixer's choice, the packer, the dedup set, the
stats' JSON form (a manifest contract), the worker's typed results and the shared did-you-mean."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mamba3lite.data import clean
from mamba3lite.data.clean import BAD_LINE, BINARY, EMPTY, KEPT, TOO_SHORT, UnitResult, WorkerConfig
from mamba3lite.data.mixture import Mixer, SourceSpec, as_spec
from mamba3lite.data.packing import Dedup, Packer
from mamba3lite.data.sources import KIND_JSONL, KIND_STR, KIND_TEXT_BYTES
from mamba3lite.data.stats import DROP_REASONS, PrepareStats
from mamba3lite.errors import did_you_mean


def test_mixer_with_a_target_follows_the_weights_and_stops_at_each_budget():
    mixer = Mixer([3.0, 1.0], sizes=[10, 10], target_tokens=400)
    assert mixer.budgets == pytest.approx([300.0, 100.0])
    taken, order = [0, 0], []
    while (i := mixer.pick(taken, [0, 1])) is not None:
        order.append(i)
        taken[i] += 10
    assert taken == [300, 100]
    assert order[:4] == [0, 1, 0, 0]  # ties go to the lowest index; then fewest tokens per unit of weight


def test_mixer_without_a_target_spreads_by_size_and_skips_exhausted_sources():
    mixer = Mixer([1.0, 5.0], sizes=[100, 300], target_tokens=None)
    assert mixer.budgets == [None, None] and mixer.rates == [100.0, 300.0]  # the weights do not apply
    assert mixer.pick([30, 60], [0, 1]) == 1  # tokens per unit of size: 30/100 > 60/300
    assert mixer.pick([20, 90], [0, 1]) == 0  # 20/100 < 90/300
    assert mixer.pick([20, 90], [1]) == 1 and mixer.pick([0, 0], []) is None  # source 0 exhausted
    # With a size unknown (a streamed source) the weights are the rates.
    assert Mixer([1.0, 5.0], sizes=[100, 0], target_tokens=None).rates == [1.0, 5.0]


def test_mixer_weights_of_1e308_do_not_overflow():
    mixer = Mixer([1e308, 1e308], sizes=[1, 1], target_tokens=10)
    assert mixer.budgets == [5.0, 5.0]


def test_as_spec_accepts_the_three_forms():
    assert as_spec("a.txt") == SourceSpec("a.txt", 1.0)
    assert as_spec(("a.txt", 2.0)) == SourceSpec("a.txt", 2.0)
    spec = SourceSpec("b", 3.0)
    assert as_spec(spec) is spec


def test_packer_adds_whole_documents_and_starts_the_next_shard():
    p = Packer("train")
    assert p.fits(1000, shard_tokens=10)  # an empty shard takes a document longer than a shard
    p.add(np.arange(4, dtype=np.uint16), n_bytes=7)
    p.add(np.arange(3, dtype=np.uint16), n_bytes=5)
    assert (p.n_tokens, p.n_docs, p.n_bytes) == (7, 2, 12)
    assert p.fits(3, shard_tokens=10) and not p.fits(4, shard_tokens=10)
    assert p.tokens().tolist() == [0, 1, 2, 3, 0, 1, 2] and p.next_path() == "train/shard_00000.bin"
    p.shard_written()
    assert (p.n_tokens, p.n_docs, p.n_bytes, p.parts) == (0, 0, 0, [])
    assert p.next_index == 1 and p.next_path() == "train/shard_00001.bin" and p.tokens().size == 0


def test_dedup_tracks_what_the_next_snapshot_must_save():
    d = Dedup()
    d.add(b"a" * 16)
    d.add(b"b" * 16)
    assert b"a" * 16 in d and b"c" * 16 not in d
    assert d.unsaved == [b"a" * 16, b"b" * 16] and d.n_saved == 0
    d.saved()
    d.add(b"c" * 16)
    assert d.unsaved == [b"c" * 16] and d.n_saved == 2


def test_stats_json_form_is_the_manifest_contract_and_round_trips_through_a_snapshot():
    stats = PrepareStats.new([SourceSpec("a.jsonl", 2.0), SourceSpec("stdlib", 1.0)])
    stats.read(0, n_replaced=3)
    stats.keep(0, "val", n_tokens=11, n_bytes=40, n_special=1)
    stats.read(1, n_replaced=0)
    stats.drop("duplicate")
    stats.sources[1].exhausted = True
    public = stats.to_dict()
    # Key order and nesting are what manifests have always held (json.dumps keeps the order).
    assert list(public) == [
        "documents_in",
        "kept",
        "dropped",
        "replaced_bytes",
        "special_tokens_removed",
        "sources",
    ]
    assert list(public["dropped"]) == list(DROP_REASONS)
    assert list(public["sources"][0]) == ["spec", "weight", "documents_in", "documents", "tokens", "bytes"]
    assert public["sources"][0] == {
        "spec": "a.jsonl", "weight": 2.0, "documents_in": 1, "documents": {"train": 0, "val": 1},
        "tokens": {"train": 0, "val": 11}, "bytes": {"train": 0, "val": 40},
    }  # fmt: skip
    assert (public["documents_in"], public["kept"], public["replaced_bytes"]) == (2, 1, 3)
    assert public["special_tokens_removed"] == 1 and public["dropped"]["duplicate"] == 1
    assert stats.dropped_text() == "duplicate 1"
    internal = json.loads(json.dumps(stats.to_dict(public=False)))
    assert [s["exhausted"] for s in internal["sources"]] == [False, True]
    back = PrepareStats.from_dict(internal)
    assert back == stats and json.dumps(back.to_dict()) == json.dumps(public)


@pytest.mark.parametrize("broken", [[], {"sources": "x"}, {"documents_in": 1}])
def test_stats_from_a_broken_snapshot_raise_what_resume_catches(broken):
    with pytest.raises((KeyError, TypeError, ValueError)):
        PrepareStats.from_dict(broken)


def test_worker_results_are_typed_per_outcome():
    clean.init_worker(WorkerConfig("gpt2", min_chars=5, text_field="text", seed=0, val_fraction=0.0))
    units = [
        (KIND_STR, "hello world, a document"),
        (KIND_STR, "   "),
        (KIND_STR, "hi"),
        (KIND_TEXT_BYTES, b"\x00\x01\x02binary" * 100),
        (KIND_JSONL, b"{not json"),
        (KIND_JSONL, b'{"text": "caf\\u00e9 au lait, s\'il vous pla\\u00eet"}'),
    ]
    results = clean.process_batch(units)
    assert all(isinstance(r, UnitResult) for r in results)
    assert [r.status for r in results] == [KEPT, EMPTY, TOO_SHORT, BINARY, BAD_LINE, KEPT]
    kept = results[0]
    assert kept.split == "train" and len(kept.digest) == clean.DIGEST_BYTES and kept.n_bytes == 23
    assert kept.tokens[-1] == 50256 and 50256 not in kept.tokens[:-1].tolist()
    assert results[4].problem and results[4].tokens is None


def test_did_you_mean_suggests_only_close_words():
    assert did_you_mean("sorces", ["sources", "target_tokens"]) == "sources"
    assert did_you_mean("zzz", ["sources", "target_tokens"]) is None
