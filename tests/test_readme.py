"""README.md stays true: it opens with the two commands, its config reference is the generated one, and
every command line it shows parses with the real CLI (commands, flags, presets exist)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from mamba3lite.cli import COMMANDS, build_parser, main
from mamba3lite.config import available_presets, resolve_preset
from mamba3lite.report import readme

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def code_blocks(text: str) -> list[str]:
    """The shell blocks (```bash or a bare fence), each fence pair matched as a pair (a python block's
    closing fence is not the opening of one)."""
    return [body for lang, body in re.findall(r"```(\w*)\n(.*?)```", text, re.S) if lang in ("", "bash")]


def command_lines(text: str) -> list[list[str]]:
    """Every `mamba3lite ...` / `torchrun ... -m mamba3lite ...` command in the code blocks, as argv
    after the program name (continuation lines joined, comments dropped)."""
    out = []
    for block in code_blocks(text):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words and words[0] == "mamba3lite":
                out.append(words[1:])
            elif words and words[0] == "torchrun":
                i = words.index("-m")
                assert words[i + 1] == "mamba3lite", line
                out.append(words[i + 2 :])
    return out


def test_opens_with_the_two_commands():
    first = code_blocks(README.read_text())[0].splitlines()
    assert [line.split("#")[0].strip() for line in first] == ["make quickstart", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^quickstart:", makefile, re.M) and re.search(r"^test:", makefile, re.M)


def test_config_reference_is_the_generated_one():
    text = README.read_text()
    _, section, _ = readme.split_readme(text)
    assert section == readme.config_section(), "run: python -m mamba3lite.report.readme"
    assert "| `max_seq_len` |" in section and "| `train_data_path` |" in section
    assert readme.main([str(README), "--check"]) == 0


def test_render_replaces_only_the_section(tmp_path):
    stale = f"# T\n\n{readme.BEGIN}\nold table\n{readme.END}\n\nafter\n"
    new = readme.render(stale)
    assert new.startswith(f"# T\n\n{readme.BEGIN}\n### `model:`") and new.endswith(f"{readme.END}\n\nafter\n")
    p = tmp_path / "R.md"
    p.write_text(stale)
    assert readme.main([str(p), "--check"]) == 1
    assert readme.main([str(p)]) == 0 and p.read_text() == new
    with pytest.raises(ValueError, match="exactly one"):
        readme.render("no markers")


def test_every_command_line_in_the_readme_parses():
    lines = command_lines(README.read_text())
    assert len(lines) >= 10
    seen = set()
    for argv in lines:
        assert argv and argv[0] in COMMANDS, argv
        seen.add(argv[0])
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as e:  # argparse rejected a flag the README shows
            raise AssertionError(f"README command does not parse: mamba3lite {shlex.join(argv)}") from e
        config = getattr(args, "config", None)
        if config is not None:
            resolve_preset(config)  # a named preset must exist
    assert {"prepare", "train", "eval", "generate", "inspect", "plot"} <= seen


def test_presets_named_in_the_readme_exist():
    text = README.read_text()
    for name in re.findall(r"`(mamba3_[a-z0-9_]+|tiny|pretrain_a100_400m)`", text):
        assert name in available_presets(), name


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
