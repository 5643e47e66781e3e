"""Live fault tolerance (training.fault_tolerance, torchft): two replica groups, each its own torchrun,
one killed mid-run; the healthy one keeps committing, the restarted one heals from it by live transfer,
and the end is bit-equal to one process replaying the recorded participation. Plus the bad inputs."""

from __future__ import annotations

import dataclasses
import json
import socket
import threading

import chaos_harness as H
import ft_harness as F
import pytest
import torch

from mamba3lite.checkpoint.run_dir import RunDir
from mamba3lite.cli import main
from mamba3lite.config import Config, load_config
from mamba3lite.errors import ConfigError
from mamba3lite.train.parallel import DistInfo, Parallelism
from mamba3lite.train.parallel.lighthouse import start_lighthouse
from mamba3lite.train.parallel.replicas import ReplicaGroups

pytest.importorskip("torchft")

KILL_AT = 10  # group 1's worker dies once it has committed this step
HOLD_AT = 20  # group 0 waits here for the restarted worker's start (an event), so the heal is in the run


@pytest.fixture
def lighthouse():
    # heartbeat timeout 0.5 s: a dead group leaves the next quorum quickly; join timeout 20 s: a group that
    # heartbeats (restarted, building) is waited for
    server = start_lighthouse("127.0.0.1", 0, min_replicas=1, join_timeout_ms=20000, heartbeat_timeout_ms=500)
    yield server.address()
    server.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize(
    "ranks, inner",
    [(1, None), (2, "ddp"), (2, "fsdp")],
    ids=["1-process", "2-process-ddp-muon", "2-process-fsdp-muon"],
)
def test_a_killed_group_heals_live_and_the_run_equals_the_replayed_oracle(
    tmp_path, chaos_data, lighthouse, ranks, inner
):
    """2 groups of `ranks` processes (DDP and Muon inside a group of 2); the last rank of group 1 is
    killed. A group of one process is restarted by its torchrun (--max-restarts); a group of two is started
    again from outside: torchrun's in-place restart of a 2-process gloo group sometimes fails its first
    connect on a loaded machine ("Connection refused" to the previous round's address): torch's, not ours."""
    # the 2-process groups train with Muon (+ AdamW), DDP or FSDP2 inside: that state is healed too
    extra = {"parallelism": inner, "optimizer": "muon"} if ranks > 1 else {}
    if inner == "fsdp":
        # no clipping: FSDP2's norm sums each rank's shards, then the ranks (other roundings than one
        # process's norm of whole tensors); without clipping the weights do not depend on it
        extra["grad_clip"] = 0.0
    configs = [F.group_config(chaos_data, tmp_path, g, 2, lighthouse, **extra) for g in (0, 1)]
    release = tmp_path / "release"
    restarts = 1 if ranks == 1 else 0
    g0 = F.start_group(configs[0], tmp_path / "g0.log", hold=f"{HOLD_AT}:{release}", ranks=ranks)
    g1 = F.start_group(configs[1], tmp_path / "g1.log", ranks=ranks, restarts=restarts)
    procs = [g0, g1]
    try:
        assert H.wait_until(lambda: H.trained_step_since(tmp_path / "g1", 0) >= KILL_AT, g1), (
            g1.log.read_text()
        )
        killed_at = F.kill_worker(g1)
        if not restarts:
            assert g1.wait(timeout=H.PATIENCE_S) != 0
            g1 = F.start_group(configs[1], tmp_path / "g1b.log", ranks=ranks, restarts=0)
            procs.append(g1)
        # the healthy group commits alone, up to the hold, within a bound (no sleep)
        assert H.wait_until(lambda: H.trained_step_since(tmp_path / "g0", killed_at) >= HOLD_AT, g0, 120)
        assert H.wait_until(lambda: F.started_after(tmp_path / "g1", killed_at), g1, 120), g1.log.read_text()
        release.write_text("")
        assert g0.wait(timeout=H.PATIENCE_S) == 0, g0.log.read_text()[-3000:]
        assert g1.wait(timeout=H.PATIENCE_S) == 0, g1.log.read_text()[-3000:]
    finally:
        for p in procs:
            F.stop_group(p)
    run0, run1 = tmp_path / "g0", tmp_path / "g1"
    # committed steps 1..30 on the healthy group, each once
    assert [r["step"] for r in F.rows(run0, "train")] == list(range(1, F.STEPS + 1))
    participation = RunDir(run0).run_state(F.STEPS).replicas["participation"]
    assert RunDir(run1).run_state(F.STEPS).replicas["participation"] == participation
    alone = [s for s in range(1, F.STEPS + 1) if F.participation_at(participation, s) == [0]]
    # alone from the fault to the step the joiner came back at: at the hold, or a step or two later when
    # its first heartbeat reached the lighthouse after the healthy group's next quorum
    back = max(alone) + 1
    assert alone == list(range(min(alone), back)) and min(alone) <= KILL_AT + 3 and back > HOLD_AT, (
        participation
    )
    assert F.participation_at(participation, KILL_AT) == [0, 1]
    assert all(F.participation_at(participation, s) == [0, 1] for s in range(back, F.STEPS + 1))
    quorums = F.rows(run0, "event", "quorum")
    assert [q["quorum"] for q in quorums][-2:] == [1, 2], quorums
    # the joiner healed from the live peer: what it holds equals what was sent, bit for bit
    (heal,) = F.rows(run1, "event", "heal")
    (sent,) = [r for r in F.rows(run0, "event", "heal_sent") if r["step"] == heal["step"]]
    assert heal["step"] == back - 1 and heal["state_digest"] == sent["state_digest"] and heal["heal_s"] >= 0
    # the logged loss is the mean over the groups of the step: the same number in both groups' rows
    losses = [
        {r["step"]: r["loss"] for r in F.rows(run, "train") if r["step"] >= back} for run in (run0, run1)
    ]
    assert losses[0] == losses[1] and len(losses[0]) == F.STEPS + 1 - back
    # the end: both groups, and one process replaying the participation, bit for bit
    w0, w1 = (F.checkpoint_weights(run, F.STEPS, configs[0]) for run in (run0, run1))
    oracle = F.oracle_weights(configs[0], participation, ranks=ranks)
    assert H.weights_identical(w0, w1)
    assert all(torch.equal(w0[k], oracle[k]) for k in w0), [
        k for k in w0 if not torch.equal(w0[k], oracle[k])
    ]


@pytest.mark.slow
def test_killing_and_restarting_every_group_resumes_bit_exact(tmp_path, chaos_data):
    """The old path stays the fallback: every group killed (SIGKILL, whatever step each is in) and started
    again resumes from its own newest checkpoint (a group whose newest is older heals from the other) and
    ends, bit for bit, where one process replaying both groups at every step ends. (SIGTERM would let
    each group stop after its own step: one could be left waiting for a quorum of two.)"""
    # min_replicas 2: both groups take part in every step, before and after the restart
    server = start_lighthouse("127.0.0.1", 0, min_replicas=2, join_timeout_ms=20000, heartbeat_timeout_ms=500)
    steps = 16
    configs = [F.group_config(chaos_data, tmp_path, g, 2, server.address(), max_steps=steps, save_every=4)
               for g in (0, 1)]  # fmt: skip
    procs = [F.start_group(c, tmp_path / f"g{g}.log", restarts=0) for g, c in enumerate(configs)]
    try:
        assert H.wait_until(lambda: H.trained_step_since(tmp_path / "g0", 0) >= 6, procs[0])
        for p in procs:
            F.kill_worker(p)
        assert all(p.wait(timeout=H.PATIENCE_S) != 0 for p in procs)
        procs += [F.start_group(c, tmp_path / f"g{g}b.log", restarts=0) for g, c in enumerate(configs)]
        assert [p.wait(timeout=H.PATIENCE_S) for p in procs[2:]] == [0, 0], (tmp_path / "g0b.log").read_text()
    finally:
        server.shutdown()
        for p in procs:
            F.stop_group(p)
    assert all(any(r.get("event") == "resume" for r in H.metrics_rows(tmp_path / f"g{g}")) for g in (0, 1))
    oracle = F.oracle_weights(configs[0], [[1, steps, [0, 1]]], steps=steps)
    for g in (0, 1):
        weights = F.checkpoint_weights(tmp_path / f"g{g}", steps, configs[0])
        assert all(torch.equal(weights[k], oracle[k]) for k in weights), g


@pytest.fixture
def saved_run(tmp_path, chaos_data):
    """A run directory holding a checkpoint (2 plain steps), and the hash of its files."""
    config = H.write_config(tmp_path / "plain.yaml", chaos_data, tmp_path / "run", max_steps=2, eval_every=0)
    assert main(["train", "--config", str(config)]) == 0
    return config, _files(tmp_path / "run")


def _files(run_dir):
    """The run directory's files and their hashes, but its .lock (the pid of its last holder: taking the
    lock is not damage)."""
    return {k: v for k, v in H.tree_hash(run_dir).items() if not k.endswith(".lock")}


def _ft_args(config, *sets: str) -> list[str]:
    return ["train", "--config", str(config), "--set", "training.fault_tolerance.enabled=true", *[
        a for s in sets for a in ("--set", s)]]  # fmt: skip


def test_an_unreachable_lighthouse_is_one_error_and_the_checkpoints_are_untouched(saved_run, capsys):
    config, before = saved_run
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there
    args = _ft_args(config, f"training.fault_tolerance.lighthouse=http://127.0.0.1:{port}",
                    "training.fault_tolerance.connect_timeout_s=1", "training.max_steps=4")  # fmt: skip
    assert main(args) != 0
    err = capsys.readouterr().err
    assert "cannot reach the torchft lighthouse" in err and "mamba3lite lighthouse" in err
    assert "Traceback" not in err
    assert _files(config.parent / "run") == before


def test_min_replica_size_above_the_groups_and_an_unsupported_strategy_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="min_replica_size is 3 but the job has 2 replica"):
        load_config("tiny", ["training.fault_tolerance.replica_groups=2",
                             "training.fault_tolerance.min_replica_size=3"])  # fmt: skip
    with pytest.raises(ConfigError, match="lighthouse is empty"):
        load_config("tiny", ["training.fault_tolerance.enabled=true"])
    on = ["training.fault_tolerance.enabled=true", "training.fault_tolerance.lighthouse=http://127.0.0.1:1",
          f"training.checkpoint_dir={tmp_path / 'run'}"]  # fmt: skip
    hsdp = ["training.parallelism=hsdp", "training.dp_replicate=2"]
    for extra, message in ((hsdp, "not supported with parallelism hsdp"),
                           (["training.context_parallel=2"], "context_parallel"),
                           (["training.time_budget_minutes=5"], "time_budget_minutes")):  # fmt: skip
        cfg = load_config("tiny", [*on, *extra])
        with pytest.raises(ConfigError, match=message):
            Parallelism.from_config(cfg, DistInfo(rank=0, world_size=4))  # refused before any mesh or peer
    assert not (tmp_path / "run").exists()


def _two_groups(lighthouse: str, fingerprints: list[str], steps: list[int]) -> list[BaseException | None]:
    """Two replica groups (one process each, in threads, as torchft's own tests run them) whose configs
    have `fingerprints`, each asking the quorum for its step after `steps`; what each raised."""
    cfg = load_config(
        "tiny",
        [
            "training.fault_tolerance.enabled=true",
            f"training.fault_tolerance.lighthouse={lighthouse}",
            "training.fault_tolerance.replica_groups=2",
            "training.fault_tolerance.timeout_s=3",
        ],
    )
    model = torch.nn.Linear(2, 2)
    errors: list[BaseException | None] = [None, None]

    def group(g: int) -> None:
        ft = dataclasses.replace(cfg.training.fault_tolerance, replica_group_id=g)
        replicas = ReplicaGroups(ft, 0, 1)
        replicas.attach(lambda: {"w": model.weight}, lambda state: None, fingerprints[g])
        try:
            replicas.begin_step(steps[g])
        except BaseException as e:
            errors[g] = e
        finally:
            replicas.shutdown()

    threads = [threading.Thread(target=group, args=(g,)) for g in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=H.PATIENCE_S)
    return errors


def test_groups_whose_configs_differ_stop_with_one_error(tmp_path):
    # min_replicas 2: the first quorum holds both groups
    server = start_lighthouse("127.0.0.1", 0, min_replicas=2, join_timeout_ms=20000, heartbeat_timeout_ms=500)
    try:
        # at the start (both at step 0): both see that the quorum disagrees
        errors = _two_groups(server.address(), ["a" * 64, "b" * 64], [0, 0])
        assert all(isinstance(e, ConfigError) and "disagree on their configuration" in str(e) for e in errors)
        # a joiner (step 0) whose config differs from the running group's (step 5): only the joiner
        # stops, before it loads anything
        errors = _two_groups(server.address(), ["a" * 64, "c" * 64], [5, 0])
        assert isinstance(errors[1], ConfigError) and "differs from the quorum's" in str(errors[1])
        assert not isinstance(errors[0], ConfigError)
    finally:
        server.shutdown()


def test_participation_is_recorded_run_length_encoded():
    from mamba3lite.train.parallel.replicas import Participation

    p = Participation()
    for step, groups in [(1, [0, 1]), (2, [0, 1]), (3, [0]), (4, [0, 1])]:
        p.add(step, groups)
    assert p.runs == [[1, 2, [0, 1]], [3, 3, [0]], [4, 4, [0, 1]]]
    assert p.at(3) == [0] and p.at(5) is None
    p.truncate(3)
    assert p.runs == [[1, 2, [0, 1]], [3, 3, [0]]]
    assert json.loads(json.dumps(p.runs)) == p.runs
    assert Config.from_dict({}).training.fault_tolerance.enabled is False
