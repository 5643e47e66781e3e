"""Scenario 5: preemption. SIGTERM at chosen moments (inside a checkpoint save, inside an evaluation,
right after a step, at a random time): the process exits 0 within a bounded time, leaving a verified
checkpoint of the last step it trained; resuming continues exactly (bit-for-bit at the end)."""

from __future__ import annotations

import random
import shutil
import signal
from pathlib import Path

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
        trials=4,  # each signal point once; a fifth trial would be a second save, a point already hit
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
    # Bounded: the current step, an evaluation and a save at most (seconds; generous for a loaded CI box).
    assert max(t.exit_s for t in result.trials if t.exit_s is not None) < 120, report
    assert result.final_rc == 0
    assert result.final_identical, "final weights differ from the uninterrupted run"


# `mamba3lite` that sends itself SIGTERM at one moment outside the training loop, chosen by CHAOS_TERM_AT:
# "build" (while the training data is opened, before the trainer exists), "restore" (as the checkpoint
# is verified and loaded: seconds to minutes for a big one), "after" (train() has returned).
TERM_AT = """
import os, signal, sys
from mamba3lite.train.trainer import Pretrainer
where = os.environ["CHAOS_TERM_AT"]
def term_then(fn):
    def wrapped(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return fn(self, *args, **kwargs)
    return wrapped
def then_term(fn):
    def wrapped(self, *args, **kwargs):
        out = fn(self, *args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        return out
    return wrapped
if where == "build":
    Pretrainer._build_train_data = term_then(Pretrainer._build_train_data)
elif where == "restore":
    Pretrainer._restore = term_then(Pretrainer._restore)
else:
    Pretrainer.train = then_term(Pretrainer.train)
from mamba3lite.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory, chaos_data) -> tuple[Path, int]:
    """(a run directory, its newest verified step): a run of the chaos config stopped by a SIGTERM after
    step 3, short of the end. Made once; each case below resumes a copy of it (a trainer process less
    per case)."""
    work = tmp_path_factory.mktemp("stopped")
    run = work / "run"
    config = H.write_config(work / "config.yaml", chaos_data, run)
    first = H.start_train(config, log_dir=work / "logs")
    assert H.wait_until(lambda: H.trained_step_since(run, 0) >= 3, first)
    first.send_signal(signal.SIGTERM)
    assert H.finish(first)[0] == 0
    base, _ = H.latest_verified(run)
    assert base is not None and base < H.MAX_STEPS
    return run, base


@pytest.mark.slow
@pytest.mark.parametrize("where", ["build", "restore", "after"])
def test_sigterm_outside_the_loop_exits_zero_and_resumes_exactly(
    tmp_path, chaos_data, reference, stopped_run, where
):
    """Regression: the handlers existed only inside the loop, so a SIGTERM while the trainer was built,
    while it verified and restored its checkpoint, or after the run (shutdown) killed the process (exit
    -15) instead of a clean stop with exit 0."""
    import os
    import subprocess
    import sys

    # A checkpoint to resume from, made by a SIGTERM after step 3 (same config: same LR schedule).
    run = Path(shutil.copytree(stopped_run[0], tmp_path / "run"))
    base = stopped_run[1]
    config = H.write_config(tmp_path / "config.yaml", chaos_data, run)
    r = subprocess.run(
        [sys.executable, "-c", TERM_AT, "train", "--config", str(config)],
        env={**os.environ, **H.BASE_ENV, "CHAOS_TERM_AT": where},
        capture_output=True,
        text=True,
        timeout=H.PATIENCE_S,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    latest, _ = H.latest_verified(run)
    if where == "after":  # the run had finished: nothing was left to stop
        assert "done: step 12" in r.stdout and latest == H.MAX_STEPS
    else:  # one step after the resume, then a clean stop with its checkpoint
        assert f"stopped: step {base + 1}" in r.stdout and latest == base + 1, r.stdout[-1500:]
    assert H.checkpoint_is_sound(run, latest)
    assert H.run_train(config).returncode == 0
    assert H.weights_identical(H.final_weights(run), reference)


# `python -m mamba3lite` that receives SIGTERM while the interpreter shuts down after the command.
TERM_AT_EXIT = """
import atexit, os, runpy, signal, sys
atexit.register(lambda: os.kill(os.getpid(), signal.SIGTERM))
sys.argv = ["mamba3lite", *sys.argv[1:]]
runpy.run_module("mamba3lite", run_name="__main__")
"""


@pytest.mark.slow
def test_sigterm_during_interpreter_shutdown_keeps_exit_zero(tmp_path, chaos_data):
    """Regression: after a finished run, a SIGTERM during shutdown (torch's teardown takes a while) hit
    the default handler again and turned the finished run into exit -15."""
    import os
    import subprocess
    import sys

    config = H.write_config(tmp_path / "config.yaml", chaos_data, tmp_path / "run", max_steps=2)
    r = subprocess.run(
        [sys.executable, "-c", TERM_AT_EXIT, "train", "--config", str(config)],
        env={**os.environ, **H.BASE_ENV},
        capture_output=True,
        text=True,
        timeout=H.PATIENCE_S,
    )
    assert r.returncode == 0 and "done: step 2" in r.stdout, r.stderr[-2000:]
