"""Which source the next document comes from: source specs with weights, mixture files, and the `Mixer`.

The next document comes from the source with the fewest tokens taken per unit of rate (ties: lowest
index). With a target token count, source i stops after weight_i / Σweights × target tokens and its rate
is its weight; without one, every document of every source is used and the rate is the source's size on
disk (when every source's is known). Either way the sources run out together, so every shard sees every
source.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mamba3lite import intake
from mamba3lite.errors import ConfigError, did_you_mean

_MIXTURE_KEYS = ("sources", "target_tokens")
_MIXTURE_SOURCE_KEYS = ("source", "weight")


@dataclass(frozen=True)
class SourceSpec:
    """A source spec (see `mamba3lite.data.sources`) and its mixing weight (> 0)."""

    spec: str
    weight: float = 1.0


def as_spec(source: str | SourceSpec | tuple[str, float]) -> SourceSpec:
    """A spec string, a (spec, weight) pair or a SourceSpec, as a SourceSpec."""
    if isinstance(source, SourceSpec):
        return source
    return SourceSpec(source) if isinstance(source, str) else SourceSpec(*source)


def _unknown_key(key: str, known: Sequence[str], where: str) -> ConfigError:
    close = did_you_mean(key, known)
    hint = f"; did you mean {close!r}?" if close else f"; known keys: {', '.join(known)}"
    return ConfigError(f"{where}: unknown key {key!r}{hint}")


def read_mixture_file(path: Path) -> Any:
    """The parsed YAML document of a mixture file (the one place the file is read): through the border
    reader, so a pipe, a device, a huge file, bytes that are not UTF-8, a number too long to read or a
    nesting too deep is one ConfigError naming the file."""
    return intake.read_yaml(path, intake.MIXTURE)


def _source_of(item: Any, where: str, base: Path) -> SourceSpec:
    """One entry of a mixture's `sources:` list (a spec string or {source, weight})."""
    if isinstance(item, str):
        item = {"source": item}
    if not isinstance(item, dict) or "source" not in item:
        raise ConfigError(f"{where} must be a mapping with a `source` key")
    for key in item:
        if key not in _MIXTURE_SOURCE_KEYS:
            raise _unknown_key(str(key), _MIXTURE_SOURCE_KEYS, where)
    spec = str(item["source"])
    if spec != "stdlib" and not spec.startswith("hf:") and not os.path.isabs(spec):
        spec = os.path.join(base, spec)
    # As the flags read a number: YAML 1.1 reads `5e-1` and `1e6` (no dot) as strings.
    return SourceSpec(spec, intake.as_number(item.get("weight", 1.0), where=f"{where}.weight"))


def load_mixture(path: str | os.PathLike) -> tuple[list[SourceSpec], int | None]:
    """Read a mixture YAML file:

        target_tokens: 20_000_000        # optional
        sources:
          - source: data/web/*.jsonl     # any source spec; relative paths are relative to this file
            weight: 0.7
          - source: stdlib
            weight: 0.3

    Returns (sources, target_tokens). ConfigError naming the file and field on anything wrong."""
    path = Path(path)
    doc = read_mixture_file(path)
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: expected a mapping with `sources:` (and optionally `target_tokens:`)")
    for key in doc:
        if key not in _MIXTURE_KEYS:
            raise _unknown_key(str(key), _MIXTURE_KEYS, str(path))
    items = doc.get("sources")
    if not isinstance(items, list) or not items:
        raise ConfigError(f"{path}: `sources` must be a non-empty list of {{source: ..., weight: ...}}")
    specs = [_source_of(item, f"{path}: sources[{i}]", path.parent) for i, item in enumerate(items)]
    target = doc.get("target_tokens")
    if target is not None:
        target = intake.as_count(target, where=f"{path}: target_tokens", minimum=1)
    return specs, target


class Mixer:
    """The interleaving policy (see the module docstring): per-source budgets and rates, fixed by the
    arguments. The state it decides on, the tokens taken from each source, is the caller's."""

    def __init__(self, weights: Sequence[float], sizes: Sequence[int], target_tokens: int | None) -> None:
        top = max(weights)  # relative weights: a sum of 1e308s must not overflow to inf
        total_w = sum(w / top for w in weights)
        self.budgets = [
            None if target_tokens is None else target_tokens * (w / top) / total_w for w in weights
        ]
        # With a target every source reaches its budget at about the same time; without one every
        # document is used, so sources are spread by size and all run out at about the same time.
        if target_tokens is None and all(sizes):
            self.rates = [float(n) for n in sizes]
        else:
            self.rates = list(weights)

    def pick(self, taken: Sequence[int], active: Sequence[int]) -> int | None:
        """The source of the next document among `active` (not exhausted), given the tokens `taken` from
        each so far; None when none may give more (all exhausted, or at their budgets)."""
        best = None
        for i in active:
            b = self.budgets[i]
            if b is not None and taken[i] >= b:
                continue
            if best is None or taken[i] * self.rates[best] < taken[best] * self.rates[i]:
                best = i
        return best

    def run_length(self, taken: Sequence[int], active: Sequence[int], i: int, totals: Sequence[int]) -> int:
        """How many picks in a row go to source i while its tokens taken are totals[0], totals[1], ... in
        turn, the others' staying as in `taken` (totals[0] must pick i). `pick` is monotone in taken[i]
        (more taken never makes a source more eligible), so a binary search over `pick` itself."""
        trial = list(taken)

        def picks(k: int) -> bool:
            trial[i] = int(totals[k])
            return self.pick(trial, active) == i

        lo, hi = 1, len(totals)  # the first k that does not pick i, or len(totals)
        while lo < hi:
            mid = (lo + hi) // 2
            if picks(mid):
                lo = mid + 1
            else:
                hi = mid
        return lo
