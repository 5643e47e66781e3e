"""One fault during a run: restart-all (torchrun --max-restarts, resume from the last checkpoint) against
live fault tolerance (torchft replica groups, training.fault_tolerance), at G = 2 and 4 data-parallel
replicas on the CPU (gloo), the chaos config (tiny model, 32-token windows).

    python benchmarks/bench_fault_tolerance.py [--groups 2,4] [--steps 1500] [--fault-at 30]
        [--save-every 20] [--step-time 1.0] [--work-dir DIR]

restart-all: one `torchrun --nproc_per_node G` DDP job; rank 1's worker is SIGKILLed once step FAULT_AT is
    logged, the job fails, and it is started again: every worker resumes from the newest checkpoint.
torchft: G replica groups, each `torchrun --nproc_per_node 1 --max-restarts 1`, and a lighthouse; group 1's
    worker is SIGKILLed once step FAULT_AT is logged; the others go on, the restarted one heals live.

Columns (one fault each; times from the kill):
    step (ms)           a step's time here before the fault (median): this tiny model's, ~10 ms
    healthy stalled     seconds until a replica that did not fail commits a new step (restart-all: every
                        replica waits for the restart and redoes the rolled-back steps)
    all back            seconds until all G replicas commit a step past the one the fault interrupted
    rolled back         steps whose work was thrown away (restart-all: back to the checkpoint; torchft:
                        the attempt the fault interrupted, which did not commit)
    replica-s lost      replica-seconds without new progress: restart-all G x all back; torchft
                        (G - 1) x healthy stalled + all back (the failed group, absent until it is back)
                        + G x rolled x a step here (the interrupted attempt)
    replica-steps lost  the same in steps of one replica: here (/ this step time), and at --step-time
                        (a realistic model's step): the restart, quorum and heal seconds stay what they were
                        here (they do not scale with the step), each rolled-back step costs a step;
                        restart-all G x (all back - rolled x step + rolled x T), torchft
                        ((G - 1) x healthy stalled + all back) + G x rolled x T, over T

Why seconds: a step here is ~10 ms, so a 3 s restart is hundreds of steps, and a count of steps alone
says more about this model's size than about the mode. Timing is the machine's: on a shared or loaded
machine compare the two rows of one G, not across runs. The run must be long enough that the failed group
is back before it ends (`--steps`); a row that says "never" measured no return.
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "reliability"))

import chaos_harness as H
import ft_harness as F
import yaml

from mamba3lite.checkpoint.run_dir import RunDir
from mamba3lite.train.parallel.lighthouse import start_lighthouse

# the lighthouse's: how soon a dead group leaves the quorum, and how long a quorum waits for a group that
# heartbeats but has not joined (a survivor still blocked in the collective the dead group left; defaults 5 s)
HEARTBEAT_TIMEOUT_MS, JOIN_TIMEOUT_MS = 500, 1000


def step_s(trains: list[dict], before: float) -> float:
    """The median seconds between consecutive committed steps logged before `before` (the first 5 skipped,
    start-up, when there are enough)."""
    times = [r["time"] for r in sorted(trains, key=lambda r: r["step"]) if r["time"] < before]
    return statistics.median(b - a for a, b in itertools.pairwise(times[5:] if len(times) > 10 else times))


def restart_all(work: Path, data: Path, groups: int, steps: int, fault_at: int, save_every: int) -> dict:
    run = work / "run"
    batch = {"gradient_accumulation_steps": None, "global_batch_size": 2 * groups}
    cfg = H.config_dict(data, run, max_steps=steps, save_every=save_every, keep_last_n=2, eval_every=0,
                        parallelism="ddp", **batch)  # fmt: skip
    config = work / "ddp.yaml"
    config.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(groups),
    ]
    argv = [*torchrun, "-m", "mamba3lite", "train", "--config", str(config)]
    env = {**os.environ, **H.BASE_ENV}
    t0 = time.time()
    with open(work / "ddp.log", "w", encoding="utf-8") as log:
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        assert H.wait_until(lambda: H.trained_step_since(run, 0) >= fault_at, p), log.name
        children = Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()
        os.kill(int(sorted(children, key=int)[1]), signal.SIGKILL)  # a worker other than rank 0's
        killed = time.time()
        assert p.wait(timeout=H.PATIENCE_S) != 0  # the job fails as a whole ...
        # ... and is started again, every worker resuming from the newest checkpoint: what torchrun
        # --max-restarts does, here from outside (a gloo job restarted in place by the agent sometimes fails
        # its first connect on a loaded machine, which would measure the machine, not the mode)
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        assert p.wait(timeout=H.PATIENCE_S * 2) == 0, (work / "ddp.log").read_text()[-3000:]
    wall = time.time() - t0
    rows = H.metrics_rows(run)
    trains = [r for r in rows if r.get("kind") == "train"]
    done_before = max(r["step"] for r in trains if r["time"] < killed)
    (resume,) = [r for r in rows if r.get("event") == "resume"]
    rolled = done_before - resume["step"]
    back = min(r["time"] for r in trains if not r.get("superseded") and r["time"] > killed
               and r["step"] > done_before) - killed  # fmt: skip
    step = step_s(trains, killed)
    return {"step_s": step, "stalled": back, "back": back, "rolled": rolled, "wall": wall,
            "fixed_s": groups * max(back - rolled * step, 0.0), "per_step": groups * rolled}  # fmt: skip


def torchft(work: Path, data: Path, groups: int, steps: int, fault_at: int) -> dict:
    server = start_lighthouse("127.0.0.1", 0, min_replicas=1, join_timeout_ms=JOIN_TIMEOUT_MS,
                              heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)  # fmt: skip
    try:
        batch = {"gradient_accumulation_steps": None, "global_batch_size": 2 * groups}
        configs = [F.group_config(data, work, g, groups, server.address(), max_steps=steps, save_every=steps,
                                  **batch) for g in range(groups)]  # fmt: skip
        t0 = time.time()
        procs = [F.start_group(c, work / f"g{g}.log") for g, c in enumerate(configs)]
        try:
            assert H.wait_until(lambda: H.trained_step_since(work / "g1", 0) >= fault_at, procs[1])
            killed = F.kill_worker(procs[1])
            for g, p in enumerate(procs):
                assert p.wait(timeout=H.PATIENCE_S * 2) == 0, (work / f"g{g}.log").read_text()[-3000:]
        finally:
            for p in procs:
                F.stop_group(p)
        wall = time.time() - t0
    finally:
        server.shutdown()
    run0 = work / "g0"  # a group that did not fail: its checkpoint records every step's participants
    runs = RunDir(run0).run_state(steps).replicas["participation"]
    trains = F.rows(run0, "train")
    # the step the fault interrupted: the one after the failed group's last (its rows of before the restart,
    # superseded since); by step, not by time (a healthy group logs the step the failed one committed just
    # before the kill a moment after it)
    interrupted = max(r["step"] for r in H.metrics_rows(work / "g1") if r.get("kind") == "train"
                      and r["time"] < killed) + 1  # fmt: skip
    after = [r for r in trains if r["step"] >= interrupted]
    stalled = min(r["time"] for r in after) - killed if after else None
    full = [r["time"] for r in after if len(F.participation_at(runs, r["step"])) == groups]
    back = min(full) - killed if full else None  # None: the failed group was not back before the end
    rolled = len([r for r in F.rows(run0, "event", "uncommitted") if r["time"] >= killed])
    healed = F.rows(work / "g1", "event", "heal")
    return {"step_s": step_s(trains, killed), "stalled": stalled, "back": back, "rolled": rolled,
            "wall": wall, "fixed_s": None if back is None else (groups - 1) * stalled + back,
            "per_step": groups * rolled, "heal_s": healed[-1]["heal_s"] if healed else None}  # fmt: skip


def lost(r: dict, step: float) -> tuple[float | None, float | None]:
    """(replica-seconds, replica-steps) lost at a step of `step` seconds (see the module docstring)."""
    if r["fixed_s"] is None or step <= 0:
        return None, None
    seconds = r["fixed_s"] + r["per_step"] * step
    return seconds, seconds / step


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", default="2,4", help="replica counts to compare (comma-separated)")
    ap.add_argument("--steps", type=int, default=1500, help="long enough for a restarted group to return")
    ap.add_argument("--fault-at", type=int, default=30, help="the fault comes once this step is logged")
    ap.add_argument("--save-every", type=int, default=20, help="restart-all's checkpoint interval")
    ap.add_argument("--step-time", type=float, default=1.0, help="a realistic step's seconds, for the "
                    "replica-steps lost at it")  # fmt: skip
    ap.add_argument("--work-dir", type=Path, help="keep the runs (logs, metrics.jsonl, checkpoints) here "
                    "(default: a temporary directory, removed)")  # fmt: skip
    args = ap.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_ft_") as tmp:
        root = Path(tmp) if args.work_dir is None else args.work_dir
        root.mkdir(parents=True, exist_ok=True)
        data = H.write_dataset(root / "data", n_train=40_000)
        for groups in (int(g) for g in args.groups.split(",")):
            for name, fn in (("restart-all", restart_all), ("torchft", torchft)):
                work = root / f"{name}_{groups}"
                work.mkdir()
                extra = (args.save_every,) if fn is restart_all else ()
                r = fn(work, data, groups, args.steps, args.fault_at, *extra)
                results.append((groups, name, r))
                print(f"done: {name} at {groups} replicas", file=sys.stderr, flush=True)
    every, t = args.save_every, args.step_time
    print(f"\nOne fault at step {args.fault_at} of {args.steps} (restart-all checkpoints every {every}); "
          f"times in seconds from the kill; the lighthouse's heartbeat timeout {HEARTBEAT_TIMEOUT_MS} ms, "
          f"join timeout {JOIN_TIMEOUT_MS} ms (the healthy groups' stall under torchft is at most about "
          "their sum)\n")  # fmt: skip
    print(f"| replicas | mode | step (ms) | healthy stalled (s) | all back (s) | rolled back | replica-s "
          f"lost | replica-steps lost here / at {t:g} s per step | wall (s) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    never = "never (the run ended first)"
    for groups, name, r in results:
        (seconds, here), (_, there) = lost(r, r["step_s"]), lost(r, t)
        stalled = never if r["stalled"] is None else f"{r['stalled']:.1f}"
        back = never if r["back"] is None else f"{r['back']:.1f}"
        cost = "-" if seconds is None else f"{seconds:.1f}"
        steps = "-" if here is None else f"{here:,.0f} / {there:,.1f}"
        print(f"| {groups} | {name} | {r['step_s'] * 1000:.0f} | {stalled} | {back} | {r['rolled']} | {cost} "
              f"| {steps} | {r['wall']:.1f} |")  # fmt: skip
    heals = [f"{g} groups {r['heal_s']:.2f} s" for g, n, r in results if r.get("heal_s") is not None]
    print(f"\ntorchft heal (the joiner's quorum with the live transfer): {', '.join(heals) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
