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
