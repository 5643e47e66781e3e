"""The "Long context" table of docs/guides/context-parallelism.md (report/memory_table.py
`longest_context_markdown`): the longest window that fits by model/memory.py's per-rank estimate, for
each context-parallel size C."""

from __future__ import annotations

from dataclasses import replace

from mamba3lite.config import load_config
from mamba3lite.model.memory import USABLE_FRACTION, per_rank_memory
from mamba3lite.report.memory_table import longest_context_markdown, longest_seq_len

DEVICE_GIB = 0.5  # small enough that the tiny preset's windows stop at a few hundred thousand tokens


def fits(seq_len: int, cp: int) -> bool:
    cfg = load_config("tiny")
    t = replace(cfg.training, micro_batch_size=1, max_seq_len=seq_len, context_parallel=cp)
    return per_rank_memory(cfg.model, t, shards=8).total <= USABLE_FRACTION * DEVICE_GIB * 2**30


def test_the_longest_window_fits_and_twice_it_does_not_and_grows_with_c():
    longest = {c: longest_seq_len("tiny", 8, c, DEVICE_GIB) for c in (1, 2, 4, 8)}
    for c, seq_len in longest.items():
        assert seq_len is not None and seq_len & (seq_len - 1) == 0, longest
        assert fits(seq_len, c) and not fits(2 * seq_len, c), (c, seq_len)
    # activations per rank are T / C tokens: C more ranks per window train a window at least as long
    assert longest[1] < longest[2] <= longest[4] <= longest[8], longest


def test_the_table_has_one_row_per_preset_and_a_column_per_c():
    table = longest_context_markdown(["tiny"], world_size=4, device_gib=DEVICE_GIB)
    rows = [line for line in table.splitlines() if line.startswith("|")]
    assert rows[0] == "| preset | parameters | C = 1 | C = 2 | C = 4 |"  # 8 does not divide 4 ranks
    assert len(rows) == 3 and rows[2].startswith("| `tiny` |")
    k = longest_seq_len("tiny", 4, 2, DEVICE_GIB) // 1024
    assert rows[2].split("|")[4].strip() == f"{k}K"
