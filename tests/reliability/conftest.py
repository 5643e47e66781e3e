"""Shared fixtures of the reliability suite: a tiny prepared dataset, the chaos config and the weights
of one uninterrupted reference run (computed once per session, in a subprocess like every other run)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # chaos_harness, also used by benchmarks/chaos.py

import chaos_harness as H


@pytest.fixture(scope="session")
def chaos_data(tmp_path_factory) -> Path:
    """A read-only-by-convention prepared dataset (copy it before damaging it)."""
    return H.write_dataset(tmp_path_factory.mktemp("chaos") / "data")


@pytest.fixture(scope="session")
def reference(tmp_path_factory, chaos_data) -> dict:
    """Final weights of an uninterrupted `mamba3lite train` run of the chaos config (MAX_STEPS steps)."""
    work = tmp_path_factory.mktemp("reference")
    config = H.write_config(work / "config.yaml", chaos_data, work / "run")
    r = H.run_train(config)
    assert r.returncode == 0, r.stderr
    return H.final_weights(work / "run")


@pytest.fixture
def data_copy(tmp_path, chaos_data) -> Path:
    """A private copy of the dataset, free to damage."""
    return Path(shutil.copytree(chaos_data, tmp_path / "data"))
