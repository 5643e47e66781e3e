"""Chaos campaign: kill -9 / resume (and SIGTERM, damaged checkpoints, a busy run directory) against real
`mamba3lite train` processes, then the summary table: scenario, trials, survived, data lost.

    python benchmarks/chaos.py                       # 20 kill -9 trials, 8 SIGTERM trials, the rest
    python benchmarks/chaos.py --kill-trials 100 --sigterm-trials 0 --no-corruption --no-lock
    python benchmarks/chaos.py --restart-trials 20   # killed workers under torchrun --max-restarts only

A kill -9 trial "survives" when the run directory still resumes from a verified checkpoint (never a
damaged one); "data lost" counts trials after which the newest verified checkpoint went backwards, plus
one if the campaign's final weights differ from an uninterrupted run (torch.equal on every tensor).
A SIGTERM trial survives when the process exits 0 with a verified checkpoint of the last step it trained.
A damaged-checkpoint trial survives when the damage is detected and the newest good step is chosen with
a warning naming the file. Everything uses the harness of tests/reliability (the same code the tests run).

--restart-trials N runs the restart campaign instead: 2 workers under `torchrun --max-restarts K` with K
planned SIGKILLs (rank 1, then rank 0, at seeded steps), N times each for the plain torch script whose
groups come from mamba3lite's init_distributed, and for `mamba3lite train` under fsdp and under ddp; and
--control-trials times for the same plain script on torch's own init_process_group (the reproduction of
the hang). Each run ends ok, lost (torchrun gave up: a restart went to a generation that could not form
its group) or hung (nothing ended within --restart-timeout); the table counts them, the seconds from each
kill to the next generation's first work, and (train) the runs whose final weights equal the
uninterrupted run's.
"""

from __future__ import annotations

import argparse
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "reliability"))

import chaos_harness as H


def _campaign(work: Path, data: Path, reference: dict, trials: int, sig: int, modes, seed: int):
    config = H.write_config(work / "config.yaml", data, work / "run")
    res = H.interrupt_campaign(
        work, config, work / "run", reference, trials=trials, rng=random.Random(seed), sig=sig, modes=modes
    )
    survived = sum(t.survived for t in res.trials) - len(res.bad_resumes)
    lost = sum(t.data_lost for t in res.trials) + (not res.final_identical)
    hits: dict[str, int] = {}
    for t in res.trials:
        key = t.mode if t.hit and not t.hit.startswith("finished") else f"{t.mode} (missed: run ended)"
        hits[key] = hits.get(key, 0) + 1
    return len(res.trials), survived, lost, hits, res


def _corruption(work: Path, data: Path, flips: int, seed: int) -> tuple[int, int, int]:
    """Damage the newest of two checkpoints in every way; count detections (fallback to step 2 with a
    warning naming the file)."""
    base = work / "base"
    config = H.write_config(work / "base.yaml", data, base, max_steps=4, eval_every=0, keep_last_n=0)
    r = H.run_train(config)
    assert r.returncode == 0, r.stderr
    from mamba3lite.rundir import checkpoint_files

    rng = random.Random(seed)
    damages = []
    for kind in ("model", "optim", "meta"):
        damages += [(kind, "truncate"), (kind, "delete")] + [(kind, f"flip{i}") for i in range(flips)]
    n = ok = lost = 0
    for i, (kind, how) in enumerate(damages):
        run = work / f"d{i}"
        shutil.copytree(base, run)
        path = checkpoint_files(run, 4)[kind]
        if how == "truncate":
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        elif how == "delete":
            path.unlink()
        else:
            b = bytearray(path.read_bytes())
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
            path.write_bytes(bytes(b))
        step, warns = H.latest_verified(run)
        n += 1
        ok += step == 2 and any(path.name in w for w in warns)
        lost += step == 4  # the damaged step would have been resumed
        shutil.rmtree(run)
    return n, ok, lost


def _lock(work: Path, data: Path, reference: dict) -> tuple[int, int, int]:
    import os

    from mamba3lite.checkpoint import SLOW_SAVE_ENV

    run = work / "run"
    config = H.write_config(work / "config.yaml", data, run)
    since_ns = time.time_ns()
    first = H.start_train(config, env={SLOW_SAVE_ENV: "0.2"}, log_dir=work / "logs")
    step = H.wait_until(lambda: H.mid_save_step(run, since_ns), first)
    os.kill(first.pid, signal.SIGSTOP)
    before = H.tree_hash(run)
    second = H.run_train(config)
    untouched = H.tree_hash(run) == before
    os.kill(first.pid, signal.SIGCONT)
    rc, _, _ = H.finish(first)
    refused = second.returncode != 0 and "in use by another trainer" in second.stderr
    unharmed = rc == 0 and H.weights_identical(H.final_weights(run), reference)
    return 1, int(step is not None and refused and untouched and unharmed), int(not unharmed)


def _restart_campaign(work: Path, data: Path, args) -> str:
    """The restart table (see the module docstring)."""
    import statistics

    import restart_harness as R

    train = {
        "max_steps": 18,
        "save_every": 3,
        "eval_every": 6,
        "dist_init_timeout_s": 60.0,
        "watchdog_s": 60.0,
    }
    references = {}
    for par in ("fsdp", "ddp"):
        R.train_run(work / f"ref-{par}", data, par, [], args.restart_timeout, **train)
        references[par] = R.final_state(work / f"ref-{par}" / "run", 18)
    scenarios = [("plain torch script, torch's init_process_group", "torch", args.control_trials),
                 ("plain torch script, mamba3lite's init_distributed", "mamba3lite", args.restart_trials),
                 ("mamba3lite train, fsdp", "fsdp", args.restart_trials),
                 ("mamba3lite train, ddp", "ddp", args.restart_trials)]  # fmt: skip
    head = "| scenario | runs | kills per run | ok | lost | hung | recover s median (max) | final bit-equal |"
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for name, kind, n in scenarios:
        plain = kind in ("torch", "mamba3lite")
        kills = 3 if plain else 2
        runs, equal = [], 0
        for i in range(n):
            where = work / f"{kind}-{i}"
            plan = R.kill_plan(args.seed + i, kills, most=10 if plain else 6)
            if plain:
                run = R.plain_run(where, kind, plan, args.restart_timeout)
            else:
                run = R.train_run(where, data, kind, plan, args.restart_timeout, **train)
                if run.outcome == "ok":
                    w, losses = R.final_state(where / "run", 18)
                    equal += H.weights_identical(w, references[kind][0]) and losses == references[kind][1]
            print(f"  {name} #{i}: {run.outcome} in {run.seconds:.0f} s, kills {plan}", flush=True)
            runs.append(run)
        rec = [s for r in runs for s in r.recover_s]
        recover = f"{statistics.median(rec):.1f} ({max(rec):.1f})" if rec else "-"
        ok, lost, hung = (sum(r.outcome == o for r in runs) for o in ("ok", "lost", "hung"))
        bit = "-" if plain else f"{equal}/{n}"
        lines.append(f"| {name} | {n} | {kills} | {ok} | {lost} | {hung} | {recover} | {bit} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kill-trials", type=int, default=20, help="kill -9 / resume trials (default 20)")
    ap.add_argument("--sigterm-trials", type=int, default=8, help="SIGTERM / resume trials (default 8)")
    ap.add_argument(
        "--flips",
        type=int,
        default=10,
        help="random bit flips (one bit of one byte each) per checkpoint file (default 10)",
    )
    ap.add_argument("--no-corruption", action="store_true", help="skip the damaged-checkpoint scenario")
    ap.add_argument("--no-lock", action="store_true", help="skip the two-trainers scenario")
    ap.add_argument("--restart-trials", type=int, default=0, help="run the restart campaign, N runs each")
    ap.add_argument("--control-trials", type=int, default=5, help="restart campaign: torch's own init runs")
    ap.add_argument("--restart-timeout", type=float, default=120.0, help="restart campaign: seconds per run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", help="keep everything here (default: a temporary directory, removed)")
    args = ap.parse_args()

    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="mamba3lite-chaos-")
    work = Path(args.workdir or tmp.name)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    data = H.write_dataset(work / "data")
    if args.restart_trials:
        print(_restart_campaign(work, data, args))
        print(f"total {time.time() - t0:.0f} s")
        return 0
    config = H.write_config(work / "reference.yaml", data, work / "reference")
    r = H.run_train(config)
    if r.returncode != 0:
        print(r.stderr, file=sys.stderr)
        return 1
    reference = H.final_weights(work / "reference")
    print(f"reference: {H.MAX_STEPS} uninterrupted steps of the chaos config ({time.time() - t0:.0f} s)")

    rows, notes = [], []
    if args.kill_trials:
        print(f"kill -9 campaign: {args.kill_trials} trials")
        (work / "kill").mkdir()
        n, ok, lost, hits, res = _campaign(
            work / "kill",
            data,
            reference,
            args.kill_trials,
            signal.SIGKILL,
            ("mid-save", "after-step", "random"),
            args.seed,
        )
        rows.append(("kill -9 at random moments, then resume", n, ok, lost))
        notes.append(
            f"kill -9: kill points {hits}; {res.segments} runs of {H.MAX_STEPS} steps, each final checkpoint "
            f"bit-for-bit equal to the uninterrupted reference: {res.final_identical}"
        )
    if args.sigterm_trials:
        print(f"SIGTERM campaign: {args.sigterm_trials} trials")
        (work / "term").mkdir()
        n, ok, lost, hits, res = _campaign(
            work / "term",
            data,
            reference,
            args.sigterm_trials,
            signal.SIGTERM,
            ("mid-save", "eval", "after-step", "random"),
            args.seed + 1000,
        )
        rows.append(("SIGTERM (save, eval, step, random), resume", n, ok, lost))
        exits = [t.exit_s for t in res.trials if t.exit_s is not None]
        notes.append(
            f"SIGTERM: signal points {hits}; {res.segments} runs, each final checkpoint bit-for-bit equal to "
            f"the reference: {res.final_identical}; exit within {max(exits, default=0):.1f} s of the signal"
        )
    if not args.no_corruption:
        print("damaged checkpoints")
        (work / "corrupt").mkdir()
        rows.append(
            (
                "damaged newest checkpoint (3 files)",
                *_corruption(work / "corrupt", data, args.flips, args.seed),
            )
        )
    if not args.no_lock:
        print("two trainers on one directory")
        (work / "lock").mkdir()
        rows.append(("second trainer on a busy run directory", *_lock(work / "lock", data, reference)))

    print()
    print(H.summary_table(rows))
    print()
    for line in notes:
        print(line)
    print(f"total {time.time() - t0:.0f} s")
    if tmp is not None:
        tmp.cleanup()
    return 0 if all(ok == n and lost == 0 for _, n, ok, lost in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
