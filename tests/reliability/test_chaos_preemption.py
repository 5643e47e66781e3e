"""Scenario 5: preemption. SIGTERM at chosen moments (inside a checkpoint save, inside an evaluation,
right after a step, at a random time): the process exits 0 within a bounded time, leaving a verified
checkpoint of the last step it trained; resuming continues exactly (bit-for-bit at the end)."""

from __future__ import annotations

import random
import signal

import chaos_harness as H
import pytest


@pytest.mark.slow
def test_sigterm_campaign_saves_exits_zero_and_resumes_exactly(tmp_path, chaos_data, reference):
    config = H.write_config(tmp_path / "config.yaml", chaos_data, tmp_path / "run")
    result = H.interrupt_campaign(
        tmp_path,
        config,
        tmp_path / "run",
        reference,
        trials=5,
        rng=random.Random(11),
        sig=signal.SIGTERM,
        modes=("mid-save", "eval", "after-step", "random"),
    )
    report = "\n".join(
        f"{t.mode} {t.hit} {t.latest_before}->{t.latest_after} {t.notes}" for t in result.trials
    )
    assert all(t.survived for t in result.trials), report
    assert not any(t.data_lost for t in result.trials), report
    hits = {t.mode for t in result.trials if t.hit.startswith(("inside the save", "during the evaluation"))}
    assert hits == {"mid-save", "eval"}, report  # the two hard moments really were hit
    assert not result.bad_resumes, result.bad_resumes
    assert result.final_rc == 0
    assert result.final_identical, "final weights differ from the uninterrupted run"


# `mamba3lite` that sends itself SIGTERM as the trainer starts restoring its checkpoint (the start-up
# window: verifying and loading a big checkpoint takes seconds to minutes).
TERM_DURING_RESTORE = """
import os, signal, sys
from mamba3lite.train.trainer import Pretrainer
_restore = Pretrainer._restore
def _restore_signalled(self, step):
    os.kill(os.getpid(), signal.SIGTERM)
    return _restore(self, step)
Pretrainer._restore = _restore_signalled
from mamba3lite.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_sigterm_while_restoring_exits_zero_and_resumes_exactly(tmp_path, chaos_data, reference):
    """Regression: the handlers were installed only after the resume, so a SIGTERM while the checkpoint
    was being verified and loaded killed the process (exit -15) instead of a clean stop."""
    import os
    import subprocess
    import sys

    run = tmp_path / "run"
    config = H.write_config(tmp_path / "config.yaml", chaos_data, run)
    assert H.run_train(config, "--max-steps", "4").returncode == 0  # a checkpoint to resume from
    r = subprocess.run(
        [sys.executable, "-c", TERM_DURING_RESTORE, "train", "--config", str(config)],
        env={**os.environ, **H.BASE_ENV},
        capture_output=True,
        text=True,
        timeout=H.PATIENCE_S,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "received SIGTERM" in r.stdout and "stopped" in r.stdout
    latest, _ = H.latest_verified(run)
    assert latest is not None and latest <= H.SAVE_EVERY * 3 and H.checkpoint_is_sound(run, latest)
    assert H.run_train(config).returncode == 0
    assert H.weights_identical(H.final_weights(run), reference)
