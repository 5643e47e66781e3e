"""report/baselines.py: the compressors' bits per byte on a dataset's val text, and their cache."""

from __future__ import annotations

import json

from mamba3lite.report.baselines import as_text, baselines_for, compressor_bits_per_byte, split_text
from userside_helpers import PYTHON_DOCS, make_dataset


def test_history_of_the_same_kind_helps_xz():
    val = ("\n".join(PYTHON_DOCS) * 3).encode()
    unrelated = bytes(range(256)) * 4000
    same_kind = ("\n".join(reversed(PYTHON_DOCS)) * 50).encode()
    alone = compressor_bits_per_byte(val, b"")
    assert 0 < alone["xz"] < 8 and 0 < alone["zlib"] < 8
    # no history: the val text alone, less the container's fixed header and footer
    assert alone["xz_given_train"] <= alone["xz"] < alone["xz_given_train"] + 8 * 100 / len(val)
    helped = compressor_bits_per_byte(val, same_kind)["xz_given_train"]
    assert helped < 0.5 * alone["xz"]
    assert compressor_bits_per_byte(val, unrelated)["xz_given_train"] > helped


def test_the_val_text_is_the_datasets_documents_and_the_cache_is_keyed_by_it(tmp_path):
    data = make_dataset(tmp_path / "d", repeats=3)
    text = split_text(data, "val").decode()
    assert any(text.startswith(doc) for doc in PYTHON_DOCS)  # decoded documents, joined by newlines
    assert len(text) > 2 * min(len(d) for d in PYTHON_DOCS)
    cache = tmp_path / "b" / "stdlib.json"
    first = baselines_for(data, cache)
    assert set(first) >= {"zlib", "xz", "xz_given_train", "val_bytes", "key"}
    assert first["val_bytes"] == len(text.encode())
    record = json.loads(cache.read_text())
    record["xz"] = 123.0  # a cached value is what a second call returns: no recomputation
    cache.write_text(json.dumps(record))
    assert baselines_for(data, cache)["xz"] == 123.0
    other = make_dataset(tmp_path / "d2", repeats=3, seed=5)  # other texts: another key, recomputed
    assert baselines_for(other, cache)["xz"] != 123.0
    cache.write_text("{not json")  # a damaged cache is recomputed, not an error
    assert baselines_for(other, cache)["xz"] < 8
    assert "the number to beat" in as_text(1.2, first) and "x xz given train" in as_text(1.2, first)
