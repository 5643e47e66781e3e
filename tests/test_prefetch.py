"""The prefetcher (train/prefetch.py) and the trainer with it: the steps it hands out are the synchronous
reader's, bounded ahead, reset when the consumer moves; an error travels to its step; no thread outlives
a run. In the trainer: prefetch on == off bit for bit, N == N/2 + resume + N/2, a checkpoint records the
batches consumed (not those produced ahead), a damaged shard stops the run at its own step and the saved
checkpoint resumes exactly there, and the data-wait fraction reaches metrics.jsonl and the console."""

from __future__ import annotations

import json
import re
import threading
import time

import numpy as np
import pytest
import torch

from mamba3lite.checkpoint import CheckpointManager
from mamba3lite.data import WindowSampler
from mamba3lite.errors import DataError
from mamba3lite.train.metrics import TrainingLogger
from mamba3lite.train.metrics.console import format_console
from mamba3lite.train.prefetch import Prefetcher
from mamba3lite.train.trainer import Pretrainer
from test_benchmarks_smoke import run_script
from test_trainer import VOCAB, make_dataset, metrics, tiny_config, weights


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "mamba3lite-prefetch" and t.is_alive()]


def source(n=40, G=4, fail_at: int | None = None, delay: float = 0.0):
    """A sampler and a `produce` over it whose batch is the windows as a tensor; draw `fail_at` (1-based)
    raises a DataError. Returns (sampler, produce, draws): draws counts the calls."""
    sampler, draws = WindowSampler(n, G, seed=3), []

    def produce():
        draws.append(None)
        time.sleep(delay)
        if len(draws) == fail_at:
            raise DataError(f"shard_00000.bin: damaged at draw {fail_at}")
        w = torch.tensor(sampler.next_batch())
        return [(w, w + 1)]

    return sampler, produce, draws


def consume(p: Prefetcher, position: dict, steps: int) -> tuple[list[list[int]], dict]:
    """What the trainer does: take the step at `position`, move to its `after`."""
    got = []
    for _ in range(steps):
        item = p.take(position)
        assert item.error is None and item.before == position
        got.append(item.batches[0][0].tolist())
        position = item.after
    return got, position


@pytest.mark.parametrize("depth", [1, 3])
def test_prefetched_steps_are_the_synchronous_ones(depth):
    sync = Prefetcher(*source()[:2], depth=0, pin=False)
    ahead = Prefetcher(*source()[:2], depth=depth, pin=False)
    start = WindowSampler(40, 4, seed=3).state_dict()
    try:
        expected, end = consume(sync, start, 25)  # 10 batches per epoch: into epoch 2
        got, end_ahead = consume(ahead, start, 25)
    finally:
        ahead.close()
    assert got == expected and end_ahead == end == {
        "seed": 3,
        "epoch": 2,
        "consumed": 20,
        "order": "feistel-v1",
    }
    assert expected[:10] == [WindowSampler(40, 4, seed=3).global_batch(0, b) for b in range(10)]


def test_the_queue_is_bounded():
    sampler, produce, draws = source(n=400)
    p = Prefetcher(sampler, produce, depth=2, pin=False)
    try:
        p.take(sampler.state_dict())
        time.sleep(0.5)  # plenty of time to run ahead if it could
        # one taken, `depth` queued, one held by the thread while it waits for room
        assert len(draws) <= 1 + 2 + 1
    finally:
        p.close()


def test_a_moved_consumer_gets_its_own_step_and_the_queue_is_dropped():
    sampler, produce, _ = source()
    start = sampler.state_dict()
    reference, _ = consume(Prefetcher(*source()[:2], depth=0, pin=False), start, 8)
    p = Prefetcher(sampler, produce, depth=3, pin=False)
    try:
        first, position = consume(p, start, 5)
        back, _ = consume(p, start, 2)  # a rollback/resume to an earlier position
        forward, _ = consume(p, position, 3)  # and forward again (a rollback that skips data)
        p.reset(start)
        again, _ = consume(p, start, 1)
    finally:
        p.close()
    assert first == reference[:5] and back == reference[:2] and forward == reference[5:8]
    assert again == reference[:1]


@pytest.mark.parametrize("depth", [0, 2])
def test_an_error_is_handed_out_at_its_own_step(depth):
    sampler, produce, draws = source(fail_at=4)
    start = sampler.state_dict()
    p = Prefetcher(sampler, produce, depth=depth, pin=False)
    try:
        _, position = consume(p, start, 3)
        item = p.take(position)
        assert isinstance(item.error, DataError) and "draw 4" in str(item.error)
        assert item.before == position and not item.batches
        if depth:
            p._thread.join(timeout=5)
            assert not p.running and len(draws) == 4  # it stopped at the error: nothing after it drawn
    finally:
        p.close()
    assert not prefetch_threads()


def test_close_stops_a_thread_waiting_on_a_full_queue():
    sampler, produce, _ = source(n=400, delay=0.01)
    p = Prefetcher(sampler, produce, depth=1, pin=False)
    p.take(sampler.state_dict())
    time.sleep(0.2)
    assert p.running
    t0 = time.monotonic()
    p.close()
    assert time.monotonic() - t0 < 2.0 and not p.running and not prefetch_threads()


def test_data_wait_is_the_fraction_of_the_window_spent_waiting():
    class Clock:
        t = 0.0

        def __call__(self):
            return self.t

    clock = Clock()
    log = TrainingLogger(log_every=2, clock=clock)
    rows = []
    for step, (seconds, wait) in enumerate([(1.0, 0.5), (3.0, 0.5), (2.0, 0.0), (2.0, 0.0)], start=1):
        clock.t += seconds
        rows.append(log.log_step(step, loss=1.0, lr=1e-3, grad_norm=1.0, tokens_processed=10,
                                 tokens_total=10 * step, data_wait_s=wait))  # fmt: skip
    first, second = rows[1], rows[3]
    assert first["data_wait"] == pytest.approx(1.0 / 4.0) and second["data_wait"] == 0.0
    assert "data_wait=25.0%" in format_console(first)


# ---------------------------------------------------------------------------------- in the trainer
@pytest.mark.slow
def test_prefetch_on_equals_off_and_resume_is_exact(tmp_path):
    off = Pretrainer(tiny_config(tmp_path / "off", prefetch_batches=0))
    r_off = off.train()
    on = Pretrainer(tiny_config(tmp_path / "on", prefetch_batches=2))
    r_on = on.train()
    assert r_on.history == r_off.history  # losses equal bit for bit
    w_off, w_on = weights(off), weights(on)
    assert all(torch.equal(w_off[k], w_on[k]) for k in w_off)

    first = Pretrainer(tiny_config(tmp_path / "split", prefetch_batches=2))
    r1 = first.train(until_step=3)
    # the checkpoint records the 3 steps consumed, not the steps the thread had produced ahead
    meta = CheckpointManager(tmp_path / "split").read_meta(3)
    G = 2 * 2  # micro_batch_size x accumulation, one process
    assert meta["sampler"] == {"seed": off.tc.seed, "epoch": 0, "consumed": 3 * G, "order": "feistel-v1"}
    assert first.prefetcher.sampler.state_dict()["consumed"] > 3 * G  # it did run ahead
    second = Pretrainer(tiny_config(tmp_path / "split", prefetch_batches=2))
    r2 = second.train()
    assert r1.history + r2.history == r_off.history
    w_split = weights(second)
    assert all(torch.equal(w_off[k], w_split[k]) for k in w_off)
    assert second.sampler.state_dict() == off.sampler.state_dict()
    assert not prefetch_threads()  # every train() joined its thread


@pytest.mark.slow
def test_a_damaged_shard_read_ahead_stops_the_run_at_its_own_step(tmp_path):
    data = make_dataset(tmp_path / "data")

    def cfg(run, **kw):
        return tiny_config(tmp_path / run, **kw).replace("data", dummy=False, train_data_path=data)

    clean = Pretrainer(cfg("clean", prefetch_batches=0))
    clean.train()
    step4 = clean.sampler.global_batch(0, 3)
    shard = next((tmp_path / "data" / "train").glob("*.bin"))
    tokens = np.fromfile(shard, dtype="<u2")
    pos = step4[1] * 16 + 5  # inside the second window of step 4 only (windows overlap by one token)
    original = tokens[pos]
    tokens[pos] = VOCAB + 3
    tokens.tofile(shard)

    damaged = Pretrainer(cfg("run", prefetch_batches=3))  # the thread reads step 4 while step 1 trains
    with pytest.raises(DataError, match=rf"{shard.name}: token id {VOCAB + 3} .* outside the vocabulary"):
        damaged.train()
    assert not prefetch_threads()
    assert CheckpointManager(tmp_path / "run").latest_step() == 3
    meta = CheckpointManager(tmp_path / "run").read_meta(3)
    assert meta["sampler"]["consumed"] == 3 * 4
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3]
    assert rows[-1]["event"] == "error" and rows[-1]["step"] == 3

    tokens[pos] = original
    tokens.tofile(shard)
    resumed = Pretrainer(cfg("run", prefetch_batches=3))
    assert resumed.train().step == 6
    w_clean, w_resumed = weights(clean), weights(resumed)
    assert all(torch.equal(w_clean[k], w_resumed[k]) for k in w_clean)
    assert resumed.sampler.state_dict() == clean.sampler.state_dict()


@pytest.mark.slow
def test_the_data_wait_reaches_metrics_jsonl(tmp_path):
    # A reader slower than nothing: every micro-batch sleeps 0.1 s on the training thread (prefetch off),
    # so each row's waited seconds (data_wait x window_seconds) are at least the sleeps of its steps.
    t = Pretrainer(tiny_config(tmp_path, max_steps=4, prefetch_batches=0))
    batch = t.input.batch
    t.input.batch = lambda indices: (time.sleep(0.1), batch(indices))[1]
    t.train()
    rows = [r for r in metrics(tmp_path) if r["kind"] == "train"]
    assert len(rows) == 4
    for r in rows:
        assert 0.0 <= r["data_wait"] <= 1.0
        assert r["data_wait"] * r["window_seconds"] >= 0.2 * r["window_steps"] * 0.95, r
    assert all("data_wait" in json.dumps(r) for r in rows)


@pytest.mark.slow
def test_bench_data_wait_prints_its_table():
    out = run_script("bench_data_wait.py", "--steps", "10", "--read-delay-ms", "10")
    assert "| read delay (ms) | wait, off | wait, on | off / on | tokens/s off | tokens/s on |" in out
    assert re.search(r"^\| 10 \| [\d.]+% \| [\d.]+% \| [\d.]+x \| [\d,]+ \| [\d,]+ \|$", out, re.M), out
