"""One fault during a run: restart-all (torchrun --max-restarts, resume from the last checkpoint) against
live fault tolerance (torchft replica groups, training.fault_tolerance), at G = 2 and 4 data-parallel
replicas on the CPU (gloo), the chaos config (tiny model, 32-token windows).

    python benchmarks/bench_fault_tolerance.py [--groups 2,4] [--steps 120] [--fault-at 30] [--save-every 20]

restart-all: one `torchrun --nproc_per_node G` DDP job; rank 1's worker is SIGKILLed once step FAULT_AT is
    logged, the job fails, and it is started again: every worker resumes from the newest checkpoint.
torchft: G replica groups, each `torchrun --nproc_per_node 1 --max-restarts 1`, and a lighthouse; group 1's
    worker is SIGKILLed once step FAULT_AT is logged; the others go on, the restarted one heals live.

Columns (one fault each):
    replica-steps lost  work of one replica for one step, thrown away or not done: restart-all, the steps
                        rolled back x G; torchft, the steps committed without the failed group (G - P each)
                        plus the attempts that did not commit (x the groups in them)
    back to full speed  seconds from the kill to the first step committed by all G replicas past the
                        step the fault interrupted
    wall                the whole run's seconds

Timing is the machine's: on a shared or loaded machine compare the two rows of one G, not across runs.
"""

from __future__ import annotations

import argparse
import os
import signal
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
    done_before = max(r["step"] for r in rows if r.get("kind") == "train" and r["time"] < killed)
    (resume,) = [r for r in rows if r.get("event") == "resume"]
    lost = (done_before - resume["step"]) * groups
    back = min(r["time"] for r in rows if r.get("kind") == "train" and not r.get("superseded")
               and r["time"] > killed and r["step"] > done_before) - killed  # fmt: skip
    return {"lost": lost, "back": back, "wall": wall}


def torchft(work: Path, data: Path, groups: int, steps: int, fault_at: int) -> dict:
    server = start_lighthouse("127.0.0.1", 0, min_replicas=1, join_timeout_ms=20000, heartbeat_timeout_ms=500)
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
                p.kill()
        wall = time.time() - t0
    finally:
        server.shutdown()
    run0 = work / "g0"
    runs = RunDir(run0).run_state(steps).replicas["participation"]
    trains = F.rows(run0, "train")
    interrupted = max((r["step"] for r in trains if r["time"] < killed), default=0)
    after = range(interrupted + 1, steps + 1)  # counted from the fault (a group that joined late at the
    # start, after the others' first steps, is the start's business, not the fault's)
    partial = sum(groups - len(F.participation_at(runs, s)) for s in after)
    uncommitted = len([r for r in F.rows(run0, "event", "uncommitted") if r["time"] >= killed])
    short = [s for s in after if len(F.participation_at(runs, s)) < groups]
    full = [s for s in after if s > max(short, default=interrupted)]
    back = None
    if short and full:  # back when every group commits again after the last step without one
        back = next(r["time"] for r in trains if r["step"] == full[0]) - killed
    return {"lost": partial + uncommitted * groups, "back": back, "wall": wall}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", default="2,4", help="replica counts to compare (comma-separated)")
    ap.add_argument("--steps", type=int, default=300, help="long enough for a restarted group to return")
    ap.add_argument("--fault-at", type=int, default=30, help="the fault comes once this step is logged")
    ap.add_argument("--save-every", type=int, default=20, help="restart-all's checkpoint interval")
    args = ap.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_ft_") as tmp:
        data = H.write_dataset(Path(tmp) / "data", n_train=40_000)
        for groups in (int(g) for g in args.groups.split(",")):
            for name, fn in (("restart-all", restart_all), ("torchft", torchft)):
                work = Path(tmp) / f"{name}_{groups}"
                work.mkdir()
                extra = (args.save_every,) if fn is restart_all else ()
                r = fn(work, data, groups, args.steps, args.fault_at, *extra)
                results.append((groups, name, r))
                print(f"done: {name} at {groups} replicas", file=sys.stderr, flush=True)
    every = args.save_every
    print(f"\nOne fault at step {args.fault_at} of {args.steps} (restart-all checkpoints every {every})\n")
    print("| replicas | mode | replica-steps lost | back to full speed (s) | wall (s) |")
    print("|---|---|---|---|---|")
    for groups, name, r in results:
        back = "never (the run ended first)" if r["back"] is None else f"{r['back']:.1f}"
        print(f"| {groups} | {name} | {r['lost']} | {back} | {r['wall']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
