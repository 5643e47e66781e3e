"""Fault-injection harness shared by tests/reliability/ and benchmarks/chaos.py.

Everything here drives the real system from outside, as a user's machine would: a tiny prepared dataset
written through `data/shards.py`, a tiny config file, `python -m mamba3lite train` in a subprocess that is
killed (SIGKILL), stopped (SIGTERM) or raced at chosen moments, and checks that read what is on disk.

Kill points are chosen by events, never by timing alone: "mid-save" waits until a model file of a new
step exists while its meta does not (the writer pauses between files under MAMBA3LITE_TEST_SLOW_SAVE),
"after step k" waits for the metrics row of step k. Random delays are used too, but a test's verdict
never depends on where they land: whatever the kill point, resume must end bit-for-bit at the reference.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

from mamba3lite.checkpoint import META_FORMAT, SLOW_SAVE_ENV, CheckpointManager
from mamba3lite.data import shards
from mamba3lite.rundir import checkpoint_files

VOCAB = 256  # a small vocabulary (the config allows any): a 50,257-row head would dominate the run time
EOS = 0
MAX_STEPS = 12
SAVE_EVERY = 2
EVAL_EVERY = 4
NAN_K = 3  # training.nan_guard_max_consecutive in the chaos config
# One process runs at a time and every process uses one thread: the same float reduction order in every
# run (the bit-for-bit comparison needs it) and no oversubscription on a small CI machine.
BASE_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
# A generous bound for anything that should take seconds: shared CI machines can be 10x slower.
PATIENCE_S = 240.0


# --------------------------------------------------------------------------------------------- data


def write_dataset(root: Path, *, n_train: int = 4000, n_val: int = 600, seed: int = 0) -> Path:
    """A prepared dataset (manifest + two train shards + one val shard, uint16) with a learnable
    pattern, written exactly as `prepare` writes it. Returns `root`."""
    root = Path(root)
    rng = np.random.default_rng(seed)
    parts = []
    for split, n in (("train", n_train // 2), ("train", n_train // 2), ("val", n_val)):
        tokens = (np.arange(n) * 7 + rng.integers(0, 3, n)) % (VOCAB - 1) + 1
        tokens[49::50] = EOS  # documents of 50 tokens, each ending with EOS
        parts.append((split, tokens, n // 50, 3 * n))
    shards.write_dataset(
        root, parts, vocab_size=VOCAB, eos_id=EOS, tokenizer={"name": "chaos-bytes", "vocab_hash": "ab" * 32}
    )
    return root


def config_dict(data_path: Path | str, run_dir: Path | str, **training) -> dict:
    """The chaos config: a 1-layer d_model-32 Mamba-3, 32-token windows, 2 x 2 windows per step,
    checkpoints every 2 steps (2 kept), evaluation every 4."""
    tc = {
        "max_seq_len": 32,
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "max_steps": MAX_STEPS,
        "lr": 3e-3,
        "min_lr": 3e-4,
        "warmup_steps": 2,
        "dtype": "fp32",
        "device": "cpu",
        "seed": 1234,
        "log_every": 1,
        "eval_every": EVAL_EVERY,
        "eval_batches": 2,
        "save_every": SAVE_EVERY,
        "keep_last_n": 2,
        "checkpoint_dir": str(run_dir),
        "nan_guard_max_consecutive": NAN_K,
        "max_rollbacks": 2,
        "progress": False,
        **training,
    }
    return {
        "model": {
            "vocab_size": VOCAB,
            "d_model": 32,
            "n_layers": 1,
            "d_intermediate": 64,
            "d_state": 8,
            "headdim": 16,
            "chunk_size": 16,
            "eos_id": EOS,
        },
        "training": tc,
        "data": {"train_data_path": str(data_path)},
    }


def write_config(path: Path, data_path: Path | str, run_dir: Path | str, **training) -> Path:
    Path(path).write_text(yaml.safe_dump(config_dict(data_path, run_dir, **training)), encoding="utf-8")
    return Path(path)


# ------------------------------------------------------------------------------------- processes


# `mamba3lite` with one observation point added: while Pretrainer.evaluate runs, the file EVAL_MARKER
# exists in the run directory (and evaluation pauses CHAOS_EVAL_PAUSE seconds first), so a test can send a
# signal from outside exactly during an evaluation. Nothing else changes.
EVAL_MARKER = "chaos_in_eval"
EVAL_DRIVER = f"""
import os, sys, time
from mamba3lite.train.trainer import Pretrainer
_evaluate = Pretrainer.evaluate
def evaluate(self):
    marker = self.run_dir / {EVAL_MARKER!r}
    marker.write_text(str(self.step))
    try:
        time.sleep(float(os.environ.get("CHAOS_EVAL_PAUSE", "0.5")))
        return _evaluate(self)
    finally:
        marker.unlink()
Pretrainer.evaluate = evaluate
from mamba3lite.cli import main
sys.exit(main(sys.argv[1:]))
"""


def train_argv(config: Path, *extra: str, eval_marker: bool = False) -> list[str]:
    entry = ["-c", EVAL_DRIVER] if eval_marker else ["-m", "mamba3lite"]
    return [sys.executable, *entry, "train", "--config", str(config), *extra]


def start_train(
    config: Path, *extra: str, env: dict | None = None, log_dir: Path, eval_marker: bool = False
) -> subprocess.Popen:
    """Start `mamba3lite train` in the background; stdout/stderr go to numbered files in `log_dir`
    (pipes could fill up and block the child while we wait for an event)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    n = len(list(log_dir.glob("*.out")))
    out = open(log_dir / f"{n:03d}.out", "w+", encoding="utf-8")  # noqa: SIM115 (closed in finish())
    err = open(log_dir / f"{n:03d}.err", "w+", encoding="utf-8")  # noqa: SIM115
    p = subprocess.Popen(
        train_argv(config, *extra, eval_marker=eval_marker),
        stdout=out,
        stderr=err,
        env={**os.environ, **BASE_ENV, **(env or {})},
    )
    p.log_files = (out, err)  # type: ignore[attr-defined]
    p.started_at = time.time()  # type: ignore[attr-defined]
    return p


def finish(p: subprocess.Popen, timeout: float = PATIENCE_S) -> tuple[int, str, str]:
    """Wait for the process (SIGKILL after `timeout`); returns (returncode, stdout, stderr)."""
    try:
        rc = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        rc = None
    texts = []
    for f in p.log_files:  # type: ignore[attr-defined]
        f.flush()
        f.seek(0)
        texts.append(f.read())
        f.close()
    assert rc is not None, (
        f"process did not finish within {timeout} s:\n{texts[0][-2000:]}\n{texts[1][-2000:]}"
    )
    return rc, texts[0], texts[1]


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children first), read from /proc while they run."""
    out: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            children = [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        for c in children:
            out += [c, *descendants(c)]
    return out


def kill_tree(p: subprocess.Popen) -> None:
    """SIGKILL `p` and every process below it, then reap `p`. torchrun starts each worker in a session of
    its own, so killing torchrun's process group (or torchrun alone) would leave its workers waiting in a
    collective, each for its timeout."""
    for pid in [*descendants(p.pid), p.pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    p.wait()


def run_train(config: Path, *extra: str, env: dict | None = None, timeout: float = PATIENCE_S):
    """Run `mamba3lite train` to completion; returns the CompletedProcess."""
    return subprocess.run(
        train_argv(config, *extra),
        env={**os.environ, **BASE_ENV, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def wait_until(
    predicate, p: subprocess.Popen | None = None, timeout: float = PATIENCE_S, poll: float = 0.005
):
    """Poll `predicate()` until it returns a truthy value (returned) or `p` exits / time runs out (None)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        if p is not None and p.poll() is not None:
            return None
        time.sleep(poll)
    return None


# ---------------------------------------------------------------------------------- observations


def metrics_rows(run_dir: Path) -> list[dict]:
    """Rows of metrics.jsonl; a torn last line (a kill mid-append) is skipped."""
    path = Path(run_dir) / "metrics.jsonl"
    out = []
    if not path.exists():
        return out
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def trained_step_since(run_dir: Path, since: float) -> int:
    """Highest step of a live (not superseded) train row written after `since` (unix time), else -1."""
    steps = [
        r["step"]
        for r in metrics_rows(run_dir)
        if r.get("kind") == "train" and not r.get("superseded") and r.get("time", 0) >= since
    ]
    return max(steps, default=-1)


def started_since(run_dir: Path, since: float) -> bool:
    """True once the trainer logged its "start" event (signal handlers installed) after `since`."""
    return any(
        r.get("kind") == "event" and r.get("event") == "start" and r.get("time", 0) >= since
        for r in metrics_rows(run_dir)
    )


def mid_save_step(run_dir: Path, since_ns: int) -> int | None:
    """A step whose model file was written after `since_ns` while its meta does not exist yet: the
    process is inside CheckpointManager.save (between files). None otherwise."""
    mgr = CheckpointManager(run_dir)
    for step in mgr.list_steps():
        files = checkpoint_files(run_dir, step)
        try:
            fresh = files["model"].stat().st_mtime_ns >= since_ns
        except FileNotFoundError:
            continue
        if fresh and not files["meta"].exists():
            return step
    return None


def latest_verified(run_dir: Path) -> tuple[int | None, list[str]]:
    """(newest loadable step, the warnings latest_step() gave on the way), as a resume would pick it."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = CheckpointManager(run_dir).latest_step()
    return step, [str(w.message) for w in caught]


def checkpoint_is_sound(run_dir: Path, step: int) -> bool:
    """The step's triple verifies (our format, sizes and sha256 of all three files) and its weights load."""
    mgr = CheckpointManager(run_dir)
    st = mgr.status(step)
    if not (st.verified and st.format == META_FORMAT):
        return False
    from safetensors.torch import load_file

    load_file(str(checkpoint_files(run_dir, step)["model"]))
    return True


def final_weights(run_dir: Path, step: int = MAX_STEPS) -> dict:
    from safetensors.torch import load_file

    return load_file(str(checkpoint_files(run_dir, step)["model"]))


def weights_identical(a: dict, b: dict) -> bool:
    """Same tensor names and torch.equal on every tensor (bit-for-bit on CPU fp32)."""
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def tree_hash(root: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under `root` (plus directories, as "<dir>"): compare before
    and after to prove that nothing on disk changed."""
    root = Path(root)
    out = {}
    if not root.exists():
        return out
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_symlink():  # a link a test made (to /dev/zero, say): its target is what must not change
            out[rel] = f"<link to {os.readlink(p)}>"
        elif p.is_dir():
            out[rel] = "<dir>"
        elif not p.is_file():  # a named pipe: reading it would block the test itself
            out[rel] = "<special file>"
        else:
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


# ------------------------------------------------------------------------------------- campaigns


@dataclass
class Trial:
    """One interruption of a campaign."""

    mode: str  # how the kill point was chosen: "mid-save", "after-step", "random", "eval"
    signal: str  # "SIGKILL" or "SIGTERM"
    hit: str  # what actually happened: "killed at ...", "finished before the signal", ...
    latest_before: int | None
    latest_after: int | None
    survived: bool  # the directory still resumes from a sound checkpoint, nothing damaged loaded
    data_lost: bool  # a verified checkpoint went backwards, or (SIGTERM) progress was not saved
    notes: list[str] = field(default_factory=list)
    exit_s: float | None = None  # seconds from the signal to the process's exit


@dataclass
class CampaignResult:
    trials: list[Trial]
    final_rc: int  # the worst exit code of the final (uninterrupted) run of each run directory
    final_identical: bool  # every run directory's final checkpoint equals the reference bit-for-bit
    segments: int  # run directories used: a new one starts when a run has reached max_steps
    resumes_checked: int  # resume events whose step we had verified beforehand
    bad_resumes: list[str]  # resume events from a step we had NOT seen as sound (must be empty)
    stderr_warnings: list[str]  # warning lines that named a bad checkpoint file on resume


def _resume_steps_since(run_dir: Path, since: float) -> list[int]:
    import re

    steps = []
    for r in metrics_rows(run_dir):
        if r.get("kind") == "event" and r.get("event") == "resume" and r.get("time", 0) >= since:
            m = re.search(r"resumed from step (\d+)", r.get("message", ""))
            if m:
                steps.append(int(m.group(1)))
    return steps


def interrupt_campaign(
    work: Path,
    config: Path,
    run_dir: Path,
    reference: dict,
    *,
    trials: int,
    rng: random.Random,
    sig: int = signal.SIGKILL,
    modes: tuple[str, ...] = ("mid-save", "after-step", "random"),
    slow_save_s: float = 0.3,
    log=print,
) -> CampaignResult:
    """Start / interrupt / resume `trials` times, then run to the end and compare the final weights with
    `reference`. The runs live in run_dir/seg0, seg1, ...: once a run has reached max_steps, it is
    finished and checked and the next trial starts a new run (so no trial is wasted on a finished run).
    Modes cycle in order (every mode is exercised even with few trials); the concrete step or delay of
    each is drawn from `rng`."""
    out: list[Trial] = []
    resumes_checked, bad_resumes, stderr_warnings = 0, [], []
    finals: list[tuple[int, bool]] = []
    logs = work / "logs"
    base_dir, seg = run_dir, 0

    def finish_segment(run_dir: Path, sound_steps: set[int]) -> None:
        nonlocal resumes_checked, stderr_warnings
        last, _ = latest_verified(run_dir)
        if last is not None and checkpoint_is_sound(run_dir, last):
            sound_steps.add(last)
        since = time.time()
        final = run_train(config, "--checkpoint-dir", str(run_dir))
        for s in _resume_steps_since(run_dir, since):
            resumes_checked += 1
            if s not in sound_steps:
                bad_resumes.append(f"final run: resumed from step {s}, not seen verified before the run")
        stderr_warnings += [ln for ln in final.stderr.splitlines() if "not usable" in ln]
        identical = final.returncode == 0 and weights_identical(final_weights(run_dir), reference)
        if final.returncode != 0:
            log(final.stderr[-3000:])
        finals.append((final.returncode, identical))

    run_dir = base_dir / "seg0"
    sound_steps: set[int] = set()
    for t in range(trials):
        mode = modes[t % len(modes)]
        before, _ = latest_verified(run_dir)
        if before == MAX_STEPS:  # this run is over: check it, start the next one
            finish_segment(run_dir, sound_steps)
            seg += 1
            run_dir, sound_steps = base_dir / f"seg{seg}", set()
            before = None
        if before is not None:
            assert checkpoint_is_sound(run_dir, before)
            sound_steps.add(before)
        env = {SLOW_SAVE_ENV: str(slow_save_s)} if mode == "mid-save" else {}
        since, since_ns = time.time(), time.time_ns()
        p = start_train(
            config, "--checkpoint-dir", str(run_dir), env=env, log_dir=logs, eval_marker=mode == "eval"
        )
        hit = ""
        if mode == "mid-save":
            step = wait_until(lambda t0=since_ns, d=run_dir: mid_save_step(d, t0), p)
            hit = f"inside the save of step {step}" if step is not None else ""
        elif mode == "after-step":
            # Past the next checkpoint (so the campaign progresses) and short of the end (so later
            # trials still have a run to interrupt).
            first = min((before or 0) + SAVE_EVERY + 1, MAX_STEPS - 1)
            k = rng.randint(first, max(first, min(first + 2, MAX_STEPS - 1)))
            got = wait_until(lambda t0=since, k=k, d=run_dir: trained_step_since(d, t0) >= k, p)
            if got:
                time.sleep(rng.uniform(0.0, 0.05))
                hit = f"after step {trained_step_since(run_dir, since)} was logged (aimed at {k})"
        elif mode == "eval":
            marker = run_dir / EVAL_MARKER
            if wait_until(marker.exists, p):
                time.sleep(rng.uniform(0.0, 0.2))  # the evaluation pauses 0.5 s first: still inside it
                hit = f"during the evaluation at step {trained_step_since(run_dir, since)}"
        else:  # "random": anywhere from interpreter start-up on (SIGKILL) or after the start event (SIGTERM)
            if sig == signal.SIGTERM:
                wait_until(lambda t0=since, d=run_dir: started_since(d, t0), p)
            time.sleep(rng.uniform(0.0, 8.0 if sig == signal.SIGKILL else 1.0))
            hit = f"{time.time() - since:.2f} s after launch"
        if p.poll() is None and hit:
            p.send_signal(sig)
            sent_at = time.time()
        else:
            hit = hit or "finished before the signal"
            sent_at = None
        rc, _stdout, stderr = finish(p)
        exit_s = None if sent_at is None else time.time() - sent_at
        stderr_warnings += [ln for ln in stderr.splitlines() if "not usable" in ln]
        for s in _resume_steps_since(run_dir, since):
            resumes_checked += 1
            if s not in sound_steps:
                bad_resumes.append(f"trial {t}: resumed from step {s}, not seen verified before the run")
        after, warns = latest_verified(run_dir)
        notes = [w[:200] for w in warns]
        survived = after is None or checkpoint_is_sound(run_dir, after)
        lost = before is not None and (after is None or after < before)
        if sig == signal.SIGTERM and sent_at is not None:
            # Preemption contract: exit 0, in bounded time, with a checkpoint of the last step trained.
            last = trained_step_since(run_dir, since)
            elapsed = exit_s
            ok = rc == 0 and "Traceback" not in stderr and after is not None and after >= last
            notes.append(f"rc={rc} after {elapsed:.1f} s; last step logged {last}, latest checkpoint {after}")
            survived = survived and ok
            lost = lost or after is None or after < last
        elif sent_at is None and rc != 0:
            survived = False
            notes.append(f"rc={rc}: {stderr.strip().splitlines()[-1:] if stderr.strip() else ''}")
        trial = Trial(mode, signal.Signals(sig).name, hit, before, after, survived, lost, notes, exit_s)
        log(
            f"  trial {t:2d} seg{seg} {mode:10s} {trial.signal}: {hit}; latest {before} -> {after}; "
            f"survived={survived}" + ("" if survived and not lost else f"; {notes}")
        )
        out.append(trial)
    finish_segment(run_dir, sound_steps)
    return CampaignResult(
        out,
        max(rc for rc, _ in finals),
        all(same for _, same in finals),
        len(finals),
        resumes_checked,
        bad_resumes,
        stderr_warnings,
    )


def summary_table(rows: list[tuple[str, int, int, int]]) -> str:
    """The issue's table: scenario, trials, survived, data lost."""
    head = f"| {'scenario':<44} | {'trials':>6} | {'survived':>8} | {'data lost':>9} |"
    sep = f"|{'-' * 46}|{'-' * 8}|{'-' * 10}|{'-' * 11}|"
    body = [f"| {s:<44} | {n:>6} | {ok:>8} | {lost:>9} |" for s, n, ok, lost in rows]
    return "\n".join([head, sep, *body])
