"""The documentation's pages (README.md and every page of the docs site) and what they show: their shell
code blocks and the `mamba3lite` command lines in them, for tests/test_readme.py and
tests/test_docs_site.py."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def pages() -> list[Path]:
    """README.md and every Markdown page under docs/."""
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


SHELL = ("", "bash", "sh", "shell", "console")  # a bare fence is a shell block here; `text` is not


def code_blocks(text: str, langs: tuple[str, ...] = SHELL) -> list[str]:
    """The blocks fenced as one of `langs` (by default the shell ones), each fence pair matched as a pair
    (a python block's closing fence is not the opening of one)."""
    return [body for lang, body in re.findall(r"```(\w*)\n(.*?)```", text, re.S) if lang in langs]


def command_lines(text: str) -> list[list[str]]:
    """Every `mamba3lite ...` / `torchrun ... -m mamba3lite ...` command in the shell blocks, as argv after
    the program name (continuation lines joined, comments dropped, an `ENV=value` prefix skipped)."""
    out = []
    for block in code_blocks(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.removeprefix("$ ")  # a console block's prompt
            words = (
                shlex.split(line, comments=True)
                if re.match(r"\s*(\w+=\S+\s+)*(mamba3lite|torchrun)\b", line)
                else []
            )
            while words and re.fullmatch(r"\w+=\S*", words[0]):
                words = words[1:]
            if words and words[0] == "mamba3lite":
                out.append(words[1:])
            elif words and words[0] == "torchrun":
                i = words.index("-m")
                assert words[i + 1] == "mamba3lite", line
                out.append(words[i + 2 :])
    return out
