"""The config reference: Markdown tables of every field of every config section (key, type, default,
meaning), rendered from the dataclasses' field documentation (`metadata={"help": ...}` in
mamba3lite.config), so the documented keys are the real ones."""

from __future__ import annotations

import dataclasses
from typing import Any

from mamba3lite.config import Config, _plain


def _type_name(type_: Any) -> str:
    text = type_ if isinstance(type_, str) else getattr(type_, "__name__", str(type_))
    return str(text).replace("typing.", "")


def config_reference_markdown() -> str:
    """Markdown tables of every field of every section (name, type, default, meaning) for the docs."""
    lines: list[str] = []
    for section, section_cls in Config.section_classes().items():
        lines += [f"### `{section}:`", ""]
        doc = (section_cls.__doc__ or "").strip().splitlines()
        if doc and not doc[0].startswith(section_cls.__name__ + "("):
            lines += [doc[0], ""]
        lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
        for f in dataclasses.fields(section_cls):
            if not f.init:
                continue
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                default = "(required)"
            if dataclasses.is_dataclass(default):  # a nested section: its row, then one per key of it
                help_text = f.metadata.get("help", "").replace("|", "\\|")
                lines += [
                    f"| `{f.name}` | {type(default).__name__} | | {help_text} |",
                    *_nested_rows(f.name, default),
                ]
                continue
            default = _plain(default)
            meaning = f.metadata.get("help", "").replace("|", "\\|")
            type_text = _type_name(f.type).replace("|", "\\|")
            lines.append(f"| `{f.name}` | {type_text} | `{default}` | {meaning} |")
        lines.append("")
    return "\n".join(lines)


def _nested_rows(name: str, section: Any) -> list[str]:
    """The reference rows of a nested section's keys, named `name.key`."""
    rows = []
    for f in dataclasses.fields(section):
        meaning = f.metadata.get("help", "").replace("|", "\\|")
        type_text = _type_name(f.type).replace("|", "\\|")
        rows.append(f"| `{name}.{f.name}` | {type_text} | `{_plain(getattr(section, f.name))}` | {meaning} |")
    return rows
