"""Killed workers under `torchrun --max-restarts`: every restarted generation forms its process group and
works on, and a training run ends bit-equal to an uninterrupted one.

torchrun's agent store outlives the generations it starts; before each generation agreed on a namespace
of its own (train/parallel/generation.py) the new ranks read the dead ranks' gloo addresses and either
failed the restart or hung in group creation (the default group, a DeviceMesh's, the async checkpoint's).
Each run here kills a worker (SIGKILL) five times, alternating rank 1 and rank 0, at steps a seed picks
anew for every run (printed on failure; CHAOS_SEED replays it), with exactly as many restarts as kills: a
lost restart, a hang (bounded by training.dist_init_timeout_s and watchdog_s, then by the test's time
limit) or a resume that is not exact fails the test. The harness: restart_harness.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import chaos_harness as H
import pytest
import restart_harness as R

pytestmark = pytest.mark.slow

KILLS = 5
MAX_STEPS = 24  # more than five kills can leave undone: a generation trains at most 4 steps before its kill
SETTINGS = dict(max_steps=MAX_STEPS, save_every=2, eval_every=8, dist_init_timeout_s=60.0, watchdog_s=60.0)


def seed() -> int:
    return int(os.environ.get("CHAOS_SEED", time.time_ns() % 1_000_000))


@pytest.mark.parametrize("parallelism", ["fsdp", "ddp"])
def test_a_run_killed_five_times_under_torchrun_restarts_recovers_each_time_and_ends_bit_equal(
    tmp_path, chaos_data, parallelism
):
    ref = H.write_config(
        tmp_path / "ref.yaml", chaos_data, tmp_path / "ref", parallelism=parallelism, **SETTINGS
    )
    argv = R.torchrun_argv(0, ["-m", "mamba3lite", "train", "--config", str(ref)])
    r = subprocess.run(
        argv, capture_output=True, text=True, timeout=H.PATIENCE_S, env={**os.environ, **H.BASE_ENV}
    )
    assert r.returncode == 0, r.stderr[-3000:]

    s = seed()
    plan = R.kill_plan(s, KILLS)
    run = R.train_run(tmp_path / "chaos", chaos_data, parallelism, plan, 2 * H.PATIENCE_S, **SETTINGS)
    about = run.describe(plan, s)
    assert run.outcome == "ok", about  # every planned kill happened, and each restart recovered
    assert "connectFullMesh failed" not in run.stderr, about  # no generation met a dead one's address
    weights, losses = R.final_state(tmp_path / "chaos" / "run", MAX_STEPS)
    ref_weights, ref_losses = R.final_state(tmp_path / "ref", MAX_STEPS)
    assert sorted(losses) == list(range(1, MAX_STEPS + 1)), about
    assert losses == ref_losses, about
    assert H.weights_identical(weights, ref_weights), about


def test_the_plain_torch_reproduction_connects_every_restarted_generation_at_its_first_try(tmp_path):
    # A torch script (no training) whose groups come from init_distributed: three kills, three restarts.
    s = seed()
    plan = R.kill_plan(s, 3, most=10)
    run = R.plain_run(tmp_path, "mamba3lite", plan, H.PATIENCE_S)
    about = run.describe(plan, s)
    assert run.outcome == "ok", about
    assert len(run.recover_s) == 3, about
    assert "connectFullMesh failed" not in run.stderr, about


def test_kill_tree_ends_workers_that_torchrun_starts_in_sessions_of_their_own():
    # The harness's clean-up after a hang: a child in a new session (as torchrun starts its workers)
    # survives a kill of its parent's process group, not kill_tree.
    code = (
        "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True); "
        "time.sleep(600)"
    )
    p = subprocess.Popen([sys.executable, "-c", code])
    assert H.wait_until(lambda: H.descendants(p.pid), timeout=30)
    (child,) = H.descendants(p.pid)
    H.kill_tree(p)
    assert H.wait_until(lambda: not os.path.exists(f"/proc/{child}") or "Z" in _state(child), timeout=10)


def _state(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/stat").read().split()[2]
    except OSError:
        return "gone"
