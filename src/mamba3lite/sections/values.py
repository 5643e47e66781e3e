"""Typed values: a section built from a mapping of YAML (or `--set`) values, each coerced to its field's
type hint, with errors that name the field.

    build_section(TrainingConfig, {"lr": "3e-4", "betas": "0.9,0.95"}, "training")

YAML 1.1 reads `3e-4` as a string and `--set` values arrive as text, so every value goes through the
field's type: int, float, bool, str, `X | None`, Literal, list and tuple (a sequence, or a comma-separated
string). An unknown key is an error with a did-you-mean; a value that does not convert names the field
and what it expected.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from mamba3lite.errors import ConfigError, did_you_mean_hint


def parse_text(text: str) -> Any:
    """A --set value: YAML scalar syntax (3e-4 stays a string for YAML 1.1; coercion handles it)."""
    import yaml

    try:
        return yaml.safe_load(text) if text else ""
    except (yaml.YAMLError, ValueError, RecursionError):
        # Not YAML, an integer past Python's int-string limit, or nesting past the recursion limit:
        # the field's coercion then says what it expected, naming the field.
        return text


def reject_unknown(keys: Any, known: Any, *, where: str) -> None:
    """Each of `keys` is one of `known`: else a ConfigError `{where} `key`` with a did-you-mean."""
    known = list(known)
    for key in keys:
        if key not in known:
            hint = did_you_mean_hint(key, known, otherwise=f"; known: {', '.join(map(str, known))}")
            raise ConfigError(f"{where} `{key}`{hint}")


def build_section(section_cls: type, values: dict, section: str) -> Any:
    """Instantiate one section dataclass from a mapping, coercing each value to its field's type."""
    fields = {f.name: f for f in dataclasses.fields(section_cls) if f.init}
    reject_unknown(values.keys(), fields.keys(), where=f"unknown key in section `{section}:`")
    hints = typing.get_type_hints(section_cls)
    kwargs = {name: _coerce(value, hints[name], f"{section}.{name}") for name, value in values.items()}
    try:
        return section_cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:  # a section class validating with plain exceptions
        raise ConfigError(f"section `{section}:`: {e}") from e


def _coerce(value: Any, type_: Any, where: str) -> Any:
    """Check/convert one value against a field's type hint; errors name the field."""
    origin = typing.get_origin(type_)
    args = typing.get_args(type_)
    if origin in (typing.Union, types.UnionType):
        return _coerce_union(value, args, where)
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{where} must be one of {', '.join(map(repr, args))}, got {value!r}")
        return value
    if origin in (tuple, list):
        return _coerce_sequence(value, origin, args, where)
    if dataclasses.is_dataclass(type_):  # a nested section (training.fault_tolerance): a mapping of its keys
        if isinstance(value, type_):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping of its keys, got {_short(value)}")
        return build_section(type_, value, where)
    scalar = _SCALARS.get(type_)
    return value if scalar is None else scalar(value, where)  # Any (and unknown hints): as given


def _coerce_union(value: Any, args: tuple, where: str) -> Any:
    """`X | None` and other unions: None (or its YAML spellings) where allowed, else the first member
    type the value converts to; the first member's error otherwise."""
    is_none = value is None or (isinstance(value, str) and value.lower() in ("none", "null", "~"))
    if is_none and type(None) in args:
        return None
    errors = []
    for arg in args:
        if arg is type(None):
            continue
        try:
            return _coerce(value, arg, where)
        except ConfigError as e:
            errors.append(str(e))
    raise ConfigError(errors[0] if errors else f"{where}: cannot be {value!r}")


def _coerce_sequence(value: Any, origin: type, args: tuple, where: str) -> Any:
    """A list or tuple field: a YAML sequence, or a comma-separated string (`--set x=a,b`)."""
    if isinstance(value, str):
        value = [v.strip() for v in value.strip("()[]").split(",") if v.strip()]
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{where} must be a list, got {value!r}")
    if origin is tuple and args and args[-1] is not Ellipsis:
        if len(value) != len(args):
            raise ConfigError(f"{where} must have {len(args)} items, got {len(value)}: {list(value)}")
        return tuple(_coerce(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    inner = args[0] if args else Any
    items = [_coerce(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
    return tuple(items) if origin is tuple else items


def _coerce_bool(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):  # `--set training.progress=1`: YAML reads an int
        return bool(value)
    if isinstance(value, str) and value.lower() in ("true", "yes", "on", "1", "false", "no", "off", "0"):
        return value.lower() in ("true", "yes", "on", "1")
    raise ConfigError(f"{where} must be true or false, got {value!r}")


def _coerce_int(value: Any, where: str) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{where} must be an integer, got {value!r}")
    number = None
    if isinstance(value, int):
        number = value
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    elif isinstance(value, str):
        try:
            f = float(value.replace("_", ""))
        except (ValueError, OverflowError):
            f = None
        if f is not None and f.is_integer():
            number = int(f)
    if number is None:
        raise ConfigError(f"{where} must be an integer, got {_short(value)}")
    if abs(number) >= 2**64:  # beyond any int64 size or counter (fields check their own ranges)
        raise ConfigError(f"{where} is impossibly large, got {_short(value)}")
    return number


def _coerce_float(value: Any, where: str) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"{where} must be a number, got {value!r}")
    try:
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            return float(value)
    except ValueError:
        pass
    except OverflowError:  # an integer of hundreds of digits
        raise ConfigError(f"{where} is too large for a number, got {_short(value)}") from None
    raise ConfigError(f"{where} must be a number, got {_short(value)}")


def _coerce_str(value: Any, where: str) -> str:
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(f"{where} must be a string, got {value!r}")


_SCALARS = {bool: _coerce_bool, int: _coerce_int, float: _coerce_float, str: _coerce_str}


def _short(value: Any) -> str:
    """repr of a value for a message, cut to 40 characters (a pasted 400-digit number)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."
