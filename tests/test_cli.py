"""The CLI shell: help for every command, clean errors, no traceback."""

from __future__ import annotations

import pytest

from mamba3lite.cli import COMMANDS, command_module, main


def test_top_level_help(cli):
    r = cli("--help")
    assert r.returncode == 0
    for name in COMMANDS:
        assert name in r.stdout


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_has_help(name, capsys):
    with pytest.raises(SystemExit) as e:
        main([name, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert f"mamba3lite {name}" in out
    assert command_module(name).HELP in " ".join(out.split())


def test_help_does_not_import_torch(cli):
    # `mamba3lite --help` must answer instantly: no command module may import torch at module level.
    import subprocess
    import sys

    code = "import sys; from mamba3lite.cli import build_parser as b; b(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_unknown_command_is_a_usage_error(cli):
    r = cli("trian")
    assert r.returncode == 2
    assert "invalid choice" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_usage_mistake_is_one_error_line_with_a_pointer_to_help(capsys):
    """argparse's own refusals (missing, unknown or malformed flags) reach the one printer: one `error:`
    line naming the command and its --help, exit code 2 returned (not SystemExit), and a huge value
    quoted in the message is shortened instead of echoed whole."""
    assert main(["generate", "--seed", "9" * 5000]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: mamba3lite generate: argument --seed"), err
    assert "invalid int value" in err and "see `mamba3lite generate --help`" in err and len(err) < 300
    assert main(["eval"]) == 2
    assert "the following arguments are required: --checkpoint-dir" in capsys.readouterr().err
