"""Killed workers under `torchrun --max-restarts`: the runs of tests/reliability/test_chaos_restarts.py and
of `benchmarks/chaos.py --restart-trials`.

A run is a torchrun job of 2 workers with exactly as many restarts as it has planned kills. The kills are
planned per generation (torchrun's restart count, which one node's agent keeps exactly): in generation g,
rank PLAN[g][0] SIGKILLs itself right after the PLAN[g][1]-th unit of work it did in that generation,
leaving a file `generation<g>` (its mtime is the moment of the kill) in the run's kill directory first.
A run ends as one of:

    ok        every planned kill happened and torchrun's last generation finished (exit 0)
    lost      torchrun gave up: a restart was spent on a generation that could not form its group
    hung      nothing ended within the time bound (the whole process group is killed)

Two programs are run this way: `mamba3lite train` (a unit is a training step) and PLAIN, a torch script
(a unit is an all-reduce on the default group and on a second group) whose process group comes from
torch's own `init_process_group` or from mamba3lite's `init_distributed`: the plain reproduction of the
restart hang, with and without the fix.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import chaos_harness as H

# Loaded by every worker through PYTHONPATH (a sitecustomize): the kill plan for `mamba3lite train`.
TRAIN_KILL_HOOK = """
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

# The plain reproduction. PLAIN_INIT=torch: torch's init_process_group (env://); =mamba3lite: ours. Each
# generation prints "connected <gen> <rank> <unix time>" once its groups are formed.
PLAIN = """
import datetime, os, signal, sys, time
import torch, torch.distributed as dist
gen, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
plan = [tuple(int(x) for x in k.split(":")) for k in os.environ["CHAOS_RESTART_KILLS"].split(",")]
timeout = float(os.environ["PLAIN_TIMEOUT_S"])
if os.environ["PLAIN_INIT"] == "torch":
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
else:
    from mamba3lite.train.parallel.process_group import init_distributed
    init_distributed("cpu", timeout, timeout)
group = dist.new_group(backend="gloo")
os.write(1, f"connected {gen} {rank} {time.time()}\\n".encode())  # one write: the ranks share the file
for unit in range(1, 21):
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.all_reduce(t, group=group)
    if gen < len(plan) and plan[gen] == (rank, unit):
        open(os.path.join(os.environ["CHAOS_KILLED_DIR"], f"generation{gen}"), "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.02)
dist.barrier()
dist.destroy_process_group()
"""


def kill_plan(seed: int, kills: int, most: int = 4) -> list[tuple[int, int]]:
    """(victim rank, its n-th unit of work in that generation) per killed generation: rank 1 first, then
    rank 0, alternating; n drawn from 1..most by `seed`."""
    rng = random.Random(seed)
    return [(1 - g % 2, rng.randint(1, most)) for g in range(kills)]


@dataclass
class RestartRun:
    outcome: str  # ok, lost, hung
    seconds: float
    recover_s: list[float] = field(default_factory=list)  # per kill: the kill to the next generation's work
    stderr: str = ""

    def describe(self, plan, seed) -> str:
        head = f"seed {seed} (CHAOS_SEED), kills {plan}: {self.outcome} in {self.seconds:.0f} s"
        return f"{head}\n{self.stderr[-4000:]}"


def torchrun_argv(restarts: int, program: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            "--max-restarts", str(restarts), *program]  # fmt: skip


def run_with_kills(work: Path, program: list[str], plan, timeout_s: float, env: dict | None = None):
    """Run `program` (torchrun's arguments after its options) under the kill plan: a RestartRun whose
    `recover_s` the caller fills in."""
    killed = work / "killed"
    killed.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ, **H.BASE_ENV, **(env or {}),
        "CHAOS_KILLED_DIR": str(killed),
        "CHAOS_RESTART_KILLS": ",".join(f"{rank}:{n}" for rank, n in plan),
    }  # fmt: skip
    started = time.monotonic()
    with open(work / "out.txt", "w+") as out, open(work / "err.txt", "w+") as err:
        p = subprocess.Popen(torchrun_argv(len(plan), program), stdout=out, stderr=err, env=env)
        try:
            rc = p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            H.kill_tree(p)  # torchrun and every worker it started
            rc = None
        err.seek(0)
        stderr = err.read()
    done = sorted(f.name for f in killed.iterdir()) == [f"generation{g}" for g in range(len(plan))]
    outcome = "hung" if rc is None else "ok" if rc == 0 and done else "lost"
    return RestartRun(outcome, time.monotonic() - started, stderr=stderr)


def kill_times(work: Path) -> list[float]:
    return sorted(f.stat().st_mtime for f in (work / "killed").iterdir())


def train_run(work: Path, data: Path, parallelism: str, plan, timeout_s: float, **training) -> RestartRun:
    """`mamba3lite train` of the chaos config under the kill plan; recovery: from each kill to the first
    training row of the next generation."""
    work.mkdir(parents=True, exist_ok=True)
    config = H.write_config(work / "config.yaml", data, work / "run", parallelism=parallelism, **training)
    hook = work / "hook"
    hook.mkdir(parents=True, exist_ok=True)
    (hook / "sitecustomize.py").write_text(TRAIN_KILL_HOOK)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")]))}
    run = run_with_kills(work, ["-m", "mamba3lite", "train", "--config", str(config)], plan, timeout_s, env)
    rows = [r for r in H.metrics_rows(work / "run") if r.get("kind") == "train"]
    for t in kill_times(work):
        after = [r["time"] for r in rows if r.get("time", 0) > t]
        if after:
            run.recover_s.append(min(after) - t)
    return run


def plain_run(work: Path, init: str, plan, timeout_s: float, group_timeout_s: float = 60.0) -> RestartRun:
    """The plain torch script under the kill plan, its groups made by `init` (torch or mamba3lite);
    recovery: from each kill to the next generation's last rank connected."""
    script = work / "plain.py"
    work.mkdir(parents=True, exist_ok=True)
    script.write_text(PLAIN)
    env = {"PLAIN_INIT": init, "PLAIN_TIMEOUT_S": str(group_timeout_s)}
    run = run_with_kills(work, [str(script)], plan, timeout_s, env)
    connected: dict[int, float] = {}
    for line in (work / "out.txt").read_text().splitlines():
        if line.startswith("connected "):
            _, gen, _, at = line.split()
            connected[int(gen)] = max(connected.get(int(gen), 0.0), float(at))
    for g, t in enumerate(kill_times(work)):
        if g + 1 in connected:
            run.recover_s.append(connected[g + 1] - t)
    return run


def final_state(run_dir: Path, step: int) -> tuple[dict, dict]:
    """(step `step`'s weights read in one process, {step: loss} of the train rows not superseded)."""
    from mamba3lite.checkpoint.run_dir import RunDir

    weights = RunDir(run_dir).load(step).model.state_dict()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in rows if r["kind"] == "train" and not r.get("superseded")}
    return weights, losses
