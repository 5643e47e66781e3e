"""A dataset's per-split and per-source tables, read from its manifest: `prepare` prints them at the end,
`inspect` on demand."""

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


def source_table(sources: list) -> list[str]:
    """One header line and one line per source of a manifest's `stats["sources"]`: spec (its tail when
    long), weight, documents and tokens per split. Tolerant of missing fields (an older manifest)."""
    lines = [f"{'source':<40}{'weight':>8}{'documents':>12}{'train tok':>14}{'val tok':>12}"]
    for src in sources:
        spec = str(src.get("spec", "?"))
        spec = spec if len(spec) <= 38 else "…" + spec[-37:]
        docs, toks = src.get("documents", {}), src.get("tokens", {})
        lines.append(
            f"{spec:<40}{src.get('weight', 1):>8g}{sum(docs.values()):>12,}"
            f"{toks.get('train', 0):>14,}{toks.get('val', 0):>12,}"
        )

    return lines


def stats_lines(stats: object, where: str) -> list[str]:
    """The lines that describe a manifest's `extra.stats` (what `prepare` read, kept and dropped), after
    checking its types: the manifest is a file the user may have edited, and a string where a count
    belongs is a DataError naming the field, not a TypeError inside a format string."""
    from mamba3lite import intake

    kind = intake.MANIFEST
    counts = {"documents_in": int, "kept": int, "replaced_bytes": int, "sources": list, "dropped": dict}
    intake.expect(stats, counts, where=where, kind=kind, optional=tuple(counts), prefix="extra.stats.")
    sources = stats.get("sources") or []
    for i, src in enumerate(sources):
        at = f"extra.stats.sources[{i}]."
        intake.expect(
            src, {"weight": float, "documents": dict, "tokens": dict}, where=where, kind=kind,
            optional=("weight", "documents", "tokens"), prefix=at,
        )  # fmt: skip
        for name, value in src.get("documents", {}).items():
            intake.expect_type(value, int, where=where, kind=kind, what=f"{at}documents.{name}")
        for name in ("train", "val"):
            value = src.get("tokens", {}).get(name, 0)
            intake.expect_type(value, int, where=where, kind=kind, what=f"{at}tokens.{name}")
    dropped = stats.get("dropped") or {}
    for name, value in dropped.items():
        intake.expect_type(value, int, where=where, kind=kind, what=f"extra.stats.dropped.{name}")
    lines = ["", *source_table(sources)] if sources else []
    return [
        *lines,
        "",
        f"documents   read {stats.get('documents_in', 0):,}, kept {stats.get('kept', 0):,}; dropped: "
        + (", ".join(f"{k} {v:,}" for k, v in dropped.items()) or "none"),
        f"replaced    {stats.get('replaced_bytes', 0):,} undecodable bytes / bad characters",
    ]
