"""A config field that documents itself, and the checks every section applies to its fields.

    lr: float = doc(1.5e-3, "peak learning rate (after warmup)")
    optimizer: str = doc("adamw", "...", choices=OPTIMIZERS)

`doc` puts the meaning (and unit) in the field's metadata, where the config reference reads it
(mamba3lite/report/config_reference.py), and any `choices=`, which `check_choices` enforces. The checks
raise a `ConfigError` that names the field (`training.lr must be > 0, got -1`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any

from mamba3lite.errors import ConfigError, did_you_mean_hint


def doc(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field with its documentation (meaning, unit) in metadata."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


def check_choices(section: str, obj: Any) -> None:
    """Every field declared with `choices=` holds one of them: one ConfigError with a did-you-mean."""
    for f in dataclasses.fields(obj):
        choices, value = f.metadata.get("choices"), getattr(obj, f.name)
        if choices is not None and value not in choices:
            hint = did_you_mean_hint(value, choices)
            raise ConfigError(f"{section}.{f.name} must be one of {', '.join(choices)}, got {value!r}{hint}")


def check_positive(section: str, obj: Any, names: tuple[str, ...], *, allow_zero: bool = False) -> None:
    """Each field `names` of `obj` is a finite number > 0 (>= 0 with `allow_zero`)."""
    for name in names:
        value = getattr(obj, name)
        if value != value or value in (float("inf"), float("-inf")):  # NaN/inf pass every comparison below
            raise ConfigError(f"{section}.{name} must be a finite number, got {value}")
        if value < 0 or (value == 0 and not allow_zero):
            bound = ">= 0" if allow_zero else "> 0"
            raise ConfigError(f"{section}.{name} must be {bound}, got {value}")
