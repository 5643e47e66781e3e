"""README.md stays one screen: at most 150 lines, the two commands in its first 15, links into the docs
site, and every command has its --help. (That its command lines parse, as every docs page's do, is
tests/test_docs_site.py's.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from docs_pages import code_blocks
from mamba3lite.cli import COMMANDS, main

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_LINES = 150


def test_opens_with_the_two_commands():
    text = README.read_text()
    first = code_blocks(text)[0]
    assert [line.split("#")[0].strip() for line in first.splitlines()] == ["make quickstart", "make test"]
    head = "\n".join(text.splitlines()[:15])
    assert "make quickstart" in head and "make test" in head, "the two commands belong in the first 15 lines"
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^quickstart:", makefile, re.M) and re.search(r"^test:", makefile, re.M)


def test_is_one_screen_that_links_into_the_docs():
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_LINES, (
        f"README.md is over {MAX_LINES} lines: move the detail to docs/"
    )
    links = re.findall(r"\]\((docs/[^)#]+)", text)
    assert len(links) >= 5, links
    for link in links:
        assert (ROOT / link).is_file(), link


def test_every_command_has_help(cli, capsys):
    # In this process (argparse prints the help and exits 0), and once as a user runs it: a process start
    # costs seconds, the parser is the same.
    for name in COMMANDS:
        with pytest.raises(SystemExit) as e:
            main([name, "--help"])
        out = capsys.readouterr().out
        assert e.value.code == 0 and out.startswith(f"usage: mamba3lite {name}"), (name, out[:200])
    r = cli("train", "--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: mamba3lite train"), r.stderr
