"""ThreadWatch: the pure rule over synthetic window times (slow-down -> trial -> kept or back, back-off,
room again, windows that do not count), where it applies, and one tiny training run whose window times
are scripted: the thread count changes, the event row is in metrics.jsonl, train() puts it back."""

from __future__ import annotations

import os

import pytest
import torch

from mamba3lite.config import TrainingConfig, load_config
from mamba3lite.train import threads as th
from mamba3lite.train.metrics import TrainingLogger
from mamba3lite.train.threads import (
    BACKOFF_GROWTH,
    FIRST_BACKOFF_WINDOWS,
    MIN_WINDOW_SECONDS,
    NoThreadWatch,
    ThreadState,
    ThreadWatch,
    decide,
    seconds_per_step,
    thread_watch,
)
from mamba3lite.train.trainer import Pretrainer
from test_trainer import metrics, tiny_config

CPU = torch.device("cpu")


@pytest.fixture
def two_threads(monkeypatch):
    """torch at 2 threads, nothing pinned in the environment; the count before is restored after."""
    before = torch.get_num_threads()
    for name in th.PINNING_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def feed(state: ThreadState, times, spare=None):
    """Run `decide` over window times; returns the final state and each window's switch (or None)."""
    switches = []
    for t in times:
        state, switch = decide(state, t, spare)
        switches.append(switch)
    return state, switches


def test_slow_down_tries_one_thread_and_keeps_it_when_faster():
    state, switches = feed(ThreadState(own=2, current=2), [0.24, 0.26, 0.71])
    assert switches[:2] == [None, None]
    assert (switches[2].before, switches[2].after) == (2, 1)
    assert switches[2].message.startswith(
        "threads 2 -> 1: 0.71 s/step against 0.24 before (the machine got busy)"
    )
    assert state.current == 1 and state.trial_from == (2, 0.71)
    # the trial window at 1 thread beat the slow one: kept, no switch, the trial over
    state, switches = feed(state, [0.35, 0.36, 0.34, 0.37])
    assert switches == [None] * 4
    assert state.current == 1 and state.trial_from is None and state.best == {2: 0.24, 1: 0.34}


def test_a_lost_trial_goes_back_and_the_next_waits_longer():
    state, _ = feed(ThreadState(own=2, current=2), [0.24, 0.71])
    state, [back] = feed(state, [0.90])  # 1 thread was slower still
    assert (back.before, back.after) == (
        1,
        2,
    ) and "1 thread was slower (0.90 s/step against 0.71 at 2 threads)" in back.message
    assert state.current == 2 and state.wait == FIRST_BACKOFF_WINDOWS
    # still slow at 2 threads: no trial while waiting, then one; it loses again and the wait grows
    state, switches = feed(state, [0.71] * FIRST_BACKOFF_WINDOWS + [0.71, 0.95])
    assert switches[:FIRST_BACKOFF_WINDOWS] == [None] * FIRST_BACKOFF_WINDOWS
    assert [(s.before, s.after) for s in switches[FIRST_BACKOFF_WINDOWS:]] == [(2, 1), (1, 2)]
    assert state.wait == FIRST_BACKOFF_WINDOWS * BACKOFF_GROWTH
    assert state.backoff == FIRST_BACKOFF_WINDOWS * BACKOFF_GROWTH**2
    state, switches = feed(state, [0.71] * state.wait)
    assert switches == [None] * (FIRST_BACKOFF_WINDOWS * BACKOFF_GROWTH) and state.current == 2


def test_back_to_the_own_count_once_the_machine_has_room():
    state, _ = feed(ThreadState(own=2, current=2), [0.24, 0.71, 0.35])  # now at 1 thread, kept
    # the other job still runs (no spare CPU): 1 thread stays, however long
    state, switches = feed(state, [0.35] * 10, spare=0.1)
    assert switches == [None] * 10 and state.current == 1
    state, [probe] = feed(state, [0.35], spare=1.2)
    assert (probe.before, probe.after) == (1, 2) and "leaves 1.2 CPUs idle" in probe.message
    state, [kept] = feed(state, [0.25], spare=0.2)  # 2 threads beat 0.35: kept
    assert kept is None and state.current == 2 and state.backoff == FIRST_BACKOFF_WINDOWS


def test_a_lost_return_goes_back_to_one_thread_and_backs_off():
    state, _ = feed(ThreadState(own=2, current=2), [0.24, 0.71, 0.35] + [0.35] * FIRST_BACKOFF_WINDOWS)
    state, switches = feed(state, [0.35, 4.0], spare=1.5)  # the load average lagged: still busy
    assert [(s.before, s.after) for s in switches] == [(1, 2), (2, 1)]
    assert state.current == 1 and state.wait == FIRST_BACKOFF_WINDOWS
    state, switches = feed(state, [0.35] * FIRST_BACKOFF_WINDOWS, spare=1.5)
    assert switches == [None] * FIRST_BACKOFF_WINDOWS


def test_windows_that_do_not_count_change_nothing():
    start = ThreadState(own=2, current=2, best={2: 0.24})
    assert decide(start, None, 2.0) == (start, None)
    trial, _ = decide(start, 0.71, None)
    assert decide(trial, None, None) == (trial, None)  # the trial waits for a window that counts
    row = {"kind": "train", "step": 10, "window_steps": 5, "window_seconds": 2.0}
    assert seconds_per_step(row) == pytest.approx(0.4)
    assert seconds_per_step({**row, "window_seconds": 0.9 * MIN_WINDOW_SECONDS}) is None  # noise
    assert seconds_per_step({**row, "warmup_window": True}) is None  # start-up: compile, load
    assert seconds_per_step({**row, "skipped": 1}) is None  # abandoned steps' time without their steps


def test_evaluation_time_is_not_window_time():
    """The numbers the watch reads are the metrics row's: an evaluation inside a window is left out."""
    now = [0.0]
    logger = TrainingLogger(log_every=4, clock=lambda: now[0])
    watch = ThreadWatch(2, set_threads=pytest.fail, spare=lambda: None)
    step = 0
    for window in range(3):  # a start-up window, a plain one, one with a 30 s evaluation in it
        for _ in range(4):
            step += 1
            now[0] += 0.5
            row = logger.log_step(
                step, loss=1.0, lr=1e-3, grad_norm=1.0, tokens_processed=64, tokens_total=64 * step
            )
            if window == 2 and step % 4 == 2:
                now[0] += 30.0
                logger.exclude_time(30.0)
        assert seconds_per_step(row) == (None if window == 0 else pytest.approx(0.5))
        watch.after_window(row, logger)  # set_threads=pytest.fail: a switch would fail the test
    assert watch.state.current == 2 and watch.state.best == {2: pytest.approx(0.5)}


def test_the_watch_applies_to_cpu_runs_of_one_process_with_threads_not_pinned(two_threads):
    assert isinstance(thread_watch(CPU, 1, True, environ={}), ThreadWatch)
    assert thread_watch(CPU, 1, True, environ={}).state.own == 2
    assert isinstance(thread_watch(torch.device("cuda"), 1, True, environ={}), NoThreadWatch)
    assert isinstance(thread_watch(CPU, 2, True, environ={}), NoThreadWatch)  # several processes
    assert isinstance(thread_watch(CPU, 1, False, environ={}), NoThreadWatch)  # cpu_threads_watch off
    assert isinstance(thread_watch(CPU, 1, True, environ={"OMP_NUM_THREADS": "2"}), NoThreadWatch)
    torch.set_num_threads(1)
    assert isinstance(thread_watch(CPU, 1, True, environ={}), NoThreadWatch)


def test_the_watch_sets_threads_logs_once_and_restores():
    set_to, events = [], []

    class Logger:
        def event(self, step, event, message, tokens_total=None, **extra):
            events.append((step, event, message, extra))

    watch = ThreadWatch(2, set_threads=set_to.append, spare=lambda: None)
    for step, t in ((1, 0.24), (2, 0.7), (3, 0.3), (4, 0.3)):
        watch.after_window({"step": step, "window_steps": 10, "window_seconds": 10 * t}, Logger())
    watch.after_window(None, Logger())  # no window closed: nothing
    assert set_to == [1] and [(e[0], e[1], e[3]) for e in events] == [
        (2, "threads", {"threads": 1, "threads_before": 2})
    ]
    watch.restore()
    assert set_to == [1, 2] and watch.state == ThreadState(own=2, current=2)
    NoThreadWatch().after_window({"step": 1}, None)  # the no-op takes the same calls
    NoThreadWatch().restore()


def test_a_training_run_switches_threads_and_logs_it(tmp_path, monkeypatch, two_threads):
    """Window times scripted through the watch's input: a slow window at 2 threads, a faster one at 1."""
    monkeypatch.setattr(os, "getloadavg", lambda: (99.0, 99.0, 99.0))  # no room: no return to 2
    script = {2: 0.24, 3: 0.25, 4: 0.80, 5: 0.30, 6: 0.31, 7: 0.30}
    ran_at = {}

    def scripted(row):
        ran_at[row["step"]] = torch.get_num_threads()  # the count the window's step ran at
        return None if row.get("warmup_window") else script[row["step"]]

    monkeypatch.setattr(th, "seconds_per_step", scripted)
    trainer = Pretrainer(tiny_config(tmp_path, max_steps=7, log_every=1, cpu_threads_watch=True))
    trainer.train()
    assert ran_at == {1: 2, 2: 2, 3: 2, 4: 2, 5: 1, 6: 1, 7: 1}
    events = [r for r in metrics(tmp_path) if r.get("event") == "threads"]
    assert len(events) == 1 and events[0]["step"] == 4
    assert (events[0]["threads_before"], events[0]["threads"]) == (2, 1)
    assert events[0]["message"].startswith("threads 2 -> 1: 0.80 s/step against 0.24 before")
    assert torch.get_num_threads() == 2  # train() put the run's own count back


def test_the_watch_is_on_in_the_quickstarts_preset_and_off_by_default():
    """A plain `train` keeps one thread count (CPU results bit-exact across a resume); the `tiny` preset,
    the quickstart's timed CPU demo, follows the load."""
    assert TrainingConfig().cpu_threads_watch is False
    assert load_config("tiny").training.cpu_threads_watch is True
