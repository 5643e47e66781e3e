"""A dataset's per-split table, as `prepare` prints it at the end and `inspect` prints it on demand."""

from __future__ import annotations


def split_table(manifest) -> list[str]:
    """One header line and one line per split: shards, documents, tokens and source-text MB."""
    from mamba3lite.data.shards import SPLITS

    lines = [f"{'split':<8}{'shards':>8}{'documents':>12}{'tokens':>15}{'text MB':>10}"]
    for split in SPLITS:
        sh = manifest.split_shards(split)
        lines.append(
            f"{split:<8}{len(sh):>8,}{sum(s.n_docs for s in sh):>12,}{manifest.n_tokens(split):>15,}"
            f"{manifest.n_bytes(split) / 1e6:>10.2f}"
        )
    return lines
