"""Scenario 1: SIGKILL at random moments of a real run (including inside a checkpoint save), resume,
repeat; the run ends bit-for-bit where an uninterrupted run ends and never resumes a damaged checkpoint."""

from __future__ import annotations

import random
import signal

import chaos_harness as H
import pytest


@pytest.mark.slow
def test_kill9_campaign_ends_bit_for_bit_at_the_reference(tmp_path, chaos_data, reference):
    config = H.write_config(tmp_path / "config.yaml", chaos_data, tmp_path / "run")
    # Two rounds of the three kill points (inside a save, after a step, at a random moment from start-up
    # on): every one is hit twice and each resumes what the one before left. A trial costs a process
    # start-up (most of its time), and more rounds only repeat the same points later in the run.
    result = H.interrupt_campaign(
        tmp_path, config, tmp_path / "run", reference, trials=6, rng=random.Random(7), sig=signal.SIGKILL
    )
    report = "\n".join(
        f"{t.mode} {t.hit} {t.latest_before}->{t.latest_after} {t.notes}" for t in result.trials
    )
    assert all(t.survived for t in result.trials), report
    assert not any(t.data_lost for t in result.trials), report
    # The kill points really were varied: inside a save at least once, after a logged step at least once.
    assert any(t.mode == "mid-save" and t.hit.startswith("inside the save") for t in result.trials), report
    assert any(t.mode == "after-step" and t.hit.startswith("after step") for t in result.trials), report
    assert not result.bad_resumes, result.bad_resumes
    assert result.resumes_checked >= 3, report  # the campaign did resume, more than once
    # A kill inside a save leaves a triple without its meta; the resume said so, naming the file.
    assert any("meta_step_" in w and "missing" in w for w in result.stderr_warnings), result.stderr_warnings
    assert result.final_rc == 0
    assert result.final_identical, "final weights differ from the uninterrupted run"


# `mamba3lite` whose write-mode files (every atomic writer opens them with os.fdopen) SIGKILL the process
# once CHAOS_KILL_AFTER_BYTES bytes have been written in total: a kill -9 exactly in the middle of a file.
KILL_MID_WRITE = """
import os, signal, sys
budget = [int(os.environ["CHAOS_KILL_AFTER_BYTES"])]
_fdopen = os.fdopen
class Dying:
    def __init__(self, f):
        self._f = f
    def write(self, data):
        view = memoryview(data).cast("B")
        n = min(len(view), budget[0])
        self._f.write(view[:n])
        budget[0] -= n
        if n < len(view):
            self._f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return n
    def __getattr__(self, name):
        return getattr(self._f, name)
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        self._f.close()
def fdopen(fd, mode="r", *args, **kwargs):
    f = _fdopen(fd, mode, *args, **kwargs)
    return Dying(f) if "w" in mode else f
os.fdopen = fdopen
from mamba3lite.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_kill_mid_write_leaves_no_orphan_temp_file_after_resume(tmp_path, chaos_data, reference):
    """Regression: a kill -9 in the middle of writing a checkpoint file left its temp file
    (`.model_step_2.safetensors.XXXX.tmp`, as large as the file) in the run directory forever; repeated
    preemptions of a big model would fill the disk. The next save now removes such leftovers."""
    import os
    import subprocess
    import sys

    run = tmp_path / "run"
    config = H.write_config(tmp_path / "config.yaml", chaos_data, run)
    # ~4 KB of run records first, then the model file of step 2 (~100 KB): die inside the latter.
    dying = subprocess.run(
        [sys.executable, "-c", KILL_MID_WRITE, "train", "--config", str(config)],
        env={**os.environ, **H.BASE_ENV, "CHAOS_KILL_AFTER_BYTES": "20000"},
        capture_output=True,
        text=True,
        timeout=H.PATIENCE_S,
    )
    assert dying.returncode == -signal.SIGKILL, dying.stderr
    orphans = sorted(p.name for p in run.glob(".*.tmp"))
    assert any(n.startswith(".model_step_2.safetensors.") for n in orphans), orphans  # the scenario happened
    assert H.latest_verified(run)[0] is None
    r = H.run_train(config)
    assert r.returncode == 0, r.stderr
    assert not list(run.glob(".*.tmp")), sorted(p.name for p in run.glob(".*.tmp"))
    assert H.weights_identical(H.final_weights(run), reference)
