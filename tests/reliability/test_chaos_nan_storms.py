"""Scenario 4: NaN storms (MAMBA3LITE_INJECT_NONFINITE). 1, K-1 and K consecutive non-finite losses
(K = nan_guard_max_consecutive), and K again after each rollback: the run skips, rolls back, never applies
a non-finite update, logs every event, and finishes. A storm that no rollback gets past ends, after a
bounded number of rollbacks, with one clear error (and the last good checkpoint intact)."""

from __future__ import annotations

import chaos_harness as H
import pytest
import torch

from mamba3lite.checkpoint import CheckpointManager
from mamba3lite.config import load_config
from mamba3lite.errors import TrainingError
from mamba3lite.train.trainer import INJECT_ENV, Pretrainer, parse_injection

K = H.NAN_K  # 3; max_rollbacks is 2; 2 micro-steps per optimizer step; a checkpoint every 2 steps


def _trainer(tmp_path, chaos_data, monkeypatch, spec: str) -> tuple[Pretrainer, list[int]]:
    monkeypatch.setenv(INJECT_ENV, spec)
    H.write_config(tmp_path / "c.yaml", chaos_data, tmp_path / "run")
    tr = Pretrainer(load_config(tmp_path / "c.yaml", ["training.eval_every=0"]))
    applied: list[int] = []
    step = tr.optimizer.step

    def checked_step(*args, **kwargs):
        # The guard's promise, checked at the only place an update happens: finite gradients in, finite
        # weights out.
        for p in tr.params:
            assert p.grad is None or bool(torch.isfinite(p.grad).all()), "non-finite gradient applied"
        out = step(*args, **kwargs)
        assert all(bool(torch.isfinite(p).all()) for p in tr.params), "non-finite weights after a step"
        applied.append(tr.step + 1)
        return out

    tr.optimizer.step = checked_step
    return tr, applied


def _events(run_dir, name: str) -> list[dict]:
    # Superseded rows count too: a skip before a rollback happened, even if its timeline was abandoned.
    return [r for r in H.metrics_rows(run_dir) if r.get("kind") == "event" and r.get("event") == name]


STORMS = {
    # name: (injected micro-steps, expected rollbacks)
    "one": ("5", 0),
    "K-1 in a row": (f"9:{K - 1}", 0),
    "K-1 across a step boundary": (f"6:{K - 1}", 0),
    "K in a row": (f"9:{K}", 1),
    "K again after every rollback": (f"9:{K},17:{K},25:{K}", 3),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(STORMS))
def test_nan_storm_is_skipped_or_rolled_back_and_the_run_finishes(tmp_path, chaos_data, monkeypatch, name):
    spec, rollbacks = STORMS[name]
    tr, applied = _trainer(tmp_path, chaos_data, monkeypatch, spec)
    result = tr.train()
    run = tmp_path / "run"
    assert result.step == H.MAX_STEPS and not result.stopped
    assert result.rollbacks == rollbacks
    assert len(_events(run, "nan_skip")) == len(parse_injection(spec))  # every injected loss was logged
    assert len(_events(run, "rollback")) == rollbacks
    assert CheckpointManager(run).status(H.MAX_STEPS).verified
    assert all(bool(torch.isfinite(t).all()) for t in H.final_weights(run).values())
    # Each optimizer step of the final timeline was applied once, plus the steps redone after rollbacks.
    assert sorted(set(applied)) == list(range(1, H.MAX_STEPS + 1))


@pytest.mark.slow
def test_storm_that_never_ends_stops_after_bounded_rollbacks(tmp_path, chaos_data, monkeypatch):
    tr, applied = _trainer(tmp_path, chaos_data, monkeypatch, "10:1000")  # from step 6 on, every loss NaN
    with pytest.raises(TrainingError, match="max_rollbacks"):
        tr.train()
    run = tmp_path / "run"
    rollbacks = _events(run, "rollback")
    assert len(rollbacks) == 2  # max_rollbacks, then the error: no loop
    assert all("rolled back to step 4" in r["message"] for r in rollbacks)
    # Step 5 trained cleanly (then was rolled back to checkpoint 4); nothing was ever applied after it.
    assert max(applied) == 5
    assert CheckpointManager(run).latest_step() == 4 and CheckpointManager(run).status(4).verified


@pytest.mark.slow
def test_cli_reports_an_endless_storm_as_one_line(tmp_path, chaos_data):
    config = H.write_config(tmp_path / "c.yaml", chaos_data, tmp_path / "run", eval_every=0)
    r = H.run_train(config, env={INJECT_ENV: "10:1000"})
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "max_rollbacks" in errors[0], r.stderr
    assert CheckpointManager(tmp_path / "run").status(4).verified


def test_nan_before_the_first_checkpoint_is_a_clear_error(tmp_path, chaos_data, monkeypatch):
    tr, applied = _trainer(tmp_path, chaos_data, monkeypatch, f"0:{K}")
    with pytest.raises(TrainingError, match="no checkpoint"):
        tr.train()
    assert applied == []
