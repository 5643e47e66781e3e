"""Killed workers under `torchrun --max-restarts`: every restarted generation forms its process group and
trains on, and the run ends bit-equal to an uninterrupted one.

torchrun's agent store outlives the generations it starts; before each generation agreed on a namespace
of its own (train/parallel/generation.py) the new ranks read the dead ranks' gloo addresses and either
failed the restart or hung in group creation (the default group, a DeviceMesh's, the async checkpoint's).
Each test here kills a worker (SIGKILL) five times in one run, alternating rank 1 and rank 0, at steps a
seed picks anew for every run (printed on failure, CHAOS_SEED to replay), with exactly as many restarts
as kills: a lost restart, a hang (bounded here by training.dist_init_timeout_s and watchdog_s) or a resume
that is not exact fails the test.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import chaos_harness as H
import pytest

from mamba3lite.checkpoint.run_dir import RunDir

pytestmark = pytest.mark.slow

KILLS = 5
MAX_STEPS = 24  # more than the kills can leave undone: each generation trains at most 4 steps before its kill
# A sitecustomize for every worker: in generation g (torchrun's restart count), rank PLAN[g][0] SIGKILLs
# itself right after the PLAN[g][1]-th training step it ran (before that step's checkpoint, or while an
# earlier step's async save is still writing), leaving the file generation<g> in CHAOS_KILLED_DIR first.
KILL_HOOK = """
import os, signal
plan = os.environ.get("CHAOS_RESTART_KILLS")
if plan and os.environ.get("RANK") is not None:
    plan = [tuple(int(x) for x in k.split(":")) for k in plan.split(",")]
    gen = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if gen < len(plan) and plan[gen][0] == int(os.environ["RANK"]):
        from mamba3lite.train import trainer

        original, trained = trainer.Pretrainer.train_step, [0]

        def train_step(self):
            done = original(self)
            trained[0] += 1
            if trained[0] == plan[gen][1]:
                open(os.path.join(os.environ["CHAOS_KILLED_DIR"], f"generation{gen}"), "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            return done

        trainer.Pretrainer.train_step = train_step
"""


def kill_plan(seed: int) -> list[tuple[int, int]]:
    """(victim rank, its n-th step in that generation) for each generation that is killed."""
    rng = random.Random(seed)
    return [(1 - g % 2, rng.randint(1, 4)) for g in range(KILLS)]


def torchrun(config: Path, restarts: int, env: dict, timeout: float) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "--max-restarts", str(restarts), "-m", "mamba3lite", "train", "--config", str(config)]  # fmt: skip
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **H.BASE_ENV, **env}
    )


def final_state(run_dir: Path) -> tuple[dict, dict]:
    """(the final step's weights read in one process, {step: loss} of the rows not superseded)."""
    weights = RunDir(run_dir).load(MAX_STEPS).model.state_dict()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in rows if r["kind"] == "train" and not r.get("superseded")}
    return weights, losses


@pytest.mark.parametrize("parallelism", ["fsdp", "ddp"])
def test_a_run_killed_five_times_under_torchrun_restarts_recovers_each_time_and_ends_bit_equal(
    tmp_path, chaos_data, parallelism
):
    settings = dict(max_steps=MAX_STEPS, save_every=2, eval_every=8, parallelism=parallelism,
                    dist_init_timeout_s=60.0, watchdog_s=60.0)  # fmt: skip
    ref_config = H.write_config(tmp_path / "ref.yaml", chaos_data, tmp_path / "ref", **settings)
    r = torchrun(ref_config, 0, {}, H.PATIENCE_S)
    assert r.returncode == 0, r.stderr[-3000:]

    seed = int(os.environ.get("CHAOS_SEED", time.time_ns() % 1_000_000))
    plan = kill_plan(seed)
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(KILL_HOOK)
    killed = tmp_path / "killed"
    killed.mkdir()
    env = {
        "CHAOS_KILLED_DIR": str(killed),
        "CHAOS_RESTART_KILLS": ",".join(f"{rank}:{n}" for rank, n in plan),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")])),
    }
    config = H.write_config(tmp_path / "chaos.yaml", chaos_data, tmp_path / "run", **settings)
    started = time.monotonic()
    r = torchrun(config, KILLS, env, 2 * H.PATIENCE_S)
    took = time.monotonic() - started
    about = f"seed {seed} (CHAOS_SEED), kills {plan}, {took:.0f} s:\n{r.stderr[-4000:]}"
    assert r.returncode == 0, about
    # every planned kill happened (so each of the KILLS restarts was needed, and each recovered)
    assert sorted(p.name for p in killed.iterdir()) == [f"generation{g}" for g in range(KILLS)], about
    assert "connectFullMesh failed" not in r.stderr, about  # no generation met a dead one's address

    weights, losses = final_state(tmp_path / "run")
    ref_weights, ref_losses = final_state(tmp_path / "ref")
    assert sorted(losses) == list(range(1, MAX_STEPS + 1)), about
    assert losses == ref_losses, about
    assert H.weights_identical(weights, ref_weights), about
