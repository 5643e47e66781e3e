"""What `prepare` counted: documents read, kept and dropped (by reason), per source and split; and the
work units computed and reused, per node (`WorkCounts`, the summary's only).

`PrepareStats.to_dict()` is the manifest's `extra["stats"]` (a contract: its keys and their order do not
change) and, with the internal `exhausted` flags, part of the resume snapshot; `from_dict` reads the
snapshot's form back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mamba3lite.data.shards import SPLITS

if TYPE_CHECKING:
    from mamba3lite.data.units import UnitRecord

DROP_REASONS = ("too_short", "duplicate", "binary", "empty", "bad_lines")


def _per_split() -> dict[str, int]:
    return dict.fromkeys(SPLITS, 0)


@dataclass
class SourceStats:
    """One source's contribution; `documents`, `tokens` and `bytes` are per split."""

    spec: str
    weight: float
    documents_in: int = 0
    documents: dict[str, int] = field(default_factory=_per_split)
    tokens: dict[str, int] = field(default_factory=_per_split)
    bytes: dict[str, int] = field(default_factory=_per_split)
    exhausted: bool = False  # read to its end (internal: not in the manifest)

    def to_dict(self, public: bool) -> dict:
        d = {
            "spec": self.spec,
            "weight": self.weight,
            "documents_in": self.documents_in,
            "documents": dict(self.documents),
            "tokens": dict(self.tokens),
            "bytes": dict(self.bytes),
        }
        return d if public else {**d, "exhausted": self.exhausted}

    @classmethod
    def from_dict(cls, d: dict) -> SourceStats:
        counts = {k: {s: int(d[k][s]) for s in SPLITS} for k in ("documents", "tokens", "bytes")}
        return cls(
            d["spec"], float(d["weight"]), int(d["documents_in"]), **counts, exhausted=bool(d["exhausted"])
        )


@dataclass
class PrepareStats:
    """The counters of one prepare run (all of it goes into the resume snapshot)."""

    sources: list[SourceStats]
    documents_in: int = 0
    kept: int = 0
    dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DROP_REASONS, 0))
    replaced_bytes: int = 0  # characters replaced by U+FFFD (undecodable bytes, lone surrogates)
    special_tokens_removed: int = 0  # EOS ids a tokenizer produced inside a document

    @classmethod
    def new(cls, specs: Sequence[Any]) -> PrepareStats:
        """Zero counts for sources with `.spec` and `.weight` (SourceSpec)."""
        return cls([SourceStats(s.spec, s.weight) for s in specs])

    def read(self, i: int, n_replaced: int, n_docs: int = 1) -> None:
        """`n_docs` documents of source i were read (whatever becomes of them), `n_replaced` characters
        replaced in them."""
        self.documents_in += n_docs
        self.sources[i].documents_in += n_docs
        self.replaced_bytes += n_replaced

    def drop(self, reason: str, n_docs: int = 1) -> None:
        self.dropped[reason] += n_docs

    def keep(self, i: int, split: str, n_tokens: int, n_bytes: int, n_special: int, n_docs: int = 1) -> None:
        """`n_docs` documents of source i went into `split`, with these totals."""
        self.kept += n_docs
        self.special_tokens_removed += n_special
        src = self.sources[i]
        src.documents[split] += n_docs
        src.tokens[split] += n_tokens
        src.bytes[split] += n_bytes

    def dropped_text(self, sep: str = ", ") -> str:
        """The non-zero drop counts, "reason n" each."""
        return sep.join(f"{k} {v}" for k, v in self.dropped.items() if v)

    def to_dict(self, public: bool = True) -> dict:
        """The JSON form: the manifest's (public) or the snapshot's (with each source's `exhausted`)."""
        return {
            "documents_in": self.documents_in,
            "kept": self.kept,
            "dropped": dict(self.dropped),
            "replaced_bytes": self.replaced_bytes,
            "special_tokens_removed": self.special_tokens_removed,
            "sources": [s.to_dict(public) for s in self.sources],
        }

    @classmethod
    def from_dict(cls, d: dict) -> PrepareStats:
        """The snapshot form back; KeyError / TypeError / ValueError when it is not one."""
        return cls(
            sources=[SourceStats.from_dict(s) for s in d["sources"]],
            documents_in=int(d["documents_in"]),
            kept=int(d["kept"]),
            dropped={k: int(d["dropped"][k]) for k in DROP_REASONS},
            replaced_bytes=int(d["replaced_bytes"]),
            special_tokens_removed=int(d["special_tokens_removed"]),
        )


@dataclass
class WorkCounts:
    """The work units of a run: how many were computed and how many reused (a complete, verified record
    from an interrupted run, or one Ray re-ran after a node was lost), and per node: units, documents,
    tokens and the seconds its tasks took (throughput = tokens / task seconds: per worker, not per node)."""

    executor: str = ""
    computed: int = 0
    reused: int = 0
    nodes: dict = field(default_factory=dict)  # node -> [units, documents, tokens, seconds]
    dedup_partitions: int = 0  # tasks the dedup set was partitioned into (0: not partitioned)
    dedup_candidates: int = 0  # digests occurring more than once: all the driver's set may hold

    def add(self, record: UnitRecord) -> None:
        if record.reused:
            self.reused += 1
            return
        self.computed += 1
        n = self.nodes.setdefault(record.node, [0, 0, 0, 0.0])
        n[0] += 1
        n[1] += record.n_docs
        n[2] += record.n_tokens
        n[3] += record.seconds

    def n_tokens(self) -> int:
        """Tokens of the units computed in this run (EOS and the documents dropped after, included)."""
        return sum(n[2] for n in self.nodes.values())

    def table(self) -> list[str]:
        lines = [f"units: {self.computed:,} computed, {self.reused:,} reused ({self.executor})"]
        if self.dedup_partitions:
            lines.append(
                f"dedup: partitioned by digest into {self.dedup_partitions} tasks; "
                f"{self.dedup_candidates:,} digests occur more than once (all the driver remembers)"
            )
        for node, (n_units, n_docs, n_tokens, secs) in sorted(self.nodes.items()):
            rate = n_tokens / secs if secs > 0 else float("nan")
            lines.append(
                f"  node {node}: {n_units:,} units, {n_docs:,} documents, {n_tokens:,} tokens, "
                f"{rate:,.0f} tokens/s per task"
            )
        return lines
