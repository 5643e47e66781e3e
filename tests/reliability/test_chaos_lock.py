"""Scenario 7: two trainers on one checkpoint directory. The second refuses at once (the run lock) and
touches nothing; the first, frozen meanwhile in the middle of a checkpoint save, finishes unharmed: its
final checkpoint verifies and equals an uninterrupted run bit-for-bit."""

from __future__ import annotations

import os
import signal
import time

import chaos_harness as H
import pytest

from mamba3lite.checkpoint import SLOW_SAVE_ENV


@pytest.mark.slow
def test_second_trainer_is_refused_and_the_first_is_unharmed(tmp_path, chaos_data, reference):
    run = tmp_path / "run"
    config = H.write_config(tmp_path / "config.yaml", chaos_data, run)
    since_ns = time.time_ns()
    first = H.start_train(config, env={SLOW_SAVE_ENV: "0.2"}, log_dir=tmp_path / "logs")
    try:
        step = H.wait_until(lambda: H.mid_save_step(run, since_ns), first)
        assert step is not None, "the first trainer never reached a checkpoint save"
        # Freeze the first trainer inside its save, so the race below does not depend on timing.
        os.kill(first.pid, signal.SIGSTOP)
        before = H.tree_hash(run)
        second = H.run_train(config)
        after = H.tree_hash(run)
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert second.returncode != 0 and "Traceback" not in second.stderr, second.stderr
    errors = [ln for ln in second.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "in use by another trainer" in errors[0] and f"pid {first.pid}" in errors[0]
    assert after == before, "the refused trainer changed the run directory (its .lock included)"
    rc, _out, err = H.finish(first)
    assert rc == 0, err[-2000:]
    assert H.checkpoint_is_sound(run, H.MAX_STEPS)
    assert H.weights_identical(H.final_weights(run), reference)
    # The lock died with its holder: a third trainer may use the directory (nothing left to do: exit 0).
    third = H.run_train(config)
    assert third.returncode == 0, third.stderr
