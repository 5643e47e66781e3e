"""A generation's namespace in a real TCPStore (train/parallel/generation.py): ranks that start in any
order, some reading a dead generation's keys first, end on one fresh namespace; a missing rank is one
TrainingError naming it, within the deadline. And the watchdog (train/watchdog.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from mamba3lite.errors import TrainingError
from mamba3lite.train.parallel.generation import GENERATION_KEY, Deadline, agree_namespace
from mamba3lite.train.watchdog import EXIT_CODE, NoWatchdog, Watchdog, overdue, watchdog_for


@pytest.fixture
def store():
    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    yield server


def client(server):
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))


def agree_all(server, world: int, order: list[int], gap_s: float = 0.0) -> dict[int, str]:
    """Every rank's namespace, the ranks started in `order` with `gap_s` between them."""
    out: dict[int, object] = {}

    def rank(r: int) -> None:
        try:
            out[r] = agree_namespace(client(server), r, world, Deadline(20.0))
        except BaseException as e:  # surfaced below
            out[r] = e

    threads = []
    for r in order:
        threads.append(threading.Thread(target=rank, args=(r,)))
        threads[-1].start()
        time.sleep(gap_s)
    for t in threads:
        t.join()
    for v in out.values():
        if isinstance(v, BaseException):
            raise v
    return out  # type: ignore[return-value]


def test_every_generation_agrees_on_a_namespace_of_its_own(store):
    first = agree_all(store, 3, [0, 1, 2])
    assert len(set(first.values())) == 1
    second = agree_all(store, 3, [2, 0, 1])
    assert len(set(second.values())) == 1 and second[0] != first[0]


def test_a_rank_that_reads_the_dead_generations_namespace_first_ends_on_the_new_one(store):
    dead = agree_all(store, 2, [0, 1])[0]  # a generation that is gone, its keys left in the store
    assert store.get(GENERATION_KEY).decode() == dead
    result: dict[str, object] = {}
    t = threading.Thread(
        target=lambda: result.update(ns=agree_namespace(client(store), 1, 2, Deadline(20.0)))
    )
    t.start()
    # Rank 1 of the new generation has read the dead namespace and said hello there (a new nonce): it now
    # waits for an ack that nobody will write, until rank 0 of its own generation starts.
    deadline = time.monotonic() + 10
    before = store.get(f"{dead}/hello/1")
    while store.get(f"{dead}/hello/1") == before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.get(f"{dead}/hello/1") != before
    ns0 = agree_namespace(client(store), 0, 2, Deadline(20.0))
    t.join()
    assert result["ns"] == ns0 != dead


def test_a_rank_that_never_comes_is_named_within_the_deadline(store):
    started = time.monotonic()
    with pytest.raises(TrainingError, match=r"rank 0 waited 0.5 s .* for rank 1 of this generation"):
        agree_namespace(client(store), 0, 2, Deadline(0.5))
    with pytest.raises(TrainingError, match=r"rank 1 waited 0.5 s .* for rank 0 of this generation"):
        agree_namespace(client(store), 1, 2, Deadline(0.5))
    assert time.monotonic() - started < 10


# ------------------------------------------------------------------------------------------ watchdog


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_overdue_is_the_time_since_the_last_pet():
    assert not overdue(now=109.9, last_pet=100.0, timeout_s=10.0)
    assert overdue(now=110.0, last_pet=100.0, timeout_s=10.0)


def test_the_watchdog_fires_once_the_time_passes_without_a_pet_and_names_the_last_progress(tmp_path):
    clock, exits = Clock(), []
    out = open(tmp_path / "stderr", "w+")  # noqa: SIM115 (faulthandler writes to a real file descriptor)
    dog = Watchdog(10.0, rank=1, clock=clock, exit=exits.append, out=out, fallback=False)
    clock.t += 9
    assert not dog.check()
    dog.pet("step 7")
    clock.t += 9.5
    assert not dog.check()  # 9.5 s since the pet, not 18.5 since the start
    clock.t += 0.5
    assert dog.check() and exits == [EXIT_CODE]
    out.seek(0)
    text = out.read()
    out.close()
    assert text.startswith("error: rank 1 made no progress for 10 s (training.watchdog_s) since step 7;")
    assert "test_the_watchdog_fires" in text  # the stacks of the threads follow the line


def test_a_stuck_process_prints_its_stacks_and_exits_non_zero():
    code = textwrap.dedent(
        """
        import threading, time
        from mamba3lite.train.watchdog import Watchdog
        Watchdog(0.5, rank=3, poll_s=0.05).start().pet("the checkpoint of step 4")
        threading.Event().wait()  # stuck: no progress ever again
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == EXIT_CODE
    assert (
        "error: rank 3 made no progress for 0.5 s (training.watchdog_s) since the checkpoint of step 4"
        in (r.stderr)
    )
    assert 'File "<string>", line 5' in r.stderr  # where the main thread was stuck


def test_one_process_or_a_zero_timeout_has_no_watchdog():
    assert isinstance(watchdog_for(60.0, 0, distributed=False), NoWatchdog)
    assert isinstance(watchdog_for(0.0, 0, distributed=True), NoWatchdog)
    dog = watchdog_for(60.0, 0, distributed=True)
    try:
        assert isinstance(dog, Watchdog)
    finally:
        dog.stop()


def test_impossible_bounds_are_config_errors():
    from mamba3lite.config import TrainingConfig
    from mamba3lite.errors import ConfigError

    with pytest.raises(ConfigError, match="dist_init_timeout_s"):
        TrainingConfig(dist_init_timeout_s=0)
    with pytest.raises(ConfigError, match="watchdog_s"):
        TrainingConfig(watchdog_s=-1)
    assert TrainingConfig(watchdog_s=0).watchdog_s == 0  # off
