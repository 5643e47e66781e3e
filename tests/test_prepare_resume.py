"""Resume: an interrupted `prepare` re-run with the same arguments equals an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from mamba3lite.data import prepare as P
from mamba3lite.data import staging
from mamba3lite.data.shards import verify_dataset
from test_prepare_helpers import tree_hashes


def _corpus(tmp_path) -> list:
    """Two sources with duplicates across them, so cursors, dedup set and both splits all matter."""
    a = [f"alpha {i}: " + "words " * (4 + i % 9) for i in range(120)]
    b = [f"beta {i}: " + "tokens " * (3 + i % 5) for i in range(80)] + a[::10]  # 12 duplicates of alpha
    for name, texts in (("a", a), ("b", b)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return [P.SourceSpec(str(tmp_path / "a.jsonl"), 2.0), P.SourceSpec(str(tmp_path / "b.jsonl"), 1.0)]


KW = {"workers": 0, "shard_tokens": 120, "val_fraction": 0.25, "min_chars": 1}


class _Interrupt(BaseException):
    pass


def _interrupt_after(monkeypatch, n_snapshots: int) -> None:
    """Interrupt the run right after its n-th snapshot; snapshots after every shard (no time throttle)."""
    monkeypatch.setattr(P, "SNAPSHOT_MIN_INTERVAL_S", 0.0)
    original = P._Run._snapshot
    count = [0]

    def snapshot(self):
        original(self)
        count[0] += 1
        if count[0] == n_snapshots:
            raise _Interrupt

    monkeypatch.setattr(P._Run, "_snapshot", snapshot)


def _prepare_interrupted(monkeypatch, n_snapshots: int, sources, out, **kw) -> None:
    """A prepare of `sources` into `out` interrupted right after its n-th snapshot."""
    with monkeypatch.context() as m:
        _interrupt_after(m, n_snapshots)
        with pytest.raises(_Interrupt):
            P.prepare(sources, out, **{**KW, **kw})


@pytest.mark.parametrize("n_snapshots", [1, 5, 17])
def test_resume_after_interruption_equals_uninterrupted_run(tmp_path, monkeypatch, n_snapshots):
    sources = _corpus(tmp_path)
    ref = P.prepare(sources, tmp_path / "ref", **KW)
    assert len(ref.manifest.shards) > 20
    out = tmp_path / "ds"
    _prepare_interrupted(monkeypatch, n_snapshots, sources, out)
    stage = out / staging.STAGE_DIRNAME
    assert (stage / staging.STATE_NAME).is_file() and not (out / "manifest.json").exists()
    state = json.loads((stage / staging.STATE_NAME).read_text())
    # What a write killed mid-way (SIGKILL, power loss) leaves behind; the finished dataset must not carry it.
    (stage / "train").mkdir(exist_ok=True)
    (stage / "train" / ".shard_99999.bin.x1y2z3.tmp").write_bytes(b"half a shard")
    resumed = P.prepare(sources, out, **KW)
    # The shards the snapshot had written are kept; those it had sent to be written are written again.
    assert resumed.resumed_shards == len(state["shards"]) and (n_snapshots == 1 or resumed.resumed_shards)
    assert state["queued"] or n_snapshots > 1  # the first snapshot comes before its shard is written
    assert tree_hashes(out) == tree_hashes(tmp_path / "ref")


def test_stale_or_damaged_state_starts_afresh(tmp_path, monkeypatch, capsys):
    sources = _corpus(tmp_path)
    P.prepare(sources, tmp_path / "ref", **KW)
    out = tmp_path / "ds"
    _prepare_interrupted(monkeypatch, 4, sources, out)
    shard = out / staging.STAGE_DIRNAME / "train" / "shard_00001.bin"
    shard.write_bytes(shard.read_bytes()[:-2])  # a damaged shard: resuming would be wrong
    s = P.prepare(sources, out, **KW)
    assert s.resumed_shards == 0 and "does not verify" in capsys.readouterr().err
    assert tree_hashes(out) == tree_hashes(tmp_path / "ref")
    # A state from other arguments is not resumed either.
    _prepare_interrupted(monkeypatch, 4, sources, tmp_path / "ds2", seed=1)
    s = P.prepare(sources, tmp_path / "ds2", **KW)
    assert s.resumed_shards == 0 and "arguments differ" in capsys.readouterr().err
    assert tree_hashes(tmp_path / "ds2") == tree_hashes(tmp_path / "ref")

    # Nor one whose source files changed since (here: touched).
    _prepare_interrupted(monkeypatch, 4, sources, tmp_path / "ds3")
    src = tmp_path / "a.jsonl"
    os.utime(src, ns=(src.stat().st_atime_ns, src.stat().st_mtime_ns + 1_000_000_000))
    s = P.prepare(sources, tmp_path / "ds3", **KW)
    assert s.resumed_shards == 0 and "source files changed" in capsys.readouterr().err
    assert tree_hashes(tmp_path / "ds3") == tree_hashes(tmp_path / "ref")


def _huge_int_state(stage):
    (stage / staging.STATE_NAME).write_text('{"snapshot": ' + "9" * 5000 + "}")


def _nested_state(stage):
    (stage / staging.STATE_NAME).write_text("[" * 100_000)


def _unit_tokens_are_a_pipe(stage):
    """A unit whose tokens a partly filled shard names, its token file swapped for a pipe."""
    state = json.loads((stage / staging.STATE_NAME).read_text())
    key = next(piece[0] for packer in state["packers"] for piece in packer["pieces"])
    tokens = stage / "units" / f"{key}.tok"
    tokens.unlink()
    os.mkfifo(tokens)


def _seen_is_dev_zero(stage):
    (stage / staging.SEEN_NAME).unlink()
    (stage / staging.SEEN_NAME).symlink_to("/dev/zero")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs a named pipe")
@pytest.mark.parametrize(
    "damage", [_huge_int_state, _nested_state, _unit_tokens_are_a_pipe, _seen_is_dev_zero]
)
def test_a_staging_record_that_does_not_read_is_not_restored_and_never_blocks(
    tmp_path, monkeypatch, capsys, damage
):
    """prepare's own records go through the border reader too: a state.json of a 5,000-digit number or
    deep nesting, a staged file swapped for a pipe or a link to /dev/zero are not resumed from (no
    traceback, no hang, no endless read): the run starts afresh and equals an uninterrupted one."""
    sources = _corpus(tmp_path)
    P.prepare(sources, tmp_path / "ref", **KW)
    out = tmp_path / "ds"
    _prepare_interrupted(monkeypatch, 3, sources, out)
    damage(out / staging.STAGE_DIRNAME)
    s = P.prepare(sources, out, **KW)
    assert s.resumed_shards == 0 and "not resuming" in capsys.readouterr().err.lower()
    assert tree_hashes(out) == tree_hashes(tmp_path / "ref")


def _stat(pid: int | str) -> list[str] | None:
    """Fields of /proc/PID/stat after "pid (comm)": state, ppid, ...; None if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (Linux /proc)."""
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and (st := _stat(p)) and int(st[1]) == pid]


def _alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] != "Z"  # a zombie has exited


def _prepare_cmd(out, *extra):
    return [
        sys.executable,
        "-m",
        "mamba3lite",
        "prepare",
        "--source",
        "stdlib",
        "--max-docs",
        "120",
        "--shard-tokens",
        "20000",
        "--val-fraction",
        "0.05",
        "--workers",
        "2",
        "--out",
        str(out),
        *extra,
    ]


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="finds the worker processes in Linux's /proc")
def test_resume_after_kill(tmp_path):
    """Kill a real run (SIGKILL, no clean-up) after a few shards; the re-run equals an uninterrupted run.
    (A subprocess: the default snapshot throttle applies, so shards after the last snapshot are redone.)"""
    out = tmp_path / "ds"
    env = {**os.environ, P.SLEEP_ENV: "0.3"}
    proc = subprocess.Popen(_prepare_cmd(out), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    state = out / staging.STAGE_DIRNAME / staging.STATE_NAME
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if len(json.loads(state.read_text())["shards"]) >= 3:
                    break
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.05)
        assert proc.poll() is None, (
            "the run finished before it could be killed: " + proc.stderr.read().decode()
        )
        workers = _children(proc.pid)
        assert len(workers) == 2, workers
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert not (out / "manifest.json").exists()
    # The tokenizer workers notice their parent is gone and exit (they would otherwise wait on the task
    # queue forever), and none of them keeps the dataset's lock: the re-run starts at once.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(w) for w in workers):
        time.sleep(0.1)
    assert not any(_alive(w) for w in workers), f"orphaned workers {workers} still running"
    r = subprocess.run(_prepare_cmd(out), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "resuming:" in r.stderr
    ref = subprocess.run(_prepare_cmd(tmp_path / "ref"), capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr
    assert verify_dataset(out) == []
    assert tree_hashes(out) == tree_hashes(tmp_path / "ref")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="finds the worker processes in Linux's /proc")
def test_sigterm_ends_a_running_prepare_and_its_workers_within_seconds(tmp_path):
    """SIGTERM to a prepare whose main process waits on its tokenizer workers (the place it spends its
    time blocked): the command ends within seconds, its workers too, and the same command resumes."""
    out = tmp_path / "ds"
    env = {**os.environ, P.SLEEP_ENV: "0.3"}
    proc = subprocess.Popen(_prepare_cmd(out), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    state = out / staging.STAGE_DIRNAME / staging.STATE_NAME
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None and not state.exists():
            time.sleep(0.05)
        assert proc.poll() is None, "the run finished before the signal: " + proc.stderr.read().decode()
        workers = _children(proc.pid)
        assert len(workers) == 2, workers
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)  # raises TimeoutExpired if SIGTERM did not end it
        assert time.monotonic() - t0 < 10
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(w) for w in workers):
        time.sleep(0.1)
    assert not any(_alive(w) for w in workers), f"workers {workers} outlived the SIGTERM'd prepare"
    assert not (out / "manifest.json").exists()
    r = subprocess.run(_prepare_cmd(out), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and verify_dataset(out) == [], r.stderr


@pytest.mark.parametrize("older", [False, True], ids=["new-out", "over-an-older-dataset"])
@pytest.mark.parametrize("moves_done", [0, 1, 2])
def test_an_interrupted_final_move_is_completed_by_the_same_command(
    tmp_path, monkeypatch, capsys, moves_done, older
):
    """The finished dataset is moved into --out split by split, then its manifest. Interrupted in between
    (`moves_done` renames done), --out held shards and no manifest: the same command refused it as "not
    empty", --overwrite rebuilt everything. It now completes the move, computing nothing again."""
    sources = _corpus(tmp_path)
    ref = P.prepare(sources, tmp_path / "ref", **KW)
    out = tmp_path / "ds"
    kw = dict(KW, overwrite=older)
    if older:
        P.prepare(sources[1:], out, **KW)
    commit, real_replace = staging.commit, os.replace

    def interrupted_commit(stage, out_dir, manifest):
        calls = [0]

        def replace(src, dst):
            if calls[0] == moves_done:
                raise _Interrupt
            calls[0] += 1
            real_replace(src, dst)

        with monkeypatch.context() as m:
            m.setattr(staging.os, "replace", replace)
            commit(stage, out_dir, manifest)

    with monkeypatch.context() as m:
        m.setattr(staging, "commit", interrupted_commit)
        with pytest.raises(_Interrupt):
            P.prepare(sources, out, **kw)
    assert not (out / "manifest.json").exists()
    capsys.readouterr()
    again = P.prepare(sources, out, **kw)
    assert "interrupted while moving it into" in capsys.readouterr().err
    assert again.resumed_shards == len(ref.manifest.shards)
    assert tree_hashes(out) == tree_hashes(tmp_path / "ref")
    assert verify_dataset(out) == []
