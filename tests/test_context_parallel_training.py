"""Context parallelism in training (train/parallel/: the "cp" mesh dimension): runs whose windows are
shared by C processes train the same losses as one process (fp32, the same global batch), resume
across C in both directions, and every setting that cannot run is one clear error through the CLI."""

from __future__ import annotations

import json
import shutil

import pytest

from mamba3lite.checkpoint import CheckpointManager
from test_distributed import losses, one_process_run, train, write_config
from test_parallel import HYBRID

pytestmark = pytest.mark.slow

CP2 = ("--set", "training.context_parallel=2")


def assert_equal_losses(ref: dict[int, float], got: dict[int, float], steps: list[int]) -> None:
    assert sorted(ref) == sorted(got) == steps, (ref, got)
    for step in steps:
        assert abs(ref[step] - got[step]) <= 1e-5 * abs(ref[step]), (step, ref[step], got[step])


def resumed_from(run) -> list[int]:
    """The steps the run's resumes started from, in order (their events in metrics.jsonl)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if r.get("event") == "resume"]


# The one-process reference: the recipe's default optimizer, named as test_distributed.py names it, so
# the session trains it once for both modules.
ONE = ("--set", "training.optimizer=adamw")


def test_two_processes_sharing_each_window_equal_one_and_resume_across_cp(tmp_path, tmp_path_factory):
    ref = one_process_run(tmp_path_factory, *ONE)
    config = write_config(tmp_path)
    train(config, tmp_path / "cp", 2, *CP2)  # one data-parallel rank, each window cut in two
    one = losses(ref)
    assert_equal_losses(one, losses(tmp_path / "cp"), [1, 2, 3, 4])
    ev1, ev2 = losses(ref, "eval", "val_loss"), losses(tmp_path / "cp", "eval", "val_loss")
    assert sorted(ev1) == [2, 4] and all(abs(ev1[s] - ev2[s]) <= 1e-5 * ev1[s] for s in ev1)
    # a cp=2 checkpoint resumes on one process, and a one-process checkpoint at cp=2: step 2 of the cp=2
    # run and of (a copy of) the reference, their step 4 deleted
    down, up = tmp_path / "cp", tmp_path / "up"
    shutil.copytree(ref, up)  # the shared reference is read, never written
    for run, nproc, settings in ((down, 1, ()), (up, 2, CP2)):
        CheckpointManager(run).delete(4)
        train(config, run, nproc, *settings)
        assert_equal_losses(one, losses(run), [1, 2, 3, 4])
        assert resumed_from(run) == [2], run


def test_a_hybrid_sharing_each_window_over_two_processes_equals_one(tmp_path, tmp_path_factory):
    """A hybrid's attention layer (rotary, the conv over qkv, packed documents) exchanges its keys and
    values between the two pieces of each window: the losses and validation losses of one process."""
    ref = one_process_run(tmp_path_factory, *ONE, *HYBRID)
    train(write_config(tmp_path), tmp_path / "cp", 2, *ONE, *HYBRID, *CP2)
    assert_equal_losses(losses(ref), losses(tmp_path / "cp"), [1, 2, 3, 4])
    ev1, ev2 = losses(ref, "eval", "val_loss"), losses(tmp_path / "cp", "eval", "val_loss")
    assert sorted(ev1) == [2, 4] and all(abs(ev1[s] - ev2[s]) <= 1e-5 * ev1[s] for s in ev1)


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_data_parallel_2_x_context_parallel_2_equals_one_process(tmp_path, tmp_path_factory, parallelism):
    ref = one_process_run(tmp_path_factory, *ONE)
    train(write_config(tmp_path), tmp_path / "four", 4, *CP2, "--set", f"training.parallelism={parallelism}")
    assert_equal_losses(losses(ref), losses(tmp_path / "four"), [1, 2, 3, 4])


# One refusal per process count: every refusal is plan_layout's ConfigError, raised on every rank at start
# (each message is checked in one process in test_parallel.py's layout tests). What the user is promised
# is a clear `error:` line, a non-zero exit and no worker traceback; how many ranks print theirs is a race,
# since torchrun ends the others when the first one exits (a rank's line may never be written).
@pytest.mark.parametrize(
    ("nproc", "settings", "says"),
    [
        (1, CP2, "context_parallel is 2 but this is one process"),
        (2, (*CP2, "--set", "training.max_seq_len=15"), "does not divide the window of 15 tokens"),
    ],
)
def test_a_context_parallel_setting_that_cannot_run_is_one_error(tmp_path, nproc, settings, says):
    proc = train(write_config(tmp_path), tmp_path / "run", nproc, *settings, check=False)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors and all(says in line for line in errors), proc.stderr[-2000:]
    assert 1 <= len(errors) <= nproc, proc.stderr[-2000:]  # at most one line per process, at least one
    assert "src/mamba3lite/" not in proc.stderr  # no worker traceback (torchrun prints its own)
    assert nproc > 1 or "Traceback" not in proc.stderr
