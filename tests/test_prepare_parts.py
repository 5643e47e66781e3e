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


def test_mixer_run_length_is_the_number_of_picks_in_a_row_one_at_a_time_would_make():
    rng = np.random.default_rng(0)
    for trial in range(300):
        n = int(rng.integers(1, 5))
        target = None if trial % 2 else int(rng.integers(50, 5000))
        mixer = Mixer(rng.uniform(0.1, 3, n).tolist(), rng.integers(1, 1000, n).tolist(), target)
        taken = rng.integers(0, 2000, n).tolist()
        active = sorted(rng.choice(n, int(rng.integers(1, n + 1)), replace=False).tolist())
        if (i := mixer.pick(taken, active)) is None:
            continue
        gains = rng.integers(0, 300, 40) * (rng.random(40) < 0.8)  # a dropped document takes nothing
        totals = (taken[i] + np.cumsum(gains) - gains).tolist()
        expected, trial_taken = 0, list(taken)
        while expected < len(totals):
            trial_taken[i] = totals[expected]
            if mixer.pick(trial_taken, active) != i:
                break
            expected += 1
        assert mixer.run_length(taken, active, i, totals) == expected


def test_packer_adds_documents_as_pieces_of_the_units_and_starts_the_next_shard():
    p = Packer("train")
    assert p.fits(1000, shard_tokens=10)  # an empty shard takes a document longer than a shard
    assert p.room(np.cumsum([1000, 5]), shard_tokens=10) == 1 and p.room(np.cumsum([4, 6, 1]), 10) == 2
    # Documents that follow on in a unit's token file make one piece; a gap (a duplicate, the other
    # split's document) starts another; a later call continuing the last piece extends it.
    p.add("u1", np.array([0, 4, 9]), np.array([4, 7, 12]), n_bytes=12)
    p.add("u1", np.array([12]), np.array([14]), n_bytes=3)
    p.add("u2", np.array([0]), np.array([2]), n_bytes=1)
    assert p.pieces == [["u1", 0, 7], ["u1", 9, 14], ["u2", 0, 2]]
    assert (p.n_tokens, p.n_docs, p.n_bytes) == (14, 5, 16)
    assert p.fits(6, shard_tokens=20) and not p.fits(7, shard_tokens=20)
    assert p.room(np.cumsum([3, 3, 1]), shard_tokens=20) == 2
    job = p.job()
    assert job.path == "train/shard_00000.bin" and job.pieces[1] == ("u1", 9, 14) and job.n_docs == 5
    assert type(job).from_dict(json.loads(json.dumps(job.to_dict()))) == job
    assert Packer.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    p.shard_written()
    assert (p.n_tokens, p.n_docs, p.n_bytes, p.pieces) == (0, 0, 0, [])
    assert p.next_index == 1 and p.next_path() == "train/shard_00001.bin"
    with pytest.raises(ValueError, match="do not add up"):
        Packer.from_dict({**p.to_dict(), "pieces": [["u", 0, 3]]})


def test_dedup_finds_repeats_of_kept_digests_and_within_a_batch():
    d = Dedup()
    d.add_all([b"a" * 16])
    assert d.duplicates([b"b" * 16, b"c" * 16]) == []
    assert d.duplicates([b"b" * 16, b"a" * 16, b"c" * 16, b"b" * 16]) == [1, 3]
    d.candidates = {b"b" * 16}  # partitioned: only digests that occur twice in the corpus are kept
    d.add_all([b"b" * 16, b"c" * 16])
    assert b"b" * 16 in d and b"c" * 16 not in d and d.unsaved == [b"a" * 16, b"b" * 16]


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
