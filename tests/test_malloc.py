"""mamba3lite.malloc: glibc mallopt settings that keep freed memory for reuse (CPU training speed)."""

from __future__ import annotations

import platform

import pytest

from mamba3lite import malloc


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_applies_on_glibc_and_is_idempotent(monkeypatch):
    monkeypatch.setattr(malloc, "_done", False)
    assert malloc.keep_freed_memory() is True
    assert malloc.keep_freed_memory() is True


def test_other_libc_is_a_harmless_no(monkeypatch):
    monkeypatch.setattr(malloc, "_done", False)
    monkeypatch.setattr(malloc.platform, "libc_ver", lambda: ("", ""))
    assert malloc.keep_freed_memory() is False


def test_the_cli_applies_it_before_the_command(monkeypatch, tmp_path, capsys):
    from mamba3lite import cli

    calls = []
    monkeypatch.setattr(cli, "keep_freed_memory", lambda: calls.append(1) or True)
    assert cli.main(["inspect", str(tmp_path / "missing")]) != 0
    assert calls == [1]
